"""The simulator (router/sim): its queues against queueing theory, the live policy objects routing inside it,
the document's case study against the planner, links, caches and scale."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from jaxserve.router.planner import LogNormal, Profile, Workload, plan
from jaxserve.router.policies.least_loaded import LeastLoaded
from jaxserve.router.policies.prfaas import PrfaaS, ThresholdParams
from jaxserve.router.sim.models import Clock, Link, Prefill, PrefixCache
from jaxserve.router.sim.run import Deployment, InstanceSpec, Simulation, Traffic, case_study

PROFILES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "bench",
                        "profiles")


def _load(name):
    with open(os.path.join(PROFILES, name)) as f:
        return json.load(f)


def flat(seconds: float, step_s: float = 0.001, batch: int = 1000) -> Profile:
    """Every prompt takes `seconds`; decode barely holds anything."""
    return Profile.from_json({"prefill": {"tokens": [1, 2], "seconds": [seconds, seconds], "kv_bytes": [1, 2]},
                              "decode": {"step_seconds": step_s, "max_batch": batch}})


def test_a_prefill_queue_waits_as_pollaczek_khinchine_says():
    """Poisson arrivals at rate 0.5/s, every prefill 1 s (M/D/1, rho 0.5): mean wait 0.5 s, so mean TTFT 1.5 s."""
    prof = flat(1.0)
    dep = Deployment([InstanceSpec("p0", "pd", "pd", "prefill", prof), InstanceSpec("d0", "pd", "pd", "decode", prof)],
                     LeastLoaded, chunk_tokens=1)
    res = Simulation(dep, Traffic(0.5, LogNormal(4.0, 1e-6, 1, 1000), output_tokens=1, duration_s=40000),
                     seed=3).run(drain_s=100)
    assert res["ttft_s"]["mean"] == pytest.approx(1.5, rel=0.05)
    assert res["throughput_rps"] == pytest.approx(0.5, rel=0.03)


def test_decode_slots_bound_throughput():
    """4 slots, 100 output tokens of 10 ms: 4 requests per second at most, whatever is offered."""
    prof = flat(0.001, step_s=0.01, batch=4)
    dep = Deployment([InstanceSpec("p0", "pd", "pd", "prefill", prof), InstanceSpec("d0", "pd", "pd", "decode", prof)],
                     LeastLoaded)
    res = Simulation(dep, Traffic(8.0, LogNormal(4.0, 0.5, 1, 1000), output_tokens=100, duration_s=2000)).run(drain_s=0)
    assert res["throughput_rps"] == pytest.approx(4.0, rel=0.03)


def test_a_prefill_behind_a_cached_prefix_takes_the_profiles_extra():
    prof = Profile.from_json({"prefill": {"tokens": [16, 64], "seconds": [0.004, 0.010], "kv_bytes": [1, 4],
                                          "prefix": {"new_tokens": 32, "tokens": [1024], "extra_seconds": [0.020]}},
                              "decode": {"step_seconds": 0.002, "max_batch": 8}})
    clock, steps = Clock(), []
    p = Prefill(clock, "p0", "pd", "pd", prof, chunk_tokens=32, cache_tokens=0)
    p.submit(32, steps.append, lambda: None, cached=1024)  # a next turn: 32 new tokens behind 1,024 cached
    p.submit(32, steps.append, lambda: None)  # a fresh prompt of 32
    clock.run(1.0)
    assert steps == [pytest.approx(0.006 + 0.020), pytest.approx(0.006)]


def test_chunked_prefill_lets_a_short_prompt_pass_a_long_one():
    """chunk_size 256, 512 tokens a step: a 1,024-token prompt runs as four chunks whose times sum to its whole
    prefill; a 64-token prompt arriving during its first chunk rides in the second step instead of waiting for
    the whole of it (as it does with whole prompts)."""
    F = {256: 0.010, 320: 0.013, 512: 0.024, 768: 0.040, 1024: 0.060}  # convex: attention grows with length
    prof = Profile.from_json({"prefill": {"tokens": [64] + list(F), "seconds": [0.003] + list(F.values()),
                                          "kv_bytes": [1] * 6}, "decode": {"step_seconds": 0.002, "max_batch": 8}})
    ends = {}
    for chunk in (None, 256):
        clock, done = Clock(), {}
        p = Prefill(clock, "p0", "pd", "pd", prof, chunk_tokens=512, cache_tokens=0, chunk_size=chunk, max_seqs=4)
        p.submit(1024, lambda dt: None, lambda: done.setdefault("long", clock.now))
        clock.at(0.001, p.submit, 64, lambda dt: None, lambda: done.setdefault("short", clock.now))
        clock.run(1.0)
        ends[chunk] = done
    assert ends[None] == {"long": pytest.approx(0.060), "short": pytest.approx(0.063)}
    # steps: [long 0-256] 10 ms; [long 256-512, short 64]: F(320) + F(512) - F(256) - F(256) = 17 ms;
    # [long 512-768] F(768) - F(512) = 16 ms; [long 768-1024] 20 ms: the long prompt ends 3 ms later than alone
    assert ends[256] == {"short": pytest.approx(0.027), "long": pytest.approx(0.063)}


def test_a_trace_replays_exactly_its_conversations():
    """Traffic.trace: each listed conversation arrives when listed with its length, its second turn exactly
    think_s after the first finished (the whole conversation plus followup_tokens), and nothing else arrives."""
    prof = flat(0.5, step_s=0.01)
    dep = Deployment([InstanceSpec("p0", "pd", "pd", "prefill", prof), InstanceSpec("d0", "pd", "pd", "decode", prof)],
                     LeastLoaded)
    trace = ((1.0, 300, True), (2.5, 40, False), (90.0, 7, True))  # the last one arrives after the run's end
    sim = Simulation(dep, Traffic(50.0, LogNormal(4.0, 1.0, 1, 1000), output_tokens=10, duration_s=60, turn_p=1.0,
                                  think_s=3.0, followup_tokens=5, trace=trace))
    res = sim.run()
    got = sorted((r.arrival, r.turn, r.prompt) for r in sim.finished)
    first = next(r for r in sim.finished if r.turn == 0 and r.prompt == 300)
    assert [(t, p) for t, turn, p in got if turn == 0] == [(1.0, 300), (2.5, 40)]
    assert [(turn, p) for _, turn, p in got if turn == 1] == [(1, 300 + 10 + 5)]
    assert [t for t, turn, _ in got if turn == 1] == [pytest.approx(first.done + 3.0)]
    assert res["requests"] == 3

    # bench/sim_validate.py pairs each live request with its replayed self: conversation by arrival order
    from bench.sim_validate import PER_REQUEST, pairs
    rec = lambda t, conv, turn, n, ttft: {"t": t, "ok": True, "conv": conv, "turn": turn, "len": n,  # noqa: E731
                                          "route": "pd", "ttft_s": ttft, "cached": 0}
    live = [rec(2.5, 1, 1, 40, 0.2), rec(1.0, 0, 1, 300, 0.7), rec(first.done + 3.0, 0, 2, 315, 0.3),
            {"t": 95.0, "ok": False, "conv": 2, "turn": 1, "len": 7}]
    got = [dict(zip(PER_REQUEST, row)) for row in pairs(live, sim.finished)]
    assert [(g["prompt_tokens"], g["turn"], g["ttft_live_s"]) for g in got] == [(300, 1, 0.7), (40, 1, 0.2),
                                                                               (315, 2, 0.3)]
    by_len = {r.prompt: r for r in sim.finished}
    assert [g["ttft_sim_s"] for g in got] == [pytest.approx(by_len[n].first - by_len[n].arrival, abs=1e-5)
                                             for n in (300, 40, 315)]


def test_the_serving_path_cost_is_added_per_route_and_prompt_length():
    """Deployment.path_s: a route's measured cost beyond the prefill, interpolated by prompt length (held at the
    ends), added to its TTFTs; a route without one pays dispatch_s. bench/sim_validate.py measures it: TTFT less
    the profile's prefill time of the uncached tokens behind the cached ones, the median per length."""
    from bench.sim_validate import serving_path
    prof = flat(0.5, step_s=0.01)
    trace = ((1.0, 50, False), (30.0, 400, False))

    def ttfts(**kw):
        dep = Deployment([InstanceSpec("p0", "pd", "pd", "prefill", prof),
                          InstanceSpec("d0", "pd", "pd", "decode", prof)], LeastLoaded, **kw)
        sim = Simulation(dep, Traffic(1.0, LogNormal(4.0, 1.0, 1, 1000), output_tokens=10, duration_s=60,
                                      trace=trace))
        sim.run()
        return {r.prompt: r.first - r.arrival for r in sim.finished}, {r.route for r in sim.finished}
    got, routes = ttfts(dispatch_s=0.002, path_s={"pd": ((0, 100), (0.01, 0.03))})
    assert routes == {"pd"}
    assert got == {50: pytest.approx(0.5 + 0.02), 400: pytest.approx(0.5 + 0.03)}
    got, _ = ttfts(dispatch_s=0.002, path_s={"prfaas": ((0, 100), (0.01, 0.03))})
    assert got == {50: pytest.approx(0.502), 400: pytest.approx(0.502)}
    lin = Profile.from_json({"prefill": {"tokens": [1, 1001], "seconds": [0.001, 0.101], "kv_bytes": [1, 2]},
                             "decode": {"step_seconds": 0.01, "max_batch": 4}})
    # (turn, route, prompt tokens, cached, TTFT): first turns make the PD curve and next turns the colocated
    # one; a next turn the policy sent elsewhere, a length with fewer than `least` requests, count for nothing
    cal = [(1, "pd", 2, 0, 0.0072), (1, "pd", 2, 0, 0.0092), (1, "pd", 2, 0, 0.0082), (1, "pd", 201, 0, 0.033),
           (2, "colocated", 300, 200, 0.0109 + 0.005), (2, "pd", 201, 100, 9.0), (1, "pd", 700, 0, 9.0),
           (1, None, 3, 0, 1.0)]
    path, fixed = serving_path(cal, {"pd": lin, "colocated": lin}, least=1)
    assert path["pd"][0] == (2, 201, 700) and path["pd"][1][:2] == pytest.approx((0.0082 - 0.0011, 0.012))
    assert path["colocated"] == ((300,), (pytest.approx(0.005),)) and fixed == pytest.approx(0.0071)
    path, _ = serving_path(cal, {"pd": lin, "colocated": lin})
    assert path == {"pd": ((2,), (pytest.approx(0.0071),))}


