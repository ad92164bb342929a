"""Where an engine step's wall time goes, phase by phase (host scheduling, input preparation, the device program,
output handling), summed per kind of step. Plain Python, a few `perf_counter` calls per step; the engine keeps
one (`LLMEngine.timer`) and bench/offline.py prints its summary.

A step is `begin()`, then `mark(phase)` at the end of each phase (the time since the previous mark is charged to
it), then `end(kind)`. Single-threaded, as the engine loop that drives it.
"""

from __future__ import annotations

import time
from collections import defaultdict


class StepTimer:
    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self._count: dict[str, int] = defaultdict(int)
        self._total: dict[str, float] = defaultdict(float)
        self._phases: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
        self._cur: dict[str, float] = {}
        self._t0 = self._last = None

    def begin(self) -> None:
        self._t0 = self._last = time.perf_counter()
        self._cur = defaultdict(float)

    def mark(self, phase: str) -> None:
        if self._last is None:
            return
        now = time.perf_counter()
        self._cur[phase] += now - self._last
        self._last = now

    def end(self, kind: str) -> None:
        """Close the step as a `kind` step (e.g. "decode", "prefill", "mixed"); an empty kind drops it."""
        if self._t0 is None:
            return
        if kind:
            now = time.perf_counter()
            self._count[kind] += 1
            self._total[kind] += now - self._t0
            for p, v in self._cur.items():
                self._phases[kind][p] += v
            if now > self._last:
                self._phases[kind]["other"] += now - self._last
        self._t0 = self._last = None

    def summary(self) -> dict:
        """{kind: {"count", "mean_ms", "phases_ms": {phase: mean ms per step}}}, phases in the order first seen."""
        return {k: {"count": n, "mean_ms": 1e3 * self._total[k] / n,
                    "phases_ms": {p: 1e3 * v / n for p, v in self._phases[k].items()}}
                for k, n in self._count.items()}
