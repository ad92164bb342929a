"""Decisions of the load-balancing policies (router/policies/) and of BanaServe's migration planner
(router/migration.py) on hand-built load states."""

from __future__ import annotations

import dataclasses
import re

import pytest

from jaxserve.config import ConfigFileError, parse
from jaxserve.router import policies as policy
from jaxserve.router.policies.banaserve import BanaServe, BanaServeParams
from jaxserve.router.policies.cache_aware import CacheAware, CacheAwareParams
from jaxserve.router.policies.flowkv import FlowKV, FlowKVParams
from jaxserve.router.policies.round_robin import RoundRobin
from jaxserve.router.migration import MigrationParams, MigrationPlanner, Unit
from jaxserve.router.policies.base import InstanceState, LinkState, PrefixMove, RequestInfo, Snapshot


def inst(name, role="prefill", cluster="a", **kw):
    kw.setdefault("blocks_total", 100)
    kw.setdefault("blocks_free", 100)
    return InstanceState(name, role, cluster, "pd", **kw)


def snap(*insts, prompt=2100, store=0, now=0.0, links=(), per_token=None):
    return Snapshot(RequestInfo(prompt, prompt), tuple(insts), links, now, per_token, store)


D = inst("d0", "decode")


# ---- the anchors' rules: they collapse onto the holder of a hot prefix
def test_sglang_rule_stays_on_the_prefix_holder_until_the_absolute_imbalance_threshold():
    ca = CacheAware(CacheAwareParams("sglang", balance_abs=32, balance_rel=1.5))
    hot = lambda n: inst("p0", cached_tokens=2000, inflight=n)  # noqa: E731
    assert ca.place(snap(hot(30), inst("p1"), D)).prefill == "p0"  # 30 requests queued there: still p0
    pl = ca.place(snap(hot(33), inst("p1"), D))
    assert pl.prefill == "p1" and "imbalanced" in pl.reason
    # a weak match goes to the instance with the most free cache
    pl = ca.place(snap(inst("p0", cached_tokens=500, blocks_free=10), inst("p1", blocks_free=90), D))
    assert pl.prefill == "p1" and "most free cache" in pl.reason


def test_dynamo_rule_credits_the_overlap_against_the_queue():
    ca = CacheAware(CacheAwareParams("dynamo"))
    # p0: 100 new tokens (7 blocks) + 1000 queued (63) = 70; p1: 2100 new (132): p0, in spite of its queue
    pl = ca.place(snap(inst("p0", cached_tokens=2000, queued_tokens=1000), inst("p1"), D))
    assert pl.prefill == "p0" and pl.uncached_tokens == 100
    # once the queue outgrows the prefix, p1
    assert ca.place(snap(inst("p0", cached_tokens=2000, queued_tokens=2200), inst("p1"), D)).prefill == "p1"
    with pytest.raises(ValueError, match="rule"):
        CacheAwareParams("nope")


def test_round_robin_takes_instances_in_turn():
    rr = RoundRobin()
    s = snap(inst("p1"), inst("p0"), D, inst("d1", "decode"))
    got = [(pl.prefill, pl.decode) for pl in (rr.place(s) for _ in range(4))]
    assert got == [("p0", "d0"), ("p1", "d1"), ("p0", "d0"), ("p1", "d1")]


# ---- BanaServe, Algorithm 2
def test_banaserve_with_the_store_balances_load_where_the_prefix_lives_on_one_instance():
    busy = inst("p0", cached_tokens=2000, busy=0.9, queued_tokens=4000, prefill_tokens_s=1000.0)
    idle = inst("p1", busy=0.1, prefill_tokens_s=1000.0)
    b = BanaServe()
    pl = b.place(snap(busy, idle, D, store=2000))
    # the store holds the prefix: p1 computes the same 100 tokens without p0's 4000-token queue
    assert pl.prefill == "p1" and pl.uncached_tokens == 100 and pl.prefix_source == "store"
    # without the store p1 would compute all 2100: still faster than waiting behind 4000 (2.1 s vs 4.1 s)
    pl = BanaServe(BanaServeParams(store=False)).place(snap(busy, idle, D))
    assert pl.prefill == "p1" and pl.uncached_tokens == 2100
    # ... but a short queue on the holder wins there
    short = inst("p0", cached_tokens=2000, busy=0.5, queued_tokens=500, prefill_tokens_s=1000.0)
    assert BanaServe(BanaServeParams(store=False)).place(snap(short, idle, D)).prefill == "p0"


