"""Where a benchmark result came from: its stamp.

Every benchmark writes its JSON through `write(path, result)`, which adds a "stamp": the commit (and whether
tracked files differed from it), the UTC date, the machine (platform, cores, JAX backend and devices) and the
exact command line. A result describes the code of its commit; re-run a benchmark when a change is meant to move
its figure. `python -m bench.report` shows every result with its stamp (docs/benchmarks.md).
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def _machine() -> dict:
    m = {"platform": platform.platform(), "cpus": os.cpu_count(), "affinity": len(os.sched_getaffinity(0))}
    if "jax" in sys.modules:  # a benchmark that ran JAX: where
        import jax
        m["backend"] = jax.default_backend()
        m["devices"] = sorted({d.device_kind for d in jax.devices()})
    return m


def stamp() -> dict:
    return {"commit": _git("rev-parse", "HEAD") or None,
            # results are not code: one result left uncommitted must not mark the next one measured as dirty
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results",
                               ":(exclude)docs", ":(exclude)README.md")),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
            "machine": _machine(),
            "command": shlex.join(["python"] + sys.orig_argv[1:])}  # a shell runs it again as it ran


def arguments(doc: str):
    """The argument parser a benchmark starts from: --json (required) and --png, described by its docstring's
    first line."""
    import argparse
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--png", default=None)
    return ap


def save_figure(fig, path: str) -> None:
    fig.tight_layout()
    fig.savefig(path, dpi=90)


def write(path: str, result: dict, indent: int = 1) -> None:
    """Write `result` with its stamp to `path` (folders created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump({**result, "stamp": stamp()}, f, indent=indent)