def test_the_live_policy_routes_by_the_threshold():
    """A fixed threshold: the share sent to PrfaaS is P(L > t) of the length distribution."""
    P, D = Profile.from_json(_load("prfaas_h200.json")), Profile.from_json(_load("pd_h20.json"))
    wl = Workload.from_json(_load("workload_case_study.json"))
    dep = case_study(P, D, "prfaas_pd", lambda: PrfaaS(ThresholdParams(19400, adaptive=False)))
    res = Simulation(dep, Traffic(1.0, wl.lengths, 1024, duration_s=3600), seed=2).run()
    share = res["routes"]["prfaas"] / res["requests"]
    assert share == pytest.approx(wl.lengths.above(19400), abs=0.03)


def test_the_case_study_saturates_where_the_planner_says_and_prfaas_cuts_ttft():
    """Offered 4 req/s (above every deployment's capacity) for an hour: completions per second within 5% of the
    planner's lambda_max for each deployment; at 1.5 req/s PrfaaS-PD's P90 TTFT is under half the homogeneous
    cluster's (the document: 64% lower)."""
    P, D = Profile.from_json(_load("prfaas_h200.json")), Profile.from_json(_load("pd_h20.json"))
    wl = Workload.from_json(_load("workload_case_study.json"))
    planned = plan(P, D, wl, 4, 8, 100.0)
    setups = {"prfaas_pd": (lambda: PrfaaS(ThresholdParams(19400, adaptive=False)), {}),
              "homogeneous": (LeastLoaded, dict(n_p=9, n_d=3)),
              "naive": (lambda: PrfaaS(ThresholdParams(0, adaptive=False)), dict(n_p=0, n_d=8))}
    p90 = {}
    for which, (mk, kw) in setups.items():
        dep = case_study(P, D, which, mk, **kw)
        sat = Simulation(dep, Traffic(4.0, wl.lengths, 1024, duration_s=3600), seed=1).run(drain_s=0)
        assert sat["throughput_rps"] == pytest.approx(planned[which]["lambda_max"], rel=0.05), which
        p90[which] = Simulation(dep, Traffic(1.5, wl.lengths, 1024, duration_s=3600), seed=1).run()["ttft_s"]["p90"]
    assert p90["prfaas_pd"] < 0.5 * p90["homogeneous"], p90


