"""Placement policies on hand-built snapshots (plain Python): each routing rule of PrfaaS 3.4.3, cache
affinity against overload, the threshold controller's hysteresis, and policy selection by config."""

import dataclasses

import pytest

from jaxserve.config import ConfigFileError, parse
from jaxserve.router import policies as policy
from jaxserve.router.policies.base import InstanceState, LinkState, PrefixMove, RequestInfo, Snapshot
from jaxserve.router.policies.least_loaded import LeastLoaded
from jaxserve.router.policies.prfaas import PrfaaS, ThresholdController, ThresholdParams

GBPS = 1e9 / 8


def inst(name, role, cluster="pd", kind=None, **kw):
    return InstanceState(name, role, cluster, kind or ("prfaas" if cluster.startswith("prfaas") else "pd"), **kw)


def snap(total, *insts, util=None, now=0.0, retrans=0):
    links = () if util is None else (LinkState("prfaas", "pd", GBPS, util * GBPS, retransmits=retrans),)
    return Snapshot(RequestInfo(total, total), tuple(insts), links, now)


def cluster(pd_p=0, pd_d=0, prfaas_p=0, ppd=(), dd=(), rp=()):
    """A PD cluster (pd-p0.., pd-d0..) and a PrfaaS cluster (pf-p0..); ppd / dd / rp: per-instance kwargs."""
    out = [inst(f"pd-p{i}", "prefill", **(ppd[i] if i < len(ppd) else {})) for i in range(pd_p)]
    out += [inst(f"pd-d{i}", "decode", **(dd[i] if i < len(dd) else {})) for i in range(pd_d)]
    out += [inst(f"pf-p{i}", "prefill", "prfaas", **(rp[i] if i < len(rp) else {})) for i in range(prfaas_p)]
    return out


def prfaas(t=1000, **kw):
    return PrfaaS(ThresholdParams(t, **kw))


def test_least_loaded_places_both_sides_by_load():
    s = snap(10, *cluster(2, 2, ppd=[{"inflight": 1}], dd=[{"running": 4}, {"running": 1}]))
    pl = LeastLoaded().place(s)
    assert (pl.decode, pl.prefill, pl.route) == ("pd-d1", "pd-p1", "pd")
    pl = LeastLoaded().place(snap(10, *cluster(0, 1)))
    assert (pl.decode, pl.prefill, pl.route) == ("pd-d0", None, "colocated")
    assert LeastLoaded().place(snap(10, *cluster(1, 0))).decode is None


def test_threshold_splits_short_and_long_uncached_prefills():
    pol = prfaas(1000, adaptive=False)
    for total, route, where in [(10, "pd", "pd-p0"), (1000, "pd", "pd-p0"), (1001, "prfaas", "pf-p0")]:
        pl = pol.place(snap(total, *cluster(1, 1, 1)))
        assert (pl.route, pl.prefill, pl.decode) == (route, where, "pd-d0"), total
        assert pl.uncached_tokens == total and pl.move_prefix is None
    # the uncached length decides, not the prompt's: a long prompt whose prefix the PD prefill holds stays
    pl = pol.place(snap(5000, *cluster(1, 1, 1, ppd=[{"cached_tokens": 4200}])))
    assert (pl.route, pl.uncached_tokens, pl.prefix_source) == ("pd", 800, "pd-p0")


def test_scarce_bandwidth_judges_each_clusters_prefix_alone():
    """l_total 5000, PrfaaS holds 4500, PD 1000, t 1000: l_total - l_pd = 4000 > t."""
    pol = prfaas(1000, adaptive=False, scarce_utilisation=0.6)
    insts = cluster(1, 1, 1, ppd=[{"cached_tokens": 1000}], rp=[{"cached_tokens": 4500}])
    pl = pol.place(snap(5000, *insts, util=0.7))
    assert (pl.route, pl.prefill, pl.move_prefix) == ("prfaas", "pf-p0", None)
    assert pl.uncached_tokens == 500 and pl.details["scarce"]


def test_abundant_bandwidth_uses_the_best_prefix_anywhere_and_moves_it():
    pol = prfaas(1000, adaptive=False, scarce_utilisation=0.6)
    # the prefix sits in PrfaaS and the rest is short: computed on PD, the prefix KV moves to PD
    insts = cluster(1, 1, 1, ppd=[{"cached_tokens": 1000}], rp=[{"cached_tokens": 4500}])
    pl = pol.place(snap(5000, *insts, util=0.1))
    assert (pl.route, pl.prefill) == ("pd", "pd-p0") and not pl.details["scarce"]
    assert pl.move_prefix == PrefixMove("pf-p0", 4500) and pl.uncached_tokens == 500 and pl.prefix_source == "pf-p0"
    # the prefix sits in PD and the rest is long: computed in PrfaaS, the PD prefix moves there
    insts = cluster(1, 1, 1, ppd=[{"cached_tokens": 3000}])
    pl = pol.place(snap(8000, *insts, util=0.1))
    assert (pl.route, pl.prefill, pl.move_prefix, pl.uncached_tokens) == ("prfaas", "pf-p0",
                                                                          PrefixMove("pd-p0", 3000), 5000)
    # no link configured counts as abundant; a prefix already where the compute runs moves nowhere
    pl = pol.place(snap(8000, *cluster(1, 1, 1, rp=[{"cached_tokens": 3000}])))
    assert (pl.route, pl.move_prefix, pl.uncached_tokens) == ("prfaas", None, 5000)


