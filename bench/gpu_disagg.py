"""Disaggregated serving against colocated serving on one GPU: `jaxserve serve` of a prefill and a decode worker
sharing the device (each with its share of its memory, instance.device_memory) against one colocated instance of
the same model and engine settings, over HTTP, greedy; and the PrfaaS deployment (configs/prfaas.yaml's shape): a
PrfaaS cluster's prefill instance joined to a PD cluster's prefill and decode instances by an emulated link
(`--link-gbps`), the policy sending prompts of over `--threshold` uncached tokens across it, all three workers on
the GPU (KV across the link leaves the device once, into host memory, for the TCP backend).

- answers: a set of prompts (8 to 200 tokens, so some cross the PrfaaS link) decoded each way, their tokens
  compared with colocated's (where one differs: the first token that does, and colocated's log-probability gap
  between its two likeliest tokens there: a near tie, which bf16 programs of another shape may break otherwise);
- per prompt length (256, 2048 and 4000 tokens by default): TTFT and TPOT of streamed requests, the median over
  `--reps` fresh prompts (no prefix hits), each deployment, and its ratios to colocated; the KV bytes each
  request moved, its backend (cuda_ipc, device, shm or tcp; `--cuda-ipc off` measures JAX's transfer server in
  CUDA IPC's place), the instance that prefilled it, the router's time to place it (`placed_s`: a disaggregated
  request's decode reservation included, which its prefill does not wait for: router.early_prefill; none for
  colocated, one in-process engine), the TTFT of the engine that
  answered from the request's arrival there (`engine_ttft_s`: colocated's own; a disaggregated request's decode
  instance, from its reservation to the first token it recorded once the KV was in) and the prefill engine's own
  (`prefill_ttft_s`: its arrival there to its first token), the wait from the first token to the second
  (`second_s`: disaggregated, the first token leaves the prefill instance at once, so the KV's transfer and import
  show here; a prompt longer than a chunk sends its earlier chunks' KV while the later ones compute), and each
  instance's engine steps over the timed
  requests (their kinds, count, mean ms and phases: the workers' step timers as the router's /health
  reports them), which say where a deployment's TTFT goes. The backends' own rates beside the device copy and
  raw sockets are bench.transfer's (gpu_check runs both);
- under load (`--load N`, 16 by default, the engines' `max_num_seqs`): N streamed requests of `--load-prompt`
  tokens sent at once, each decoding `--load-new`, after one untimed round of the same shape (the decode batch's
  programs): TPOT median and 90th percentile over the requests, TTFT median, output tokens per second over the
  round, and each instance's engine steps: whether a disaggregated decode worker keeps colocated's step under a
  full batch (its per-request messages to the router are on its host beside the engine's loop);
- with decode busy (`--busy N`): `--reps` prompts of the first length timed one at a time while N requests keep
  decoding: the TTFT, the placement and the prefilling engine's TTFT (a decode reservation is made by decode's
  engine thread, after its current step);
- the ready time of each deployment (launch to /health 200, the compilation cache shared, so a later start
  finds the programs an earlier one built).
A deployment that fails is recorded with its error and the next one still runs; the JSON is written after each.
`--deployments colocated,disaggregated,sequential` adds the router's early prefill's A/B: `sequential` is the
disaggregated deployment with its Prefill call after the decode reservation (router.early_prefill off).

The model is a random bf16 checkpoint of SmolLM2-135M's shape (`--shape small`, bench/gpu_decode.py writes it on
the device; the GGUF package is larger than what travels to a lent GPU) or a checkpoint directory (`--model`).
Warm-up is off: one untimed request per prompt length compiles what the timed ones run, so the few minutes of a
lent GPU go to serving. Each deployment is its own `jaxserve serve` process; the result is one JSON, stamped.

    python -m bench.gpu_disagg --json bench/results/gpu_disagg_h200.json     # on the GPU (bench/gpu_check.sh)
    python -m bench.gpu_disagg --model DIR --lengths 24,40 --new 4 --reps 1  # anywhere, a tiny checkpoint
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import yaml

from bench.startup import launch, stop
from jaxserve.router.launcher import free_ports


DEPLOYMENTS = ("colocated", "disaggregated", "sequential", "prfaas")
DEFAULT = ("colocated", "disaggregated", "prfaas")  # sequential: the router's early prefill's A/B, on request
HEARTBEAT_WAIT_S = 1.5  # past a heartbeat (server.heartbeat_s, 1 s): the router's copy of the workers' step times


def configs(model: str, max_len: int, cache: str, cpus: bool = False, cuda_ipc: bool = True, link_gbps: float = 25.0,
            threshold: int = 128, max_num_seqs: int = 16) -> dict[str, dict]:
    """{deployment: config mapping}, the same model and engine section in each; the workers of one deployment
    share device 0 (the default split of its memory) and move KV inside a cluster through CUDA IPC (or, cuda_ipc
    False, JAX's transfer server); the PrfaaS cluster's over a link of `link_gbps`; `sequential` is
    `disaggregated` with the router's Prefill call after the decode reservation (router.early_prefill off)."""
    engine = {"block_size": 16, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": 2048, "max_model_len": max_len,
              "prefix_caching": False, "warmup": False, "compilation_cache": cache}
    base = {"model": {"path": model, "name": "m", "dtype": "bfloat16"},
            "engine": engine, "server": {"host": "127.0.0.1", "max_tokens_limit": 4096}}
    transfer = {"token": "gpu-disagg", "layers_per_group": 4, "stream_min_tokens": 512, "cuda_ipc": cuda_ipc}

    def inst(name: str, role: str, core: int) -> dict:
        return {"name": name, "role": role, **({"cpus": [core]} if cpus else {})}
    pd = [inst("p0", "prefill", 0), inst("d0", "decode", 1)]
    disaggregated = {**base, "clusters": [{"name": "c", "instances": pd}], "transfer": transfer}
    return {"colocated": {**base, "clusters": [{"name": "c", "instances": [{"name": "solo", "role": "both"}]}]},
            "disaggregated": disaggregated, "sequential": {**disaggregated, "router": {"early_prefill": False}},
            "prfaas": {**base, "transfer": transfer,
                       "clusters": [{"name": "prfaas", "kind": "prfaas", "instances": [inst("x0", "prefill", 2)]},
                                    {"name": "pd", "kind": "pd", "instances": pd}],
                       "links": [{"src": "prfaas", "dst": "pd", "bandwidth_gbps": link_gbps, "latency_ms": 1,
                                  "connections": 4}],
                       "policy": {"name": "prfaas", "threshold_tokens": threshold, "adaptive": False}}}


def complete(port: int, prompt: list[int], new: int, top: int = 0) -> dict:
    """One streamed greedy completion -> {"tokens", "ttft_s", "second_s", "tpot_s", "jaxserve", "gaps"}: second_s
    the wait from the first token to the second (disaggregated: where the KV's transfer shows, the first token
    coming from the prefill instance at once); gaps, with top >= 2, each token's log-probability gap between its
    two likeliest tokens (None where they decode alike)."""
    body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": new, "temperature": 0, "ignore_eos": True,
                       "stream": True, "logprobs": top}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    stamps, tokens, meta, gaps = [], [], None, []
    with urllib.request.urlopen(req, timeout=600) as r:
        for line in r:
            line = line.decode().strip()
            if not line.startswith("data: {"):
                continue
            ev = json.loads(line[6:])
            lp = ev["choices"][0].get("logprobs") or {}
            got = lp.get("tokens") or []
            if got:
                stamps += [time.perf_counter() - t0] * len(got)  # each token when its chunk came
                tokens += got
                gaps += [top_gap(t) for t in lp.get("top_logprobs") or [{}] * len(got)]
            meta = ev.get("jaxserve", meta)
    if not stamps:
        raise RuntimeError(f"no tokens streamed for a prompt of {len(prompt)} tokens")
    tpot = (stamps[-1] - stamps[0]) / (len(tokens) - 1) if len(tokens) > 1 else None
    return {"tokens": tokens, "ttft_s": stamps[0], "second_s": stamps[1] - stamps[0] if len(stamps) > 1 else None,
            "tpot_s": tpot, "jaxserve": meta, "gaps": gaps}


