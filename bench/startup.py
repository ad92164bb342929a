"""Start-up time of `jaxserve serve` on the default config (the router and its prefill and decode workers), with
an empty XLA compilation cache and again with the cache the first start filled.

Each start is timed from launch until /health answers 200 (every worker has loaded, compiled its programs and
registered), then stopped with SIGINT. The cache is a fresh directory (engine.compilation_cache in a copy of
the embedded config), so the first start compiles everything. Writes JSON: both times, their ratio, the
programs each worker compiled, and the command.
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
import time
import urllib.request

import yaml

from router.launcher import free_ports



def start(config: str, port: int, timeout_s: float) -> tuple[float, str]:
    """-> (seconds until /health is 200, the server's output)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # the config's cache, not an inherited one
    t0 = time.monotonic()
    proc = subprocess.Popen([sys.executable, "-m", "router.cli", "serve", "--config", config, "--port", str(port)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    try:
        while time.monotonic() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"jaxserve serve exited with {proc.returncode}: {proc.stdout.read()[-2000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0, _stop(proc)
            except OSError:
                pass
            time.sleep(0.25)
        raise TimeoutError(f"not ready after {timeout_s}s")
    except BaseException:
        _stop(proc)
        raise


def _stop(proc: subprocess.Popen) -> str:
    proc.send_signal(signal.SIGINT)
    try:
        out, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, _ = proc.communicate()
    return out or ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/startup.json")
    ap.add_argument("--timeout-s", type=float, default=900)
    args = ap.parse_args(argv)
    from importlib import resources
    cfg = yaml.safe_load(resources.files("jaxserve").joinpath("configs/local.yaml").read_text())
    runs = []
    with tempfile.TemporaryDirectory(prefix="jaxserve-startup-") as tmp:
        cfg["engine"]["compilation_cache"] = os.path.join(tmp, "xla")
        path = os.path.join(tmp, "config.yaml")
        with open(path, "w") as f:
            yaml.safe_dump(cfg, f)
        for name in ("empty cache", "cache from the first start"):
            secs, out = start(path, free_ports("127.0.0.1"), args.timeout_s)
            compiled = {m.group(1): int(m.group(2)) for m in re.finditer(r"(\S+): (\d+) programs compiled", out)}
            runs.append({"cache": name, "ready_s": secs, "programs_warmed": compiled})
            print(f"{name}: ready after {secs:.1f}s ({compiled})", flush=True)
    out = {"benchmark": "startup", "host": platform.node(), "cpus": os.cpu_count(),
           "command": "python -m bench.startup --json " + args.json,
           "measured": "jaxserve serve on the embedded config (router + prefill and decode workers, each on its "
                       "own core), launch to /health 200, with an empty and with a filled XLA compilation cache",
           "runs": runs, "cold_over_warm": runs[0]["ready_s"] / runs[1]["ready_s"]}
    from bench.stamp import write
    write(args.json, out, indent=1)
    print(f"cold / warm start: {out['cold_over_warm']:.1f}x; wrote {args.json}")


if __name__ == "__main__":
    main()
