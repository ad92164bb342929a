"""The long-term loop (router/replan.py): decisions from observed traffic, hysteresis and spacing of flips,
the threshold it hands the short-term controller; and the router carrying a flip out on a live cluster."""

from __future__ import annotations

import json
import time

import numpy as np
import pytest

from jaxserve.config import ConfigFileError, parse
from jaxserve.router.planner import Empirical, Profile, Workload, best_threshold
from jaxserve.router.policies.prfaas import ThresholdController, ThresholdParams
from jaxserve.router.replan import ReplanParams, Replanner


def _profile(prefill_s_per_token: float, step_s: float, batch: int) -> Profile:
    return Profile.from_json({"prefill": {"tokens": [100, 1000], "seconds": [100 * prefill_s_per_token,
                                                                              1000 * prefill_s_per_token],
                                          "kv_bytes": [1e5, 1e6]},
                              "decode": {"step_seconds": step_s, "max_batch": batch}})


FAST_PREFILL_SLOW_DECODE = _profile(1e-4, 0.05, 4)  # decode-bound: wants decode instances
SLOW_PREFILL_FAST_DECODE = _profile(1e-2, 0.001, 64)  # prefill-bound: wants prefill instances


def fed(profile, n=40, min_samples=20, **kw) -> Replanner:
    r = Replanner(ReplanParams(min_samples=min_samples, min_interval_s=kw.pop("min_interval_s", 0.0), **kw),
                  profile, profile)
    rng = np.random.default_rng(0)
    for i, L in enumerate(rng.integers(50, 800, n)):
        r.observe(int(L), float(i) * 0.1)
        r.finished(32, float(i) * 0.1)
    return r


def test_no_decision_before_enough_traffic():
    r = fed(FAST_PREFILL_SLOW_DECODE, n=5)
    d = r.decide(1.0, 0, {"p0": ("prefill", 0), "d0": ("decode", 0)}, 10.0)
    assert d.threshold_tokens is None and d.flip is None and "5 requests observed, 20 needed" in d.why


def test_a_decode_bound_split_flips_its_least_loaded_prefill_instance():
    r = fed(FAST_PREFILL_SLOW_DECODE)
    pd = {"p0": ("prefill", 3), "p1": ("prefill", 1), "p2": ("prefill", 2), "d0": ("decode", 0)}
    d = r.decide(5.0, 0, pd, 10.0)
    assert d.flip == ("p1", "decode"), d.why
    assert d.best["lambda_max"] > d.current["lambda_max"] and (d.current["n_p"], d.current["n_d"]) == (3, 1)
    # the threshold is the best one for the split in effect, on the observed lengths
    wl = Workload(Empirical([n for _, n in r._lengths]), 32)
    assert d.threshold_tokens == best_threshold(r.prfaas, r.pd, wl, 0, 3, 1, 10.0, 16)["threshold_tokens"]


def test_a_prefill_bound_split_flips_a_decode_instance():
    r = fed(SLOW_PREFILL_FAST_DECODE)
    d = r.decide(5.0, 0, {"p0": ("prefill", 0), "d0": ("decode", 2), "d1": ("decode", 0), "d2": ("decode", 1)},
                 10.0)
    assert d.flip == ("d1", "prefill"), d.why


def test_hysteresis_spacing_and_a_flip_under_way_hold_flips_back():
    pd = {"p0": ("prefill", 0), "p1": ("prefill", 0), "d0": ("decode", 0)}
    r = fed(FAST_PREFILL_SLOW_DECODE, min_gain=10.0)  # no split gains 1000%
    d = r.decide(5.0, 0, pd, 10.0)
    assert d.flip is None and "would gain under" in d.why and d.threshold_tokens is not None
    r = fed(FAST_PREFILL_SLOW_DECODE, min_interval_s=60.0)
    assert r.decide(5.0, 0, pd, 10.0).flip is not None
    held = r.decide(30.0, 0, pd, 10.0)  # the same split again: the last flip was 25 s ago
    assert held.flip is None and "the last flip was 25s ago" in held.why
    assert r.decide(5.0 + 61.0, 0, pd, 10.0).flip is not None  # the interval has passed
    r = fed(FAST_PREFILL_SLOW_DECODE)
    assert r.decide(5.0, 0, pd, 10.0, flipping=True).flip is None
    # an optimal split stays as it is
    r = fed(FAST_PREFILL_SLOW_DECODE)
    d = r.decide(5.0, 0, {"p0": ("prefill", 0), "d0": ("decode", 0), "d1": ("decode", 0), "d2": ("decode", 0)}, 10.0)
    assert d.flip is None and d.why == "the split in effect is optimal"


