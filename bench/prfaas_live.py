"""PrfaaS live: selective offload against never- and always-offload on one mixed workload, then a link
bandwidth drop, over real worker processes.

Topology (configs/prfaas.yaml's shape, the bench-size dense llama of bench/families.py): a PrfaaS cluster of
one prefill worker on core 0; a PD cluster of a prefill and a decode worker sharing core 1; the PrfaaS -> PD
link is TCP shaped to `--bandwidth-gbps` with `--latency-ms`. The router runs in this process
(bench/clusters.py); its policy is switched between runs, the workers stay (warm, same processes).

Workload: input lengths from PrfaaS 4.1's truncated log-normal (mu 9.90, sigma 1.00, [128, 128K]) divided by
`--scale` (64: [2, 2048] tokens, mean about 420); output fixed at 1024 / scale = 16 tokens (greedy); Poisson
arrivals of new conversations at `--rate`; a conversation has a second turn with probability `--turns` (its
prompt + answer + a 32-token message, sent `--think-s` after the answer). Each run draws fresh token ids (no
cache carries over between runs).

(a) never (`prfaas` with an unreachable threshold: everything on the PD cluster), always (threshold 0,
    fixed: every prefill in PrfaaS, the naive heterogeneous setup) and selective (`--threshold`, adaptive),
    each for `--duration` seconds of arrivals: throughput (completed requests and tokens per second), goodput
    (requests per second whose TTFT met `--slo-ttft`), TTFT p50 / p90, routes, KV bytes over the link.
(b) selective with the adaptive threshold and with a fixed one, on the same arrivals, lengths and turns (fresh
    token ids); halfway through each run the link's bandwidth halves (the router's set_link, as POST
    /admin/links does): p90 TTFT and p90 time to the second token per `--window` seconds, and the effective
    threshold over time; `--png` plots them. The first token leaves the prefill instance before the KV, so a
    congested link shows in the time to the second token (decode waits for the KV), not in TTFT.

    python -m bench.prfaas_live --json bench/results/prfaas_live.json --png bench/results/prfaas_live.png
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import time

import numpy as np

from bench.clusters import finish, run
from bench.faults import pct

MU, SIGMA, LO, HI = 9.90, 1.00, 128, 128 * 1024
MESSAGE = 32
WARM_RATE = 0.6  # conversations per second of the untimed warm-up when the rate is still to be measured


def lengths(rng: np.random.Generator, n: int, scale: int) -> list[int]:
    """n input lengths: the truncated log-normal, scaled down by `scale` (rejection sampling)."""
    out = []
    while len(out) < n:
        x = rng.lognormal(MU, SIGMA)
        if LO <= x <= HI:
            out.append(max(2, int(x / scale)))
    return out


def config(args, path: str) -> dict:
    return {"model": {"path": path, "name": "bench"},
            "engine": dict(block_size=16, num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=512,
                           chunk_size=256, max_prefill_seqs=4, max_model_len=HI // args.scale + 2 * MESSAGE + 64,
                           num_snapshots=16, warmup=True),
            "clusters": [{"name": "prfaas", "kind": "prfaas",
                          "instances": [{"name": "prfaas-p0", "role": "prefill", "cpus": [0]}]},
                         {"name": "pd", "kind": "pd",
                          "instances": [{"name": "pd-p0", "role": "prefill", "cpus": [1]},
                                        {"name": "pd-d0", "role": "decode", "cpus": [1]}]}],
            "links": [{"src": "prfaas", "dst": "pd", "bandwidth_gbps": args.bandwidth_gbps,
                       "latency_ms": args.latency_ms, "connections": 4}],
            "transfer": {"token": "bench-prfaas", "layers_per_group": 4, "stream_min_tokens": 256, "deadline_s": 60},
            "router": {"heartbeat_s": 0.5, "down_after_s": 10.0, "busy_wait_s": 120},
            "policy": {"name": "prfaas", "threshold_tokens": args.threshold},
            "server": {"request_timeout_s": 600}}


def policy(args, name: str):
    from jaxserve.policy_config import policy_section
    from jaxserve.router import policies
    kw = {"never": dict(threshold_tokens=10**9, adaptive=False), "always": dict(threshold_tokens=0, adaptive=False),
          "selective": dict(threshold_tokens=args.threshold), "fixed": dict(threshold_tokens=args.threshold,
                                                                              adaptive=False)}[name]
    return policies.make(policy_section(name="prfaas", local_prefill_tokens=MESSAGE + 16, **kw))


async def workload(cluster, args, seed: int, duration: float, on_tick=None, salt: int = 0,
                   rate: float | None = None) -> list[dict]:
    """Open-loop conversations for `duration` s at `rate` (default `--rate`) per second; -> one record per
    request. `seed` draws the arrivals, lengths and second turns, `salt` the token ids: two runs with one seed
    and different salts offer the same load with prompts neither has cached."""
    from jaxserve.sampling import SamplingParams
    rate = rate or args.rate
    rng = np.random.default_rng(seed)
    ids = np.random.default_rng([seed, salt])
    vocab = 1000
    params = SamplingParams(max_tokens=1024 // args.scale, temperature=0, ignore_eos=True)
    records: list[dict] = []

    async def one(rid: str, conv: int, prompt: list[int], turn: int) -> list[int] | None:
        arrival = time.monotonic() - t0
        second = []  # when the second token arrived: decode ran on the KV (the first leaves before the KV)

        def seen(u):
            if not second and len(u.token_ids) >= 2:
                second.append(time.monotonic() - t0 - arrival)
        try:
            u = await finish(await cluster.add(rid, prompt, params), seen)
        except Exception as e:  # noqa: BLE001 - a failed request is counted, the run goes on
            records.append({"t": arrival, "ok": False, "error": str(e)[:200], "conv": conv, "turn": turn,
                            "len": len(prompt)})
            return None
        r = u.route or {}
        records.append({"t": arrival, "ok": True, "ttft_s": u.ttft_s, "tt2t_s": second[0] if second else None,
                        "e2e_s": time.monotonic() - t0 - arrival,
                        "conv": conv, "turn": turn, "len": len(prompt), "cached": u.cached_tokens,
                        "route": r.get("route"),
                        "kv_bytes": r.get("kv_bytes_transferred", 0), "tokens": len(u.token_ids)})
        return u.token_ids

    async def conversation(i: int, n: int, second: bool, message: list[int]):
        first = [int(x) for x in ids.integers(1, vocab, n)]
        ans = await one(f"s{seed}.{salt}-c{i}-t1", i, first, 1)
        if ans is not None and second:
            await asyncio.sleep(args.think_s)
            await one(f"s{seed}.{salt}-c{i}-t2", i, first + ans + message, 2)

    tasks, i = [], 0
    lens = iter(lengths(rng, 100_000, args.scale))  # drawn before the clock starts (a fraction of a second)
    t0 = time.monotonic()
    next_at = rng.exponential(1 / rate)
    while (now := time.monotonic() - t0) < duration:
        if on_tick is not None:
            on_tick(now)
        if now >= next_at:
            # drawn here, in arrival order, so that every run with this seed offers the same conversations
            turn2, message = rng.random() < args.turns, [int(x) for x in ids.integers(1, vocab, MESSAGE)]
            tasks.append(asyncio.ensure_future(conversation(i, next(lens), turn2, message)))
            i += 1
            next_at += rng.exponential(1 / rate)
        await asyncio.sleep(min(0.05, max(0.0, next_at - now)))
    await asyncio.gather(*tasks)
    return records


def summary(records: list[dict], duration: float, slo: float) -> dict:
    ok = [r for r in records if r["ok"]]
    ttft = [r["ttft_s"] for r in ok]
    span = max(duration, max((r["t"] + r["e2e_s"] for r in ok), default=duration))
    routes: dict = {}
    for r in ok:
        routes[r["route"]] = routes.get(r["route"], 0) + 1
    return {"requests": len(records), "failed": len(records) - len(ok), "routes": routes,
            "throughput_rps": len(ok) / span, "tokens_per_s": sum(r["tokens"] + r["len"] for r in ok) / span,
            "goodput_rps": sum(1 for t in ttft if t <= slo) / span, "slo_attainment": (
                sum(1 for t in ttft if t <= slo) / len(ttft) if ttft else None),
            "ttft_p50_s": pct(ttft, 50), "ttft_p90_s": pct(ttft, 90),
            "ttft_by_route": {k: {"n": len(v), "p50_s": pct(v, 50), "p90_s": pct(v, 90)} for k, v in sorted(
                {r["route"]: [q["ttft_s"] for q in ok if q["route"] == r["route"]] for r in ok}.items())},
            "tt2t_p90_s": pct([r["tt2t_s"] for r in ok if r.get("tt2t_s") is not None], 90),
            "second_turn_cached_fraction": pct([r["cached"] / r["len"] for r in ok if r["turn"] == 2], 50),
            "kv_bytes_prfaas": sum(r["kv_bytes"] for r in ok if r["route"] == "prfaas")}


def windows(records: list[dict], width: float, duration: float) -> list[dict]:
    out = []
    for k in range(int(np.ceil(duration / width))):
        rs = [r for r in records if r["ok"] and k * width <= r["t"] < (k + 1) * width]
        out.append({"t": k * width, "requests": len(rs), "ttft_p90_s": pct([r["ttft_s"] for r in rs], 90),
                    "tt2t_p90_s": pct([r["tt2t_s"] for r in rs if r["tt2t_s"] is not None], 90),
                    "offloaded": sum(1 for r in rs if r["route"] == "prfaas")})
    return out


async def settle(cluster, limit_s: float = 120.0) -> float:
    """Wait until the last heartbeats show every instance idle (nothing running, waiting or reserved) and every
    link drained (no frame queued or unacknowledged), twice a heartbeat apart; -> the seconds it took. A run
    that starts while the one before still drains its link would pay for it."""
    t0, idle = time.monotonic(), 0
    while time.monotonic() - t0 < limit_s:
        ws = cluster.registry.all()
        quiet = all(not w.inflight and not any(int(w.stats.get(k, 0) or 0)
                                               for k in ("running", "waiting", "reservations")) and
                    not any(int(v.get("queue_depth") or 0) or int(v.get("in_flight_bytes") or 0)
                            for v in w.links.values()) for w in ws)
        idle = idle + 1 if quiet else 0
        if idle >= 2:
            break
        await asyncio.sleep(cluster.cfg.router.heartbeat_s)
    return time.monotonic() - t0


def offered_rate(capacity_rps: float, load: float, turns: float) -> float:
    """New conversations per second that offer `load` x `capacity_rps` requests per second, a conversation being
    1 + `turns` requests on average."""
    return load * capacity_rps / (1 + turns)


async def calibrate(cluster, args) -> dict:
    """The PD cluster's capacity for this workload, measured on it: first turns of the workload's lengths (fresh
    token ids), closed loop at `--calibrate-concurrency` for `--calibrate-s` seconds under the never policy
    (every prefill on the PD cluster); -> its completed requests per second and the conversation rate that
    offers `--load` times it. The PD cluster's capacity scales with the machine's cores, so the offered load
    puts it past saturation by the same factor on any machine, where the policies differ."""
    from jaxserve.sampling import SamplingParams
    cluster.policy = policy(args, "never")
    params = SamplingParams(max_tokens=1024 // args.scale, temperature=0, ignore_eos=True)
    rng = np.random.default_rng(7)
    lens = iter(lengths(rng, 100_000, args.scale))
    done: list[int] = []
    t0 = time.monotonic()

    async def client(c: int):
        k = 0
        while time.monotonic() - t0 < args.calibrate_s:
            prompt = [int(x) for x in rng.integers(1, 1000, next(lens))]
            await finish(await cluster.add(f"calibrate-{c}-{k}", prompt, params))
            done.append(len(prompt))
            k += 1
    await asyncio.gather(*(client(c) for c in range(args.calibrate_concurrency)))
    wall = time.monotonic() - t0
    capacity = len(done) / wall
    return {"what": "the PD cluster alone (never policy), first turns of the workload's lengths, closed loop",
            "concurrency": args.calibrate_concurrency, "requests": len(done), "wall_s": wall,
            "mean_prompt_tokens": float(np.mean(done)) if done else None, "capacity_rps": capacity,
            "load": args.load, "rate": offered_rate(capacity, args.load, args.turns)}


async def warm(cluster, args):
    """Untimed: every prefill bucket once through each route, then `--warm-s` of the workload with each route
    (batched shapes, table widths, transfer programs), so the runs measure serving, not compiling."""
    from jaxserve.sampling import SamplingParams
    params = SamplingParams(max_tokens=1024 // args.scale, temperature=0, ignore_eos=True)
    n, sizes = 16, []
    while n <= HI // args.scale:
        sizes.append(n)
        n *= 2
    for k, name in enumerate(("never", "always")):
        cluster.policy = policy(args, name)
        for j, n in enumerate(sizes + [sizes[-1] + MESSAGE]):
            await finish(await cluster.add(f"warm-{name}-{j}", [(7 * i + j) % 999 + 1 for i in range(n)], params))
        await workload(cluster, args, 10 + k, args.warm_s, rate=args.rate or WARM_RATE)


def workload_args(ap: argparse.ArgumentParser, rate: float | None, duration: float, warm_s: float) -> None:
    """The cluster and workload options (also bench/sim_validate.py's)."""
    ap.add_argument("--json", required=True)
    ap.add_argument("--models", default="bench/.models", help="where bench-size checkpoints are built")
    ap.add_argument("--scale", type=int, default=64, help="input lengths divided by this")
    ap.add_argument("--rate", type=float, default=rate, help="new conversations per second" + (
        "" if rate is not None else " (default: measured, see --load)"))
    ap.add_argument("--turns", type=float, default=0.3, help="probability of a conversation's second turn")
    ap.add_argument("--think-s", type=float, default=0.5)
    ap.add_argument("--duration", type=float, default=duration, help="seconds of arrivals per run")
    ap.add_argument("--threshold", type=int, default=256, help="the selective policy's threshold (tokens)")
    ap.add_argument("--bandwidth-gbps", type=float, default=0.048, help="the PrfaaS -> PD link (Gbit/s)")
    ap.add_argument("--latency-ms", type=float, default=5.0)
    ap.add_argument("--slo-ttft", type=float, default=3.0, help="TTFT SLO (s) for goodput")
    ap.add_argument("--warm-s", type=float, default=warm_s, help="untimed workload per route before the runs")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    workload_args(ap, rate=None, duration=90, warm_s=30)
    # at the default load the selective split's KV fills about 70% of this link; offloading every prefill needs
    # all of it (and more than the one PrfaaS prefill worker computes)
    ap.set_defaults(bandwidth_gbps=0.12)
    ap.add_argument("--load", type=float, default=1.25,
                    help="without --rate: the requests offered per second, as a multiple of the PD cluster's "
                         "capacity measured first in the same run")
    ap.add_argument("--calibrate-s", type=float, default=30.0, help="seconds of the capacity measurement")
    ap.add_argument("--calibrate-concurrency", type=int, default=8)
    ap.add_argument("--png", default=None)
    ap.add_argument("--window", type=float, default=10.0, help="seconds per p90 window in (b)")
    ap.add_argument("--repeats", type=int, default=2, help="runs of each threshold in (b), in ABBA order")
    ap.add_argument("--parts", default="a,b")
    args = ap.parse_args(argv)
    from bench.families import checkpoint
    from tqdm import tqdm
    path = checkpoint("llama", args.models)
    parts = args.parts.split(",")

    async def go(cluster):
        out: dict = {}
        bar = tqdm(total=1 + (args.rate is None) + 3 * ("a" in parts) + 2 * args.repeats * ("b" in parts),
                   desc="prfaas_live", unit="run")
        await warm(cluster, args)
        bar.update()
        if args.rate is None:
            await settle(cluster)
            out["calibration"] = await calibrate(cluster, args)
            args.rate = out["calibration"]["rate"]
            bar.update()
        if "a" in parts:
            out["policies"] = {}
            for k, name in enumerate(("never", "always", "selective")):
                await settle(cluster)
                cluster.policy = policy(args, name)
                recs = await workload(cluster, args, 100 + k, args.duration)
                out["policies"][name] = summary(recs, args.duration, args.slo_ttft)
                bar.update()
        if "b" in parts:
            out["bandwidth_drop"] = {"selective": [], "fixed": []}
            # ABBA: fixed, adaptive, adaptive, fixed, ...: neither goes first every time
            order = [n for r in range(args.repeats) for n in (("fixed", "selective") if r % 2 == 0
                                                              else ("selective", "fixed"))]
            for k, name in enumerate(order):
                await cluster.set_link("prfaas", "pd", args.bandwidth_gbps)
                waited = await settle(cluster)
                cluster.policy = policy(args, name)
                threshold: list = []
                state = {"dropped": False}

                def tick(now, threshold=threshold, state=state):
                    if not state["dropped"] and now >= args.duration / 2:
                        state["dropped"] = True
                        asyncio.ensure_future(cluster.set_link("prfaas", "pd", args.bandwidth_gbps / 2))
                    if not threshold or now - threshold[-1][0] >= 0.5:
                        threshold.append((now, cluster.policy.state().get("threshold_tokens")))
                # the same arrivals, lengths and turns in every run; fresh token ids
                recs = await workload(cluster, args, 200, args.duration, tick, salt=k)
                half = args.duration / 2
                out["bandwidth_drop"][name].append({
                    "settled_s": waited,
                    "before": summary([r for r in recs if r["t"] < half], half, args.slo_ttft),
                    "after": summary([r for r in recs if r["t"] >= half], half, args.slo_ttft),
                    "windows": windows(recs, args.window, args.duration), "threshold": threshold})
                bar.update()
            await cluster.set_link("prfaas", "pd", args.bandwidth_gbps)
        bar.close()
        return out

    res = run(config(args, path), go)
    result = {"benchmark": "prfaas_live", "host": platform.node(), "cpus": os.cpu_count(),
              "measured": "one run, same worker processes: the policies side by side on the same arrival process "
                          "(fresh prompts per run), then a link bandwidth drop halfway with the adaptive and the "
                          "fixed threshold", "args": vars(args), **res}
    pol = res.get("policies")
    if pol:
        best = max(pol, key=lambda k: pol[k]["goodput_rps"])
        result["verdict"] = {"best_goodput": best, **{f"{k}_goodput_over_never": pol[k]["goodput_rps"] /
                                                      max(pol["never"]["goodput_rps"], 1e-9) for k in pol
                                                      if k != "never"}}
    drop = res.get("bandwidth_drop")
    if drop:
        result["verdict_drop"] = {k: {f"{m}_p90_{h}_s": [run[h][f"{m}_p90_s"] for run in v]
                                      for m in ("ttft", "tt2t") for h in ("before", "after")}
                                  for k, v in drop.items()}
    from bench.stamp import write
    write(args.json, result, indent=1)
    if args.png and drop:
        plot(result, args.png)
    print(json.dumps({k: result[k] for k in ("verdict", "verdict_drop") if k in result}, indent=1))


def plot(result: dict, png: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    args, drop = result["args"], result["bandwidth_drop"]
    fig, (a, c, b) = plt.subplots(3, 1, figsize=(8, 8), sharex=True)
    colors = {"selective": "tab:blue", "fixed": "tab:orange"}
    for name, runs in drop.items():
        for i, v in enumerate(runs):
            label = f"{'adaptive' if name == 'selective' else 'fixed'} threshold" if i == 0 else None
            style = dict(color=colors[name], alpha=1.0 if i == 0 else 0.5, ls="-" if i == 0 else ":")
            for ax, key in ((a, "ttft_p90_s"), (c, "tt2t_p90_s")):
                w = [x for x in v["windows"] if x[key] is not None]
                ax.plot([x["t"] + args["window"] / 2 for x in w], [x[key] for x in w], marker="o", label=label,
                        **style)
            b.step([t for t, _ in v["threshold"]], [x for _, x in v["threshold"]], where="post", label=label,
                   **style)
    for ax in (a, c, b):
        ax.axvline(args["duration"] / 2, color="grey", ls="--")
        ax.legend()
    a.set_ylabel("p90 TTFT (s)")
    c.set_ylabel("p90 time to 2nd token (s)")
    a.set_title(f"link {args['bandwidth_gbps']} -> {args['bandwidth_gbps'] / 2} Gbit/s at the dashed line")
    b.set_ylabel("effective threshold (tokens)")
    b.set_xlabel("seconds into the run")
    fig.tight_layout()
    fig.savefig(png, dpi=100)


if __name__ == "__main__":
    main()
