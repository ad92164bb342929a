"""bench/prfaas_live.py's offered load: the conversation rate from the PD cluster's measured capacity, and the
capacity measurement's orchestration against a stand-in cluster (requests answered by the event loop, no
model): what it sends, under which policy, and what it reports."""

from __future__ import annotations

import asyncio
import types

import numpy as np
import pytest

from bench import prfaas_live


def test_the_offered_rate_counts_second_turns():
    # 2 requests/s of capacity at 1.5x load, 30% of conversations with a second turn: 3 requests/s offered,
    # 1.3 requests per conversation
    assert prfaas_live.offered_rate(2.0, 1.5, 0.3) == pytest.approx(3.0 / 1.3)
    assert prfaas_live.offered_rate(2.0, 1.0, 0.0) == pytest.approx(2.0)


class Stand:
    """Answers every request at once with one finished update; records what it was sent and under which
    policy."""

    def __init__(self):
        self.policy = None
        self.sent: list[tuple[str, int, float]] = []  # request id, prompt length, the threshold it met

    async def add(self, rid, prompt, params):
        self.sent.append((rid, len(prompt), self.policy.state().get("threshold_tokens")))
        assert params.max_tokens == 16 and params.temperature == 0
        q: asyncio.Queue = asyncio.Queue()
        await asyncio.sleep(0.001)
        q.put_nowait(types.SimpleNamespace(finished=True, error=None, token_ids=[1] * params.max_tokens,
                                           route={"route": "pd"}, ttft_s=0.001, cached_tokens=0))
        return q


def test_calibration_runs_the_workload_on_the_pd_cluster_alone_and_reports_its_rate():
    args = types.SimpleNamespace(scale=64, calibrate_s=0.2, calibrate_concurrency=3, load=1.5, turns=0.3,
                                 threshold=256)
    stand = Stand()
    cal = asyncio.run(prfaas_live.calibrate(stand, args))
    assert cal["requests"] == len(stand.sent) > args.calibrate_concurrency
    # every request under the never policy (an unreachable threshold: nothing offloaded), each id once
    assert {t for _, _, t in stand.sent} == {10**9}
    assert len({rid for rid, _, _ in stand.sent}) == len(stand.sent)
    # the workload's first-turn lengths, in its order
    want = prfaas_live.lengths(np.random.default_rng(7), len(stand.sent), args.scale)
    assert [n for _, n, _ in stand.sent] == want
    assert cal["capacity_rps"] == pytest.approx(cal["requests"] / cal["wall_s"])
    assert cal["rate"] == pytest.approx(prfaas_live.offered_rate(cal["capacity_rps"], 1.5, 0.3))


def test_the_warm_up_runs_before_the_rate_is_measured(monkeypatch):
    """Without --rate the warm-up's workload runs at WARM_RATE (the rate is measured after it), both routes."""
    monkeypatch.setattr(prfaas_live, "WARM_RATE", 200.0)  # arrivals within the 0.3 s of each route's workload
    args = types.SimpleNamespace(scale=64, threshold=256, turns=0.3, think_s=0.0, warm_s=0.3, rate=None)
    stand = Stand()
    asyncio.run(prfaas_live.warm(stand, args))
    assert args.rate is None
    thresholds = [t for _, _, t in stand.sent]
    assert {10**9, 0} <= set(thresholds)  # never, then always
    assert any(rid.startswith("s10.") for rid, _, _ in stand.sent) and any(rid.startswith("s11.") for rid, _, _ in
                                                                           stand.sent)