def test_a_single_pd_instance_is_planned_without_a_flip():
    r = fed(FAST_PREFILL_SLOW_DECODE)
    d = r.decide(5.0, 1, {"d0": ("decode", 0)}, 10.0)
    assert d.flip is None and d.threshold_tokens is not None and d.why == "the split in effect is optimal"


def test_old_traffic_leaves_the_window():
    r = fed(FAST_PREFILL_SLOW_DECODE, window_s=10.0)
    d = r.decide(100.0, 0, {"p0": ("prefill", 0), "d0": ("decode", 0)}, 10.0)
    assert d.threshold_tokens is None and "0 requests observed" in d.why


def test_equal_observed_lengths_plan_a_positive_rate():
    """All requests of one length (lo == hi): the threshold at that length keeps them all in PD, whose rate is
    positive (the shortest length belongs to the short side)."""
    wl = Workload(Empirical([7] * 10), 32)
    row = best_threshold(FAST_PREFILL_SLOW_DECODE, FAST_PREFILL_SLOW_DECODE, wl, 0, 2, 1, 10.0, 16)
    assert row["lambda_max"] > 0 and row["threshold_tokens"] == 7 and row["l_short"] == 7


def test_empirical_lengths_match_numpy():
    xs = np.random.default_rng(1).integers(1, 5000, 300)
    e = Empirical(xs)
    for t in (0, 17, 1000, 2500, 4999, 5000):
        assert e.above(t) == pytest.approx(np.mean(xs > t))
        lo = xs[xs <= t]
        assert e.mean_between(0, t) == (pytest.approx(lo.mean()) if len(lo) else None)
        hi = xs[xs > t]
        assert e.mean_between(t, 1e9) == (pytest.approx(hi.mean()) if len(hi) else None)
    assert e.mean() == pytest.approx(xs.mean()) and (e.lo, e.hi) == (xs.min(), xs.max())


def test_rebase_moves_the_short_term_controllers_base():
    c = ThresholdController(ThresholdParams(1024, adaptive=False))
    c.rebase(300)
    assert c.value == 300 and c.base == 300
    c.stair = 900.0  # raised by the link
    c.rebase(500)
    assert c.value == 900.0  # a raised level stays until the link allows it down
    c.rebase(2000)
    assert c.value == 2000


def test_replan_config_needs_its_profiles(tmp_path):
    base = {"model": {"path": "bundled"}, "clusters": [{"name": "c", "instances": [
        {"name": "p0", "role": "prefill"}, {"name": "d0", "role": "decode"}]}]}
    with pytest.raises(ConfigFileError, match="replan_s needs prfaas_profile and pd_profile"):
        parse({**base, "policy": {"name": "prfaas", "replan_s": 5}})
    with pytest.raises(ConfigFileError, match="policy.replan_s: a key of the prfaas policy"):
        parse({**base, "policy": {"replan_s": 5}})
    from jaxserve.router.cluster import Router
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"prefill": {"tokens": [1], "seconds": [1]}, "decode": {}}))
    cfg = parse({**base, "policy": {"name": "prfaas", "replan_s": 5, "prfaas_profile": str(bad),
                                    "pd_profile": str(bad)}})
    with pytest.raises(ConfigFileError, match=r"policy\.prfaas_profile\.prefill\.kv_bytes"):
        Router(cfg, None)


@pytest.mark.slow
def test_the_router_flips_an_instance_when_decode_is_the_bottleneck(checkpoint_dir, tmp_path):
    """A live cluster (p0, p1 prefill; d0 decode) whose PD profile says decode is the bottleneck: after enough
    requests the loop flips the less loaded prefill instance to decode, and requests keep succeeding."""
    from tests.router.test_cluster_http import complete, disagg_config, serving
    prof = tmp_path / "pd.json"
    prof.write_text(json.dumps(FAST_PREFILL_SLOW_DECODE.to_json()))
    cfg = disagg_config(checkpoint_dir("llama"), [{"name": "p1", "role": "prefill"}],
                        policy={"name": "prfaas", "replan_s": 0.3, "prfaas_profile": str(prof),
                                "pd_profile": str(prof), "replan_min_samples": 6, "replan_min_interval_s": 0})
    with serving(cfg) as (client, cluster):
        for i in range(6):
            complete(client, [5 + i, 7, 9, 11, 13, 2, 3])
        deadline = time.monotonic() + 120
        while not cluster.admin.replanner.flips or any(w.draining for w in cluster.registry.all()):
            assert time.monotonic() < deadline, f"no flip: {cluster.admin.replan_state}"
            time.sleep(0.05)
        roles = sorted(w.role for w in cluster.registry.all())
        assert roles == ["decode", "decode", "prefill"], roles
        assert cluster.admin.replan_state["replan_flips"] >= 1
        for i in range(4):
            complete(client, [9 + i, 7, 9, 11, 13, 2, 3])
