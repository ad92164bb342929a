"""PrfaaS at datacenter scale, simulated (router/sim) with the live policy objects, next to the planner.

Parts (the PrfaaS document's case study: bench/profiles; each simulated hour at one seed):
  grid      the planner's grid search (Figure 5): lambda_max over the PD split at the optimal threshold, and the
            two prefill stages' capacities over the threshold at N_p / N_d = 3 / 5
  case      PrfaaS-PD, homogeneous PD and naive heterogeneous: throughput offered 4 req/s (above every
            deployment's capacity) against the planner's lambda_max and the document's Table 6; TTFT at 1.5 req/s
  bursts    PrfaaS-PD at 2 req/s with the rate x2.5 for 2 minutes of every 15: TTFT over time (what the
            analytic model cannot show)
  drop      the PrfaaS -> PD link at 12 Gbit/s halving to 6 at 30 minutes, 1.8 req/s: the time until the KV is at
            the decode instance, fixed threshold (19.4K) against the adaptive one
  shift     a PD cluster of 8 (4 prefill / 4 decode to start) whose traffic turns from long prompts with short
            answers to short prompts with long answers at 30 minutes, 1.3 req/s: static split against the
            long-term loop (re-plan every minute, a flip's warm-up 30 s)
  scale     104 cells of the case study (9,984 accelerators) for an hour at 90% of capacity: the wall time
`python -m bench.prfaas_sim --json bench/results/prfaas_sim.json --png bench/results/prfaas_sim.png`.
"""

from __future__ import annotations

import json
import os
import platform

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
PAPER = {"prfaas_pd": {"lambda_max": 3.24, "ttft_mean_s": 2.22, "ttft_p90_s": 3.51, "threshold_tokens": 19400},
         "homogeneous": {"lambda_max": 2.11, "ttft_mean_s": 4.44, "ttft_p90_s": 9.73},
         "naive": {"lambda_max": 2.45, "ttft_mean_s": 1.74, "ttft_p90_s": 3.51}}


def _inputs():
    from jaxserve.router.planner import Profile, Workload
    load = lambda n: json.load(open(os.path.join(HERE, n)))  # noqa: E731
    return (Profile.from_json(load("prfaas_h200.json")), Profile.from_json(load("pd_h20.json")),
            Workload.from_json(load("workload_case_study.json")))


def _policy(threshold: int, adaptive: bool = False):
    from jaxserve.router.policies.prfaas import PrfaaS, ThresholdParams
    return lambda: PrfaaS(ThresholdParams(threshold, adaptive=adaptive, hold_s=10.0, window_s=60.0))


def grid(P, D, W) -> dict:
    from jaxserve.router.planner import best_threshold, plan, stages, thresholds
    best = plan(P, D, W, 4, 8, 100.0)["prfaas_pd"]
    t = best["threshold_tokens"]
    split = [stages(P, D, W, t, 4, n, 8 - n, 100.0) for n in range(9)]
    ts = thresholds(W, 1024)
    curve = [stages(P, D, W, x, 4, 3, 5, 100.0) for x in ts]
    return {"optimum": best, "by_split": [{"n_p": r["n_p"], "lambda_max": r["lambda_max"],
                                           "prefill": r["theta_prfaas"] + r["theta_pd_p"], "decode": r["theta_pd_d"]}
                                          for r in split],
            "by_threshold": [{"t": r["threshold_tokens"], "prfaas_over_p": r["theta_prfaas"] / r["p"] if r["p"] else None,
                              "pd_p_over_1_minus_p": r["theta_pd_p"] / (1 - r["p"]) if r["p"] < 1 else None}
                             for r in curve],
            "best_at_3_5": best_threshold(P, D, W, 4, 3, 5, 100.0)["threshold_tokens"]}


def case(P, D, W) -> dict:
    from jaxserve.router.planner import plan
    from jaxserve.router.policies.least_loaded import LeastLoaded
    from jaxserve.router.sim.run import Simulation, Traffic, case_study
    planned = plan(P, D, W, 4, 8, 100.0)
    setups = {"prfaas_pd": (_policy(19400), {}), "homogeneous": (LeastLoaded, dict(n_p=9, n_d=3)),
              "naive": (_policy(0), dict(n_p=0, n_d=8))}
    out = {}
    for which, (mk, kw) in setups.items():
        dep = case_study(P, D, which, mk, **kw)
        sat = Simulation(dep, Traffic(4.0, W.lengths, 1024, duration_s=3600), seed=1).run(drain_s=0)
        at = Simulation(dep, Traffic(1.5, W.lengths, 1024, duration_s=3600), seed=1).run()
        out[which] = {"planner_lambda_max": planned[which]["lambda_max"], "sim_throughput_rps": sat["throughput_rps"],
                      "sim_ttft_at_1_5_rps": at["ttft_s"], "sim_routes_at_1_5_rps": at["routes"],
                      "sim_egress_gbps_saturated": sat["egress_gbps"], "paper": PAPER[which]}
    base = out["homogeneous"]["sim_throughput_rps"]
    for r in out.values():
        r["sim_ratio_vs_homogeneous"] = r["sim_throughput_rps"] / base
    return out