def test_a_link_carries_no_more_than_its_bandwidth():
    clock, rng = Clock(), np.random.default_rng(0)
    link = Link(clock, "a", "b", 8.0, 0.0, 0.0, rng)  # 1 GB/s
    done = []
    for _ in range(10):
        link.send(500_000_000, lambda: done.append(clock.now))
    clock.at(2.0, link.set_gbps, 4.0)  # a transfer sent after this point takes the new rate
    clock.at(6.0, link.send, 500_000_000, lambda: done.append(clock.now))  # the queue is empty by then
    clock.run(100)
    assert done[0] == pytest.approx(0.5) and done[9] == pytest.approx(5.0)  # queued at 1 GB/s, back to back
    assert done[10] == pytest.approx(7.0)  # 0.5 GB at 0.5 GB/s
    assert link.bytes_sent == 5_500_000_000 and link.pending_bytes == 0


def test_prefix_caches_evict_the_least_recent_conversation():
    c = PrefixCache(100)
    c.put("a", 40)
    c.put("b", 40)
    c.get("a")
    c.put("c", 40)  # over capacity: b is the least recent
    assert (c.get("a"), c.get("b"), c.get("c")) == (40, 0, 40) and c.used == 80
    assert c.held("a") == 40  # looking (a snapshot for the policy) is not a use: a stays the least recent
    c.put("d", 40)
    assert (c.held("a"), c.held("c"), c.held("d")) == (0, 40, 40)


