"""Prefill/decode interference: long prefills arriving while many requests decode, colocated vs disaggregated
on the same two cores, through the router and real worker processes.

colocated: one `both` instance on cores 0 and 1 (chunked prefill shares its steps with the decodes);
disaggregated: a prefill worker on core 0 and a decode worker on core 1, KV over TCP.
Workload (same in both, random tokens, greedy, EOS ignored): `--decodes` requests with short prompts decode
`--decode-tokens` tokens each; once all are decoding, `--prefills` requests with `--prefill-len`-token prompts
arrive every `--gap` seconds (1 output token each). Every instance warms up (compiles every program it can
run) before it serves, as `jaxserve serve` does, and a first untimed pass of the same shape runs before the
timed one: a pass alone does not reach every decode batch bucket, and a program compiled inside the timed pass
would be measured as a stall. Measured at the router: TPOT samples = the time between consecutive tokens of
the decoding requests (every gap of every request); reported p50 / p90 / p99 and per-request mean TPOT, and the
prefills' TTFT.
Headline: p99 TPOT colocated / disaggregated (goal >= 2). CPU timings: compare the ratio.

`python -m bench.interference --json bench/results/interference.json`
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import platform
import time

import numpy as np
from tqdm import tqdm

SETUPS = {
    "colocated": [{"name": "c0", "role": "both", "cpus": [0, 1]}],
    "disaggregated": [{"name": "p0", "role": "prefill", "cpus": [0]}, {"name": "d0", "role": "decode", "cpus": [1]}],
}


def _pct(xs, q):
    return float(np.percentile(np.asarray(xs), q)) if xs else None


def run_setup(path: str, instances: list[dict], args, vocab: int) -> dict:
    from bench import clusters
    from jaxserve.sampling import SamplingParams
    chunk = args.chunk
    max_len = max(args.prefill_len, args.decode_prompt + args.decode_tokens) + 64
    config = {"model": {"path": path},
              "engine": dict(block_size=16, num_blocks=(args.decodes + args.prefills + 2) * (max_len // 16 + 2),
                             max_num_seqs=args.decodes + 4, max_num_batched_tokens=chunk + args.decodes + 4,
                             chunk_size=chunk, max_prefill_seqs=2, max_model_len=max_len, prefix_caching=False,
                             num_snapshots=0, warmup=True),
              "clusters": [{"name": "b", "instances": instances}],
              "transfer": {"token": "bench", "connections": 4}, "router": {"ready_timeout_s": 600}}
    dec = SamplingParams(max_tokens=args.decode_tokens, temperature=0.0, ignore_eos=True)
    pre = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)

    async def workload(cluster, rng, tag):
        from bench.clusters import finish
        gaps: list[float] = []
        per_request: list[float] = []
        started = asyncio.Event()
        first_tokens = [0]

        async def decode(i):
            last = [None]

            def on_update(u):
                now = time.monotonic()
                if u.token_ids:
                    if last[0] is None:
                        first_tokens[0] += 1
                        if first_tokens[0] == args.decodes:
                            started.set()
                    else:
                        gaps.append(now - last[0])
                    last[0] = now
            t0 = time.monotonic()
            u = await finish(await cluster.add(f"{tag}-d{i}", rng.integers(3, vocab, args.decode_prompt).tolist(),
                                               dec), on_update)
            per_request.append((time.monotonic() - t0 - u.ttft_s) / max(len(u.token_ids) - 1, 1))

        async def prefill(i):
            u = await finish(await cluster.add(f"{tag}-p{i}", rng.integers(3, vocab, args.prefill_len).tolist(),
                                               pre))
            return u.ttft_s

        decodes = [asyncio.ensure_future(decode(i)) for i in range(args.decodes)]
        await started.wait()
        prefills = []
        for i in range(args.prefills):
            prefills.append(asyncio.ensure_future(prefill(i)))
            await asyncio.sleep(args.gap)
        ttfts = await asyncio.gather(*prefills)
        await asyncio.gather(*decodes)
        return gaps, per_request, ttfts

    async def measure(cluster):
        rng = np.random.default_rng(0)
        await workload(cluster, rng, "warm")  # first use of every program (they compiled at warm-up)
        return await workload(cluster, rng, "timed")

    gaps, per_request, ttfts = clusters.run(config, measure, pinned=not args.unpinned)
    return {"instances": instances, "tpot_samples": len(gaps),
            "tpot_p50_s": _pct(gaps, 50), "tpot_p90_s": _pct(gaps, 90), "tpot_p99_s": _pct(gaps, 99),
            "tpot_max_s": max(gaps), "request_tpot_mean_s": float(np.mean(per_request)),
            "prefill_ttft_median_s": float(np.median(ttfts)), "prefill_ttft_s": ttfts}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--models", default="bench/.models", help="where bench-size checkpoints are built")
    ap.add_argument("--family", default="llama")
    ap.add_argument("--decodes", type=int, default=8)
    ap.add_argument("--decode-prompt", type=int, default=32)
    ap.add_argument("--decode-tokens", type=int, default=96)
    ap.add_argument("--prefills", type=int, default=4)
    ap.add_argument("--prefill-len", type=int, default=1024)
    ap.add_argument("--gap", type=float, default=0.4, help="seconds between prefill arrivals")
    ap.add_argument("--chunk", type=int, default=256, help="chunked-prefill chunk size")
    ap.add_argument("--unpinned", action="store_true", help="the workers on any core (default: as SETUPS pins them)")
    args = ap.parse_args(argv)
    from bench.families import checkpoint
    from jaxserve.models.config import load_config
    path = checkpoint(args.family, args.models)
    vocab = load_config(path).vocab_size
    res = {name: run_setup(path, inst, args, vocab) for name, inst in tqdm(SETUPS.items(), desc="setups",
                                                                           unit="setup")}
    ratio = res["colocated"]["tpot_p99_s"] / res["disaggregated"]["tpot_p99_s"]
    out = {"benchmark": "interference", "host": platform.node(), "cpus": mp.cpu_count(),
           "model": os.path.basename(path), "workload": {k: v for k, v in vars(args).items() if k != "json"},
           "setups": res, "p99_tpot_ratio": ratio, "goal": 2.0}
    from bench.stamp import write
    write(args.json, out, indent=1)
    for name, r in res.items():
        print(f"{name:14s} TPOT p50 {r['tpot_p50_s'] * 1e3:.1f} ms, p99 {r['tpot_p99_s'] * 1e3:.1f} ms, "
              f"prefill TTFT {r['prefill_ttft_median_s'] * 1e3:.0f} ms")
    print(f"p99 TPOT colocated / disaggregated: {ratio:.2f} (goal >= 2)")


if __name__ == "__main__":
    main()