def test_cache_affine_instance_unless_overloaded():
    pol = prfaas(1000, adaptive=False, affinity_slack=2)
    hot = {"cached_tokens": 900, "inflight": 2}
    pl = pol.place(snap(1500, *cluster(2, 1, ppd=[hot, {}])))
    assert pl.prefill == "pd-p0" and pl.uncached_tokens == 600  # 2 in flight beyond the idle one: still affine
    hot["inflight"] = 3
    pl = pol.place(snap(1500, *cluster(2, 1, ppd=[hot, {}])))
    assert pl.prefill == "pd-p1" and pl.uncached_tokens == 1500  # overloaded: the least loaded takes it
    # the same for decode instances: the one holding the conversation, unless it is overloaded
    dd = [{"cached_tokens": 100}, {"cached_tokens": 1200, "inflight": 1}]
    assert pol.place(snap(2000, *cluster(1, 2, dd=dd))).decode == "pd-d1"
    dd[1]["inflight"] = 5
    assert pol.place(snap(2000, *cluster(1, 2, dd=dd))).decode == "pd-d0"


def test_many_requests_on_one_hot_prefix_spread_out():
    """Every request shares one cached prefix on pd-p0; as they pile up there the rest go elsewhere."""
    pol = prfaas(10_000, adaptive=False, affinity_slack=1)
    inflight = {"pd-p0": 0, "pd-p1": 0, "pd-p2": 0}
    for _ in range(30):
        insts = [inst(n, "prefill", inflight=k, cached_tokens=500 if n == "pd-p0" else 0) for n, k in inflight.items()]
        pl = pol.place(snap(600, *insts, inst("pd-d0", "decode")))
        inflight[pl.prefill] += 1
    assert max(inflight.values()) - min(inflight.values()) <= 2 and inflight["pd-p0"] == max(inflight.values())


def test_decode_holding_the_history_prefills_the_rest_itself():
    pol = prfaas(1000, adaptive=False, local_prefill_tokens=256)
    pl = pol.place(snap(3000, *cluster(1, 1, 1, dd=[{"cached_tokens": 2800}])))
    assert (pl.route, pl.decode, pl.prefill, pl.uncached_tokens, pl.prefix_source) == \
        ("colocated", "pd-d0", None, 200, "pd-d0")
    pl = pol.place(snap(3000, *cluster(1, 1, 1, dd=[{"cached_tokens": 2700}])))
    # 300 left is more than local_prefill_tokens: no prefill instance holds the prefix, so 3000 uncached > t
    # goes to PrfaaS (only the 300 tokens the decode instance lacks cross the link)
    assert (pl.route, pl.decode, pl.uncached_tokens) == ("prfaas", "pd-d0", 3000)


def test_fallbacks_when_a_cluster_has_no_prefill_instance():
    pol = prfaas(1000, adaptive=False)
    pl = pol.place(snap(5000, *cluster(1, 1, 0)))
    assert (pl.route, pl.prefill) == ("pd", "pd-p0") and "no PrfaaS prefill instance" in pl.reason
    pl = pol.place(snap(10, *cluster(0, 1, 1)))
    assert (pl.route, pl.prefill) == ("prfaas", "pf-p0") and "no prefill instance up" in pl.reason
    pl = pol.place(snap(10, *cluster(0, 1, 0)))
    assert (pl.route, pl.prefill, pl.decode) == ("colocated", None, "pd-d0")
    assert pol.place(snap(10, *cluster(1, 0, 1))).decode is None