def test_later_turns_reuse_the_conversations_cached_prefix():
    P, D = Profile.from_json(_load("prfaas_h200.json")), Profile.from_json(_load("pd_h20.json"))
    dep = case_study(P, D, "prfaas_pd", lambda: PrfaaS(ThresholdParams(4096, adaptive=False)))
    sim = Simulation(dep, Traffic(0.5, LogNormal(8.0, 0.5, 128, 16384), 256, duration_s=1800, turn_p=0.8,
                                  think_s=5.0, followup_tokens=300), seed=4)
    sim.run()
    later = [r for r in sim.finished if r.turn > 0]
    assert len(later) > 100
    # a later turn placed on the prefill instance that holds its conversation (the policy's cache affinity,
    # unless that instance is overloaded) computes only the new tokens and the previous answer
    assert np.mean([r.uncached <= 300 + 256 for r in later]) > 0.9
    assert np.mean([r.uncached for r in later]) < 0.5 * np.mean([r.prompt for r in later])


@pytest.mark.slow
def test_ten_thousand_accelerators():
    """104 cells of the case study (1,248 instances of 8 GPUs: 9,984 accelerators) at 90% of their planned
    capacity for two minutes of traffic (bench/prfaas_sim.py runs the hour): every request served at the
    offered rate, in well under the traffic's own duration."""
    DURATION_S = 120
    P, D = Profile.from_json(_load("prfaas_h200.json")), Profile.from_json(_load("pd_h20.json"))
    wl = Workload.from_json(_load("workload_case_study.json"))
    dep = case_study(P, D, "prfaas_pd", lambda: PrfaaS(ThresholdParams(19400, adaptive=False)))
    res = Simulation(dep, Traffic(0.9 * 3.19, wl.lengths, 1024, duration_s=DURATION_S), cells=104,
                     seed=5).run(drain_s=600)
    assert res["instances"] * 8 == 9984 and res["failed"] == 0
    assert res["requests"] / DURATION_S == pytest.approx(104 * 0.9 * 3.19, rel=0.05)
    assert res["wall_s"] < DURATION_S / 2, res["wall_s"]


