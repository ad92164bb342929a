"""Where an engine step's wall time goes, phase by phase (host scheduling, input preparation, the device program,
output handling), summed per kind of step. Plain Python, a few `perf_counter` calls per step; the engine keeps
one (`LLMEngine.timer`) and bench/offline.py prints its summary. `busy()` is the fraction of the last
`BUSY_WINDOW_S` seconds spent inside steps (the load the router's balancing policies read from heartbeats).

A step is `begin()`, then `mark(phase)` at the end of each phase (the time since the previous mark is charged to
it), then `end(kind)`. Single-threaded, as the engine loop that drives it.
"""

from __future__ import annotations

import time
from collections import defaultdict, deque


class StepTimer:
    BUSY_WINDOW_S = 2.0

    def __init__(self):
        self._recent: deque[tuple[float, float]] = deque()  # (start, end) of the steps that ended lately
        self.reset()

    def busy(self, now: float | None = None) -> float:
        """Fraction of the last BUSY_WINDOW_S seconds spent in steps (those still running not counted)."""
        now = time.perf_counter() if now is None else now
        lo = now - self.BUSY_WINDOW_S
        while self._recent and self._recent[0][1] < lo:
            self._recent.popleft()
        return min(1.0, sum(e - max(s, lo) for s, e in self._recent) / self.BUSY_WINDOW_S)

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
        now = time.perf_counter()
        self._recent.append((self._t0, now))
        while self._recent[0][1] < now - self.BUSY_WINDOW_S:  # kept to the window whether or not busy() is read
            self._recent.popleft()
        if kind:  # the count last: a reader on another thread (totals) sees a counted kind's phases
            for p, v in self._cur.items():
                self._phases[kind][p] += v
            if now > self._last:
                self._phases[kind]["other"] += now - self._last
            self._total[kind] += now - self._t0
            self._count[kind] += 1
        self._t0 = self._last = None

    def totals(self) -> dict:
        """{kind: {"count", "ms", "phases_ms": {phase: ms}}}: sums since the last reset (two readings' difference
        is a window's: bench/gpu_disagg.py reads a worker's over its timed requests). Readable from another thread
        than the one timing (each dict copied by one list() call, which no other Python thread interleaves)."""
        out, total, phases = {}, self._total, self._phases  # .get: a reader inserts nothing in the defaultdicts
        for k, n in list(self._count.items()):
            out[k] = {"count": n, "ms": round(1e3 * total.get(k, 0.0), 3),
                      "phases_ms": {p: round(1e3 * v, 3) for p, v in list(phases.get(k, {}).items())}}
        return out

    def summary(self) -> dict:
        """{kind: {"count", "mean_ms", "phases_ms": {phase: mean ms per step}}}, phases in the order first seen."""
        return {k: {"count": n, "mean_ms": 1e3 * self._total[k] / n,
                    "phases_ms": {p: 1e3 * v / n for p, v in self._phases[k].items()}}
                for k, n in self._count.items()}