def test_threshold_rises_before_the_link_saturates_and_falls_back():
    c = ThresholdController(ThresholdParams(1000, hold_s=2.0))
    link = lambda u, r=0: LinkState("prfaas", "pd", GBPS, u * GBPS, retransmits=r)  # noqa: E731
    assert c.observe(link(0.85), 0.0) == 1000  # a level must hold for hold_s first
    assert c.observe(link(0.95), 1.0) == 1000
    assert c.observe(link(0.9), 2.0) == 1500  # held 2 s
    assert c.observe(link(0.95), 3.0) == 1500  # the evidence starts again after a change
    assert c.observe(link(0.95), 5.0) == 2250
    assert c.observe(link(0.6), 6.0) == 2250  # inside the band: kept
    assert c.observe(link(0.1), 7.0) == 2250
    assert c.observe(link(0.1), 9.0) == 1500
    assert c.observe(link(0.1), 10.0) == 1500  # the first reading under the new threshold starts the clock
    assert c.observe(link(0.1), 12.0) == 1000
    assert c.observe(link(0.0), 14.0) == 1000  # never below threshold_tokens
    assert c.observe(link(0.0), 17.0) == 1000
    assert c.observe(link(0.5, r=0), 20.0) == 1000
    assert c.observe(link(0.5, r=7), 21.0) == 1500  # TCP retransmits grew: raised at once
    assert c.observe(link(0.5, r=9), 22.0) == 1500  # ... at most once per hold_s
    top = ThresholdController(ThresholdParams(1000, max_threshold_tokens=1200, hold_s=0))
    assert top.observe(link(1.0), 0) == 1200 and top.observe(link(1.0), 1) == 1200
    fixed = ThresholdController(ThresholdParams(1000, adaptive=False))
    assert fixed.observe(link(1.0), 0) == 1000 and fixed.changes == 0


def test_a_burst_does_not_move_the_threshold():
    """Readings that cross a level for less than hold_s (bursts of transfers) change nothing."""
    c = ThresholdController(ThresholdParams(1000, hold_s=4.0))
    for k in range(100):
        u = 0.95 if k % 6 < 3 else 0.5  # 1.5 s above raise_utilisation, 1.5 s inside the band, repeated
        c.observe(LinkState("prfaas", "pd", GBPS, u * GBPS), k * 0.5)
    assert c.changes == 0 and c.value == 1000


@pytest.mark.parametrize("demand", [0.3, 0.7, 1.0, 2.5, 6.0])
def test_threshold_settles_under_steady_load(demand):
    """A closed loop: the link carries the KV of the requests above the threshold, modelled as utilisation
    demand x t0 / t (the tail of a length distribution thins as t rises). Under steady demand the threshold
    moves monotonically to a level inside the band and stays there: no oscillation."""
    p = ThresholdParams(1000, hold_s=1.0)
    c = ThresholdController(p)
    values = []
    for step in range(200):
        u = demand * 1000 / c.value
        values.append(c.observe(LinkState("prfaas", "pd", GBPS, u * GBPS), step * 0.5))
    diffs = [b - a for a, b in zip(values, values[1:]) if b != a]
    assert all(d > 0 for d in diffs) or all(d < 0 for d in diffs)  # one direction only
    final_u = demand * 1000 / values[-1]
    assert values[-1] == values[-50]  # settled
    assert final_u < p.raise_utilisation or values[-1] == c.top
    assert final_u >= p.lower_utilisation or values[-1] == p.threshold_tokens


def test_predicted_floor_follows_a_bandwidth_drop_at_once():
    """The floor: from the recent uncached lengths and the measured bytes per token, the smallest threshold
    whose offloaded KV fits raise_utilisation of the link. Halving the capacity raises it on the next
    placement, with no utilisation level to wait for; restoring it lowers it again; old lengths age out."""
    c = ThresholdController(ThresholdParams(100, window_s=10.0, hold_s=4.0))
    for n in (50, 150, 300, 600):
        c.record(n, 0.0)
    per_token = 1000.0  # bytes; the lengths above 100 offload 1050 tokens per 10 s: 105 kB/s
    full = LinkState("prfaas", "pd", 210e3)  # at 100: 0.5 utilisation
    assert c.observe(full, 1.0, per_token) == 100 and c.predicted == pytest.approx(0.5)
    half = LinkState("prfaas", "pd", 105e3)  # at 100: 1.0; keeping 150 local: 0.857; 300 too: 0.571
    assert c.observe(half, 1.5, per_token) == 300 and c.predicted == pytest.approx(600 / 1050)
    assert c.floor == 300 and c.stair == 100  # the prediction moved, not the measured staircase
    assert c.observe(full, 2.0, per_token) == 100
    assert c.observe(half, 2.5, None) == 100  # no transfer measured yet: no prediction
    assert c.observe(half, 12.0, per_token) == 100  # the lengths left the window
    fixed = ThresholdController(ThresholdParams(100, adaptive=False))
    fixed.record(600, 0.0)
    assert fixed.observe(half, 1.0, per_token) == 100
    fixed.record(50, 25.0)  # a fixed threshold never predicts: its window still forgets old lengths
    assert [n for _, n in fixed._recent] == [50]