def test_the_long_term_loop_follows_a_traffic_shift():
    """A PD cluster of 8 split 4 / 4 whose traffic turns from long prompts with short answers (prefill-bound) to
    short prompts with long answers (decode-bound) half way: the replanner flips instances toward prefill, then
    back toward decode, and serves what is offered where the static split falls behind."""
    from jaxserve.router.planner import LogNormal as LN
    from jaxserve.router.replan import ReplanParams
    P, D = Profile.from_json(_load("prfaas_h200.json")), Profile.from_json(_load("pd_h20.json"))
    tr = Traffic(1.3, LN(9.9, 1.0, 128, 131072), 256, duration_s=3600,
                 phases=((1800, LN(7.5, 0.5, 128, 32768), 2048),))
    res = {}
    for name, replan in (("static", None), ("replan", (ReplanParams(replan_s=60, window_s=300, min_interval_s=60,
                                                                    t_step=256), P, D))):
        dep = case_study(P, D, "homogeneous", LeastLoaded, n_p=4, n_d=4)
        res[name] = Simulation(dep, tr, seed=4, replan=replan, warmup_s=30.0).run()
    flips = res["replan"]["flips"]
    assert [f["role"] for f in flips if f["t_s"] < 1800] and all(f["role"] == "prefill" for f in flips
                                                                 if f["t_s"] < 1800)
    assert [f for f in flips if f["t_s"] >= 1800 and f["role"] == "decode"]
    assert res["replan"]["throughput_rps"] == pytest.approx(1.3, rel=0.05)
    assert res["static"]["throughput_rps"] < 0.9 * 1.3
    assert res["replan"]["ttft_s"]["p90"] < 0.1 * res["static"]["ttft_s"]["p90"]


def test_a_decode_instances_own_prefill_stalls_its_running_requests():
    """A request decoding for 10 s on d0, then a 3 s prefill d0 runs itself: the first finishes 3 s late."""
    from jaxserve.router.sim.models import Decode
    clock = Clock()
    d = Decode(clock, "d0", "pd", "pd", flat(3.0, step_s=0.1, batch=4), 1000)
    done = {}
    d.admit(100, lambda: done.setdefault("a", clock.now))
    clock.at(2.0, d.local.submit, 1, lambda dt: None, lambda: done.setdefault("prefill", clock.now))
    clock.run(100.0)
    assert done["prefill"] == pytest.approx(5.0) and done["a"] == pytest.approx(13.0)


def test_a_store_fetch_overlaps_the_prefill_compute():
    """A prefill whose prefix comes from the store takes max(compute, fetch) + one layer's share of the fetch."""
    from jaxserve.router.sim.models import Prefill
    clock = Clock()
    p = Prefill(clock, "p0", "pd", "pd", flat(1.0), 8192, 0)
    ends = []
    p.submit(10, lambda dt: None, lambda: ends.append(clock.now), fetch_s=0.32)  # hidden under 1 s of compute
    clock.run(10.0)
    p.submit(10, lambda dt: None, lambda: ends.append(clock.now), fetch_s=3.2)  # longer than the compute
    clock.run(30.0)
    assert ends[0] == pytest.approx(1.0 + 0.32 / 32) and ends[1] - 10.0 == pytest.approx(3.2 + 3.2 / 32)


