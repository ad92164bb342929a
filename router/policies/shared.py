"""What the load-balancing policies (round_robin, cache_aware, banaserve, flowkv) share: prefix and KV-use
reads of an instance, TTFT and transfer-time estimates, the nearest decode instance, a placement's build.
"""

from __future__ import annotations

import math

from .base import InstanceState, Placement, PrefixMove, Snapshot, least_loaded, _route


def prefix_tokens(i: InstanceState, snap: Snapshot, store: bool) -> int:
    """Prompt tokens i need not compute: what it holds, or (store) what the global store holds."""
    return max(i.cached_tokens, snap.store_tokens if store else 0)


def kv_used(i: InstanceState) -> float:
    return 1.0 - i.blocks_free / i.blocks_total if i.blocks_total else 0.0


def est_ttft(i: InstanceState, snap: Snapshot, store: bool, rate: float | None = None) -> float | None:
    """Seconds until i would finish this request's prefill: its queue and the uncached rest at its measured
    rate, or `rate` before it has one (None when neither is known)."""
    r = i.prefill_tokens_s or rate
    if not r:
        return None
    return (i.queued_tokens + max(1, snap.request.prompt_tokens - prefix_tokens(i, snap, store))) / r


class Ttft:
    """Estimated-TTFT ordering of prefill candidates: estimates within `tolerance_s` of each other count as
    equal (measured rates differ a little between like instances, and the fastest-measured one must not draw
    every request), then the caller's load key, then the least recently picked (a rotation among equals)."""

    def __init__(self, tolerance_s: float):
        self.tol = tolerance_s
        self.picks = 0
        self.last: dict[str, int] = {}

    def best(self, cands: list[InstanceState], snap: Snapshot, store: bool, load) -> tuple[InstanceState, float]:
        rate = typical_rate(cands)
        est = {i.name: est_ttft(i, snap, store, rate) for i in cands}
        known = [t for t in est.values() if t is not None]
        lo = min(known, default=None)

        def key(i):
            t = est[i.name]
            near = t is not None and t - lo <= self.tol
            far = 0.0 if near else math.inf if t is None else t
            return (far,) + tuple(load(i)) + (self.last.get(i.name, -1), i.name)
        best = min(cands, key=key)
        self.picks += 1
        self.last[best.name] = self.picks
        return best, math.inf if est[best.name] is None else est[best.name]


def typical_rate(cands: list[InstanceState]) -> float | None:
    """The median measured prefill rate of the candidates: the estimate for one not measured yet (an idle
    instance must not lose to a measured one for want of a figure)."""
    rates = sorted(i.prefill_tokens_s for i in cands if i.prefill_tokens_s)
    return rates[len(rates) // 2] if rates else None


def transfer_s(snap: Snapshot, p: InstanceState, d: InstanceState) -> float:
    """Seconds for the request's KV to reach d from p: 0 inside a cluster (or one instance); across, the
    link's backlog and this request's KV at its capacity (0 on an unshaped link, inf where no link is
    configured between the two clusters)."""
    if p.cluster == d.cluster or p.name == d.name:
        return 0.0
    lk = snap.link(p.cluster, d.cluster)
    if lk is None or not lk.capacity_bytes_s:
        return math.inf if lk is None else 0.0
    per = snap.kv_bytes_per_token or 0.0
    kv = max(0, snap.request.kv_tokens - d.cached_tokens) * per
    return (lk.queued_bytes + lk.pending_bytes + kv) / lk.capacity_bytes_s


def nearest_decode(snap: Snapshot, p: InstanceState | None, decodes: list[InstanceState]) -> InstanceState | None:
    """The decode instance with the least transfer time from p, then the least loaded."""
    if not decodes:
        return None
    if p is None:
        return least_loaded(decodes)
    return min(decodes, key=lambda d: (transfer_s(snap, p, d),) + d.load)


def _placement(snap: Snapshot, d: InstanceState, p: InstanceState | None, why: str, store: bool = False,
               details: dict | None = None) -> Placement:
    total = snap.request.prompt_tokens
    if p is None:
        return Placement(d.name, None, "colocated", why, uncached_tokens=total - d.cached_tokens,
                         prefix_source=d.name if d.cached_tokens else None, details=details or {})
    cached = prefix_tokens(p, snap, store)
    src, move = None, None
    if cached:
        src = p.name if p.cached_tokens >= cached else (snap.store or "store")
        if src != p.name and snap.store:  # the store's longer prefix is loaded into p first
            move = PrefixMove(snap.store, cached, overlap=True)
    return Placement(d.name, p.name, _route(p, d), why, move, uncached_tokens=total - cached, prefix_source=src,
                     details=details or {})


def _prefills(snap: Snapshot, decode: str | None = None) -> list[InstanceState]:
    return [i for i in snap.of("prefill") if i.role == "prefill" and i.name != decode]