def test_prfaas_keeps_more_local_after_a_bandwidth_drop():
    """Through the policy: a 200-token prompt goes to PrfaaS on the full link and stays on the PD cluster once
    the link halves, because the window's long requests alone fill what is left of it."""
    pol = prfaas(100, window_s=10.0)
    insts = cluster(1, 1, 1)

    def place(total, capacity, now):
        link = (LinkState("prfaas", "pd", capacity),)
        return pol.place(Snapshot(RequestInfo(total, total), tuple(insts), link, now, 1000.0))
    for k, n in enumerate((2000, 2000, 200)):
        assert place(n, 1e6, k * 0.1).route == "prfaas"  # 420 kB per 10 s on 1 MB/s: room for all
    assert place(200, 0.5e6, 1.0).route == "pd"  # 4.2k tokens in the window x 1 kB / 10 s: 0.84 of 0.5 MB/s
    assert pol.state()["threshold_floor_tokens"] == 200
    assert place(3000, 0.5e6, 1.1).route == "prfaas"


def test_a_raised_threshold_keeps_work_local_only_where_pd_prefill_has_room():
    """After the drop the floor keeps a 200-token prompt local. With the PD prefill idle it stays; with a
    queue it would wait behind longer than the link's backlog plus this KV plus PrfaaS's queue, it goes to
    PrfaaS all the same. Requests under the base threshold are never weighed; before a rate is measured the
    threshold decides."""
    def place(pd_queue, pd_rate, pending=0, total=200, pf_queue=0):
        pol = prfaas(100, window_s=10.0)
        insts = cluster(1, 1, 1, ppd=[dict(queued_tokens=pd_queue, prefill_tokens_s=pd_rate)],
                        rp=[dict(queued_tokens=pf_queue, prefill_tokens_s=2000.0)])
        link = (LinkState("prfaas", "pd", 0.5e6, pending_bytes=pending),)
        for k, n in enumerate((2000, 2000, 200)):  # the window's lengths fill the halved link: floor 200
            pol.place(Snapshot(RequestInfo(n, n), tuple(insts), link, k * 0.1, 1000.0))
        return pol.place(Snapshot(RequestInfo(total, total), tuple(insts), link, 1.0, 1000.0))
    idle = place(0, 1000.0)  # PD: 200 / 1000 = 0.2 s; PrfaaS: 200 kB / 0.5 MB/s + 0.1 s = 0.5 s
    assert idle.route == "pd" and idle.details["wait_local_s"] == 0.2 and idle.details["wait_prfaas_s"] == 0.5
    busy = place(4800, 1000.0)  # PD: 5 s behind its queue
    assert busy.route == "prfaas" and "outlasts the link" in busy.reason
    assert place(4800, 1000.0, pending=5e6).route == "pd"  # the link's backlog is longer still: 10.5 s
    assert place(4800, 1000.0, pf_queue=20000).route == "pd"  # and so is PrfaaS's queue: 10.5 s
    assert place(4800, None).route == "pd"  # no rate measured yet
    assert place(4800, 1000.0, total=90).route == "pd"  # under the base threshold: always local


def test_prefill_meter_counts_busy_time_once():
    """Two prefills batched together end 10 ms apart: the rate is their tokens over the busy second, not the
    second one's 1000 tokens over 10 ms; a failed prefill only leaves the queue."""
    from jaxserve.router.registry import PrefillMeter
    m = PrefillMeter()
    m.start(1000)
    m.start(1000)
    assert m.queued_tokens == 2000 and m.tokens_s is None
    m.end(1000, 0.0, 1.0, True)
    m.end(1000, 0.0, 1.01, True)
    assert m.queued_tokens == 0 and m.tokens_s == pytest.approx(1900 / 0.91, rel=1e-3)
    m.start(500)
    m.end(500, 5.0, 6.0, False)
    assert m.queued_tokens == 0 and m.tokens_s == pytest.approx(1900 / 0.91, rel=1e-3)


def test_band_must_be_wider_than_one_step():
    with pytest.raises(ValueError, match="must exceed lower_utilisation"):
        ThresholdParams(1000, raise_utilisation=0.5, lower_utilisation=0.4, step=1.5)
    with pytest.raises(ConfigFileError, match="policy: .*raise_utilisation"):
        parse({"policy": {"name": "prfaas", "raise_utilisation": 0.5, "lower_utilisation": 0.4}})


def test_policy_selected_by_name():
    assert isinstance(policy.make(parse({}).policy), LeastLoaded)
    pol = policy.make(parse({"policy": {"name": "prfaas", "threshold_tokens": 64, "affinity_slack": 0}}).policy)
    assert isinstance(pol, PrfaaS) and pol.params.threshold_tokens == 64 and pol.params.affinity_slack == 0
    with pytest.raises(ConfigFileError, match="policy.name"):
        parse({"policy": {"name": "nearest"}})


def test_snapshots_are_immutable():
    s = snap(10, *cluster(1, 1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.instances[0].inflight = 3