def test_banaserve_ties_go_to_the_instance_holding_the_prefix_then_rotate():
    b = BanaServe()
    holder = inst("p0", cached_tokens=2000, prefill_tokens_s=1000.0)
    other = inst("p1", prefill_tokens_s=1000.0)
    # equal estimates (the store holds the prefix): the holder computes without loading it
    assert [b.place(snap(holder, other, D, store=2000)).prefill for _ in range(3)] == ["p0"] * 3
    # nobody holds it locally: equal instances take turns
    got = [b.place(snap(inst("p0", prefill_tokens_s=1000.0), other, D, store=2000)).prefill for _ in range(4)]
    assert sorted(got) == ["p0", "p0", "p1", "p1"] and got[0] != got[1]
    # the holder's queue outweighs the tolerance: the other instance loads from the store
    busy = inst("p0", cached_tokens=2000, prefill_tokens_s=1000.0, queued_tokens=500)
    assert b.place(snap(busy, other, D, store=2000)).prefill == "p1"


def test_banaserve_load_is_busy_plus_kv_plus_queued_estimate_and_overload_takes_the_shortest_queue():
    b = BanaServe(BanaServeParams(load_threshold=1.0, token_budget=1000))
    a = inst("p0", busy=0.5, blocks_free=50, queued_tokens=100)  # 0.5 + 0.5 + 0.1
    assert b.load(a) == pytest.approx(1.1)
    c = inst("p1", busy=0.2, blocks_free=90, inflight=3)  # 0.2 + 0.1: under delta_L, no rates: least load
    assert b.place(snap(a, c, D)).prefill == "p1"
    # every instance at or above delta_L: the shortest queue, whatever the load
    x = inst("p0", busy=1.0, blocks_free=0, inflight=5)
    y = inst("p1", busy=1.0, blocks_free=10, inflight=2)
    pl = b.place(snap(x, y, D))
    assert pl.prefill == "p1" and "shortest queue" in pl.reason and b.overloaded == 1


def test_banaserve_picks_the_decode_instance_with_the_least_transfer_time():
    link = LinkState("a", "b", 1e6, queued_bytes=5e6)
    p = inst("p0")
    near = inst("d0", "decode", "a", inflight=3)
    far = inst("d1", "decode", "b")
    pl = BanaServe().place(snap(p, near, far, links=(link,), per_token=100.0))
    assert pl.decode == "d0"  # same cluster: no transfer, though more loaded
    far2 = inst("d1", "decode", "a")
    assert BanaServe().place(snap(p, near, far2)).decode == "d1"  # both near: the less loaded


# ---- FlowKV
def flow(**kw):
    return FlowKV(FlowKVParams(**kw))


def test_flowkv_scores_are_weighted_and_smoothed_over_the_window():
    f = flow(window_s=5.0)
    w = f.p.prefill_weights
    hot = inst("p0", running=8, waiting=8, busy=1.0, queued_tokens=8192, blocks_free=0)
    full = f.score(hot, "prefill")
    assert full == pytest.approx(w.running + w.waiting + w.tokens + w.kv + w.busy)
    idle = inst("p0")
    f.observe(snap(hot, now=0.0))
    f.observe(snap(idle, now=1.0))
    assert f.score(idle, "prefill") == pytest.approx(full / 2)  # the mean of the two readings
    f.observe(snap(idle, now=7.0))  # the hot reading has left the window
    assert f.score(idle, "prefill") == 0.0


