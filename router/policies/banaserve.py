"""`banaserve` (BanaServe 4.4.2, Algorithm 2): with a global KV store every prefill instance can load any
prefix the store holds (`Snapshot.store_tokens`), so the choice is about load alone. Each prefill
instance's load is U = C/Cmax + M/Mmax (its busy fraction plus its KV use, eq. 37) plus the estimated load of
what the router has placed there since (its queued prefill tokens over `token_budget`, Algorithm 2 line 15).
Among the instances under `load_threshold` the one with the least estimated TTFT (its queue and the
request's uncached tokens at its measured rate, the prefix counted from its cache or the store) wins,
estimates within `ttft_tolerance_s` counting as ties, broken by the prefix it would load from the store (its
own cache first), then (load, queue), then the least recently picked; with none under it, the shortest
queue. Decode: the instance with the least KV transfer time
(none inside the prefill's cluster; else the link's backlog and this request's KV at its capacity), ties by
load.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import InstanceState, Placement, Snapshot, least_loaded
from .shared import Ttft, kv_used, nearest_decode, _placement, _prefills, prefix_tokens


@dataclass(frozen=True)
class BanaServeParams:
    load_threshold: float = 1.5  # delta_L: U at or above it sends the request to the shortest queue
    token_budget: int = 8192  # prefill tokens one step computes: queued tokens / budget is the added load
    store: bool = True  # prefixes in the global KV store count as hits on every prefill instance
    ttft_tolerance_s: float = 0.02  # estimated TTFTs this close count as equal


class BanaServe:
    name = "banaserve"

    def __init__(self, params: BanaServeParams = BanaServeParams()):
        self.p = params
        self.overloaded = 0  # placements where every prefill instance was at or above delta_L
        self.ttft = Ttft(params.ttft_tolerance_s)

    def state(self) -> dict[str, float]:
        return {"overloaded_placements": self.overloaded}

    def load(self, i: InstanceState) -> float:
        """U = C/Cmax + M/Mmax (eq. 37) + the estimated load of the prefills queued there (Algorithm 2, l.15)."""
        return i.busy + kv_used(i) + i.queued_tokens / self.p.token_budget

    def pick(self, snap: Snapshot, cands: list[InstanceState]) -> tuple[InstanceState, str, dict]:
        loads = {i.name: self.load(i) for i in cands}
        qlen = {i.name: max(i.inflight, i.waiting + i.running) for i in cands}
        under = [i for i in cands if loads[i.name] < self.p.load_threshold]
        details = {"loads": {k: round(v, 3) for k, v in loads.items()}}
        if not under:
            self.overloaded += 1
            best = min(cands, key=lambda i: (qlen[i.name], loads[i.name], i.name))
            return best, f"every prefill instance at U >= {self.p.load_threshold}: the shortest queue", details

        # among near-equal estimates, the instance that needs the least loaded from the store, then load
        best, t = self.ttft.best(under, snap, self.p.store,
                                 lambda i: (prefix_tokens(i, snap, self.p.store) - i.cached_tokens, loads[i.name],
                                            qlen[i.name]))
        why = (f"least estimated TTFT {t:.3f}s at U {loads[best.name]:.2f}" if t < math.inf
               else f"least load U {loads[best.name]:.2f}")
        return best, why, details

    def place(self, snap: Snapshot) -> Placement:
        ds = snap.of("decode")
        if not ds:
            return Placement(None, None, "colocated", "no decode instance is up")
        ps = _prefills(snap)
        if not ps:
            d = least_loaded(ds)
            return _placement(snap, d, None, "no prefill instance is up: decode prefills")
        pre, why, details = self.pick(snap, ps)
        d = nearest_decode(snap, pre, [x for x in ds if x.name != pre.name] or ds)
        return _placement(snap, d, pre, why, self.p.store, details)


def from_config(s) -> BanaServe:
    """The policy of a config's `policy` section (jaxserve/config.py PolicySection)."""
    return BanaServe(BanaServeParams(load_threshold=s.load_threshold, token_budget=s.token_budget,
                                     store=s.store))
