"""StepTimer's busy fraction (what heartbeats report to the balancing policies), on a controlled clock."""

import pytest

from jaxserve.engine import steptimer


def test_busy_is_the_share_of_the_window_spent_in_steps(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(steptimer.time, "perf_counter", lambda: now[0])
    t = steptimer.StepTimer()
    assert t.busy() == 0.0
    for _ in range(4):  # 0.25 s steps with 0.25 s gaps: half the time busy
        t.begin()
        now[0] += 0.25
        t.end("decode")
        now[0] += 0.25
    assert t.busy() == pytest.approx(0.5)
    now[0] += 1.0  # a step that began before the window counts only inside it
    t.begin()
    now[0] += 3.0
    t.end("prefill")
    assert t.busy() == pytest.approx(1.0)
    now[0] += 2.5
    assert t.busy() == 0.0 and len(t._recent) <= 1  # old steps leave the window (and the memory)
