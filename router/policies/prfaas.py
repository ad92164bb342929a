"""`prfaas` (PrfaaS section 3.4.3): selective offload of long uncached prefills to a PrfaaS cluster, judged on
the uncached length against a threshold that follows the link's utilisation with hysteresis; cache-aware
(bandwidth scarce: each cluster's own prefix; abundant: the best prefix anywhere, moved across when it
sits in the other cluster) and cache-affine within a cluster unless the affine instance is overloaded.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from .base import LinkState, Placement, PrefixMove, Snapshot, affine, _route


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


def from_config(s) -> PrfaaS:
    """The policy of a config's `policy` section (jaxserve/config.py PolicySection)."""
    return PrfaaS(ThresholdParams(
        threshold_tokens=s.threshold_tokens, adaptive=s.adaptive, raise_utilisation=s.raise_utilisation,
        lower_utilisation=s.lower_utilisation, step=s.threshold_step, max_threshold_tokens=s.max_threshold_tokens,
        hold_s=s.hold_s, window_s=s.window_s, scarce_utilisation=s.scarce_utilisation,
        affinity_slack=s.affinity_slack, local_prefill_tokens=s.local_prefill_tokens))
