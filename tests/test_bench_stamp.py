"""Benchmark results carry their stamp (commit, date, machine, command), and a result older than the code it
measures is reported stale (bench/stamp.py)."""

import json
import shlex
import subprocess
import sys

import pytest

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


def write_with(tmp_path, st):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"figure": 1, **({"stamp": st} if st else {})}))
    return str(path)


def test_staleness(tmp_path):
    head = git("rev-parse", "HEAD")
    assert stamp.staleness(write_with(tmp_path, None)) == "no stamp"
    assert "not in this repository" in stamp.staleness(write_with(tmp_path, {"commit": "0" * 40}))
    assert stamp.staleness(write_with(tmp_path, {"commit": head, "dirty": False})) is None
    assert stamp.staleness(write_with(tmp_path, {"commit": head, "dirty": True})) == "measured with uncommitted changes"
    # the benchmark's own module, then the bench modules it imports (bench/offline.py runs bench/vllm_offline.py)
    assert stamp.measured_paths("python -m bench.offline --json x") == stamp.CODE + ("bench/offline.py",
                                                                                    "bench/vllm_offline.py")
    assert stamp.measured_paths(None) == stamp.CODE + ("bench",)
    last = git("log", "-n", "1", "--format=%H", "--", *stamp.CODE)  # the newest commit that changed measured code
    parent = git("rev-parse", "--verify", "-q", f"{last}^")
    if not parent:
        pytest.skip("shallow history: no commit before the last code change")
    assert "later commits changed the code" in stamp.staleness(write_with(tmp_path, {"commit": parent}))


def test_a_result_describes_the_bench_modules_its_benchmark_imports():
    # bench/sim_validate.py runs bench/prfaas_live.py's workload on bench/clusters.py's cluster: a change to
    # either changes its result. bench/stamp.py only writes the stamp.
    got = stamp.bench_imports("bench.sim_validate")
    assert got[0] == "bench.sim_validate"
    assert {"bench.prfaas_live", "bench.clusters", "bench.families"} <= set(got)
    assert "bench.stamp" not in got
    assert len(got) == len(set(got))
    # transitive: bench/online.py imports bench/offline.py, which runs bench/vllm_offline.py
    assert "bench/vllm_offline.py" in stamp.measured_paths("python -m bench.online --json x")
