"""Soak: Poisson load at a fraction of measured capacity on a real disaggregated deployment, and what grows.

Deployment: `jaxserve serve` (router + HTTP server, one process) with a prefill worker (core 0) and a decode
worker (core 1) as its children, KV over TCP, the bench-size Llama (bench/families.py) or `--model`. With
`--cores`, the whole soak runs on those cores: the router and locust pinned to them, the prefill worker on the
first, the decode worker on the last (`--cores 0`: one core for everything, as `make test` runs it beside the
rest of the suite).
1. Capacity: closed-loop requests at `--calibrate-concurrency` for `--calibrate-s` seconds: completed
   requests per second (the same prompt-length and output-length distribution as the load).
2. Load: locust, headless (bench/soak_locust.py), Poisson arrivals at `--utilisation` x capacity for
   `--duration` seconds (it stops by itself), at most `--users` in flight; `--arrivals think` instead lets the
   load back off as latency grows (each user waits after each answer), as `make test`'s soak runs it beside the
   rest of the suite, whose share of the cores changes under it. The rate locust achieved is reported beside the
   rate asked for.
3. Every `--sample-s`, for the router process and each worker: resident memory (VmRSS), threads and open file
   descriptors (/proc); and the cluster's free and used cache blocks (/metrics, from the workers' heartbeats).
4. After the load: the time until no block is used, and free blocks against the baseline taken before it.
Reported: per process and series, the least-squares slope over the load after its first `--settle` fraction
(compiles and allocator warm-up), per hour, and the start / end values; requests, failures and latency
percentiles from locust; a PNG of the series over time (`--png`). JSON to `--json`.

    python -m bench.soak --json bench/results/soak.json --png bench/results/soak.png --duration 3600
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import random
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from bench.faults import stop_process, wait_ready
from jaxserve.router.launcher import free_ports

ENGINE = dict(block_size=16, num_blocks=512, max_num_seqs=16, max_num_batched_tokens=256, chunk_size=256,
              max_prefill_seqs=4, max_model_len=512, num_snapshots=16, prefix_caching=False, warmup=True)
SERIES = ("rss_mb", "threads", "fds")


def proc_sample(pid: int) -> dict | None:
    """rss_mb, threads, fds of a live process (None once it is gone)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            status = f.read()
        fds = len(os.listdir(f"/proc/{pid}/fd"))
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    rss = int(re.search(r"VmRSS:\s+(\d+) kB", status).group(1)) / 1024
    threads = int(re.search(r"Threads:\s+(\d+)", status).group(1))
    return {"rss_mb": rss, "threads": threads, "fds": fds}


# argv: cores, program, its arguments: the program runs with its CPU affinity set before it starts (a Python
# program's threads, JAX's among them, inherit it)
_PIN = ("import os, sys; os.sched_setaffinity(0, {int(c) for c in sys.argv[1].split(',')}); "
        "os.execv(sys.argv[2], sys.argv[2:])")


def pinned(cmd: list[str], cores: list[int] | None) -> list[str]:
    """cmd (its program an absolute path) run on `cores`; as it is where cores is None."""
    return cmd if cores is None else [sys.executable, "-c", _PIN, ",".join(map(str, cores)), *cmd]


