"""Benchmark results carry their stamp: commit, date, machine, command (bench/stamp.py)."""

import json
import shlex
import subprocess
import sys

from bench import stamp

ROOT = stamp.ROOT


def git(*args):
    return subprocess.run(["git", "-C", ROOT, *args], capture_output=True, text=True).stdout.strip()


def test_write_stamps_the_result(tmp_path):
    path = str(tmp_path / "sub" / "r.json")
    stamp.write(path, {"figure": 1.5})
    with open(path) as f:
        d = json.load(f)
    st = d["stamp"]
    assert d["figure"] == 1.5 and st["commit"] == git("rev-parse", "HEAD")
    assert shlex.split(st["command"])[1:] == sys.orig_argv[1:] and st["date"].endswith("+00:00")
    assert st["machine"]["cpus"] >= 1 and isinstance(st["dirty"], bool)