def test_flowkv_normal_load_minimises_ttft_then_transfer():
    f = flow()
    a = inst("p0", cached_tokens=2000, prefill_tokens_s=1000.0, queued_tokens=50)
    b = inst("p1", prefill_tokens_s=1000.0)
    pl = f.place(snap(a, b, D))
    assert f.scenario == "normal" and pl.prefill == "p0" and pl.uncached_tokens == 100


def test_flowkv_imbalanced_prefill_lets_idle_decode_instances_prefill_for_a_while():
    f = flow(hold_s=10.0)
    hot = [inst(f"p{i}", running=8, waiting=6, busy=1.0, queued_tokens=4000) for i in range(2)]
    idle_d = inst("d0", "decode")
    pl = f.place(snap(*hot, idle_d, now=0.0))
    assert f.scenario == "imbalanced" and f.cp > f.p.low and pl.prefill is None and pl.decode == "d0"
    # prefill has calmed down (fresh window) but the switch holds for hold_s ...
    calm = [inst(f"p{i}") for i in range(2)]
    f2 = f.place(snap(*calm, idle_d, now=6.0))
    assert f2.prefill is None
    # ... and ends after it: back to the prefill instances
    assert f.place(snap(*calm, idle_d, now=20.0)).prefill in ("p0", "p1") and f.scenario == "normal"


def test_flowkv_control_flips_an_idle_prefill_instance_when_decode_is_loaded_and_scales_in_extremes():
    f = flow(extreme_s=30.0)
    ps = [inst("p0"), inst("p1", running=1)]
    hot_d = inst("d0", "decode", running=8, waiting=4, busy=1.0, blocks_free=0)  # C^d 1.15
    acts = f.control(snap(*ps, hot_d, now=0.0))
    assert f.scenario == "imbalanced" and [(a.kind, a.instance, a.role) for a in acts] == [("flip", "p0", "decode")]
    # extreme (both sides far over): nothing until it has lasted extreme_s, then one scale-out of the hotter side
    very = dict(running=16, waiting=16, busy=1.0, blocks_free=0, queued_tokens=16384)
    g = flow(extreme_s=30.0)
    xs = [inst("p0", **very), inst("d0", "decode", **very)]
    assert g.control(snap(*xs, now=0.0)) == [] and g.scenario == "extreme"
    acts = g.control(snap(*xs, now=31.0))
    assert [(a.kind, a.role) for a in acts] == [("scale_out", "prefill")]
    assert g.control(snap(*xs, now=32.0)) == []  # the next one needs the scenario to hold again
    # decode far over, prefill cool: after extreme_s its coolest prefill instance moves to decode, and the
    # next flip waits another extreme_s
    k = flow(extreme_s=30.0)
    hotter = inst("d0", "decode", **very)
    mixed = [inst("p0", running=1, busy=0.5), inst("p1", busy=0.2), hotter]
    assert k.control(snap(*mixed, now=0.0)) == [] and k.scenario == "extreme"
    acts = k.control(snap(*mixed, now=31.0))
    assert [(a.kind, a.instance, a.role) for a in acts] == [("flip", "p1", "decode")]
    assert k.control(snap(*mixed, now=45.0)) == [] and k.control(snap(*mixed, now=76.0)) != []
    # low load for extreme_s: scale in the least loaded instance of a role that has more than one
    h = flow(extreme_s=30.0)
    quiet = [inst("p0"), inst("p1"), inst("d0", "decode")]
    assert h.control(snap(*quiet, now=0.0)) == []
    acts = h.control(snap(*quiet, now=40.0))
    assert [(a.kind, a.role, a.instance) for a in acts] == [("scale_in", "prefill", "p0")]


