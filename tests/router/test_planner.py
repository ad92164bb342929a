"""The PrfaaS-PD planner (router/planner.py, `jaxserve plan`): interpolation, the truncated log-normal against
numerical integration, eqs. (3)-(6) on hand-computed cases, the search against brute force, and the document's
case study (Table 6) from its Table 5 and a PD profile derived from Table 6."""

import json
import math
import os

import numpy as np
import pytest
from typer.testing import CliRunner

from jaxserve.router.cli import app
from jaxserve.router.planner import LogNormal, PlanError, Profile, Workload, plan, stages, thresholds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROFILES = os.path.join(ROOT, "bench", "profiles")


def _profile(tokens, seconds, kv, step=0.025, batch=20):
    return Profile.from_json({"prefill": {"tokens": tokens, "seconds": seconds, "kv_bytes": kv},
                              "decode": {"step_seconds": step, "max_batch": batch}})


def _load(name):
    with open(os.path.join(PROFILES, name)) as f:
        return json.load(f)


def test_prefill_time_and_kv_are_linear_between_points_and_extrapolated_outside():
    p = _profile([100, 200, 400], [1.0, 2.0, 6.0], [10, 20, 60])
    assert p.prefill_seconds(150) == pytest.approx(1.5)
    assert p.prefill_seconds(300) == pytest.approx(4.0)
    assert p.prefill_seconds(50) == pytest.approx(0.5)  # from the first two points
    assert p.prefill_seconds(500) == pytest.approx(8.0)  # from the last two
    assert p.kv_bytes_at(400) == 60 and p.kv_bytes_at(300) == pytest.approx(40)
    assert p.decode_rate(1000) == pytest.approx(20 / (0.025 * 1000))


def test_a_cached_prefix_adds_its_measured_extra_from_zero():
    d = {"prefill": {"tokens": [100, 200], "seconds": [1.0, 2.0], "kv_bytes": [1, 2],
                     "prefix": {"new_tokens": 32, "tokens": [256, 1024], "extra_seconds": [0.004, 0.020]}},
         "decode": {"step_seconds": 0.025, "max_batch": 20}}
    p = Profile.from_json(d)
    assert p.prefix_seconds(0) == 0 and p.prefix_seconds(128) == pytest.approx(0.002)  # from (0, 0)
    assert p.prefix_seconds(640) == pytest.approx(0.012) and p.prefix_seconds(2048) == pytest.approx(0.0413, 1e-3)
    assert Profile.from_json(p.to_json()) == p and _profile([1], [1.0], [1]).prefix_seconds(500) == 0
    d["prefill"]["prefix"]["extra_seconds"] = [0.004]
    with pytest.raises(PlanError, match=r"pd\.prefill\.prefix: tokens and extra_seconds differ in length"):
        Profile.from_json(d, "pd")


@pytest.mark.parametrize("mu,sigma,lo,hi", [(9.9, 1.0, 128, 131072), (6.0, 0.5, 16, 2048), (3.0, 2.0, 1, 1e5)])
def test_truncated_lognormal_matches_numerical_integration(mu, sigma, lo, hi):
    L = LogNormal(mu, sigma, lo, hi)
    x = np.exp(np.linspace(math.log(lo), math.log(hi), 400001))
    pdf = np.exp(-((np.log(x) - mu) ** 2) / (2 * sigma ** 2)) / (x * sigma * math.sqrt(2 * math.pi))

    def integral(y, a, b):
        m = (x >= a) & (x <= b)
        return np.trapezoid(y[m], x[m])
    z = integral(pdf, lo, hi)
    for t in (lo * 2, math.exp(mu), hi / 3):
        assert L.above(t) == pytest.approx(integral(pdf, t, hi) / z, rel=1e-4)
        assert L.mean_between(t, hi) == pytest.approx(integral(x * pdf, t, hi) / integral(pdf, t, hi), rel=1e-4)
        assert L.mean_between(lo, t) == pytest.approx(integral(x * pdf, lo, t) / integral(pdf, lo, t), rel=1e-4)
    assert L.above(lo) == pytest.approx(1.0) and L.above(hi) == 0.0 and L.mean_between(hi, hi * 2) is None


