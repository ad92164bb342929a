"""Load balancing with hot shared prefixes, and role switching under a traffic shift, simulated (router/sim) with
the live policy objects (router/policies/).

Parts:
  hot    4 prefill + 2 decode instances; every prompt starts with one of 8 shared 6,000-token prefixes
         (Zipf 1.1: the two hottest take half the traffic) and adds 50-1,000 tokens of its own; each instance's
         prefix cache holds about 10 prefixes' worth. Offered 8, 16 and 24 req/s. Per policy: throughput,
         TTFT p50/p90/p99 and each prefill instance's utilisation over time. The anchors' cache-aware rules
         (SGLang's, Dynamo's), least loaded, round robin, BanaServe's load-aware dispatch without a store, and
         with the global KV store (prefixes loaded from host memory at 20 GB/s, pipelined with the compute).
  scale  the same at 8x: 32 prefill + 16 decode instances, 64 prefixes, 128 req/s.
  shift  a PD cluster of 8 (4 prefill / 4 decode to start, the PrfaaS document's H20 profile) whose traffic
         turns at minute 30 from long prompts with short answers to short prompts with long answers (1.3 req/s):
         the fixed split (least loaded) against FlowKV's scheduler with its controller (every 10 s; a role flip
         drains the instance and takes 30 s of warm-up) and without it (dispatch only).
  live   real worker processes on this machine (the bench-size llama): prefill p0 on core 0 and p1 on core 1,
         decode d0 on core 1, the global KV store s0 on core 0; each prefill cache 128 blocks of 16 tokens (four
         480-token prefixes); prompts of one of 8 shared 480-token prefixes (Zipf 1.1) plus 16-64 tokens of their own, 8
         output tokens, Poisson arrivals at `--live-rate` for `--live-s` seconds per policy (the same arrivals,
         prefix choices and lengths in every run, fresh token ids). cache_aware (SGLang's and Dynamo's rules)
         against banaserve over the store (prefixes read from its shared pool; _tcp: over the transfer layer, as
         from a store on another host): TTFT, throughput, and each prefill instance's busy fraction over time
         (its heartbeats).
`python -m bench.balance --json bench/results/balance.json --png bench/results/balance.png`.
"""

from __future__ import annotations

import json
import os
import platform

import numpy as np

HERE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "profiles")
# a prefill profile with a 1e-4 s/token slope (1,000 tokens in 0.1 s) and 1e4 KV bytes per token
HOT_PROFILE = {"prefill": {"tokens": [100, 10000], "seconds": [0.01, 1.0], "kv_bytes": [1e6, 1e8]},
               "decode": {"step_seconds": 0.001, "max_batch": 256}}


def _policies():
    from jaxserve.router.policies.banaserve import BanaServe, BanaServeParams
    from jaxserve.router.policies.cache_aware import CacheAware, CacheAwareParams
    from jaxserve.router.policies.round_robin import RoundRobin
    from jaxserve.router.policies.least_loaded import LeastLoaded
    return {  # name -> (make_policy, with the global KV store)
        "cache_aware_sglang": (lambda: CacheAware(CacheAwareParams("sglang")), False),
        "cache_aware_dynamo": (lambda: CacheAware(CacheAwareParams("dynamo")), False),
        "least_loaded": (LeastLoaded, False),
        "round_robin": (RoundRobin, False),
        "banaserve_no_store": (lambda: BanaServe(BanaServeParams(store=False)), False),
        "banaserve_store": (BanaServe, True),
    }