def metrics(client) -> dict:
    """The cluster's gauges from /metrics (blocks_free, blocks_used, running, waiting)."""
    out = {}
    for line in client.get("/metrics").text.splitlines():
        m = re.match(r"jaxserve_(blocks_free|blocks_used|running|waiting) ([0-9.e+-]+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


class Deployment:
    """`jaxserve serve` on a free port with a 1P1D config; its processes by name. cores: where the router and its
    workers run (prefill on the first, decode on the last); None: prefill on core 0, decode on core 1, the router
    anywhere."""

    def __init__(self, model: str, tmp: str, name: str, cores: list[int] | None = None):
        self.port = free_ports("127.0.0.1")
        cfg = {"model": {"path": model, "name": name}, "engine": ENGINE,
               "transfer": {"token": "soak-" + os.urandom(8).hex(), "connections": 2, "shared_memory": False},
               "router": {"heartbeat_s": 0.5, "down_after_s": 5.0},
               "server": {"host": "127.0.0.1", "port": self.port, "max_waiting": 256, "max_tokens_limit": 256},
               "clusters": [{"name": "main", "instances": [
                   {"name": "prefill-0", "role": "prefill", "cpus": [cores[0] if cores else 0]},
                   {"name": "decode-0", "role": "decode", "cpus": [cores[-1] if cores else 1 % os.cpu_count()]}]}]}
        self.config = os.path.join(tmp, "soak.yaml")
        import yaml
        with open(self.config, "w") as f:
            yaml.safe_dump(cfg, f)
        self.log = open(os.path.join(tmp, "serve.log"), "w")
        self.proc = subprocess.Popen(pinned([sys.executable, "-m", "jaxserve.router.cli", "serve",
                                             "--config", self.config], cores), stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{self.port}"

    def wait_ready(self, timeout: float) -> None:
        import httpx
        wait_ready(self.proc, lambda: httpx.get(self.url + "/health", timeout=2).json().get("status") == "ok",
                   "jaxserve serve", self.log.name, timeout)

    def processes(self) -> dict[str, int]:
        """router and each worker (by its --instance) -> pid."""
        import psutil
        out = {"router": self.proc.pid}
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                argv = child.cmdline()
            except psutil.Error:
                continue
            if "--instance" in argv:
                out[argv[argv.index("--instance") + 1]] = child.pid
        return out

    def close(self) -> None:
        stop_process(self.proc)
        self.log.close()


def wait_idle(url: str, limit_s: float) -> float:
    """Seconds until /metrics shows no block used and no request running or waiting (the workers' stats come
    with their heartbeats); gives up after limit_s (the caller reads what is still held)."""
    import httpx
    t = time.monotonic()
    with httpx.Client(base_url=url, timeout=10) as client:
        while time.monotonic() - t < limit_s:
            c = metrics(client)
            if c.get("blocks_used") == 0 and c.get("running") == 0 and c.get("waiting") == 0:
                break
            time.sleep(0.25)
    return time.monotonic() - t


def request_body(rng: random.Random, args, vocab: int) -> dict:
    prompt = [rng.randrange(1, vocab) for _ in range(rng.randint(args.prompt_min, args.prompt_max))]
    return {"model": "soak", "prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}


def capacity(url: str, args, vocab: int) -> dict:
    """Closed loop at `calibrate_concurrency` for `calibrate_s`: completed requests per second."""
    import httpx
    done, errors = [], []
    stop = time.monotonic() + args.calibrate_s

    def worker(i):
        rng = random.Random(i)
        with httpx.Client(base_url=url, timeout=300) as c:
            while time.monotonic() < stop:
                r = c.post("/v1/completions", json=request_body(rng, args, vocab))
                (done if r.status_code == 200 else errors).append(time.monotonic())
    t0 = time.monotonic()
    ts = [threading.Thread(target=worker, args=(i,)) for i in range(args.calibrate_concurrency)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.monotonic() - t0
    if errors or not done:
        raise RuntimeError(f"calibration: {len(errors)} errors, {len(done)} requests")
    return {"requests": len(done), "wall_s": wall, "requests_per_s": len(done) / wall,
            "concurrency": args.calibrate_concurrency}


class Sampler(threading.Thread):
    """Samples the processes and the cluster's blocks every `every` seconds from start() to stop(); the first
    sample is taken at construction (the baseline), the last by stop() (after the load, once idle)."""

    def __init__(self, dep: Deployment, every: float):
        super().__init__(daemon=True)
        import httpx
        self.dep, self.every = dep, every
        self.pids = dep.processes()
        self.affinity = {n: sorted(os.sched_getaffinity(p)) for n, p in self.pids.items()}  # cores each may run on
        self.client = httpx.Client(base_url=dep.url, timeout=10)
        self.t0 = time.monotonic()
        self._halt = threading.Event()
        self.samples: list[dict] = [self.sample()]

    def sample(self) -> dict:
        s = {"t": time.monotonic() - self.t0, "procs": {n: proc_sample(p) for n, p in self.pids.items()}}
        try:
            s["cluster"] = metrics(self.client)
        except Exception as e:  # noqa: BLE001 - a failed scrape is recorded, the soak goes on
            s["cluster"] = {"error": str(e)}
        return s

    def run(self) -> None:
        while not self._halt.wait(self.every):
            self.samples.append(self.sample())

    def stop(self) -> None:
        self._halt.set()
        self.join(30)
        self.samples.append(self.sample())
        self.client.close()


def slope_per_hour(ts: list[float], ys: list[float]) -> float | None:
    if len(ts) < 3 or max(ts) - min(ts) <= 0:
        return None
    return float(np.polyfit(np.asarray(ts) / 3600.0, np.asarray(ys, float), 1)[0])


def analyse(samples: list[dict], load: tuple[float, float], settle: float) -> dict:
    """Per process and series: slope per hour over the settled load window, values at its start and end, max, and
    the value in the last sample (idle, after the load)."""
    a = load[0] + settle * (load[1] - load[0])
    window = [s for s in samples if a <= s["t"] <= load[1]]
    out = {}
    for name in samples[0]["procs"]:
        out[name] = {}
        for k in SERIES:
            pts = [(s["t"], s["procs"][name][k]) for s in window if s["procs"].get(name)]
            if not pts:
                continue
            ts, ys = zip(*pts)
            last = samples[-1]["procs"].get(name)
            out[name][k] = {"slope_per_hour": slope_per_hour(ts, ys), "start": ys[0], "end": ys[-1],
                            "max": max(ys), "after": last[k] if last else None, "window_s": ts[-1] - ts[0]}
    return out


def locust_stats(prefix: str) -> dict:
    with open(prefix + "_stats.csv") as f:
        rows = list(csv.DictReader(f))
    agg = next(r for r in rows if r["Name"] == "Aggregated")
    pct = {q: float(agg[f"{q}%"]) / 1e3 for q in ("50", "90", "99") if agg.get(f"{q}%") not in (None, "N/A")}
    errors = []  # what each failure was (locust's failures file: method, name, error, occurrences)
    if os.path.isfile(prefix + "_failures.csv"):
        with open(prefix + "_failures.csv") as f:
            errors = [{"error": r["Error"], "occurrences": int(r["Occurrences"])} for r in csv.DictReader(f)]
    return {"requests": int(agg["Request Count"]), "failures": int(agg["Failure Count"]), "errors": errors,
            "requests_per_s": float(agg["Requests/s"]), "latency_s": pct,
            "latency_mean_s": float(agg["Average Response Time"]) / 1e3}


def plot(samples: list[dict], load: tuple[float, float], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(4, 1, figsize=(9, 11), sharex=True)
    ts = [s["t"] / 60 for s in samples]
    for ax, k, label in zip(axes, SERIES, ("resident memory (MB)", "threads", "open file descriptors")):
        for name in samples[0]["procs"]:
            ax.plot(ts, [s["procs"][name][k] if s["procs"].get(name) else np.nan for s in samples], label=name)
        ax.set_ylabel(label)
    axes[0].legend(loc="upper left")
    for key, style in (("blocks_free", "-"), ("blocks_used", "--")):
        axes[3].plot(ts, [s["cluster"].get(key, np.nan) for s in samples], style, label=key.replace("_", " "))
    axes[3].set_ylabel("cache blocks (cluster)")
    axes[3].legend(loc="upper left")
    axes[3].set_xlabel("minutes")
    for ax in axes:
        ax.axvspan(load[0] / 60, load[1] / 60, color="0.92", zorder=0)
    fig.suptitle("jaxserve soak: Poisson load (shaded) on 1 prefill + 1 decode worker")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--png", default=None, help="plot of the series over time")
    ap.add_argument("--duration", type=float, default=600, help="seconds of load")
    ap.add_argument("--utilisation", type=float, default=0.8, help="load as a fraction of measured capacity")
    ap.add_argument("--users", type=int, default=16, help="locust users: at most this many requests in flight")
    ap.add_argument("--arrivals", choices=["paced", "think"], default="paced",
                    help="paced: Poisson arrivals at the rate whatever the latency; think: each user waits after "
                         "each answer, so the load backs off as latency grows (bench/soak_locust.py)")
    ap.add_argument("--calibrate-s", type=float, default=40)
    ap.add_argument("--calibrate-concurrency", type=int, default=8)
    ap.add_argument("--sample-s", type=float, default=2.0)
    ap.add_argument("--settle", type=float, default=0.25, help="fraction of the load left out of the slopes")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-min", type=int, default=16)
    ap.add_argument("--prompt-max", type=int, default=128)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the bench-size Llama)")
    ap.add_argument("--models", default="bench/.models")
    ap.add_argument("--cores", default=None, type=lambda v: [int(c) for c in v.split(",")],
                    help="comma-separated cores the whole soak runs on (router, workers, locust); default: prefill "
                         "on core 0, decode on core 1, the rest unpinned")
    args = ap.parse_args(argv)
    if args.cores is not None and not set(args.cores) <= os.sched_getaffinity(0):
        ap.error(f"--cores {args.cores}: this process may run only on cores {sorted(os.sched_getaffinity(0))}")
    if args.model is None:
        from bench.families import checkpoint
        args.model = checkpoint("llama", args.models)
    with open(os.path.join(args.model, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    tmp = tempfile.mkdtemp(prefix="jaxserve-soak-")
    dep = Deployment(os.path.abspath(args.model), tmp, "soak", args.cores)
    sampler = None
    try:
        print("soak: starting the deployment (router + 2 workers, compiling)", flush=True)
        dep.wait_ready(900)
        sampler = Sampler(dep, args.sample_s)
        baseline = sampler.samples[0]["cluster"]
        sampler.start()
        print(f"soak: measuring capacity ({args.calibrate_s:.0f}s at concurrency {args.calibrate_concurrency})",
              flush=True)
        cap = capacity(dep.url, args, vocab)
        rate = args.utilisation * cap["requests_per_s"]
        print(f"soak: capacity {cap['requests_per_s']:.2f} req/s; Poisson load at {rate:.2f} req/s for "
              f"{args.duration:.0f}s", flush=True)
        prefix = os.path.join(tmp, "locust")
        load0 = time.monotonic() - sampler.t0
        locust = shutil.which("locust", path=os.path.dirname(sys.executable)) or shutil.which("locust")
        if locust is None:
            raise RuntimeError("locust is not installed (the `test` extra)")
        cmd = [locust, "-f", os.path.join(os.path.dirname(__file__), "soak_locust.py"), "--headless",
               "--host", dep.url, "-u", str(args.users), "-r", str(args.users),
               "--run-time", f"{int(args.duration)}s", "--stop-timeout", "120", "--csv", prefix,
               "--only-summary", "--loglevel", "WARNING", "--rate", str(rate),
               "--max-tokens", str(args.max_tokens), "--prompt-min", str(args.prompt_min),
               "--prompt-max", str(args.prompt_max), "--vocab", str(vocab), "--model-name", "soak",
               "--arrivals", args.arrivals]
        lc = subprocess.run(pinned(cmd, args.cores), capture_output=True, text=True, timeout=args.duration + 600)
        load1 = time.monotonic() - sampler.t0
        if not os.path.exists(prefix + "_stats.csv"):
            raise RuntimeError(f"locust wrote no stats (exit {lc.returncode}):\n{lc.stdout[-2000:]}\n{lc.stderr[-2000:]}")
        stats = locust_stats(prefix)
        idle_after_s = wait_idle(dep.url, 120)
        sampler.stop()
        end = sampler.samples[-1]["cluster"]
        out = {"benchmark": "soak", "host": platform.node(), "cpus": os.cpu_count(), "model": args.model,
               "what": "jaxserve serve (router + HTTP) with a prefill and a decode worker; Poisson completions "
                       "(locust) at a fraction of the capacity measured closed-loop in the same run; RSS, threads, "
                       "fds of each process from /proc, cluster blocks from /metrics",
               "cores": args.cores, "capacity": cap, "utilisation": args.utilisation, "rate_requests_per_s": rate,
               "arrivals": args.arrivals, "users": args.users,
               "duration_s": args.duration, "settle": args.settle, "locust": stats,
               "blocks": {"baseline_free": baseline.get("blocks_free"), "end_free": end.get("blocks_free"),
                          "end_used": end.get("blocks_used"), "idle_after_s": idle_after_s},
               "slopes": analyse(sampler.samples, (load0, load1), args.settle),
               "load_window_s": [load0, load1], "affinity": sampler.affinity, "samples": sampler.samples}
        from bench.stamp import write
        write(args.json, out, indent=1)
        if args.png:
            plot(sampler.samples, (load0, load1), args.png)
        print(summary(out))
        return out
    finally:
        if sampler is not None and sampler.is_alive():
            sampler.stop()
        dep.close()
        shutil.rmtree(tmp, ignore_errors=True)


def summary(out: dict) -> str:
    s, b = out["locust"], out["blocks"]
    lines = [f"soak: {s['requests']} requests at {out['rate_requests_per_s']:.2f} req/s "
             f"({out['utilisation']:.0%} of {out['capacity']['requests_per_s']:.2f}), {s['failures']} failed, "
             f"p50/p99 {s['latency_s'].get('50', float('nan')):.2f}/{s['latency_s'].get('99', float('nan')):.2f}s",
             f"soak: free blocks {b['baseline_free']:.0f} before, {b['end_free']:.0f} after "
             f"(idle {b['idle_after_s']:.1f}s after the load)"]
    for name, series in out["slopes"].items():
        lines.append(f"soak: {name:10s} " + ", ".join(
            f"{k} {v['start']:.0f}->{v['end']:.0f} ({v['slope_per_hour']:+.1f}/h)" for k, v in series.items()))
    return "\n".join(lines)


if __name__ == "__main__":
    main()