def test_flowkv_steady_load_keeps_one_scenario():
    f = flow()
    state = [inst("p0", running=4, waiting=2, busy=0.8, queued_tokens=2000), inst("d0", "decode", running=2)]
    seen = {f.place(snap(*state, now=t * 0.5)).details["scenario"] for t in range(40)}
    assert len(seen) == 1 and f.switches <= 1


# ---- BanaServe, Algorithm 1
def units(lo_load, hi_load, **kw):
    base = dict(layers=(0, 8), heads=8, running=4, weight_bytes_per_layer=1e6, kv_bytes_per_layer=1e5)
    base.update(kw)
    return [Unit("hot", hi_load, **base), Unit("cold", lo_load, **{**base, "running": 0})]


def test_migration_moves_the_layers_that_balance_the_pair_best():
    m = MigrationPlanner(MigrationParams(delta_up=0.4, delta_down=0.1, rho=0.1, budget_s=1.0, bandwidth_bytes_s=1e8))
    moves = m.plan(units(0.2, 1.6))
    assert len(moves) == 1
    mv = moves[0]
    # a layer carries 1.6/8 = 0.2 of load: 3 or 4 layers leave a gap of 0.2; the cheaper (3) wins
    assert (mv.kind, mv.src, mv.dst, mv.layers) == ("layers", "hot", "cold", (5, 8))
    assert mv.benefit == pytest.approx(1.2) and mv.cost_s == pytest.approx(3 * 1.1e6 / 1e8 + 0.05)


def test_migration_falls_back_to_heads_within_the_budget_and_respects_the_ratio():
    p = MigrationParams(delta_up=0.4, delta_down=0.1, rho=0.1, budget_s=0.5, bandwidth_bytes_s=1e8)
    heavy = units(0.2, 1.6, weight_bytes_per_layer=1e9)  # one layer alone takes 10 s: over the budget
    mv = MigrationPlanner(p).plan(heavy)[0]
    assert mv.kind == "heads" and mv.heads == 7  # 1.6 x 0.5 x h/8 closest to half the 1.4 gap
    none = MigrationPlanner(MigrationParams(rho=1000.0)).plan(units(0.2, 1.6))
    assert none == []  # no move is worth its cost
    # nothing running on the overloaded instance: nothing to move
    assert MigrationPlanner(p).plan(units(0.2, 1.6, running=0)) == []
    # no layer or head moves supported
    assert MigrationPlanner(p).plan(units(0.2, 1.6, layers=None, heads=0)) == []


def test_migration_hysteresis_starts_above_delta_up_and_stops_under_delta_down():
    m = MigrationPlanner(MigrationParams(delta_up=0.5, delta_down=0.2, rho=0.0, bandwidth_bytes_s=1e9))
    assert m.plan(units(0.5, 0.9)) == [] and not m.active  # gap 0.4: under delta_up, no round
    assert m.plan(units(0.2, 1.6)) and m.active and m.rounds == 1
    assert m.plan(units(0.5, 0.85)) and m.active  # gap 0.35 inside a round: still balanced
    assert m.plan(units(0.5, 0.6)) == [] and not m.active  # gap 0.1: the round ends
    # a steady load between the thresholds never starts one
    assert all(m.plan(units(0.5, 0.9)) == [] for _ in range(20)) and m.rounds == 1


def test_migration_pairs_the_most_over_with_the_most_under_and_moves_each_once():
    p = MigrationParams(delta_up=0.4, delta_down=0.1, rho=0.0, bandwidth_bytes_s=1e9)
    base = dict(layers=(0, 8), heads=8, running=2, weight_bytes_per_layer=1e5, kv_bytes_per_layer=1e4)
    us = [Unit("a", 1.8, **base), Unit("b", 1.2, **base), Unit("c", 0.1, **base), Unit("d", 0.5, **base)]
    moves = MigrationPlanner(p).plan(us)
    assert [(m.src, m.dst) for m in moves] == [("a", "c"), ("b", "d")]