def top_gap(top: dict) -> float | None:
    """A token's {piece: log-probability} of its likeliest tokens -> the gap between the first two (None: fewer
    than two pieces, as where two tokens decode to one piece)."""
    lps = sorted(top.values(), reverse=True)
    return round(lps[0] - lps[1], 5) if len(lps) > 1 else None


def health_steps(port: int) -> dict:
    """{instance: StepTimer.totals as of its last heartbeat} from the router's /health (a server of one
    in-process engine: {"local": its totals})."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=30) as r:
        h = json.load(r)
    if "instances" not in h:
        return {"local": h.get("steps") or {}}
    return {k: v.get("steps") or {} for k, v in h["instances"].items()}


def step_window(before: dict, after: dict) -> dict:
    """{instance: {kind: {"count", "mean_ms", "phases_ms"}}}: each instance's engine steps between two readings
    of health_steps (the kinds with steps in the window)."""
    out = {}
    for name, kinds in after.items():
        for kind, a in kinds.items():
            b = before.get(name, {}).get(kind, {"count": 0, "ms": 0.0, "phases_ms": {}})
            n = a["count"] - b["count"]
            if n > 0:
                out.setdefault(name, {})[kind] = {
                    "count": n, "mean_ms": round((a["ms"] - b["ms"]) / n, 3),
                    "phases_ms": {p: round((v - b["phases_ms"].get(p, 0.0)) / n, 3) for p, v in a["phases_ms"].items()}}
    return out


def under_load(port: int, prompts: list[list[int]], new: int) -> dict:
    """`prompts` streamed at once, each decoding `new` tokens -> TPOT median and 90th percentile over the requests,
    TTFT median, output tokens per second from the first request sent to the last token received."""
    from concurrent.futures import ThreadPoolExecutor
    t0 = time.perf_counter()
    with ThreadPoolExecutor(len(prompts)) as pool:
        runs = list(pool.map(lambda p: complete(port, p, new), prompts))
    wall = time.perf_counter() - t0
    tpots = sorted(r["tpot_s"] for r in runs if r["tpot_s"] is not None)
    return {"requests": len(prompts), "tpot_s": statistics.median(tpots),
            "tpot_p90_s": tpots[min(len(tpots) - 1, int(0.9 * len(tpots)))],
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "tokens_per_s": sum(len(r["tokens"]) for r in runs) / wall}


def while_busy(port: int, probes: list[list[int]], background: list[list[int]], busy_new: int) -> dict:
    """TTFT of `probes` sent one at a time while the `background` requests decode (each streamed for `busy_new`
    tokens and sent again as it ends) -> medians of the probes' TTFT, the router's placement time and the
    prefilling engine's TTFT (where a reservation that waits for decode's step shows)."""
    import threading
    stopping = threading.Event()

    def loop(p):
        while not stopping.is_set():
            complete(port, p, busy_new)
    threads = [threading.Thread(target=loop, args=(p,), daemon=True) for p in background]
    for t in threads:
        t.start()
    try:
        time.sleep(1.0)  # all of them decoding
        for p in probes[:3]:  # untimed: what a probe beside the batch compiles
            complete(port, p, 2)
        runs = []
        for p in probes[3:]:
            runs.append(complete(port, p, 2))
            time.sleep(0.05)
    finally:
        stopping.set()
        for t in threads:
            t.join(600)
    metas = [r["jaxserve"] or {} for r in runs]
    return {"requests": len(background), "prompt": len(probes[0]), "probes": len(runs),
            "ttft_s": statistics.median(r["ttft_s"] for r in runs),
            "placed_s": _median(m.get("placed_s") for m in metas),
            "prefill_ttft_s": _median(m.get("prefill_ttft_s") for m in metas)}


def serve_and_measure(config: dict, work: str, name: str, answers: list[list[int]], lengths: list[int],
                      reps: int, new: int, vocab: int, seed: int, timeout_s: float,
                      load: tuple[int, int, int] = (0, 0, 0), busy: tuple[int, int] = (0, 0)) -> dict:
    """One deployment served and measured; load = (requests at once, prompt tokens, tokens each decodes); busy =
    (requests decoding, tokens each) behind `reps` probes of the first length (while_busy)."""
    import numpy as np
    path = os.path.join(work, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(config, f)
    port = free_ports("127.0.0.1")
    proc, ready = launch(path, port, timeout_s)
    try:
        got = [complete(port, p, new, top=2) for p in answers]  # the top two: how near a tie a difference is
        out = {"ready_s": ready, "answers": [g["tokens"] for g in got], "gaps": [g["gaps"] for g in got],
               "lengths": {}}
        rng = np.random.default_rng(seed)
        for n in lengths:
            complete(port, rng.integers(3, vocab, n).tolist(), new)  # compiles what this length runs
            time.sleep(HEARTBEAT_WAIT_S)  # the workers' step times as of after it
            before = health_steps(port)
            runs = [complete(port, rng.integers(3, vocab, n).tolist(), new) for _ in range(reps)]
            time.sleep(HEARTBEAT_WAIT_S)
            steps = step_window(before, health_steps(port))
            metas = [r["jaxserve"] or {} for r in runs]
            out["lengths"][str(n)] = {
                "ttft_s": statistics.median(r["ttft_s"] for r in runs),
                "tpot_s": statistics.median(r["tpot_s"] for r in runs if r["tpot_s"] is not None),
                "second_s": _median(r["second_s"] for r in runs),
                "kv_bytes": statistics.median(m.get("kv_bytes_transferred") or 0 for m in metas),
                "kv_backend": sorted({m.get("kv_backend") for m in metas if m.get("kv_backend")}),
                "prefill_instance": sorted({m.get("prefill_instance") for m in metas if m.get("prefill_instance")}),
                "placed_s": _median(m.get("placed_s") for m in metas),
                "engine_ttft_s": _median(m.get("ttft_s") for m in metas),
                "prefill_ttft_s": _median(m.get("prefill_ttft_s") for m in metas),
                "steps": steps}
            print(f"{name}: {n} tokens: {out['lengths'][str(n)]}", flush=True)
        if load[0]:
            def batch():
                return [rng.integers(3, vocab, load[1]).tolist() for _ in range(load[0])]
            under_load(port, batch(), load[2])  # compiles the decode batch's programs
            time.sleep(HEARTBEAT_WAIT_S)
            before = health_steps(port)
            out["load"] = under_load(port, batch(), load[2])
            time.sleep(HEARTBEAT_WAIT_S)
            out["load"]["steps"] = step_window(before, health_steps(port))
            print(f"{name}: under load: {out['load']}", flush=True)
        if busy[0]:
            out["busy"] = while_busy(port, [rng.integers(3, vocab, lengths[0]).tolist() for _ in range(reps + 3)],
                                     [rng.integers(3, vocab, 32).tolist() for _ in range(busy[0])], busy[1])
            print(f"{name}: with {busy[0]} requests decoding: {out['busy']}", flush=True)
    finally:
        stop(proc)
    return out


def _median(xs) -> float | None:
    """The median of the values that are there (None: none are)."""
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def main(argv=None) -> int:
    from bench.stamp import arguments, write
    ap = arguments(__doc__)
    ap.add_argument("--model", help="a checkpoint directory (default: a random one of --shape)")
    ap.add_argument("--shape", default="small", help="bench/gpu_decode.py's shapes")
    ap.add_argument("--lengths", default="256,2048,4000")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--new", type=int, default=32, help="tokens decoded per request")
    ap.add_argument("--answers", type=int, default=8, help="prompts whose answers are compared")
    ap.add_argument("--timeout-s", type=float, default=300, help="per deployment's start")
    ap.add_argument("--pin", action="store_true", help="pin the workers to cores 0, 1 (and the PrfaaS one to 2)")
    ap.add_argument("--cuda-ipc", choices=("on", "off"), default="on",
                    help="disaggregated KV through CUDA IPC (on) or JAX's transfer server (off), on a GPU")
    ap.add_argument("--deployments", default=",".join(DEFAULT), help="colocated first, then any of "
                    "disaggregated, sequential (disaggregated without the router's early prefill), prfaas")
    ap.add_argument("--link-gbps", type=float, default=25.0, help="the PrfaaS -> PD link's emulated bandwidth")
    ap.add_argument("--threshold", type=int, default=128, help="uncached prompt tokens over which PrfaaS prefills")
    ap.add_argument("--load", type=int, default=16, help="requests sent at once for TPOT under load (0: none); "
                    "the engines' max_num_seqs when over 16")
    ap.add_argument("--load-prompt", type=int, default=256, help="prompt tokens of each request under load")
    ap.add_argument("--load-new", type=int, default=128, help="tokens each request under load decodes")
    ap.add_argument("--busy", type=int, default=0, help="requests kept decoding (32-token prompts, --busy-new tokens "
                    "each, sent again as they end) while --reps prompts of the first length are timed one at a time "
                    "(0: not measured)")
    ap.add_argument("--busy-new", type=int, default=300, help="tokens each of the --busy requests decodes")
    a = ap.parse_args(argv)
    names = a.deployments.split(",")
    if names[0] != "colocated" or not set(names) <= set(DEPLOYMENTS) or len(set(names)) != len(names):
        ap.error(f"--deployments: colocated first, then any of {DEPLOYMENTS[1:]}, each once; got {a.deployments!r}")
    if a.busy >= max(16, a.load):  # a timed prompt beside a full batch would wait for a slot, not a reservation
        ap.error(f"--busy {a.busy}: fewer than the engines' max_num_seqs ({max(16, a.load)}), a slot left for the "
                 "timed prompt")
    import numpy as np

    from jaxserve.models.config import load_config
    lengths = [int(x) for x in a.lengths.split(",")]
    work = tempfile.mkdtemp(prefix="gpu_disagg_")
    path = a.model
    if path is None:  # written by a process of its own, which leaves the device when done
        path = os.path.join(work, "checkpoint")
        subprocess.run([sys.executable, "-m", "bench.gpu_decode", "--part", "make", "--dir", path, "--work", work,
                        "--shape", a.shape, "--json", os.path.join(work, "unused.json")], check=True)
    mc = load_config(path)
    max_len = min(getattr(mc, "max_position_embeddings", 4096) or 4096, 8192)
    lengths = [n for n in lengths if n + a.new < max_len]
    rng = np.random.default_rng(0)
    answers = [rng.integers(3, mc.vocab_size, int(rng.integers(8, 200))).tolist() for _ in range(a.answers)]
    cfgs = configs(path, max_len, os.path.join(work, "xla"), a.pin, a.cuda_ipc == "on", a.link_gbps, a.threshold,
                   max(16, a.load))
    load = (a.load, min(a.load_prompt, max_len - a.load_new - 1), a.load_new)
    result = {"model": a.model or f"random, {a.shape} shape (bench/gpu_decode.py)", "max_model_len": max_len,
              "lengths": lengths, "reps": a.reps, "new": a.new, "cuda_ipc": a.cuda_ipc, "link_gbps": a.link_gbps,
              "threshold_tokens": a.threshold, "answers": len(answers), "load": dict(zip(("requests", "prompt", "new"),
                                                                                           load)), "compared": {}}
    tokens, gaps, failed = {}, {}, False
    for name in names:
        try:
            out = serve_and_measure(cfgs[name], work, name, answers, lengths, a.reps, a.new, mc.vocab_size, 1,
                                    a.timeout_s, load, (a.busy, a.busy_new))
        except Exception as e:  # noqa: BLE001 - recorded; the other deployments still run
            result[name], failed = {"error": f"{type(e).__name__}: {e}"}, True
            print(f"{name} failed: {e}", flush=True)
        else:
            tokens[name], gaps[name], result[name] = out.pop("answers"), out.pop("gaps", None), out
            if name != "colocated" and "colocated" in tokens:
                result["compared"][name] = compare(result["colocated"], out, tokens["colocated"], tokens[name],
                                                   gaps["colocated"])
        write(a.json, result)  # kept if the next deployment does not finish in the time a run has
    print(json.dumps(result["compared"]))
    return 1 if failed else 0


def compare(colocated: dict, other: dict, base: list, answers: list, gaps: list | None = None) -> dict:
    """A deployment against colocated: answers equal, where each other one first differs (with colocated's gap
    between its two likeliest tokens there, from `gaps`, per answer and token), TTFT and TPOT ratios per prompt
    length, and under load (TPOT median and 90th percentile, output tokens per second) where both were loaded."""
    out = {"answers_equal": sum(x == y for x, y in zip(base, answers)),
           "differ": [first_difference(i, x, y, gaps[i] if gaps else None)
                      for i, (x, y) in enumerate(zip(base, answers)) if x != y],
           "ratios": {n: {"ttft": d["ttft_s"] / colocated["lengths"][n]["ttft_s"],
                          "tpot": d["tpot_s"] / colocated["lengths"][n]["tpot_s"]}
                      for n, d in other["lengths"].items()}}
    if "load" in colocated and "load" in other:
        out["load"] = {k: other["load"][k] / colocated["load"][k] for k in ("tpot_s", "tpot_p90_s", "tokens_per_s")}
    if "busy" in colocated and "busy" in other:
        out["busy"] = {"ttft_s": other["busy"]["ttft_s"] / colocated["busy"]["ttft_s"]}
    return out


def first_difference(i: int, x: list[int], y: list[int], gaps: list | None = None) -> list:
    """[prompt i, the first token index where answers x and y differ, x's token there, y's] (None: one ended), and
    where x's per-token gaps are given, x's gap between its two likeliest tokens there (None: not known)."""
    t = next((t for t, (u, v) in enumerate(zip(x, y)) if u != v), min(len(x), len(y)))
    out = [i, t, x[t] if t < len(x) else None, y[t] if t < len(y) else None]
    return out if gaps is None else out + [gaps[t] if t < len(gaps) else None]


if __name__ == "__main__":
    raise SystemExit(main())
