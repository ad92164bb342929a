"""Placement policies: where a request's prefill and decode run (plain Python, no I/O).

A policy sees an immutable `Snapshot` (the request's length, every instance it may use with its role,
cluster, load, free blocks and the prefix index's answer for this request, the inter-cluster links with
capacity and live utilisation, the time) and returns a `Placement` (the decode instance, the prefill
instance or none, a cached prefix to move between clusters, the route, and why). It reads nothing else and
does no I/O, so the live router (cluster.py, snapshots from snapshot.py) and a simulator run the same
objects. A policy may keep state that the snapshots drive (the prfaas threshold controller); given the same
sequence of snapshots it places the same way. `make(cfg.policy)` builds the one `policy.name` selects.

- `least_loaded` (BanaServe's dispatch with no prefix affinity): decode on the least loaded decode instance,
  prefill on the least loaded prefill instance of any cluster.
- `prfaas` (PrfaaS section 3.4.3): selective offload of long uncached prefills to a PrfaaS cluster, judged on
  the uncached length against a threshold that follows the link's utilisation with hysteresis; cache-aware
  (bandwidth scarce: each cluster's own prefix; abundant: the best prefix anywhere, moved across when it
  sits in the other cluster) and cache-affine within a cluster unless the affine instance is overloaded.

`round_robin`, `cache_aware`, `banaserve` and `flowkv` live in balance.py.

Load, everywhere: requests the router has in flight on the instance, then its reported waiting + running,
then the most free blocks; the name breaks exact ties, so placements are deterministic.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

ROUTES = ("colocated", "pd", "prfaas")


@dataclass(frozen=True)
class InstanceState:
    name: str
    role: str  # prefill / decode / both
    cluster: str
    kind: str  # the cluster's kind: pd / prfaas
    inflight: int = 0  # requests the router has on it now
    waiting: int = 0  # its last reported queue
    running: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    cached_tokens: int = 0  # the prefix index's answer: prompt tokens whose KV this instance holds
    queued_tokens: int = 0  # uncached tokens of the prefills the router has on it, not yet computed
    prefill_tokens_s: float | None = None  # its measured prefill rate (None: not measured yet)
    busy: float = 0.0  # fraction of recent time its engine spent computing (heartbeat)
    swapped: int = 0  # requests preempted and waiting to run again
    sending: int = 0  # KV transfers queued on it, not yet on the wire

    def prefill_wait(self, tokens: int) -> float | None:
        """Seconds until a prefill of `tokens` more would be computed here: its queue and them at its measured
        rate (None before a rate is measured)."""
        return None if not self.prefill_tokens_s else (self.queued_tokens + tokens) / self.prefill_tokens_s

    def serves(self, role: str) -> bool:
        return self.role == role or self.role == "both"

    @property
    def load(self) -> tuple:
        return (self.inflight, self.waiting + self.running, -self.blocks_free, self.name)


@dataclass(frozen=True)
class LinkState:
    """KV traffic from cluster `src`'s prefill instances to cluster `dst`'s decode instances."""
    src: str
    dst: str
    capacity_bytes_s: float | None  # None: not shaped (no configured bandwidth)
    egress_bytes_s: float = 0.0  # recent throughput, summed over the instances sending on it
    pending_bytes: int = 0  # sent and not yet acknowledged
    queued_frames: int = 0
    queued_bytes: int = 0  # waiting in the senders' queues, not yet on the wire
    retransmits: int = 0  # TCP retransmits so far (TCP_INFO)

    @property
    def utilisation(self) -> float:
        if not self.capacity_bytes_s:
            return 0.0
        return self.egress_bytes_s / self.capacity_bytes_s


@dataclass(frozen=True)
class RequestInfo:
    prompt_tokens: int
    kv_tokens: int  # tokens whose KV prefill hands over


@dataclass(frozen=True)
class Snapshot:
    request: RequestInfo
    instances: tuple[InstanceState, ...]  # up, and not excluded for this request
    links: tuple[LinkState, ...] = ()
    now: float = 0.0  # seconds (monotonic), for policies that follow the links over time
    kv_bytes_per_token: float | None = None  # KV bytes a transfer sends per token, as measured (None: not yet)
    store_tokens: int = 0  # prompt tokens whose KV the global KV store holds (router/balance.py `banaserve`)
    store: str | None = None  # the store instance (a prefix it holds moves from there: PrefixMove)

    def of(self, role: str, kind: str | None = None, cluster: str | None = None) -> list[InstanceState]:
        return [i for i in self.instances if i.serves(role) and (kind is None or i.kind == kind)
                and (cluster is None or i.cluster == cluster)]

    def link(self, src: str, dst: str) -> LinkState | None:
        return next((lk for lk in self.links if lk.src == src and lk.dst == dst), None)


@dataclass(frozen=True)
class PrefixMove:
    """Cached prefix KV to copy from `src` (an instance of another cluster, or the global KV store) into the
    prefill instance. overlap: the prefill runs over the prefix as it lands, layer group by layer group
    (BanaServe's pipelined load: for a source whose fetch keeps up with compute; the prefill instance's engine
    waits on it meanwhile); else it is loaded first and the prefill starts once it is cached."""
    src: str
    tokens: int
    overlap: bool = False


@dataclass(frozen=True)
class Placement:
    decode: str | None  # None: no decode instance can take it
    prefill: str | None  # None: the decode instance prefills itself
    route: str  # colocated / pd / prfaas
    reason: str
    move_prefix: PrefixMove | None = None
    uncached_tokens: int | None = None  # prompt tokens the prefill computes
    prefix_source: str | None = None  # the instance whose cached prefix the prefill uses
    details: dict = field(default_factory=dict, compare=False)  # numbers behind the choice (logs, metrics)


class Policy(Protocol):
    name: str

    def place(self, snap: Snapshot) -> Placement: ...

    def state(self) -> dict[str, float]:
        """Numbers the policy keeps between placements (/metrics publishes them as jaxserve_policy_<key>)."""


def least_loaded(candidates: list[InstanceState]) -> InstanceState | None:
    return min(candidates, key=lambda i: i.load, default=None)


def affine(candidates: list[InstanceState], slack: int) -> InstanceState | None:
    """The instance holding the longest prefix of the request, unless it has more than `slack` requests in
    flight beyond the least loaded candidate (a hot cache must not draw every request): then the least loaded."""
    if not candidates:
        return None
    low = least_loaded(candidates)
    best = min(candidates, key=lambda i: (-i.cached_tokens,) + i.load)
    if best.cached_tokens > low.cached_tokens and best.inflight - low.inflight <= slack:
        return best
    return low


def route_of(prefill_kind: str, prefill_cluster: str, decode_cluster: str) -> str:
    """The route of a prefill and a decode on different instances: `prfaas` when the prefill ran in a PrfaaS
    cluster and the KV crossed to another cluster, else `pd` (one instance doing both is `colocated`)."""
    return "prfaas" if prefill_kind == "prfaas" and prefill_cluster != decode_cluster else "pd"


def _route(prefill: InstanceState, decode: InstanceState) -> str:
    return route_of(prefill.kind, prefill.cluster, decode.cluster)


class LeastLoaded:
    name = "least_loaded"

    def state(self) -> dict[str, float]:
        return {}

    def place(self, snap: Snapshot) -> Placement:
        d = least_loaded(snap.of("decode"))
        if d is None:
            return Placement(None, None, "colocated", "no decode instance is up")
        p = least_loaded([i for i in snap.of("prefill") if i.name != d.name])
        if p is None:
            return Placement(d.name, None, "colocated", "no prefill instance is up: decode prefills")
        return Placement(d.name, p.name, _route(p, d), "least loaded prefill and decode instances",
                         uncached_tokens=snap.request.prompt_tokens - p.cached_tokens)


@dataclass(frozen=True)
class ThresholdParams:
    threshold_tokens: int  # t: uncached length above which prefill goes to a PrfaaS cluster
    adaptive: bool = True  # follow the link's utilisation
    raise_utilisation: float = 0.8  # at or above: raise the effective threshold (fewer, longer offloads)
    lower_utilisation: float = 0.4  # below: lower it again, never under threshold_tokens
    step: float = 1.5  # factor per change
    max_threshold_tokens: int | None = None  # default 16 x threshold_tokens
    hold_s: float = 4.0  # a level must hold this long (after the last change) before the threshold moves
    window_s: float = 20.0  # the recent uncached lengths the predicted link demand is taken over
    scarce_utilisation: float = 0.6  # at or above: bandwidth is scarce (each cluster's prefix judged alone)
    affinity_slack: int = 2  # see `affine`
    local_prefill_tokens: int = 256  # a decode instance holding all but this many prompt tokens prefills itself

    def __post_init__(self):
        if not 0 <= self.lower_utilisation < self.raise_utilisation:
            raise ValueError(f"policy: lower_utilisation ({self.lower_utilisation}) must be below "
                             f"raise_utilisation ({self.raise_utilisation})")
        if self.step <= 1:
            raise ValueError(f"policy: threshold_step must be > 1, got {self.step}")
        if self.window_s <= 0:
            raise ValueError(f"policy: window_s must be > 0, got {self.window_s}")
        if self.raise_utilisation <= self.lower_utilisation * self.step:
            # one raise divides a utilisation at raise_utilisation by about `step`: it must stay above the
            # lower level, or the next observation lowers the threshold again (oscillation)
            raise ValueError(f"policy: raise_utilisation ({self.raise_utilisation}) must exceed lower_utilisation "
                             f"x threshold_step ({self.lower_utilisation} x {self.step})")


class ThresholdController:
    """The effective threshold, the larger of two parts (PrfaaS 3.4.3, short term):

    - a predicted floor, from the distribution of recent uncached lengths (`record`, the last window_s
      seconds): the smallest threshold at which the KV of the requests above it, at the measured bytes per
      token, would fill at most raise_utilisation of the link's capacity. It follows a change of capacity (a
      bandwidth drop) at once, before any queue builds. The lengths do not depend on the threshold, so this
      part has no feedback loop to oscillate in.
    - a measured staircase: raised by `step` when the link's utilisation reaches raise_utilisation (or TCP
      retransmits grow: at once, at most once per hold_s), lowered by `step` when it falls below
      lower_utilisation. A level counts once it has held for hold_s, measured from the later of its start
      and the last change: one burst of transfers (the link's own figure covers 2 s) does not move it, and
      each change is judged on readings taken after it. The band between the two levels is the hysteresis: a
      steady load inside it changes nothing, and one change moves the utilisation by less than the band
      (raise > lower x step, checked), so it does not oscillate. It catches what the prediction misses
      (a wrong bytes-per-token figure, other traffic, loss)."""

    def __init__(self, p: ThresholdParams):
        self.p = p
        self.base = p.threshold_tokens
        self.top = p.max_threshold_tokens or max(16 * p.threshold_tokens, 1)
        self.stair = float(p.threshold_tokens)  # the measured part
        self.floor = float(p.threshold_tokens)  # the predicted part
        self.changed_at: float | None = None
        self.retransmits: int | None = None
        self.changes = 0
        self.utilisation = 0.0  # the last reading
        self.predicted = 0.0  # the predicted utilisation at the effective threshold
        self.high_since: float | None = None  # since when the link has read at or above raise_utilisation
        self.low_since: float | None = None  # ... below lower_utilisation
        self._recent: deque[tuple[float, int]] = deque()  # (time, uncached length), the last window_s seconds

    @property
    def value(self) -> float:
        return max(self.stair, self.floor)

    def rebase(self, tokens: float) -> None:
        """A new base threshold (the long-term re-plan, router/replan.py): the staircase restarts from it (a
        raised level above it stays until the link allows it down), the floor never goes under it."""
        raised = self.stair > self.base
        self.base = max(0, int(tokens))
        self.top = max(self.top, self.base)
        self.stair = max(self.stair, float(self.base)) if raised else float(self.base)
        self.floor = float(self.base)  # the next observation predicts it again from the recent lengths

    def record(self, uncached: int, now: float) -> None:
        """A request's uncached length, as the policy judged it (offloaded or not: the distribution)."""
        self._recent.append((now, uncached))
        self._expire(now)

    def _expire(self, now: float) -> None:
        while self._recent and now - self._recent[0][0] > self.p.window_s:
            self._recent.popleft()

    def _predict(self, link: LinkState, now: float, per_token: float | None) -> None:
        """The floor: the smallest threshold (base or a recent length) whose predicted demand fits
        raise_utilisation x capacity."""
        self._expire(now)
        if not per_token or not link.capacity_bytes_s:
            self.floor, self.predicted = float(self.base), 0.0
            return
        rate = per_token / self.p.window_s / link.capacity_bytes_s  # utilisation per token of the window
        above = sorted(n for _, n in self._recent if n > self.base)
        budget = self.p.raise_utilisation / rate
        floor, load = float(self.base), float(sum(above))
        for n in above:  # shortest first: each one kept local lowers the load
            if load <= budget:
                break
            load -= n
            floor = float(n)  # requests of n tokens and fewer stay local
        self.floor = min(float(self.top), floor)
        self.predicted = rate * sum(n for _, n in self._recent if n > self.value)

    def observe(self, link: LinkState | None, now: float, per_token: float | None = None) -> float:
        """The effective threshold now, given the link's state and the KV bytes per token measured so far."""
        if not self.p.adaptive or link is None or link.capacity_bytes_s is None:
            return self.value
        before = self.value
        self._predict(link, now, per_token)
        if self.value != before:
            self.changes += 1
        lossy = self.retransmits is not None and link.retransmits > self.retransmits
        self.retransmits = link.retransmits
        u = self.utilisation = link.utilisation
        self.high_since = (now if self.high_since is None else self.high_since) if u >= self.p.raise_utilisation \
            else None
        self.low_since = (now if self.low_since is None else self.low_since) if u < self.p.lower_utilisation \
            else None
        held = lambda since: since is not None and now - since >= self.p.hold_s  # noqa: E731
        rested = self.changed_at is None or now - self.changed_at >= self.p.hold_s
        if (held(self.high_since) or (lossy and rested)) and self.stair < self.top:
            self.stair = min(self.top, max(self.value, 1.0) * self.p.step)  # above whatever holds now
        elif held(self.low_since) and self.stair > self.base:
            self.stair = max(self.base, self.stair / self.p.step)
        else:
            return self.value
        # the next change needs a level that holds from now on, under the new threshold
        self.changed_at, self.changes = now, self.changes + 1
        self.high_since = self.low_since = None
        return self.value


class PrfaaS:
    """Selective offload (PrfaaS 3.3, 3.4.3). Decode runs in a PD cluster, on the cache-affine decode instance
    unless it is overloaded. A decode instance that already holds all but `local_prefill_tokens` of the
    prompt (the next turn of a conversation it served) prefills the rest itself. Otherwise, with l_total the
    prompt and l_c the longest prefix a prefill instance of cluster c holds, and t the controller's threshold:
    - bandwidth scarce (a PrfaaS -> PD link at or above scarce_utilisation): each cluster's prefix alone:
      l_total - l_pd <= t stays on the PD cluster's prefill, else the request goes to PrfaaS;
    - abundant: l_prefix = max(l_prfaas, l_pd); l_total - l_prefix <= t stays on PD, else PrfaaS; when the
      other cluster holds a longer prefix than the chosen prefill instance, it moves across (`move_prefix`).
    A request that only a raised threshold keeps local still goes to PrfaaS when the PD prefill's queue would hold
    it longer than the link's backlog and the PrfaaS prefill's queue (`_weigh`, on measured prefill rates).
    Within the chosen cluster the prefill instance is the cache-affine one unless overloaded. A cluster with
    no prefill instance up sends everything to the other; with none anywhere, decode prefills itself. Only the
    KV beyond what the decode instance holds crosses the link (the decode side's reservation skips it)."""

    name = "prfaas"

    def __init__(self, params: ThresholdParams):
        self.params = params
        self.threshold = ThresholdController(params)

    def state(self) -> dict[str, float]:
        c = self.threshold
        return {"threshold_tokens": c.value, "threshold_floor_tokens": c.floor, "threshold_changes": c.changes,
                "link_utilisation": c.utilisation, "link_predicted_utilisation": c.predicted}

    def place(self, snap: Snapshot) -> Placement:
        p = self.params
        d = affine(snap.of("decode", kind="pd") or snap.of("decode"), p.affinity_slack)
        if d is None:
            return Placement(None, None, "colocated", "no decode instance is up")
        total = snap.request.prompt_tokens
        remote = [i for i in snap.of("prefill", kind="prfaas") if i.role == "prefill"]
        local = [i for i in snap.of("prefill", cluster=d.cluster) if i.role == "prefill"]
        links = [lk for lk in (snap.link(c, d.cluster) for c in sorted({i.cluster for i in remote})) if lk]
        link = max(links, key=lambda lk: lk.utilisation, default=None)
        t = self.threshold.observe(link, snap.now, snap.kv_bytes_per_token)
        util = link.utilisation if link is not None else 0.0
        scarce = link is not None and link.capacity_bytes_s is not None and util >= p.scarce_utilisation
        l_pd = max((i.cached_tokens for i in local), default=0)
        l_prfaas = max((i.cached_tokens for i in remote), default=0)
        details = {"threshold": round(t), "utilisation": round(util, 4), "scarce": scarce, "l_total": total,
                   "l_pd": l_pd, "l_prfaas": l_prfaas, "l_decode": d.cached_tokens}
        if d.cached_tokens and total - d.cached_tokens <= p.local_prefill_tokens:
            return Placement(d.name, None, "colocated",
                             f"{d.name} holds {d.cached_tokens} of {total} prompt tokens: it prefills the rest",
                             uncached_tokens=total - d.cached_tokens, prefix_source=d.name, details=details)
        uncached = total - (l_pd if scarce else max(l_pd, l_prfaas))
        self.threshold.record(uncached, snap.now)
        offload = uncached > t
        why = (f"{'scarce' if scarce else 'abundant'} bandwidth (link at {util:.0%}): uncached {uncached} "
               f"{'>' if offload else '<='} threshold {t:.0f}")
        if offload and not remote:
            offload, why = False, why + ", but no PrfaaS prefill instance is up"
        elif not offload and not local and remote:
            offload, why = True, why + ", but the PD cluster has no prefill instance up"
        elif not offload and p.threshold_tokens < uncached and link is not None:
            offload, why = self._weigh(local, remote, link, uncached, snap.kv_bytes_per_token, details, why)
        pre = affine(remote if offload else local, p.affinity_slack)
        if pre is None:
            return Placement(d.name, None, "colocated", why + ": no prefill instance is up, decode prefills",
                             uncached_tokens=total - d.cached_tokens,
                             prefix_source=d.name if d.cached_tokens else None, details=details)
        move = None
        if not scarce:  # the best prefix anywhere: one held in the other cluster moves to the compute cluster
            holder = max(local if offload else remote, key=lambda i: (i.cached_tokens, i.name), default=None)
            if holder is not None and holder.cached_tokens > pre.cached_tokens:
                move = PrefixMove(holder.name, holder.cached_tokens)
        cached = move.tokens if move else pre.cached_tokens
        return Placement(d.name, pre.name, _route(pre, d), why, move, total - cached,
                         (move.src if move else pre.name) if cached else None, details)

    def _weigh(self, local, remote, link: LinkState, uncached: int, per_token: float | None, details: dict,
               why: str) -> tuple[bool, str]:
        """A request only the raised threshold keeps local (base < uncached <= threshold) still goes to PrfaaS
        when the PD prefill would hold it longer than the way out: the link's backlog (queued and unacknowledged
        bytes) and this request's KV at the link's capacity, plus the PrfaaS prefill's queue. A raise moves work
        only to a PD prefill with room. Waits come from the router's measured prefill rates; before they are
        measured, the threshold decides."""
        slack = self.params.affinity_slack
        near, far = affine(local, slack), affine(remote, slack)
        wait_local = near.prefill_wait(uncached) if near is not None else None
        if wait_local is None or far is None or not link.capacity_bytes_s or not per_token:
            return False, why
        wait_far = ((link.queued_bytes + link.pending_bytes + uncached * per_token) / link.capacity_bytes_s
                    + (far.prefill_wait(uncached) or 0.0))
        details.update(wait_local_s=round(wait_local, 3), wait_prfaas_s=round(wait_far, 3))
        if wait_local <= wait_far:
            return False, why + f" (PD prefill {wait_local:.1f}s <= link and PrfaaS {wait_far:.1f}s)"
        return True, (why + f", but PD prefill's queue ({wait_local:.1f}s) outlasts the link and PrfaaS "
                      f"({wait_far:.1f}s)")


POLICIES = ("least_loaded", "prfaas", "round_robin", "cache_aware", "banaserve", "flowkv")


def make(section) -> Policy:
    """The policy a config's `policy` section names (jaxserve/config.py PolicySection)."""
    from . import balance as b
    s = section
    if s.name == "least_loaded":
        return LeastLoaded()
    if s.name == "round_robin":
        return b.RoundRobin()
    if s.name == "cache_aware":
        return b.CacheAware(b.CacheAwareParams(s.rule, s.cache_threshold, s.balance_abs, s.balance_rel,
                                               s.overlap_weight))
    if s.name == "banaserve":
        return b.BanaServe(b.BanaServeParams(s.load_threshold, s.token_budget, True if s.store is None else s.store))
    if s.name == "flowkv":
        return b.FlowKV(b.FlowKVParams(token_budget=s.token_budget, window_s=s.load_window_s, low=s.load_low,
                                       high=s.load_high, idle_score=s.idle_score, hold_s=s.assist_s,
                                       extreme_s=s.extreme_s, store=bool(s.store)))
    if s.name == "prfaas":
        return PrfaaS(ThresholdParams(
            s.threshold_tokens, s.adaptive, s.raise_utilisation, s.lower_utilisation, s.threshold_step,
            s.max_threshold_tokens, s.hold_s, s.window_s, s.scarce_utilisation, s.affinity_slack,
            s.local_prefill_tokens))
    raise ValueError(f"policy.name: unknown policy {s.name!r} (one of {sorted(POLICIES)})")