def bursts(P, D, W) -> dict:
    from jaxserve.router.sim.run import Simulation, Traffic, case_study
    dep = case_study(P, D, "prfaas_pd", _policy(19400, adaptive=True))
    r = Simulation(dep, Traffic(2.0, W.lengths, 1024, duration_s=3600, burst_factor=2.5, burst_s=120,
                                burst_every_s=900), seed=2).run(timeline_s=60)
    return {"rate": 2.0, "burst": "x2.5 for 120 s every 900 s", "ttft_s": r["ttft_s"], "timeline": r["timeline"]}


def drop(P, D, W) -> dict:
    from jaxserve.router.sim.run import Simulation, Traffic, case_study
    out = {}
    for name, adaptive in (("fixed", False), ("adaptive", True)):
        dep = case_study(P, D, "prfaas_pd", _policy(19400, adaptive), link_gbps=12.0, link_schedule=((1800, 6.0),))
        r = Simulation(dep, Traffic(1.8, W.lengths, 1024, duration_s=3600), seed=3).run(timeline_s=60)
        after = [b for b in r["timeline"] if 1800 <= b["t_s"] < 3600]
        out[name] = {"kv_ready_s": r["kv_ready_s"], "ttft_s": r["ttft_s"], "routes": r["routes"],
                     "kv_ready_p90_after_drop_s": max(b["kv_ready_p90_s"] for b in after),
                     "throughput_rps": r["throughput_rps"], "timeline": r["timeline"]}
    return out


def shift(P, D) -> dict:
    from jaxserve.router.planner import LogNormal
    from jaxserve.router.policies.least_loaded import LeastLoaded
    from jaxserve.router.replan import ReplanParams
    from jaxserve.router.sim.run import Simulation, Traffic, case_study
    phase2 = LogNormal(7.5, 0.5, 128, 32768)
    tr = Traffic(1.3, LogNormal(9.9, 1.0, 128, 131072), 256, duration_s=3600, phases=((1800, phase2, 2048),))
    out = {}
    for name, replan in (("static", None),
                         ("replan", (ReplanParams(replan_s=60, window_s=300, min_samples=20, min_interval_s=60,
                                                  t_step=256), P, D))):
        dep = case_study(P, D, "homogeneous", LeastLoaded, n_p=4, n_d=4)
        r = Simulation(dep, tr, seed=4, replan=replan, warmup_s=30.0).run(timeline_s=60)
        out[name] = {"throughput_rps": r["throughput_rps"], "ttft_s": r["ttft_s"], "flips": r["flips"],
                     "timeline": r["timeline"]}
    return out


