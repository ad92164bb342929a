"""The long-term half of dual-timescale scheduling (the PrfaaS document, 3.4.3): every `replan_s` the router
re-plans from the traffic it has seen and applies the result.

- It keeps the uncached input length of each request it placed and the output length of each that finished,
  over the last `window_s` seconds (`observe`, `finished`).
- `decide` runs the planner (router/planner.py) on those lengths as an empirical distribution, the PrfaaS and
  PD profiles the config names (measured with `jaxserve profile`), the PrfaaS instances up, the PD instances
  up and the PrfaaS -> PD link's bandwidth now. It returns the threshold that is optimal for the split in
  effect (applied every round: the short-term controller starts from it) and at most one role flip toward the
  optimal split.
- A flip is made only when the optimal split's lambda_max beats the current one's by `min_gain` (hysteresis:
  a small predicted gain does not pay a drain and a warm-up), no flip is under way, and `min_interval_s` has
  passed since the last one (planners that flip on every reading flap). One instance moves per round, the
  least loaded of the role in surplus; the next round re-plans with the new split.

Plain Python, no I/O: the router's control loop (router/cluster.py) calls it and carries out its decisions.
"""

from __future__ import annotations

import dataclasses
from collections import deque

from .planner import Empirical, Profile, Workload, best_of, best_threshold


@dataclasses.dataclass(frozen=True)
class ReplanParams:
    replan_s: float = 60.0  # how often to re-plan
    window_s: float = 600.0  # the traffic it plans from
    min_samples: int = 20  # requests observed before any decision
    min_gain: float = 0.1  # a flip needs lambda_max to grow by this fraction
    min_interval_s: float = 120.0  # between flips
    t_step: int = 16  # threshold search step (tokens)


@dataclasses.dataclass
class Decision:
    threshold_tokens: float | None  # the optimal threshold for the split in effect (None: nothing to plan from)
    flip: tuple[str, str] | None  # (instance, new role), or None
    why: str
    current: dict | None = None  # the planner's stages for the split in effect
    best: dict | None = None  # ... for the optimal split


class Replanner:
    def __init__(self, params: ReplanParams, prfaas: Profile, pd: Profile):
        self.p, self.prfaas, self.pd = params, prfaas, pd
        self._lengths: deque[tuple[float, int]] = deque()  # (time, uncached tokens)
        self._outputs: deque[tuple[float, int]] = deque()  # (time, output tokens)
        self.last_flip: float | None = None
        self.decisions = 0
        self.flips = 0

    def observe(self, uncached: int, now: float) -> None:
        self._lengths.append((now, max(1, int(uncached))))

    def finished(self, output_tokens: int, now: float) -> None:
        if output_tokens > 0:
            self._outputs.append((now, int(output_tokens)))

    def _expire(self, now: float) -> None:
        for q in (self._lengths, self._outputs):
            while q and now - q[0][0] > self.p.window_s:
                q.popleft()

    def decide(self, now: float, n_prfaas: int, pd: dict[str, tuple[str, int]], egress_gbps: float,
               flipping: bool = False) -> Decision:
        """pd: the PD-cluster instances up, name -> (role, requests in flight); flipping: a role change is under
        way (no other starts)."""
        self._expire(now)
        self.decisions += 1
        if len(self._lengths) < self.p.min_samples or not self._outputs:
            return Decision(None, None, f"{len(self._lengths)} requests observed, {self.p.min_samples} needed")
        wl = Workload(Empirical([n for _, n in self._lengths]),
                      sum(n for _, n in self._outputs) / len(self._outputs))
        roles = {n: r for n, (r, _) in pd.items()}
        n_p = sum(r == "prefill" for r in roles.values())
        n_d = sum(r == "decode" for r in roles.values())
        if len(roles) != n_p + n_d or not n_d:
            return Decision(None, None, "the PD cluster has instances of role both, or none decodes: not planned")
        cur = best_threshold(self.prfaas, self.pd, wl, n_prfaas, n_p, n_d, egress_gbps, self.p.t_step)
        n = n_p + n_d
        best = best_of([cur] + [best_threshold(self.prfaas, self.pd, wl, n_prfaas, k, n - k, egress_gbps, self.p.t_step)
                                for k in range(1, n) if k != n_p])  # a split keeps a prefill and a decode instance
        t = cur["threshold_tokens"]
        want = best["n_p"]
        if want == n_p:
            return Decision(t, None, "the split in effect is optimal", cur, best)
        if best["lambda_max"] < (1 + self.p.min_gain) * cur["lambda_max"]:
            return Decision(t, None, f"split {want}/{n - want} would gain under {self.p.min_gain:.0%}",
                            cur, best)
        if flipping:
            return Decision(t, None, "a role change is under way", cur, best)
        if self.last_flip is not None and now - self.last_flip < self.p.min_interval_s:
            return Decision(t, None, f"the last flip was {now - self.last_flip:.0f}s ago", cur, best)
        src, dst = ("decode", "prefill") if want > n_p else ("prefill", "decode")
        name = min((x for x, r in roles.items() if r == src), key=lambda x: (pd[x][1], x))
        self.last_flip, self.flips = now, self.flips + 1
        return Decision(t, (name, dst), f"split {n_p}/{n_d} -> {want}/{n - want}: lambda_max "
                        f"{cur['lambda_max']:.3g} -> {best['lambda_max']:.3g} req/s", cur, best)
