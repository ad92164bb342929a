"""Serving benchmark: Poisson arrivals, truncated log-normal prompt lengths, jaxserve's engine vs transformers.

Workload (the PrfaaS document's shape, scaled to a small model on a CPU): prompt lengths ~ LogNormal(mu, 1.0)
truncated to [128, 128K] with mu = 9.90, all divided by `--scale` (default 128: median ~156 tokens, range
[4, 1024]); output length fixed at 1024 / `--out-scale` tokens (default 32); arrivals Poisson at `--rate`
requests/s. Random token ids, greedy decoding, EOS ignored so every request produces exactly its output.

jaxserve: the LLMEngine (paged cache, continuous batching, chunked prefill) fed in real time by the arrival
schedule; its warm-up compiles every program shape first, then two untimed passes over same-shaped workloads
(other tokens, so no prefix hits; shuffled gaps) run (the JSON says how many programs still compiled during
the timed pass). Reports throughput, TTFT and TPOT percentiles.
Baseline (the peer, same run, same checkpoint): transformers `generate` serving the same requests one at a
time in arrival order (a request starts when it has arrived and the previous one is done). The headline is
the ratio of output tokens/s. CPU timings: compare ratios, not absolute numbers.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import time

import numpy as np


def workload(n: int, rate: float, scale: float, out_scale: float, vocab: int, seed: int):
    rng = np.random.default_rng(seed)
    mu, sigma, lo, hi = 9.90 - math.log(scale), 1.0, 128 / scale, 131072 / scale
    lens = []
    while len(lens) < n:
        x = rng.lognormal(mu, sigma)
        if lo <= x <= hi:
            lens.append(max(4, int(round(x))))
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n))
    out_len = max(1, int(round(1024 / out_scale)))
    prompts = [rng.integers(3, vocab, size=L).tolist() for L in lens]
    return [{"arrival": float(a), "prompt": p, "max_tokens": out_len} for a, p in zip(arrivals, prompts)]


def pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def run_jaxserve(llm, reqs) -> dict:
    from jaxserve.sampling import SamplingParams
    eng = llm.engine
    t0 = time.monotonic()
    pending = list(enumerate(reqs))
    seqs = []
    while pending or eng.has_work:
        now = time.monotonic() - t0
        while pending and pending[0][1]["arrival"] <= now:
            i, r = pending.pop(0)
            s = eng.add_request(f"bench-{id(reqs)}-{i}", r["prompt"],
                                SamplingParams(max_tokens=r["max_tokens"], temperature=0, ignore_eos=True))[0]
            s.arrival = t0 + r["arrival"]
            seqs.append(s)
        if eng.has_work:
            eng.step()
        elif pending:
            time.sleep(max(0.0, pending[0][1]["arrival"] - (time.monotonic() - t0)))  # idle until the next arrival
    span = max(s.finish_time for s in seqs) - t0
    for s in seqs:
        eng.release(s)
    ttft = [s.first_token_time - s.arrival for s in seqs]
    tpot = [(s.finish_time - s.first_token_time) / (len(s.output) - 1) for s in seqs if len(s.output) > 1]
    toks = sum(len(s.output) for s in seqs)
    return {"output_tokens": toks, "makespan_s": span, "output_tokens_per_s": toks / span,
            "requests_per_s": len(seqs) / span,
            "ttft_s": {"p50": pct(ttft, 50), "p90": pct(ttft, 90), "p99": pct(ttft, 99)},
            "tpot_s": {"p50": pct(tpot, 50), "p90": pct(tpot, 90), "p99": pct(tpot, 99)},
            "compiled_programs": len(eng.runner.programs), "preemptions": eng.scheduler.num_preemptions}


def run_transformers(path: str, reqs) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():  # warm-up
        model.generate(torch.tensor([reqs[0]["prompt"]]), max_new_tokens=2, min_new_tokens=2, do_sample=False)
    t0 = time.monotonic()
    clock, toks, e2e = 0.0, 0, []
    for r in reqs:
        start = max(clock, r["arrival"])
        s = time.monotonic()
        with torch.no_grad():
            out = model.generate(torch.tensor([r["prompt"]]), max_new_tokens=r["max_tokens"],
                                 min_new_tokens=r["max_tokens"], do_sample=False)
        clock = start + (time.monotonic() - s)
        toks += out.shape[1] - len(r["prompt"])
        e2e.append(clock - r["arrival"])
    return {"output_tokens": toks, "makespan_s": clock, "output_tokens_per_s": toks / clock,
            "e2e_s": {"p50": pct(e2e, 50), "p90": pct(e2e, 90), "p99": pct(e2e, 99)},
            "measured_s": time.monotonic() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="bundled", help="checkpoint directory or 'bundled'")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--rate", type=float, default=8.0)
    ap.add_argument("--scale", type=float, default=128.0)
    ap.add_argument("--out-scale", type=float, default=32.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true")
    args = ap.parse_args(argv)
    from jaxserve import LLM
    from jaxserve.bundled import resolve
    from jaxserve.engine.llm_engine import EngineConfig
    path = resolve(args.model)
    llm = LLM(path, engine=EngineConfig(block_size=16, num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=512,
                                        chunk_size=256, max_prefill_seqs=4, max_model_len=2048))
    V = llm.config.vocab_size
    reqs = workload(args.requests, args.rate, args.scale, args.out_scale, V, args.seed)
    llm.engine.runner.warmup()  # every program shape the engine can run (engine/runner.py)
    print("untimed passes over same-shaped workloads ...", flush=True)
    for k in (1, 2):  # same lengths and rate, other tokens (no prefix hits), other arrival draws
        warm = workload(args.requests, args.rate, args.scale, args.out_scale, V, args.seed)
        rng = np.random.default_rng(args.seed + k)
        gaps = rng.permutation(np.diff([0.0] + [r["arrival"] for r in warm]))
        for r, t in zip(warm, np.cumsum(gaps)):
            r["prompt"], r["arrival"] = rng.integers(3, V, size=len(r["prompt"])).tolist(), float(t)
        run_jaxserve(llm, warm)
    compiled = len(llm.engine.runner.programs)
    print("jaxserve: timed pass ...", flush=True)
    ours = run_jaxserve(llm, reqs)
    result = {"benchmark": "serving", "device": f"cpu ({platform.processor() or platform.machine()}, "
              f"{os.cpu_count()} cores)", "model": path,
              "workload": {"requests": args.requests, "rate_per_s": args.rate,
                           "prompt_len": {"mean": float(np.mean([len(r['prompt']) for r in reqs])),
                                          "min": min(len(r["prompt"]) for r in reqs),
                                          "max": max(len(r["prompt"]) for r in reqs)},
                           "output_len": reqs[0]["max_tokens"], "scale": args.scale},
              "jaxserve": ours, "programs_compiled_during_timed_pass": len(llm.engine.runner.programs) - compiled}
    if not args.no_baseline:
        print("transformers generate: timed pass ...", flush=True)
        base = run_transformers(path, reqs)
        result["transformers"] = base
        result["ratio_output_tokens_per_s"] = ours["output_tokens_per_s"] / base["output_tokens_per_s"]
    from bench.stamp import write
    write(args.json, result, indent=2)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
