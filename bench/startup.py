"""Start-up time of `jaxserve serve` on each shipped config (the embedded default: the router and its prefill and
decode workers; configs/*.yaml), with an empty XLA compilation cache and again with the cache the first start
filled.

Each start is timed from launch until /health answers 200 (every worker has loaded, compiled its programs and
registered), then stopped with SIGINT. The cache is a fresh directory per config (engine.compilation_cache in a
copy of the config), so the first start compiles everything. Writes JSON: per config both times, their ratio,
the programs each worker (or the colocated server) compiled, and the command.
"""

from __future__ import annotations

import argparse
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request

import yaml

from jaxserve.router.launcher import free_ports



def launch(config: str, port: int, timeout_s: float) -> tuple[subprocess.Popen, float]:
    """`jaxserve serve --config config` on `port` -> (the process, seconds until /health is 200)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the config's cache, not an inherited one
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "jaxserve.router.cli", "serve", "--config", config,
                             "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    proc.lines = []  # its output, read as it comes (a full pipe would stall the server)
    proc.reader = threading.Thread(target=lambda: proc.lines.extend(proc.stdout), daemon=True)
    proc.reader.start()
    try:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                proc.reader.join(5)
                raise RuntimeError(f"jaxserve serve exited with {proc.returncode}: {''.join(proc.lines)[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return proc, time.monotonic() - t0
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"not ready after {timeout_s}s")
    except BaseException:
        stop(proc)
        raise


def start(config: str, port: int, timeout_s: float) -> tuple[float, str]:
    """-> (seconds until /health is 200, the server's output once stopped)."""
    proc, secs = launch(config, port, timeout_s)
    return secs, stop(proc)


def stop(proc: subprocess.Popen) -> str:
    """SIGINT, then its output (killed after a minute)."""
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
    proc.reader.join(10)
    return "".join(proc.lines)


SHIPPED = ["local.yaml", "configs/colocated.yaml", "configs/disagg.yaml", "configs/prfaas.yaml",
           "configs/banaserve.yaml"]  # local.yaml: the embedded default (jaxserve/configs/local.yaml)


def measure(config: str, timeout_s: float) -> dict:
    """Cold and warm-cache starts of one config -> {"runs": [...], "cold_over_warm"}."""
    from importlib import resources
    text = (resources.files("jaxserve").joinpath("configs/local.yaml").read_text() if config == "local.yaml"
            else open(config).read())
    cfg = yaml.safe_load(text)
    runs = []
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as tmp:
        cfg.setdefault("engine", {})["compilation_cache"] = os.path.join(tmp, "xla")
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        for name in ("empty cache", "cache from the first start"):
            secs, out = start(path, free_ports("127.0.0.1"), timeout_s)
            compiled = {m.group(1): int(m.group(2)) for m in re.finditer(r"(\S+): (\d+) programs compiled", out)}
            # each worker's own start (its process launch to its engine ready: load, warm-up), which instance
            # the cluster waited on
            engines = {m.group(1): float(m.group(2)) for m in re.finditer(r"(\S+): engine ready after ([\d.]+)s", out)}
            runs.append({"cache": name, "ready_s": secs, "programs_warmed": compiled, "engine_ready_s": engines})
            print(f"{config}, {name}: ready after {secs:.1f}s ({compiled}; engines ready after {engines})", flush=True)
    return {"runs": runs, "cold_over_warm": runs[0]["ready_s"] / runs[1]["ready_s"]}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/startup.json")
    ap.add_argument("--timeout-s", type=float, default=900)
    ap.add_argument("--configs", default=",".join(SHIPPED), help="comma-separated config files (local.yaml: the "
                    "embedded default)")
    args = ap.parse_args(argv)
    configs = {c: measure(c, args.timeout_s) for c in args.configs.split(",")}
    out = {"benchmark": "startup", "host": platform.node(), "cpus": os.cpu_count(),
           "command": "python -m bench.startup --json " + args.json +
                      ("" if args.configs == ",".join(SHIPPED) else f" --configs {args.configs}"),
           "measured": "jaxserve serve on each shipped config (workers pinned as each config says), launch to "
                       "/health 200, with an empty and with a filled XLA compilation cache",
           "configs": configs}
    from bench.stamp import write
    write(args.json, out, indent=1)
    print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