# ---- config
def test_policies_are_selected_by_name_and_checked():
    base = {"model": {"path": "bundled"}, "clusters": [{"name": "c", "instances": [
        {"name": "p0", "role": "prefill"}, {"name": "d0", "role": "decode"}]}]}
    for name, cls in (("round_robin", RoundRobin), ("cache_aware", CacheAware), ("banaserve", BanaServe),
                      ("flowkv", FlowKV)):
        assert isinstance(policy.make(parse({**base, "policy": {"name": name}}).policy), cls)
    pol = policy.make(parse({**base, "policy": {"name": "cache_aware", "rule": "dynamo"}}).policy)
    assert pol.p.rule == "dynamo"
    assert policy.make(parse({**base, "policy": {"name": "banaserve"}}).policy).p.store is True
    assert policy.make(parse({**base, "policy": {"name": "flowkv"}}).policy).p.store is False
    with pytest.raises(ConfigFileError, match="load_low"):
        parse({**base, "policy": {"name": "flowkv", "load_low": 2.0, "load_high": 1.0}})
    with pytest.raises(ConfigFileError, match="control_s needs migrate"):
        parse({**base, "policy": {"name": "banaserve", "control_s": 1.0}})
    with pytest.raises(ConfigFileError, match="rule"):
        parse({**base, "policy": {"name": "cache_aware", "rule": "vllm"}})


