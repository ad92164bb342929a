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


def test_totals_sum_each_kinds_steps_and_phases_for_a_reader_to_difference(monkeypatch):
    """What /health reports per instance: sums since the start, so two readings' difference is a window's."""
    now = [10.0]
    monkeypatch.setattr(steptimer.time, "perf_counter", lambda: now[0])
    t = steptimer.StepTimer()

    def step(kind, device_s):
        t.begin()
        now[0] += 0.001
        t.mark(f"{kind}.prepare")
        now[0] += device_s
        t.mark(f"{kind}.device")
        t.end(kind)
    step("prefill", 0.020)
    first = t.totals()
    for _ in range(3):
        step("decode", 0.004)
    step("prefill", 0.030)
    got = t.totals()
    assert first == {"prefill": {"count": 1, "ms": 21.0, "phases_ms": {"prefill.prepare": 1.0, "prefill.device": 20.0}}}
    assert got["decode"] == {"count": 3, "ms": 15.0, "phases_ms": {"decode.prepare": 3.0, "decode.device": 12.0}}
    assert got["prefill"]["count"] - first["prefill"]["count"] == 1
    assert got["prefill"]["phases_ms"]["prefill.device"] - first["prefill"]["phases_ms"]["prefill.device"] == 30.0
    t.reset()
    assert t.totals() == {}