def _summary(r: dict, traffic_s: float, timeline_s: float) -> dict:
    k = int(traffic_s // timeline_s)
    util = {n: v[:k] for n, v in r["prefill_utilisation"].items()}
    means = [float(np.mean(v)) for v in util.values()]
    return {"throughput_rps": r["throughput_rps"], "ttft_s": r["ttft_s"], "requests": r["requests"],
            "utilisation_mean": {n: round(float(np.mean(v)), 4) for n, v in util.items()},
            "utilisation_max_over_min": (max(means) / min(means)) if min(means) > 0 else None,
            "utilisation_timeline": util}


def hot(n_p: int, n_d: int, groups: int, rates: list[float], traffic_s: float, seed: int = 4) -> dict:
    from jaxserve.router.planner import LogNormal, Profile
    from jaxserve.router.sim.run import Deployment, InstanceSpec, Simulation, Traffic
    prof = Profile.from_json(HOT_PROFILE)
    inst = [InstanceSpec(f"p{i}", "pd", "pd", "prefill", prof) for i in range(n_p)]
    inst += [InstanceSpec(f"d{i}", "pd", "pd", "decode", prof) for i in range(n_d)]
    out = {"instances": {"prefill": n_p, "decode": n_d}, "prefixes": groups, "prefix_tokens": 6000,
           "cache_tokens_per_instance": 60000, "by_rate": {}}
    for rate in rates:
        row = {}
        for name, (make, store) in _policies().items():
            dep = Deployment(inst, make, store_tokens=(1 << 26) if store else 0, cache_tokens=60000)
            tr = Traffic(rate, LogNormal(5.5, 0.5, 50, 1000), 16, duration_s=traffic_s, prefix_groups=groups,
                         prefix_tokens=6000, prefix_skew=1.1)
            row[name] = _summary(Simulation(dep, tr, seed=seed).run(timeline_s=30.0), traffic_s, 30.0)
        out["by_rate"][str(rate)] = row
    return out


def shift() -> dict:
    from jaxserve.router.policies.flowkv import FlowKV, FlowKVParams
    from jaxserve.router.planner import LogNormal, Profile
    from jaxserve.router.policies.least_loaded import LeastLoaded
    from jaxserve.router.sim.run import Simulation, Traffic, case_study
    D = Profile.from_json(json.load(open(os.path.join(HERE, "pd_h20.json"))))
    phase2 = LogNormal(7.5, 0.5, 128, 32768)
    tr = Traffic(1.3, LogNormal(9.9, 1.0, 128, 131072), 256, duration_s=3600, phases=((1800, phase2, 2048),))
    out = {}
    for name, make, control in (("fixed_split", LeastLoaded, None),
                                ("flowkv_dispatch_only", lambda: FlowKV(FlowKVParams(token_budget=32768)), None),
                                ("flowkv", lambda: FlowKV(FlowKVParams(token_budget=32768)), 10.0)):
        dep = case_study(D, D, "homogeneous", make, n_p=4, n_d=4)
        r = Simulation(dep, tr, seed=4, warmup_s=30.0, control_s=control).run(timeline_s=60)
        out[name] = {"throughput_rps": r["throughput_rps"], "ttft_s": r["ttft_s"], "routes": r["routes"],
                     "flips": r["flips"], "actions": len(r["actions"]), "timeline": r["timeline"]}
    return out


def live(rate: float, duration: float, models: str, only: list[str] | None = None) -> dict:
    import asyncio
    import time

    from bench.clusters import finish, run
    from bench.families import checkpoint
    from bench.prfaas_live import settle
    from jaxserve.config import parse
    from jaxserve.sampling import SamplingParams
    from jaxserve.router import policies
    cfg = {"model": {"path": checkpoint("llama", models), "name": "bench"},
           "engine": dict(block_size=16, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=512, chunk_size=256,
                          max_prefill_seqs=4, max_model_len=640, num_snapshots=16, warmup=True),
           "clusters": [{"name": "pd", "instances": [
               {"name": "p0", "role": "prefill", "cpus": [0]}, {"name": "p1", "role": "prefill", "cpus": [1]},
               {"name": "d0", "role": "decode", "cpus": [1], "kv_blocks": 512},
               {"name": "s0", "role": "store", "cpus": [0], "kv_blocks": 1024}]}],
           "transfer": {"token": "bench-balance", "layers_per_group": 4, "deadline_s": 60},
           "router": {"heartbeat_s": 0.25, "down_after_s": 10.0, "busy_wait_s": 120},
           "policy": {"name": "banaserve"}, "server": {"request_timeout_s": 600}}
    # banaserve_store reads prefixes from the store's shared pool (every process on this host); _tcp over the
    # transfer layer, as from a store on another host
    runs = {"cache_aware_sglang": ({"name": "cache_aware"}, True),
            "cache_aware_dynamo": ({"name": "cache_aware", "rule": "dynamo"}, True),
            "banaserve_store": ({"name": "banaserve"}, True), "banaserve_store_tcp": ({"name": "banaserve"}, False)}
    if only:
        unknown = set(only) - set(runs)
        if unknown:
            raise ValueError(f"--live-policies: unknown {sorted(unknown)}; known: {sorted(runs)}")
        runs = {n: r for n, r in runs.items() if n in only}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    w = 1.0 / np.arange(1, 9) ** 1.1
    cum = np.cumsum(w / w.sum())

    async def one_run(cluster, name: str, salt: int) -> dict:
        rng = np.random.default_rng(7)  # the same arrivals, prefixes chosen and lengths in every run ...
        ids = np.random.default_rng([7, salt])  # ... with fresh token ids (nothing cached carries over)
        prefixes = [[int(x) for x in ids.integers(1, 1000, 480)] for _ in range(8)]
        recs, util, tasks = [], {"p0": [], "p1": []}, []
        t0 = time.monotonic()

        async def one(k: int, prompt: list[int]):
            try:
                u = await finish(await cluster.add(f"{name}-{k}", prompt, params))
                recs.append({"ttft_s": u.ttft_s, "prefill": (u.route or {}).get("prefill_instance"),
                             "done_s": time.monotonic() - t0})
            except Exception as e:  # noqa: BLE001 - counted
                recs.append({"error": str(e)[:200]})

        async def sample():
            while True:
                for wk in cluster.registry.all():
                    if wk.name in util:
                        util[wk.name].append((time.monotonic() - t0, float(wk.stats.get("busy", 0.0))))
                await asyncio.sleep(cluster.cfg.router.heartbeat_s)
        sampler = asyncio.ensure_future(sample())
        k, nxt = 0, rng.exponential(1 / rate)
        while (now := time.monotonic() - t0) < duration:
            if now >= nxt:
                g = int(np.searchsorted(cum, rng.random()))
                tail = [int(x) for x in ids.integers(1, 1000, int(rng.integers(16, 65)))]
                tasks.append(asyncio.ensure_future(one(k, prefixes[g] + tail)))
                k += 1
                nxt += rng.exponential(1 / rate)
            await asyncio.sleep(min(0.02, max(0.0, nxt - now)))
        await asyncio.gather(*tasks)
        sampler.cancel()
        ok = [r for r in recs if "ttft_s" in r]
        ttft = np.array([r["ttft_s"] for r in ok]) if ok else np.zeros(1)
        means = {n: float(np.mean([b for _, b in v])) if v else 0.0 for n, v in util.items()}
        return {"requests": len(recs), "failed": len(recs) - len(ok),
                "errors": [r["error"] for r in recs if "error" in r][:5],  # the first few, as the router said
                "throughput_rps": len(ok) / max(r["done_s"] for r in ok) if ok else 0.0,
                "ttft_s": {q: float(np.percentile(ttft, v)) for q, v in (("p50", 50), ("p90", 90), ("p99", 99))},
                "per_instance_requests": {n: sum(r["prefill"] == n for r in ok) for n in util},
                "busy_mean": means, "busy_timeline": {n: [(round(t, 2), round(b, 3)) for t, b in v]
                                                      for n, v in util.items()},
                "store_puts": dict(cluster.prefixes.store_puts), "prefix_moves": dict(cluster.prefixes.prefix_moves)}

    async def go(cluster):
        out = {}
        for salt, (name, (pol, shared)) in enumerate(runs.items()):
            cluster.policy = policies.make(parse({**cfg, "policy": pol}).policy)
            cluster.prefixes.shared_loads = shared
            await settle(cluster)
            await one_run(cluster, f"warm-{name}", 100 + salt)  # compiles what this policy's placements need
            await settle(cluster)
            out[name] = await one_run(cluster, name, salt)
        return out
    return {"rate": rate, "duration_s": duration, "by_policy": run(cfg, go)}


def plot(out: dict, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(3, 3, figsize=(17, 13))
    h = out.get("hot")
    if h:
        rates = list(h["by_rate"])
        names = list(h["by_rate"][rates[0]])
        a = ax[0, 0]
        for n in names:
            a.plot([float(r) for r in rates], [h["by_rate"][r][n]["ttft_s"]["p90"] for r in rates], "o-", label=n)
        a.set(xlabel="offered req/s", ylabel="TTFT p90 (s)", yscale="log", title="hot prefixes: TTFT p90")
        a.legend(fontsize=7)
        mid = rates[len(rates) // 2]
        for a, n in ((ax[0, 1], "cache_aware_sglang"), (ax[0, 2], "banaserve_store")):
            for inst, v in h["by_rate"][mid][n]["utilisation_timeline"].items():
                a.plot([30 * k / 60 for k in range(len(v))], v, label=inst)
            a.set(xlabel="minute", ylabel="prefill utilisation", ylim=(0, 1.05), title=f"{n} at {mid} req/s")
            a.legend(fontsize=7)
    s = out.get("scale")
    if s:
        a = ax[1, 0]
        r = next(iter(s["by_rate"].values()))
        names = list(r)
        a.bar(range(len(names)), [r[n]["ttft_s"]["p90"] for n in names])
        a.set_xticks(range(len(names)), [n.replace("_", "\n") for n in names], fontsize=7)
        a.set(ylabel="TTFT p90 (s)", yscale="log", title="32 prefill / 16 decode, 128 req/s")
    sh = out.get("shift")
    if sh:
        for a, y, label in ((ax[1, 1], "finished_rps", "finished req/s"), (ax[1, 2], "ttft_p90_s", "TTFT p90 (s)")):
            for n, r in sh.items():
                a.plot([x["t_s"] / 60 for x in r["timeline"]], [x[y] for x in r["timeline"]], label=n)
            a.axvline(30, color="grey", ls=":")
            a.set(xlabel="minute", ylabel=label, title="traffic shift at minute 30 (offered 1.3 req/s)",
                  yscale="log" if "ttft" in y else "linear")
            a.legend(fontsize=7)
    lv = (out.get("live") or {}).get("by_policy")
    if lv:
        names = list(lv)
        a = ax[2, 0]
        x = range(len(names))
        a.bar([i - 0.2 for i in x], [lv[n]["ttft_s"]["p50"] for n in names], 0.4, label="p50")
        a.bar([i + 0.2 for i in x], [lv[n]["ttft_s"]["p90"] for n in names], 0.4, label="p90")
        a.set_xticks(list(x), [n.replace("_", "\n") for n in names], fontsize=7)
        a.set(ylabel="TTFT (s)", title=f"live, {out['live']['rate']:.0f} req/s, 2 prefill instances")
        a.legend()
        for a, n in ((ax[2, 1], "cache_aware_sglang"), (ax[2, 2], "banaserve_store")):
            for inst, v in lv.get(n, {}).get("busy_timeline", {}).items():
                a.plot([t for t, _ in v], [b for _, b in v], label=inst)
            a.set(xlabel="s", ylabel="busy fraction (heartbeats)", ylim=(0, 1.05), title=f"live: {n}")
            a.legend(fontsize=7)
    for a in ax.flat:
        if not a.has_data():
            a.set_axis_off()
    from bench.stamp import save_figure
    save_figure(fig, path)


def main(argv=None):
    from bench.stamp import arguments
    ap = arguments(__doc__)
    ap.add_argument("--parts", default="hot,scale,shift,live")
    ap.add_argument("--traffic-s", type=float, default=600.0, help="hot, scale: seconds of traffic")
    ap.add_argument("--live-rate", type=float, default=8.0, help="live: requests per second")
    ap.add_argument("--live-s", type=float, default=60.0, help="live: seconds of arrivals per policy")
    ap.add_argument("--live-policies", default="", help="live: a comma-separated subset of its runs (default: all)")
    ap.add_argument("--models", default="bench/.models", help="where bench-size checkpoints are built")
    a = ap.parse_args(argv)
    parts = a.parts.split(",")
    unknown = set(parts) - {"hot", "scale", "shift", "live"}
    if unknown:
        ap.error(f"--parts: unknown {sorted(unknown)}")
    from tqdm import tqdm
    out = {"benchmark": "balance", "host": platform.node(),
           "what": "hot shared prefixes: the anchors' cache-aware rules against load-aware dispatch with and without "
                   "the global KV store; FlowKV's role switching against a fixed split under a traffic shift "
                   "(simulated, router/sim, with the live policy objects)"}
    jobs = {"hot": lambda: hot(4, 2, 8, [8.0, 16.0, 24.0], a.traffic_s),
            "scale": lambda: hot(32, 16, 64, [128.0], a.traffic_s), "shift": shift,
            "live": lambda: live(a.live_rate, a.live_s, a.models, [p for p in a.live_policies.split(",") if p])}
    for part in tqdm(parts, desc="parts", unit="part"):
        out[part] = jobs[part]()
    from bench.stamp import write
    write(a.json, out, indent=1)
    if a.png:
        plot(out, a.png)
    for part in ("hot", "scale"):
        for rate, row in (out.get(part) or {}).get("by_rate", {}).items():
            for n, r in row.items():
                mm = r["utilisation_max_over_min"]
                print(f"{part} {rate:>6s} req/s {n:20s} {r['throughput_rps']:7.2f} req/s  TTFT p50 "
                      f"{r['ttft_s']['p50']:7.3f} p90 {r['ttft_s']['p90']:7.3f} p99 {r['ttft_s']['p99']:7.3f} s  "
                      f"utilisation max/min {mm if mm is None else round(mm, 2)}")
    for n, r in (out.get("shift") or {}).items():
        print(f"shift {n:22s} {r['throughput_rps']:.2f} req/s  TTFT p90 {r['ttft_s']['p90']:.1f} s  "
              f"flips {len(r['flips'])}")
    for n, r in ((out.get("live") or {}).get("by_policy") or {}).items():
        print(f"live {n:20s} {r['throughput_rps']:.2f} req/s  TTFT p50 {r['ttft_s']['p50']:.3f} p90 "
              f"{r['ttft_s']['p90']:.3f} s  failed {r['failed']}  per instance {r['per_instance_requests']}  busy "
              f"{ {k: round(v, 2) for k, v in r['busy_mean'].items()} }")
    print(f"wrote {a.json}")


if __name__ == "__main__":
    main()