# ---- live: the policies place on real workers, the store serves prefixes, the controller's flip is carried out
@pytest.mark.slow
def test_policies_store_and_controller_on_a_live_cluster(checkpoint_dir):
    """p0, p1 prefill, d0 decode and s0 (the global KV store) as real worker processes; the router's policy
    object swapped between requests.
    - Every policy's placements give the same greedy tokens, on prefill instances it chose.
    - banaserve over the store: a request's prompt goes to the store as its prefill computes it; the next
      request with that prefix, placed by banaserve on the other prefill instance (no local hit there), loads
      the prefix from the store instead of computing it.
    - The flowkv controller (every 0.3 s) carries out a flip its decision asks for, then a scale-out (the
      standby prefill instance p2 starts and joins) and a scale-in (p2 drains and stops).
    - With the store killed, requests still succeed (the prefill computes). Every answer equals the one a
      cluster without a store gives."""
    import time

    from jaxserve.router.policies.flowkv import Action
    from tests.router.test_cluster_http import BS, complete, disagg_config, serving, tokens
    cfg = disagg_config(checkpoint_dir("llama"), [{"name": "p1", "role": "prefill"},
                                                  {"name": "p2", "role": "prefill", "standby": True},
                                                  {"name": "s0", "role": "store", "kv_blocks": 128}],
                        policy={"name": "flowkv", "control_s": 0.3})
    short = [[5 + i, 7, 9, 11, 13, 2, 3, 4 + i] for i in range(4)]
    shared = [(7 * j) % 50 + 3 for j in range(4 * BS)]
    prompts = [shared + [60 + i, 61, 62] for i in range(3)] + [[(11 * j) % 50 + 3 for j in range(3 * BS)] + [70]]
    got = {}
    with serving(cfg) as (client, cluster):
        def until(cond, what, limit=120):
            deadline = time.monotonic() + limit
            while not cond():
                assert time.monotonic() < deadline, (what, cluster.admin.control_actions)
                time.sleep(0.05)
        # the config's flowkv controller runs from the start: its own decisions (a scale-in after 30 s of low load,
        # counted only: p0 and p1 are no standbys) are not this test's; it is off until the test's controller
        cluster.policy = policy.make(parse({**cfg, "policy": {"name": "round_robin"}}).policy)
        base = [tokens(complete(client, p)["choices"][0]) for p in short]
        for name, extra in (("round_robin", {}), ("cache_aware", {}), ("cache_aware", {"rule": "dynamo"}),
                            ("least_loaded", {})):
            cluster.policy = policy.make(parse({**cfg, "policy": {"name": name, **extra}}).policy)
            res = [complete(client, p) for p in short]
            assert [tokens(g["choices"][0]) for g in res] == base, name
            used = {g["jaxserve"]["prefill_instance"] for g in res}
            assert used <= {"p0", "p1"} and used, (name, used)
            if name == "round_robin":
                assert used == {"p0", "p1"}
        # the global KV store under banaserve
        cluster.policy = policy.make(parse({**cfg, "policy": {"name": "banaserve"}}).policy)
        # a write-back streams as the prefill computes it (a dense model: its KV goes to the store beside decode's)
        # when the store has made its reservation before the Prefill call leaves; the router does not hold the
        # prefill for it (the prompt then goes to the store after the prefill). Prompts of their own until one has
        # streamed: a race lost three times in a row fails the test, as a write-back that never streams does
        puts = cluster.prefixes.store_puts
        for i in range(3):
            ended = puts["done"] + puts["failed"]
            complete(client, [(13 * j + 5 * i) % 50 + 3 for j in range(2 * BS)] + [80 + i])
            until(lambda: puts["done"] + puts["failed"] > ended, "the write-back", 60)
            if puts["streamed"]:
                break
        assert puts["streamed"] >= 1 and puts["failed"] == 0, puts
        got[0] = complete(client, prompts[0])
        deadline = time.monotonic() + 60
        while cluster.index.match(prompts[1], {"s0"}).get("s0", 0) < len(shared):  # written back, and indexed
            assert time.monotonic() < deadline, (puts, cluster.index.match(prompts[1], {"s0"}))
            time.sleep(0.05)
        assert puts["bytes"] > 0, puts
        metrics = client.get("/metrics").text
        for outcome in ("done", "streamed"):
            put = re.search(r'jaxserve_store_puts\{outcome="%s"\} ([0-9.]+)' % outcome, metrics)
            assert put and float(put.group(1)) >= 1, (outcome, metrics[-2000:])
        # banaserve would give it to the holder (its own cache first); on the other instance it loads the store's
        holder, bana = got[0]["jaxserve"]["prefill_instance"], cluster.policy

        class Elsewhere:
            name = "banaserve"
            state = bana.state

            def place(self, snap):
                return bana.place(dataclasses.replace(snap, instances=tuple(
                    i for i in snap.instances if i.name != holder)))
        cluster.policy = Elsewhere()
        # the prefill instances compiled their one-pass copy out of the store's pool once they learned of it
        until(lambda: all(cluster.registry.get(p).stats.get("store_copies") == 1 for p in ("p0", "p1")),
              "the prefill instances' copies out of the store's pool compiled", 60)
        got[1] = complete(client, prompts[1])

        class Claims:  # a prefix the store does not hold: its Export fails, the prefill computes it
            name = "banaserve"
            state = bana.state

            def place(self, snap):
                pl = bana.place(snap)
                return dataclasses.replace(pl, move_prefix=PrefixMove("s0", 2 * BS, overlap=True),
                                           prefix_source="s0", uncached_tokens=len(prompts[3]) - 2 * BS)
        moves = cluster.prefixes.prefix_moves
        failed = moves["failed"]
        cluster.policy = Claims()
        got[3] = complete(client, prompts[3])
        assert moves["failed"] == failed + 1 and got[3]["jaxserve"]["prefix_move"] is None, got[3]
        cluster.policy = bana
        meta = got[1]["jaxserve"]
        assert meta["prefill_instance"] != holder, meta
        assert meta["prefix_source"] == "s0" and meta["prefix_move"]["tokens"] == len(shared), meta
        # every process on this host: the prefill instance read the store's shared pool in place (its Load ran
        # beside the decode reservation), and the store took no part in it (none of its blocks is referenced)
        assert meta["prefix_move"]["overlapped"] and meta["prefix_move"]["via"] == "shared", meta
        assert meta["prefix_move"]["one_pass"] is True, meta
        until(lambda: cluster.registry.get("s0").stats.get("blocks_used") == 0, "the store's blocks unreferenced", 10)
        assert meta["cached_tokens"] >= len(shared)
        # the controller: its flip is carried out, and requests keep succeeding
        assert "p2" not in cluster.registry.workers  # standby: not started with the cluster
        flow = policy.make(parse(cfg).policy)
        plan = [Action("flip", "decode", "p1", "test: decode loaded")]

        def control(snap):
            assert "s0" not in {i.name for i in snap.instances}  # the store is no instance to place on
            return [plan.pop(0)] if plan else []
        flow.control = control
        seen = cluster.admin.control_count  # what the config's controller did while the cluster started
        cluster.policy = flow

        until(lambda: sorted(w.role for w in cluster.registry.all()) == ["decode", "decode", "prefill", "store"]
              and not any(w.draining for w in cluster.registry.all()), "flip")
        assert cluster.admin.control_actions[-1]["instance"] == "p1" and cluster.admin.control_count == seen + 1
        assert [tokens(complete(client, p)["choices"][0]) for p in short] == base
        migrate_by_hand(client, cluster, flow, cfg)
        plan.append(Action("scale_out", "prefill", None, "test: prefill overloaded"))
        until(lambda: cluster.registry.get("p2") is not None and cluster.registry.is_up(cluster.registry.get("p2")),
              "scale-out")
        cluster.policy = policy.make(parse({**cfg, "policy": {"name": "round_robin"}}).policy)
        res = [complete(client, p) for p in short]
        assert [tokens(g["choices"][0]) for g in res] == base
        assert {g["jaxserve"]["prefill_instance"] for g in res} == {"p0", "p2"}
        flow.control, cluster.policy = control, flow
        plan.append(Action("scale_in", "prefill", "p0", "test: low load"))  # p0 is no standby: p2 goes
        until(lambda: cluster.launcher.children["p2"].exited() is not None
              and not cluster.registry.is_up(cluster.registry.get("p2")), "scale-in")
        assert cluster.registry.is_up(cluster.registry.get("p0")) and cluster.admin.control_count == seen + 3
        # the store dies: nothing is lost
        cluster.launcher.kill("s0")
        deadline = time.monotonic() + 30
        while cluster.registry.is_up(cluster.registry.get("s0")):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cluster.policy = policy.make(parse({**cfg, "policy": {"name": "banaserve"}}).policy)
        got[2] = complete(client, prompts[2])
        assert got[2]["jaxserve"]["prefix_source"] != "s0"
    with serving(disagg_config(checkpoint_dir("llama"))) as (client, _):
        want = [tokens(complete(client, p)["choices"][0]) for p in prompts]
    assert [tokens(got[k]["choices"][0]) for k in range(4)] == want