def test_stages_by_hand():
    """T(l) = l / 1000 s on PrfaaS, l / 500 s on the PD cluster; KV 1 MB per 1000 tokens; decode 0.02 s steps
    of 10 requests, 100 output tokens."""
    wl = Workload(LogNormal(7.0, 0.8, 64, 8192), 100)
    pr = _profile([1000, 2000], [1.0, 2.0], [1e6, 2e6])
    pd = _profile([1000, 2000], [2.0, 4.0], [1e6, 2e6], step=0.02, batch=10)
    L = wl.lengths
    t = 1500
    p, ll, ls = L.above(t), L.mean_between(t, 8192), L.mean_between(64, t)
    r = stages(pr, pd, wl, t, n_prfaas=2, n_p=3, n_d=4, egress_gbps=0.1)
    # (3): compute 2 / (ll / 1000) against bandwidth 0.1e9 / 8 / (ll * 1000)
    th_prfaas = min(2 / (ll / 1000), 0.1e9 / 8 / (ll * 1000))
    assert r["theta_prfaas"] == pytest.approx(th_prfaas)
    assert r["theta_pd_p"] == pytest.approx(3 / (ls / 500))  # (4)
    assert r["theta_pd_d"] == pytest.approx(4 * 10 / (0.02 * 100))  # (5)
    lam = min(th_prfaas / p, 3 / (ls / 500) / (1 - p), 20.0)  # (6)
    assert r["lambda_max"] == pytest.approx(lam)
    assert r["egress_gbps"] == pytest.approx(lam * p * ll * 1000 * 8 / 1e9)
    assert (r["p"], r["l_long"], r["l_short"]) == (p, ll, ls)
    # no PD prefill instance while some requests stay local: nothing completes
    assert stages(pr, pd, wl, t, 2, 0, 7, 0.1)["lambda_max"] == 0.0
    # everything local (t = max): PrfaaS idle, decode the limit here
    r = stages(pr, pd, wl, 8192, 2, 7, 1, 0.1)
    assert r["p"] == 0 and r["lambda_max"] == pytest.approx(min(7 / (L.mean() / 500), 5.0))


def test_the_search_finds_the_brute_force_optimum_and_balances_the_stages():
    pr = Profile.from_json(_load("prfaas_h200.json"))
    pd = Profile.from_json(_load("pd_h20.json"))
    wl = Workload(LogNormal(8.5, 1.2, 128, 32768), 512)
    res = plan(pr, pd, wl, n_prfaas=2, n_pd=10, egress_gbps=40, t_step=128)
    best = res["prfaas_pd"]
    grid = [stages(pr, pd, wl, t, 2, n_p, 10 - n_p, 40) for t in thresholds(wl, 128) for n_p in range(11)]
    assert best["lambda_max"] == pytest.approx(max(r["lambda_max"] for r in grid))
    assert max(b - a for a, b in zip(thresholds(wl, 128), thresholds(wl, 128)[1:])) <= 128
    # (7): PrfaaS and PD-P saturate together (to the threshold grid's resolution); (8) to whole instances
    a, b = best["theta_prfaas"] / best["p"], best["theta_pd_p"] / (1 - best["p"])
    assert abs(a - b) / best["lambda_max"] < 0.05
    per_d = pd.decode_rate(512)
    assert abs(best["theta_prfaas"] + best["theta_pd_p"] - best["theta_pd_d"]) <= 2 * per_d
    homo = res["homogeneous"]
    assert homo["lambda_max"] == pytest.approx(max(
        min(n / pd.prefill_seconds(wl.lengths.mean()), (12 - n) * per_d) for n in range(1, 12)))
    naive = res["naive"]
    assert naive["lambda_max"] == pytest.approx(min(
        2 / pr.prefill_seconds(wl.lengths.mean()), 40e9 / 8 / pr.kv_bytes_at(wl.lengths.mean()), 10 * per_d))