def _hot_prefix_run(policy, store_tokens=0):
    """4 prefill instances whose caches hold about 10 prefixes each; 8 shared 6,000-token prefixes, Zipf-popular."""
    prof = Profile.from_json({"prefill": {"tokens": [100, 10000], "seconds": [0.01, 1.0],
                                          "kv_bytes": [1e6, 1e8]},
                              "decode": {"step_seconds": 0.001, "max_batch": 256}})
    inst = [InstanceSpec(f"p{i}", "pd", "pd", "prefill", prof) for i in range(4)]
    inst += [InstanceSpec(f"d{i}", "pd", "pd", "decode", prof) for i in range(2)]
    dep = Deployment(inst, policy, store_tokens=store_tokens, cache_tokens=60000)
    tr = Traffic(16.0, LogNormal(5.5, 0.5, 50, 1000), 16, duration_s=600, prefix_groups=8, prefix_tokens=6000,
                 prefix_skew=1.1)
    return Simulation(dep, tr, seed=4).run()


def test_hot_prefixes_pile_onto_some_instances_under_the_sglang_rule_but_not_over_the_store():
    from jaxserve.router.policies.banaserve import BanaServe
    from jaxserve.router.policies.cache_aware import CacheAware
    ca = _hot_prefix_run(CacheAware)
    bs = _hot_prefix_run(BanaServe, store_tokens=1 << 24)
    util = lambda r: [float(np.mean(v[:10])) for v in r["prefill_utilisation"].values()]  # noqa: E731
    assert max(util(ca)) > 1.5 * min(util(ca)) and max(util(bs)) < max(util(ca)), (util(ca), util(bs))
    assert bs["ttft_s"]["p90"] < ca["ttft_s"]["p90"] / 3
    assert bs["requests"] == ca["requests"]  # the same traffic


def test_the_flowkv_controller_flips_an_idle_prefill_instance_when_decode_is_the_bottleneck():
    from jaxserve.router.policies.flowkv import FlowKV
    prof = Profile.from_json({"prefill": {"tokens": [100, 10000], "seconds": [0.01, 1.0], "kv_bytes": [1e6, 1e8]},
                              "decode": {"step_seconds": 0.02, "max_batch": 8}})
    inst = [InstanceSpec(f"p{i}", "pd", "pd", "prefill", prof) for i in range(3)]
    inst += [InstanceSpec("d0", "pd", "pd", "decode", prof)]
    dep = Deployment(inst, FlowKV)
    res = Simulation(dep, Traffic(1.5, LogNormal(5.0, 0.5, 50, 1000), 200, duration_s=300), seed=2,
                     control_s=2.0, warmup_s=5.0).run()
    assert [f["role"] for f in res["flips"]] and all(f["role"] == "decode" for f in res["flips"])
    assert res["flips"][0]["instance"] in ("p0", "p1", "p2") and len(res["flips"]) <= 2


def test_instances_sharing_a_core_share_it():
    """A decode instance decoding (10 s of work) and a prefill instance on its core: a 2 s prefill step takes 4 s,
    and the decode finishes 2 s late (half speed for those 4 s)."""
    from jaxserve.router.sim.models import Decode, Prefill
    clock = Clock()
    d = Decode(clock, "d0", "pd", "pd", flat(3.0, step_s=0.1, batch=4), 1000)
    p = Prefill(clock, "p0", "pd", "pd", flat(2.0), 8192, 0)
    p.peers = [d]
    done = {}
    d.admit(100, lambda: done.setdefault("decode", clock.now))
    clock.at(1.0, p.submit, 10, lambda dt: None, lambda: done.setdefault("prefill", clock.now))
    clock.run(100.0)
    assert done["prefill"] == pytest.approx(5.0) and done["decode"] == pytest.approx(12.0)
    # alone, the same prefill takes its profile's 2 s
    clock.at(150.0, p.submit, 10, lambda dt: None, lambda: done.setdefault("alone", clock.now))
    clock.run(200.0)
    assert done["alone"] == pytest.approx(152.0)