def migrate_by_hand(client, cluster, flow, cfg):
    """POST /admin/migrate between the two decode instances (d0, and p1 since its flip) while a request decodes
    there: the move answers 200 once done, the answer is the one without migration, and the completion lists
    the move; impossible moves are 400 naming the field."""
    import concurrent.futures

    import httpx
    from tests.router.test_cluster_http import complete, tokens
    cluster.policy = policy.make(parse({**cfg, "policy": {"name": "round_robin"}}).policy)
    prompt = [5, 7, 9, 11, 13, 2, 3, 4]
    want = tokens(complete(client, prompt, max_tokens=48)["choices"][0])
    for kind, arg in (("heads", {"heads": [1]}), ("layers", {"layers": [1, 3]})):
        moved = None
        with httpx.Client(base_url=client.base_url, timeout=300) as other, \
                concurrent.futures.ThreadPoolExecutor(1) as pool:
            for _ in range(5):  # a busy machine may finish a request before a move reaches it: another one
                fut = pool.submit(complete, other, prompt, max_tokens=48)
                while moved is None and not fut.done():
                    for src, dst in (("d0", "p1"), ("p1", "d0")):
                        r = client.post("/admin/migrate", json={"kind": kind, "src": src, "dst": dst, **arg})
                        if r.status_code == 200:
                            moved = r.json()
                            break
                        assert r.status_code == 400 and "nothing is decoding" in r.text, r.text
                res = fut.result()
                if moved is not None:
                    break
        assert moved is not None and moved["kind"] == kind and len(moved["requests"]) == 1, moved
        assert tokens(res["choices"][0]) == want, kind
        assert res["jaxserve"]["migrations"] == [{"kind": kind, "src": moved["src"], "dst": moved["dst"]}], res
        assert res["jaxserve"]["decode_instance"] == moved["src"]
    for body, param in (({"kind": "heads", "src": "zz", "dst": "d0", "heads": [0]}, "src"),
                        ({"kind": "heads", "src": "d0", "dst": "s0", "heads": [0]}, "dst"),
                        ({"kind": "heads", "src": "d0", "dst": "p1", "heads": [7]}, "heads"),
                        ({"kind": "layers", "src": "d0", "dst": "p1", "layers": [3, 9]}, "layers"),
                        ({"kind": "heads", "src": "d0", "dst": "p1", "heads": [0]}, "src"),  # nothing running
                        ({"kind": "rows", "src": "d0", "dst": "p1"}, "kind")):
        r = client.post("/admin/migrate", json=body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    cluster.policy = flow


def test_the_router_carries_out_the_migration_planners_moves_from_heartbeat_loads():
    """Router.rebalance: units from the decode instances' heartbeat stats (load = busy + KV use), the planner's
    moves made as POST /admin/migrate's: the most loaded instance's last layers (or KV heads) to the least
    loaded; a steady gap under delta_up afterwards starts nothing; the store and prefill instances are no units."""
    import asyncio

    from jaxserve.router.cluster import Router
    cfg = parse({"model": {"path": "bundled"}, "clusters": [{"name": "c", "instances": [
        {"name": "p0", "role": "prefill"}, {"name": "d0", "role": "decode"}, {"name": "d1", "role": "decode"},
        {"name": "s0", "role": "store"}]}], "policy": {"name": "banaserve", "control_s": 1.0, "migrate": True}})
    router = Router(cfg, None)

    def beat(name, role, busy, used, running, heads=2):
        router.registry.register({"name": name, "role": role, "address": f"{name}:1", "max_model_len": 64,
                                  "stats": {"busy": busy, "blocks_used": used, "blocks_total": 100,
                                            "running": running, "move_layers": 4, "move_heads": heads,
                                            "layer_weight_bytes": 1e5, "layer_kv_bytes": 1e4}})
    beat("p0", "prefill", 0.9, 90, 0)
    beat("s0", "store", 0.0, 0, 0)
    beat("d0", "decode", 0.9, 60, 3)
    beat("d1", "decode", 0.1, 5, 0)
    calls = []

    async def migrate(kind, src, dst, heads=None, layers=None):
        calls.append((kind, src, dst, heads, layers))
        return {"kind": kind}
    router.admin.migrate = migrate
    assert asyncio.run(router.rebalance()) == [{"kind": "layers"}]
    kind, src, dst, heads, layers = calls[0]
    assert (kind, src, dst, heads) == ("layers", "d0", "d1", None) and layers[1] == 4 and 0 < layers[0] < 4
    # the loads even out below delta_down: the round ends; a gap between the thresholds starts none
    beat("d0", "decode", 0.5, 30, 3)
    beat("d1", "decode", 0.45, 25, 0)
    assert asyncio.run(router.rebalance()) == [] and not router.admin.mover.active
    beat("d0", "decode", 0.6, 30, 3)
    beat("d1", "decode", 0.4, 20, 0)
    assert asyncio.run(router.rebalance()) == [] and len(calls) == 1
