"""Load-balancing placement policies (plain Python, no I/O), beside policy.py's `least_loaded` and `prfaas`.

Same contract as policy.py: each sees one `Snapshot` per request and returns a `Placement`; state a policy
keeps is driven by the snapshots alone, so the live router and the simulator (router/sim) run the same
objects and place the same way given the same snapshots.

- `round_robin`: prefill and decode instances in turn (the baseline with no information at all).
- `cache_aware`: the anchors' cache-affine rules, as published, for comparison:
  - `rule: sglang` (SGLang's cache-aware router): the instances are imbalanced when the most and least loaded
    differ by more than `balance_abs` requests AND the most loaded carries more than `balance_rel` x the least;
    then the least loaded takes the request. Otherwise the instance with the highest prefix match ratio takes
    it if that ratio exceeds `cache_threshold`, else the one with the most free cache (SGLang: the smallest
    tree).
  - `rule: dynamo` (Dynamo's KV router): cost = overlap_weight x prefill blocks + decode blocks, where prefill
    blocks are the request's blocks not already cached there (the overlap credit) plus the prefill blocks
    queued there, and decode blocks the blocks in use; the lowest cost wins.
  Both collapse onto one instance when many requests share a hot prefix: its hit outweighs any queue until
  the imbalance passes `balance_abs` (SGLang) or the queue outgrows the prefix (Dynamo).
- `banaserve` (BanaServe 4.4.2, Algorithm 2): with a global KV store every prefill instance can load any
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
- `flowkv` (FlowKV 3.4, Appendix B): per instance a load score, a weighted sum of normalised indicators
  (running, waiting, swapped and sending queues, queued token budget, KV use, busy fraction; GPU memory
  bandwidth is not measured, weight 0) smoothed over a sliding window; C^p and C^d the means over the prefill
  and decode instances. Scenario: normal (both at or under their low thresholds): prefill on the least
  estimated TTFT given prefix hits, decode on the least transfer time. Imbalanced (under the high thresholds):
  when prefill is the hot side, decode instances whose own score is under `idle_score` prefill their requests
  themselves for `hold_s` (their local schedulers switch priority); when decode is the hot side, `control`
  asks for an idle prefill instance to change role. Extreme (above a high threshold for `extreme_s`):
  `control` moves an instance from the cool side to the hot one (a role flip), or with both sides over,
  asks for one instance more of the hotter role (and, with both low for as long, one fewer); the router
  carries flips out as the re-plan's, scaling through the launcher.

Load orders and estimates come from the router's counts (requests in flight, prefill tokens queued) and the
workers' heartbeats (queues, free blocks, busy fraction); names break exact ties, so placements are
deterministic.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .policy import InstanceState, Placement, PrefixMove, Snapshot, _route, least_loaded


# ---- shared pieces
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


# ---- round robin
class RoundRobin:
    name = "round_robin"

    def __init__(self):
        self._p = self._d = 0

    def state(self) -> dict[str, float]:
        return {}

    def place(self, snap: Snapshot) -> Placement:
        ds = sorted(snap.of("decode"), key=lambda i: i.name)
        if not ds:
            return Placement(None, None, "colocated", "no decode instance is up")
        d = ds[self._d % len(ds)]
        self._d += 1
        ps = sorted(_prefills(snap, d.name), key=lambda i: i.name)
        if not ps:
            return _placement(snap, d, None, "no prefill instance is up: decode prefills")
        p = ps[self._p % len(ps)]
        self._p += 1
        return _placement(snap, d, p, "in turn")


# ---- the anchors' cache-aware rules
@dataclass(frozen=True)
class CacheAwareParams:
    rule: str = "sglang"  # sglang / dynamo
    cache_threshold: float = 0.5  # sglang: a match ratio above this routes to the holder
    balance_abs: int = 32  # sglang: imbalanced when max - min load > this (requests) ...
    balance_rel: float = 1.5  # ... and max > this x min
    overlap_weight: float = 1.0  # dynamo: weight of the prefill blocks in the cost
    block_tokens: int = 16  # dynamo: tokens per block

    def __post_init__(self):
        if self.rule not in ("sglang", "dynamo"):
            raise ValueError(f"policy.rule: {self.rule!r} is not sglang or dynamo")


class CacheAware:
    name = "cache_aware"

    def __init__(self, params: CacheAwareParams = CacheAwareParams()):
        self.p = params
        self.balanced_picks = self.cache_picks = 0

    def state(self) -> dict[str, float]:
        return {"load_balanced_picks": self.balanced_picks, "cache_picks": self.cache_picks}

    def pick(self, snap: Snapshot, cands: list[InstanceState]) -> tuple[InstanceState, str]:
        p, total = self.p, max(1, snap.request.prompt_tokens)
        if p.rule == "dynamo":
            bt = p.block_tokens

            def cost(i):
                new = math.ceil(max(0, total - i.cached_tokens) / bt) + math.ceil(i.queued_tokens / bt)
                return (p.overlap_weight * new + (i.blocks_total - i.blocks_free), i.name)
            best = min(cands, key=cost)
            self.cache_picks += best.cached_tokens > 0
            return best, f"dynamo cost {cost(best)[0]:.0f} blocks (overlap {best.cached_tokens} tokens)"
        loads = [i.inflight for i in cands]
        hi, lo = max(loads), min(loads)
        if hi - lo > p.balance_abs and hi > p.balance_rel * lo:
            self.balanced_picks += 1
            return min(cands, key=lambda i: (i.inflight, i.name)), f"imbalanced ({hi} vs {lo}): shortest queue"
        best = max(cands, key=lambda i: (i.cached_tokens, -i.inflight, i.name))
        ratio = best.cached_tokens / total
        if ratio > p.cache_threshold:
            self.cache_picks += 1
            return best, f"prefix match {ratio:.0%} > {p.cache_threshold:.0%}"
        return max(cands, key=lambda i: (i.blocks_free, -i.inflight, i.name)), \
            f"best match {ratio:.0%}: the most free cache"

    def place(self, snap: Snapshot) -> Placement:
        d = least_loaded(snap.of("decode"))
        if d is None:
            return Placement(None, None, "colocated", "no decode instance is up")
        ps = _prefills(snap, d.name)
        if not ps:
            return _placement(snap, d, None, "no prefill instance is up: decode prefills")
        pre, why = self.pick(snap, ps)
        return _placement(snap, d, pre, why)


# ---- BanaServe
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


# ---- FlowKV
@dataclass(frozen=True)
class FlowKVWeights:
    """Weights of the normalised indicators in a load score (FlowKV B.2): queues per `queue_norm` requests,
    queued tokens per `token_budget`, KV use and busy fraction as fractions."""
    running: float = 0.2
    waiting: float = 0.3
    swapped: float = 0.1
    sending: float = 0.1
    tokens: float = 0.3
    kv: float = 0.3
    busy: float = 0.4
    membw: float = 0.0  # GPU memory bandwidth utilisation: not measured


@dataclass(frozen=True)
class FlowKVParams:
    prefill_weights: FlowKVWeights = FlowKVWeights()
    decode_weights: FlowKVWeights = FlowKVWeights(running=0.4, waiting=0.3, tokens=0.0, kv=0.4, busy=0.2)
    queue_norm: int = 8  # requests that count as a full queue
    token_budget: int = 8192
    window_s: float = 5.0  # sliding window the indicators are smoothed over
    low: float = 0.6  # epsilon_low for C^p and C^d: normal at or under both
    high: float = 1.2  # epsilon_high: imbalanced at or under both (and one above low); above: extreme
    idle_score: float = 0.3  # an instance under this score is idle (takes the other role's work)
    hold_s: float = 10.0  # an imbalanced-mode switch holds this long (several scheduling cycles)
    extreme_s: float = 30.0  # a scenario must last this long before scaling
    store: bool = False  # FlowKV counts only an instance's own prefix
    ttft_tolerance_s: float = 0.02  # estimated TTFTs this close count as equal

    def __post_init__(self):
        if not 0 < self.low < self.high:
            raise ValueError(f"policy: flowkv_low ({self.low}) must be positive and below flowkv_high ({self.high})")
        if self.window_s <= 0:
            raise ValueError("policy: window_s must be > 0")


@dataclass(frozen=True)
class Action:
    """What `control` asks the router to carry out: a role change of `instance` (kind `flip`), or one instance
    more (`scale_out`) or fewer (`scale_in`) of `role`."""
    kind: str  # flip / scale_out / scale_in
    role: str
    instance: str | None
    why: str


class FlowKV:
    name = "flowkv"

    def __init__(self, params: FlowKVParams = FlowKVParams()):
        self.p = params
        self._hist: dict[str, deque] = {}  # instance -> (time, raw indicators), the last window_s
        self._sum: dict[str, list[float]] = {}  # instance -> the indicators summed over its window
        self.scenario = "normal"
        self.cp = self.cd = 0.0
        self.assist_until = -math.inf  # imbalanced mode (prefill hot): idle decode instances prefill until then
        self.since: dict[str, float] = {}  # scenario -> since when it has held
        self.assists = self.switches = 0
        self.last_flip = -math.inf
        self.ttft = Ttft(params.ttft_tolerance_s)

    def state(self) -> dict[str, float]:
        return {"load_score_prefill": self.cp, "load_score_decode": self.cd,
                "scenario": ("normal", "imbalanced", "extreme").index(self.scenario),
                "assisted_prefills": self.assists, "scenario_changes": self.switches}

    # indicators and scores
    def _raw(self, i: InstanceState) -> tuple:
        return (i.running, max(i.waiting, i.inflight - i.running), i.swapped, i.sending, i.queued_tokens,
                kv_used(i), i.busy)

    def observe(self, snap: Snapshot) -> None:
        """Each instance's indicators join its window (a running sum: scoring reads the mean in O(1))."""
        now = snap.now
        for i in snap.instances:
            h = self._hist.setdefault(i.name, deque())
            tot = self._sum.setdefault(i.name, [0.0] * 7)
            raw = self._raw(i)
            h.append((now, raw))
            tot[:] = [a + b for a, b in zip(tot, raw)]
            while now - h[0][0] > self.p.window_s:
                tot[:] = [a - b for a, b in zip(tot, h.popleft()[1])]

    def score(self, i: InstanceState, role: str) -> float:
        """The smoothed, weighted load score of i in `role` (C_i^p or C_i^d)."""
        h = self._hist.get(i.name)
        m = [x / len(h) for x in self._sum[i.name]] if h else self._raw(i)
        w = self.p.prefill_weights if role == "prefill" else self.p.decode_weights
        q = self.p.queue_norm
        return (w.running * m[0] / q + w.waiting * m[1] / q + w.swapped * m[2] / q + w.sending * m[3] / q
                + w.tokens * m[4] / self.p.token_budget + w.kv * m[5] + w.busy * m[6])

    def classify(self, snap: Snapshot) -> str:
        """C^p, C^d (Algorithm 1 lines 13-15) -> the scenario (lines 17, 24, 28)."""
        ps = [i for i in snap.instances if i.role == "prefill"]
        ds = [i for i in snap.instances if i.role == "decode"]
        self.cp = sum(self.score(i, "prefill") for i in ps) / len(ps) if ps else 0.0
        self.cd = sum(self.score(i, "decode") for i in ds) / len(ds) if ds else 0.0
        lo, hi = self.p.low, self.p.high
        s = ("normal" if self.cp <= lo and self.cd <= lo else "imbalanced" if self.cp <= hi and self.cd <= hi
             else "extreme")
        if s != self.scenario:
            self.switches += 1
            self.scenario = s
        for k in ("normal", "imbalanced", "extreme"):
            if k != s:
                self.since.pop(k, None)
        self.since.setdefault(s, snap.now)
        return s

    def place(self, snap: Snapshot) -> Placement:
        self.observe(snap)
        s = self.classify(snap)
        ds = snap.of("decode")
        if not ds:
            return Placement(None, None, "colocated", "no decode instance is up")
        details = {"scenario": s, "C_p": round(self.cp, 3), "C_d": round(self.cd, 3)}
        if s == "imbalanced" and self.cp > self.cd:
            self.assist_until = snap.now + self.p.hold_s
        if snap.now < self.assist_until:  # prefill is the hot side: an idle decode instance prefills itself
            idle = [d for d in ds if self.score(d, "decode") < self.p.idle_score]
            if idle:
                d = min(idle, key=lambda d: (self.score(d, "decode"), d.name))
                self.assists += 1
                return _placement(snap, d, None, f"{s}: prefill loaded (C^p {self.cp:.2f} > C^d {self.cd:.2f}), "
                                  f"idle {d.name} prefills", details=details)
        ps = _prefills(snap)
        if not ps:
            return _placement(snap, least_loaded(ds), None, "no prefill instance is up: decode prefills",
                              details=details)

        pre, _ = self.ttft.best(ps, snap, self.p.store, lambda i: (self.score(i, "prefill"),))
        d = nearest_decode(snap, pre, [x for x in ds if x.name != pre.name] or ds)
        return _placement(snap, d, pre, f"{s}: least estimated TTFT, then the nearest decode", self.p.store,
                          details)

    def control(self, snap: Snapshot) -> list[Action]:
        """The global controller's actions for this cycle (Algorithm 1 lines 24-30), at most one:
        - imbalanced, decode the hot side: an idle prefill instance changes role to decode (prefill the hot
          side needs none: idle decode instances prefill, see `place`);
        - extreme for extreme_s: with one side over epsilon_high and the other under it, the coolest instance
          of the cool side moves to the hot one (a role flip: scaling within the pool); with both over it, one
          instance more of the hotter role (`scale_out`, for the launcher); low load for as long: one fewer of a
          role that has more than one (`scale_in`).
        A role change needs the last one to be extreme_s old (a flip shifts load; judging the next one on
        readings taken before it has settled would flip back and forth), and must leave the side it takes from
        less loaded than the side it joins, by the scores spread over one instance fewer and one more (a move
        that would turn the imbalance around is the next move back)."""
        self.observe(snap)
        s = self.classify(snap)
        ps = [i for i in snap.instances if i.role == "prefill"]
        ds = [i for i in snap.instances if i.role == "decode"]
        held = snap.now - self.since.get(s, snap.now) >= self.p.extreme_s
        rested = snap.now - self.last_flip >= self.p.extreme_s
        hi, idle = self.p.high, self.p.idle_score
        act = None

        def coolest(side, role):
            return min(side, key=lambda i: (self.score(i, role), i.name))

        def stays(c_src, n_src, c_dst, n_dst):  # the move must not turn the imbalance around
            return c_src * n_src / (n_src - 1) <= c_dst * n_dst / (n_dst + 1)
        if s == "imbalanced" and self.cd > self.cp and len(ps) > 1 and rested \
                and stays(self.cp, len(ps), self.cd, len(ds)):
            i = coolest(ps, "prefill")
            if self.score(i, "prefill") < idle:
                act = Action("flip", "decode", i.name, f"imbalanced: decode loaded (C^d {self.cd:.2f} > C^p "
                             f"{self.cp:.2f}), {i.name} idle")
        elif s == "extreme" and held:
            if self.cp > hi and self.cd > hi:
                act = Action("scale_out", "prefill" if self.cp >= self.cd else "decode", None,
                             f"overload for {self.p.extreme_s:.0f}s: C^p {self.cp:.2f}, C^d {self.cd:.2f}")
            elif rested:
                src, dst = (ds, "prefill") if self.cp > hi else (ps, "decode")
                c_src, c_dst = (self.cd, self.cp) if dst == "prefill" else (self.cp, self.cd)
                if len(src) > 1 and stays(c_src, len(src), c_dst, len(snap.instances) - len(src)):
                    i = coolest(src, src[0].role)
                    act = Action("flip", dst, i.name, f"{dst} overloaded for {self.p.extreme_s:.0f}s (C^p "
                                 f"{self.cp:.2f}, C^d {self.cd:.2f}): {i.name} moves over")
        elif s == "normal" and held and self.cp < idle and self.cd < idle:
            side = ps if len(ps) > 1 and self.cp <= self.cd else ds if len(ds) > 1 else []
            if side:
                i = coolest(side, side[0].role)
                act = Action("scale_in", side[0].role, i.name, f"low load for {self.p.extreme_s:.0f}s")
        if act is None:
            return []
        self.since.pop(s, None)  # the next action needs the scenario to hold again
        if act.kind == "flip":
            self.last_flip = snap.now
        return [act]