def scale(P, D, W, cells: int, duration_s: float) -> dict:
    from jaxserve.router.planner import plan
    from jaxserve.router.sim.run import Simulation, Traffic, case_study
    lam = plan(P, D, W, 4, 8, 100.0)["prfaas_pd"]["lambda_max"]
    dep = case_study(P, D, "prfaas_pd", _policy(19400))
    r = Simulation(dep, Traffic(0.9 * lam, W.lengths, 1024, duration_s=duration_s), cells=cells, seed=5).run()
    return {"cells": cells, "accelerators": r["instances"] * 8, "traffic_s": duration_s, "requests": r["requests"],
            "events": r["events"], "wall_s": r["wall_s"], "throughput_rps": r["throughput_rps"],
            "ttft_s": r["ttft_s"], "failed": r["failed"]}


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(2, 3, figsize=(17, 9))
    g = out.get("grid")
    if g:
        a = ax[0, 0]
        a.plot([r["n_p"] for r in g["by_split"]], [r["lambda_max"] for r in g["by_split"]], "o-", label="lambda_max")
        a.plot([r["n_p"] for r in g["by_split"]], [r["prefill"] for r in g["by_split"]], "--", label="prefill stages")
        a.plot([r["n_p"] for r in g["by_split"]], [r["decode"] for r in g["by_split"]], "--", label="decode stage")
        a.set(xlabel="N_p (N_d = 8 - N_p)", ylabel="req/s", title="(a) split at the optimal threshold")
        a.legend()
        a = ax[0, 1]
        ts = [r["t"] / 1024 for r in g["by_threshold"]]
        a.plot(ts, [r["prfaas_over_p"] for r in g["by_threshold"]], label="Theta_prfaas / p")
        a.plot(ts, [r["pd_p_over_1_minus_p"] for r in g["by_threshold"]], label="Theta_pd-p / (1 - p)")
        a.axvline(g["best_at_3_5"] / 1024, color="grey", ls=":")
        a.set(xlabel="threshold t (K tokens)", ylabel="req/s", ylim=(0, 8), title="(b) threshold at N_p/N_d = 3/5")
        a.legend()
    c = out.get("case")
    if c:
        a = ax[0, 2]
        names = list(c)
        x = range(len(names))
        a.bar([i - 0.27 for i in x], [c[n]["paper"]["lambda_max"] for n in names], 0.27, label="document")
        a.bar(list(x), [c[n]["planner_lambda_max"] for n in names], 0.27, label="planner")
        a.bar([i + 0.27 for i in x], [c[n]["sim_throughput_rps"] for n in names], 0.27, label="simulated")
        a.set_xticks(list(x), names)
        a.set(ylabel="max throughput (req/s)", title="case study")
        a.legend()
    b = out.get("bursts")
    if b:
        a = ax[1, 0]
        a.plot([r["t_s"] / 60 for r in b["timeline"]], [r["ttft_p90_s"] for r in b["timeline"]])
        for k in range(0, 60, 15):
            a.axvspan(k, k + 2, color="orange", alpha=0.2)
        a.set(xlabel="minute", ylabel="TTFT p90 (s)", title="bursts (x2.5, shaded)")
    for a, key, y, label, title, log in ((ax[1, 1], "drop", "kv_ready_p90_s", "until KV at decode, p90 (s)",
                                          "link 12 -> 6 Gbit/s at minute 30", True),
                                         (ax[1, 2], "shift", "finished_rps", "finished req/s",
                                          "traffic mix shift at minute 30 (offered 1.3)", False)):
        for name, r in (out.get(key) or {}).items():
            a.plot([x["t_s"] / 60 for x in r["timeline"]], [x[y] for x in r["timeline"]], label=name)
        a.axvline(30, color="grey", ls=":")
        a.set(xlabel="minute", ylabel=label, title=title, yscale="log" if log else "linear")
        a.legend()
    from bench.stamp import save_figure
    save_figure(fig, path)


def main(argv=None):
    from bench.stamp import arguments
    ap = arguments(__doc__)
    ap.add_argument("--parts", default="grid,case,bursts,drop,shift,scale")
    ap.add_argument("--scale-cells", type=int, default=104)
    ap.add_argument("--scale-s", type=float, default=3600.0)
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    unknown = set(parts) - {"grid", "case", "bursts", "drop", "shift", "scale"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}")
    from tqdm import tqdm
    P, D, W = _inputs()
    out = {"benchmark": "prfaas_sim", "host": platform.node(),
           "what": "the PrfaaS document's case study simulated with the live policy objects (router/sim), against "
                   "the planner (router/planner.py) and the document's Table 6"}
    for part in tqdm(parts, desc="parts", unit="part"):
        out[part] = {"grid": lambda: grid(P, D, W), "case": lambda: case(P, D, W), "bursts": lambda: bursts(P, D, W),
                     "drop": lambda: drop(P, D, W), "shift": lambda: shift(P, D),
                     "scale": lambda: scale(P, D, W, a.scale_cells, a.scale_s)}[part]()
    from bench.stamp import write
    write(a.json, out, indent=1)
    if a.png:
        plot(out, a.png)
    if "case" in out:
        for n, r in out["case"].items():
            print(f"{n:12s} planner {r['planner_lambda_max']:.2f}  sim {r['sim_throughput_rps']:.2f}  document "
                  f"{r['paper']['lambda_max']:.2f} req/s; TTFT at 1.5 req/s mean {r['sim_ttft_at_1_5_rps']['mean']:.2f} "
                  f"p90 {r['sim_ttft_at_1_5_rps']['p90']:.2f} s")
    if "scale" in out:
        s = out["scale"]
        print(f"scale: {s['accelerators']} accelerators, {s['traffic_s']:.0f} s of traffic, {s['requests']} requests, "
              f"{s['events']} events in {s['wall_s']:.0f} s")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
