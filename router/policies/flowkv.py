"""`flowkv` (FlowKV 3.4, Appendix B): per instance a load score, a weighted sum of normalised indicators
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
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from .base import InstanceState, Placement, Snapshot, least_loaded
from .shared import Ttft, kv_used, nearest_decode, _placement, _prefills


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


def from_config(s) -> FlowKV:
    """The policy of a config's `policy` section (jaxserve/config.py PolicySection)."""
    return FlowKV(FlowKVParams(token_budget=s.token_budget, window_s=s.load_window_s, low=s.load_low,
                               high=s.load_high, idle_score=s.idle_score, hold_s=s.assist_s,
                               extreme_s=s.extreme_s, store=s.store))