def test_reproduces_table_6_of_the_prfaas_document():
    """Table 5 as the PrfaaS profile, bench/profiles/pd_h20.json (derived from Table 6: docs/05-policies.md,
    Planner) as the PD profile, the document's workload, 4 PrfaaS + 8 PD instances, 100 Gbit/s: within 5% of Table 6."""
    res = plan(Profile.from_json(_load("prfaas_h200.json")), Profile.from_json(_load("pd_h20.json")),
               Workload.from_json(_load("workload_case_study.json")), 4, 8, 100.0)
    b, h, n = res["prfaas_pd"], res["homogeneous"], res["naive"]
    assert (b["n_prfaas"], b["n_p"], b["n_d"]) == (4, 3, 5)
    assert (h["n_p"], h["n_d"]) == (9, 3) and (n["n_prfaas"], n["n_d"]) == (4, 8)
    assert b["threshold_tokens"] == pytest.approx(19.4e3, rel=0.05)
    for got, want in [(b["lambda_max"], 3.24), (h["lambda_max"], 2.11), (n["lambda_max"], 2.45),
                      (b["theta_prfaas"], 1.61), (b["theta_pd_p"], 1.64), (b["theta_pd_d"], 3.91),
                      (h["theta_pd_p"], 2.11), (h["theta_pd_d"], 2.35), (n["theta_prfaas"], 2.45),
                      (n["theta_pd_d"], 6.25), (b["ratio_vs_homogeneous"], 1.54), (n["ratio_vs_homogeneous"], 1.16),
                      (b["p"], 0.496)]:
        assert got == pytest.approx(want, rel=0.05)
    # the document says "about 13 Gbps"; its own figures give 3.24 req/s x 0.496 x S_kv(44K) = 12.2 Gbit/s
    assert 11.5 < b["egress_gbps"] < 13.5


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["prefill"].pop("seconds"), "pd.prefill.seconds must be a non-empty list"),
    (lambda d: d["prefill"].update(tokens=[1024, 1024, 2, 3]), "pd.prefill.tokens must increase"),
    (lambda d: d["prefill"].update(kv_bytes=[1, 2]), "differ in length"),
    (lambda d: d["decode"].update(max_batch=0), "pd.decode.max_batch must be > 0"),
    (lambda d: d["prefill"].update(seconds=[1, "x", 2, 3]), "pd.prefill.seconds must be a number"),
])
def test_bad_profiles_name_the_field(edit, field):
    d = _load("pd_h20.json")
    edit(d)
    with pytest.raises(PlanError, match=field.replace(".", r"\.")):
        Profile.from_json(d, "pd")


def test_the_cli_prints_and_writes_the_plan_and_refuses_bad_input(tmp_path):
    out = tmp_path / "plan.json"
    args = ["plan", "--prfaas", os.path.join(PROFILES, "prfaas_h200.json"), "--pd", os.path.join(PROFILES, "pd_h20.json"),
            "--workload", os.path.join(PROFILES, "workload_case_study.json"), "--n-prfaas", "4", "--n-pd", "8",
            "--egress-gbps", "100"]
    r = CliRunner().invoke(app, args + ["--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "lambda_max" in r.output and "4 / 3 / 5" in r.output
    got = json.loads(out.read_text())
    fields = {"lambda_max", "threshold_tokens", "n_p", "n_d", "p", "l_long", "l_short", "theta_prfaas",
              "theta_pd_p", "theta_pd_d", "egress_gbps"}
    assert fields <= set(got["prfaas_pd"]) and {"homogeneous", "naive"} <= set(got)
    bad = tmp_path / "wl.json"
    bad.write_text(json.dumps({"length": {"lognormal": {"mu": 9.9, "sigma": 1, "min": 500, "max": 100}},
                               "output_tokens": 10}))
    r = CliRunner().invoke(app, args[:5] + ["--workload", str(bad)] + args[7:])
    assert r.exit_code == 2 and "workload.length.lognormal: max (100) must be above min (500)" in r.output
