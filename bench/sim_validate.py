"""The simulator against the live system: one workload on bench/prfaas_live.py's cluster (configs/prfaas.yaml's
shape: a PrfaaS prefill worker on core 0, a PD prefill and a PD decode worker sharing core 1, the bench-size
llama, a shaped PrfaaS -> PD link), run live and simulated from profiles measured here.

1. `jaxserve profile` of prfaas-p0 and of pd-p0 (one after the other, each on its core): prefill time and S_kv over
   lengths, decode step over batch sizes, max_batch at `--tpot-slo-ms`.
2. Live: the router in this process, the workers as processes (bench/clusters.py), warm-up untimed; then a
   calibration, apart from the workload, of what the profiles leave out (they time the engine alone; live, the
   router's RPCs, the engine's scheduling around a step, a prefill instance's KV hand-off): one at a time on the
   idle cluster, `--calibrate` conversations of each of CALIBRATE_TOKENS tokens (2-256 go to the PD cluster,
   512 and 1,024 to PrfaaS) and each one's next turn `--think-s` later (served colocated on the PD decode
   instance, which holds the conversation); per route and prompt length, the median TTFT less the route's
   profile prefill time of the uncached tokens behind the cached ones is that route's serving path cost
   (`serving_path`); then
   `--duration` seconds of prfaas_live's workload (Poisson conversations, truncated log-normal lengths / 64,
   16 output tokens, second turns) under the `prfaas` policy at a fixed threshold.
3. Simulated: router/sim with the same policy class and settings, the engine's chunked prefill (chunk_size,
   max_num_batched_tokens, max_prefill_seqs), the profiles, those serving path costs (`Deployment.path_s`,
   interpolated by prompt length) and the link;
   pd-p0 and pd-d0 share a core there as they do live (the profiles are measured alone). Twice:
   - replayed: the live run's own conversations (`Traffic.trace`: each one's arrival, first-turn length and
     whether its second turn came), so both serve the very same requests; the comparison the bar is on;
   - drawn: `--sim-s` of traffic drawn from the same arrival rate, length distribution, output length and
     turns, the population the live run's ~100 requests sample (its share of long prompts is one draw).
Throughput and TTFT p50 / p90, per route too, and their ratios simulated / live (the issue's bar: within 15%);
every request's route and TTFT live and replayed side by side (`per_request`), to trace a gap to its requests.
`python -m bench.sim_validate --json bench/results/sim_validate.json`
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import os
import platform
import subprocess
import sys
import tempfile

import numpy as np
import yaml


def _profile(cfg_path: str, instance: str, out: str, args) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "profile", "--config", cfg_path, "--instance",
                             instance, "--json", out, "--lengths", args.lengths, "--batches", args.batches,
                             "--tpot-slo-ms", str(args.tpot_slo_ms), "--reps", "5"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


CALIBRATE_TOKENS = (2, 64, 256, 512, 1024)  # first turns: PD up to the threshold (256), PrfaaS above it


def serving_path(calibration: list, profiles: dict, least: int = 3) -> tuple[dict, float | None]:
    """The serving path's cost per request beyond its prefill, by route and prompt length, from the calibration's
    (turn, route, prompt tokens, cached tokens, TTFT): TTFT less the route's profile prefill time of the uncached
    tokens (behind the cached ones: prefill.prefix), the median per length of at least `least` requests; first
    turns for the routes that prefill elsewhere, next turns for the colocated one (the others go where the
    policy sends them) -> ({route: ((tokens, ...), (seconds, ...))}, the shortest PD prompt's cost: the fixed
    cost per request)."""
    by: dict = {}
    for turn, route, n, cached, ttft in calibration:
        prof = profiles.get(route)
        if prof is None or ttft is None or (turn == 2) != (route == "colocated"):
            continue
        extra = ttft - prof.prefill_seconds(n - cached) - prof.prefix_seconds(cached)
        by.setdefault(route, {}).setdefault(n, []).append(extra)
    by = {route: {n: xs for n, xs in ns.items() if len(xs) >= least} for route, ns in by.items()}
    path = {route: (tuple(sorted(ns)), tuple(max(0.0, float(np.median(ns[n]))) for n in sorted(ns)))
            for route, ns in by.items() if ns}
    return path, (path["pd"][1][0] if "pd" in path else None)


PER_REQUEST = ("arrival_s", "prompt_tokens", "turn", "route_live", "route_sim", "ttft_live_s", "ttft_sim_s",
               "cached_live", "cached_sim")


def pairs(recs: list[dict], finished) -> list[list]:
    """Each request served both live and replayed, side by side (PER_REQUEST), in arrival order: the simulator
    numbers the traced conversations 1, 2, ... in arrival order and its turns from 0, the live run by its own
    conversation index and from 1."""
    order = [r["conv"] for r in sorted((r for r in recs if r["turn"] == 1), key=lambda r: r["t"])]
    sim = {(order[q.conv - 1], q.turn + 1): q for q in finished}
    out = []
    for r in sorted(recs, key=lambda r: r["t"]):
        q = sim.get((r["conv"], r["turn"]))
        if r.get("ok") and q is not None:
            out.append([round(r["t"], 4), r["len"], r["turn"], r["route"], q.route, round(r["ttft_s"], 5),
                        round(q.first - q.arrival, 5), r["cached"], q.prompt - q.uncached])
    return out


def main(argv=None):
    from bench.prfaas_live import workload_args
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(ap, rate=0.4, duration=360, warm_s=20)
    ap.add_argument("--lengths", default="16,32,64,128,256,512,1024,2048")
    ap.add_argument("--batches", default="1,2,4,8,16")
    ap.add_argument("--tpot-slo-ms", type=float, default=1000.0)
    ap.add_argument("--sim-s", type=float, default=3600.0)
    ap.add_argument("--calibrate", type=int, default=10,
                    help="conversations per calibration length (CALIBRATE_TOKENS) that measure the serving path")
    args = ap.parse_args(argv)
    from tqdm import tqdm

    from bench.clusters import run
    from bench.families import checkpoint
    from bench.prfaas_live import HI, LO, MESSAGE, MU, SIGMA, config, policy, summary, warm, workload
    from jaxserve.router.planner import LogNormal, Profile
    from jaxserve.router.sim.run import Deployment, InstanceSpec, Simulation, Traffic
    bar = tqdm(total=3, desc="sim_validate", unit="stage")
    path = checkpoint("llama", args.models)
    cfg = config(args, path)
    tmp = tempfile.mkdtemp(prefix="jaxserve-simval-")
    cfg_path = os.path.join(tmp, "prfaas.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    # 1. profiles, one instance at a time (two at once, each on its own core, disturbed each other's times)
    outs = {name: os.path.join(tmp, f"{name}.json") for name in ("prfaas-p0", "pd-p0")}
    for name, out in outs.items():
        log, _ = (p := _profile(cfg_path, name, out, args)).communicate()
        if p.returncode:
            raise SystemExit(f"jaxserve profile {name} failed:\n{log}")
    profiles = {name: json.load(open(out)) for name, out in outs.items()}
    bar.update()

    # 2. live
    async def go(cluster):
        from bench.clusters import finish
        from jaxserve.sampling import SamplingParams
        await warm(cluster, args)
        cluster.policy = policy(args, "fixed")
        params, rng, cal = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True), np.random.default_rng(9), []
        for n in CALIBRATE_TOKENS:  # one request at a time: each one's conversation, then its next turn
            for i in range(args.calibrate):
                first = [int(x) for x in rng.integers(1, 1000, n)]
                u = await finish(await cluster.add(f"cal-{n}-{i}", first, params))
                await asyncio.sleep(args.think_s)  # as the workload's next turns: the router learns what is cached
                nxt = first + list(u.token_ids) + [int(x) for x in rng.integers(1, 1000, MESSAGE)]
                u2 = await finish(await cluster.add(f"cal-{n}-{i}-2", nxt, params))
                cal += [(turn, (x.route or {}).get("route"), len(p), x.cached_tokens, x.ttft_s) for turn, x, p in
                        ((1, u, first), (2, u2, nxt))]
        return cal, await workload(cluster, args, 300, args.duration)
    calibration, recs = run(cfg, go)
    live = summary(recs, args.duration, args.slo_ttft)
    bar.update()

    # 3. simulated, the same policy and traffic
    P, D = Profile.from_json(profiles["prfaas-p0"]), Profile.from_json(profiles["pd-p0"])
    path_s, dispatch_s = serving_path(calibration, {"pd": D, "prfaas": P, "colocated": D})
    dispatch_s = dispatch_s or 0.0
    dep = Deployment([InstanceSpec("prfaas-p0", "prfaas", "prfaas", "prefill", P),
                      InstanceSpec("pd-p0", "pd", "pd", "prefill", D), InstanceSpec("pd-d0", "pd", "pd", "decode", D)],
                     lambda: policy(args, "fixed"), link_gbps=args.bandwidth_gbps,
                     link_latency_s=args.latency_ms / 1e3, chunk_tokens=cfg["engine"]["max_num_batched_tokens"],
                     chunk_size=cfg["engine"]["chunk_size"], max_prefill_seqs=cfg["engine"]["max_prefill_seqs"],
                     kv_bytes=D, dispatch_s=dispatch_s, path_s=path_s, shared_cores=(("pd-p0", "pd-d0"),))
    lengths = LogNormal(MU - math.log(args.scale), SIGMA, max(2, LO // args.scale), HI // args.scale)
    tr = Traffic(args.rate, lengths, 1024 // args.scale, duration_s=args.sim_s, turn_p=args.turns,
                 think_s=args.think_s, followup_tokens=MESSAGE)
    seconds = {r["conv"] for r in recs if r["turn"] == 2}
    trace = tuple(sorted((r["t"], r["len"], r["conv"] in seconds) for r in recs if r["turn"] == 1))
    keep = ("throughput_rps", "ttft_s", "routes", "ttft_by_route", "requests", "egress_gbps")
    replay = Simulation(dep, dataclasses.replace(tr, duration_s=args.duration, trace=trace), seed=7)
    sims = {"replayed": replay.run(), "drawn": Simulation(dep, tr, seed=7).run()}
    bar.update()
    bar.close()
    sim = sims["replayed"]

    def ratios(s):
        return {"throughput": s["throughput_rps"] / live["throughput_rps"],
                "ttft_p50": s["ttft_s"]["p50"] / live["ttft_p50_s"],
                "ttft_p90": s["ttft_s"]["p90"] / live["ttft_p90_s"]}
    ratio = ratios(sim)
    long_share = {"live": live["routes"].get("prfaas", 0) / max(1, sum(live["routes"].values())),
                  "drawn": sims["drawn"]["routes"].get("prfaas", 0) / max(1, sum(sims["drawn"]["routes"].values()))}
    out = {"benchmark": "sim_validate", "host": platform.node(), "cpus": os.cpu_count(), "args": vars(args),
           "what": "one workload live (real workers) and simulated from profiles measured by jaxserve profile: "
                   "throughput and TTFT p50 / p90; ratios simulated / live",
           "profiles": profiles, "calibration_fields": ("turn", "route", "prompt_tokens", "cached", "ttft_s"),
           "calibration": calibration, "dispatch_s": dispatch_s, "path_s": path_s, "live": live,
           "simulated": {k: sim[k] for k in keep},
           "simulated_drawn": {k: sims["drawn"][k] for k in keep},
           "ratio_sim_over_live": ratio, "within_15_percent": {k: abs(v - 1) <= 0.15 for k, v in ratio.items()},
           "ratio_drawn_over_live": ratios(sims["drawn"]), "offloaded_share": long_share,
           "per_request_fields": PER_REQUEST, "per_request": pairs(recs, replay.finished)}
    from bench.stamp import write
    write(args.json, out, indent=1)
    print(json.dumps({"live": {k: live[k] for k in ("throughput_rps", "ttft_p50_s", "ttft_p90_s", "routes")},
                      "simulated": {"throughput_rps": sim["throughput_rps"], "ttft_s": sim["ttft_s"],
                                    "routes": sim["routes"]}, "ratio": ratio,
                      "ratio_drawn": out["ratio_drawn_over_live"]}, indent=1))


if __name__ == "__main__":
    main()
