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
    assert stamp.measured_paths("python -m bench.offline --json x") == stamp.CODE + (
        "bench/offline.py", "bench/vllm_offline.py", ":(exclude)router/sim")  # it does not run the simulator
    assert stamp.measured_paths(None) == stamp.CODE + ("bench",)
    last = git("log", "-n", "1", "--format=%H", "--", *stamp.CODE)  # the newest commit that changed measured code
    parent = git("rev-parse", "--verify", "-q", f"{last}^")
    if not parent:
        pytest.skip("shallow history: no commit before the last code change")
    why = stamp.staleness(write_with(tmp_path, {"commit": parent}))
    changed = stamp.changed_code(parent, stamp.measured_paths(None))  # a result without a command: all of bench
    assert (why is None) == (not changed)
    if changed:
        assert "later commits changed the code it measures: " + changed[0] in why


def test_a_change_to_comments_and_docstrings_leaves_a_result_current(tmp_path, monkeypatch):
    """In a repository of its own: a result measured before a commit that only rewords docstrings and comments
    and rewraps lines stays current; one before a commit that changes what the code does, or a file that is not
    Python, is stale, naming the file."""
    repo = tmp_path / "repo"
    (repo / "jaxserve").mkdir(parents=True)
    run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    run("config", "user.email", "t@t")
    run("config", "user.name", "t")
    mod = repo / "jaxserve" / "m.py"

    def commit(text, name="jaxserve/m.py"):
        (repo / name).write_text(text)
        run("add", "-A")
        run("commit", "-qm", "c")
        return subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True,
                              text=True).stdout.strip()

    first = commit('"""A module."""\n\n\ndef f(x):\n    """Twice x."""\n    return 2 * x  # doubled\n')
    commit('"""A module, reworded."""\n\n\ndef f(x):\n    """Twice x,\n    reworded."""\n    return (2 *\n'
           '            x)  # a comment\n')
    monkeypatch.setattr(stamp, "ROOT", str(repo))
    assert stamp.changed_code(first, stamp.CODE) == []
    assert stamp.staleness(write_with(tmp_path, {"commit": first, "command": "python -m bench.x"})) is None
    mod.write_text(mod.read_text().replace("2 *", "3 *"))
    run("commit", "-qam", "c")
    assert stamp.changed_code(first, stamp.CODE) == ["jaxserve/m.py"]
    assert "changed the code it measures: jaxserve/m.py" in stamp.staleness(write_with(tmp_path, {"commit": first}))
    second = commit('"""A module, reworded."""\n\n\ndef f(x):\n    return 3 * x\n')
    commit("[project]\nname = 'x'\n", "pyproject.toml")
    assert stamp.changed_code(second, stamp.CODE) == ["pyproject.toml"]


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


def test_the_simulator_is_code_only_for_the_benchmarks_that_run_it(tmp_path, monkeypatch):
    """In a repository of its own: a commit to router/sim leaves current a result whose benchmark does not
    import the simulator, and makes stale one whose benchmark imports it through another bench module."""
    repo = tmp_path / "repo"
    for d in ("router/sim", "bench"):
        (repo / d).mkdir(parents=True)
    run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    run("config", "user.email", "t@t")
    run("config", "user.name", "t")
    (repo / "router" / "sim" / "run.py").write_text("STEP = 1\n")
    (repo / "router" / "policy.py").write_text("RULE = 1\n")
    (repo / "bench" / "live.py").write_text("from router import policy\n")
    (repo / "bench" / "simmed.py").write_text("from bench import helper\n")
    (repo / "bench" / "helper.py").write_text("from router.sim.run import STEP\n")
    run("add", "-A")
    run("commit", "-qm", "c")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(stamp, "ROOT", str(repo))
    (repo / "router" / "sim" / "run.py").write_text("STEP = 2\n")
    run("commit", "-qam", "c")
    (tmp_path / "live").mkdir()
    (tmp_path / "simmed").mkdir()
    live = write_with(tmp_path / "live", {"commit": first, "command": "python -m bench.live --json x"})
    simmed = write_with(tmp_path / "simmed", {"commit": first, "command": "python -m bench.simmed --json x"})
    assert stamp.staleness(live) is None
    assert "changed the code it measures: router/sim/run.py" in stamp.staleness(simmed)
    (repo / "router" / "policy.py").write_text("RULE = 2\n")  # the rest of router/ is code for every result
    run("commit", "-qam", "c")
    assert "router/policy.py" in stamp.staleness(live)


def test_a_result_describes_only_the_definitions_its_benchmark_takes_from_another(tmp_path, monkeypatch):
    """In a repository of its own: bench/a.py takes f from bench/helper.py (`from bench.helper import f`). A
    commit to helper's g, which f does not use, leaves a's result current and makes helper's own stale; one to
    what f uses (g2, a module constant) makes a's stale too."""
    repo = tmp_path / "repo"
    (repo / "bench").mkdir(parents=True)
    run = lambda *a: subprocess.run(["git", "-C", str(repo), *a], check=True, capture_output=True)  # noqa: E731
    run("init", "-q")
    run("config", "user.email", "t@t")
    run("config", "user.name", "t")
    helper = repo / "bench" / "helper.py"
    (repo / "bench" / "a.py").write_text("from bench.helper import f\n")
    helper.write_text("K = 1\n\n\ndef f():\n    return g2() + K\n\n\ndef g2():\n    return 2\n\n\n"
                      "def g():\n    return 3\n\n\nif __name__ == '__main__':\n    g()\n")
    run("add", "-A")
    run("commit", "-qm", "c")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    monkeypatch.setattr(stamp, "ROOT", str(repo))
    assert stamp.measured_names("python -m bench.a --json x") == {"bench/helper.py": {"f"}}

    def stale(module):
        (tmp_path / module).mkdir(exist_ok=True)
        return stamp.staleness(write_with(tmp_path / module, {"commit": first,
                                                               "command": f"python -m bench.{module} --json x"}))

    helper.write_text(helper.read_text().replace("return 3", "return 4").replace("    g()", "    g(1)"))
    run("commit", "-qam", "c")
    assert stale("a") is None
    assert "bench/helper.py" in stale("helper")
    helper.write_text(helper.read_text().replace("return 2", "return 5"))
    run("commit", "-qam", "c")
    assert "bench/helper.py" in stale("a")
    first = subprocess.run(["git", "-C", str(repo), "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    helper.write_text(helper.read_text().replace("K = 1", "K = 2"))
    run("commit", "-qam", "c")
    assert "bench/helper.py" in stale("a")
