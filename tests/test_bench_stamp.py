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
    assert stamp.measured("python -m bench.offline --json x")[0] == stamp.CODE + (
        "bench/offline.py", "bench/vllm_offline.py", ":(exclude)router/sim")  # it does not run the simulator
    assert stamp.measured(None)[0] == stamp.CODE + ("bench",)
    last = git("log", "-n", "1", "--format=%H", "--", *stamp.CODE)  # the newest commit that changed measured code
    parent = git("rev-parse", "--verify", "-q", f"{last}^")
    if not parent:
        pytest.skip("shallow history: no commit before the last code change")
    why = stamp.staleness(write_with(tmp_path, {"commit": parent}))
    changed = stamp.changed_code(parent, stamp.measured(None)[0])  # a result without a command: all of bench
    assert (why is None) == (not changed)
    if changed:
        assert "later commits changed the code it measures: " + changed[0] in why


class Repo:
    """A git repository of its own under tmp_path, which bench.stamp reads (stamp.ROOT points at it)."""

    def __init__(self, tmp_path, monkeypatch):
        self.root, self.results = tmp_path / "repo", tmp_path
        self.root.mkdir()
        for args in (("init", "-q"), ("config", "user.email", "t@t"), ("config", "user.name", "t")):
            self.git(*args)
        monkeypatch.setattr(stamp, "ROOT", str(self.root))

    def git(self, *args) -> str:
        return subprocess.run(["git", "-C", str(self.root), *args], check=True, capture_output=True,
                              text=True).stdout.strip()

    def commit(self, files: dict) -> str:
        """Write {path: text}, commit everything -> the commit."""
        for name, text in files.items():
            (self.root / name).parent.mkdir(parents=True, exist_ok=True)
            (self.root / name).write_text(text)
        self.git("add", "-A")
        self.git("commit", "-qm", "c")
        return self.git("rev-parse", "HEAD")

    def read(self, name: str) -> str:
        return (self.root / name).read_text()

    def staleness(self, commit: str, module: str | None = None) -> str | None:
        """stamp.staleness of a result measured at `commit` by `python -m bench.MODULE` (None: no command)."""
        d = self.results / f"result-{module}"
        d.mkdir(exist_ok=True)
        cmd = {"command": f"python -m bench.{module} --json x"} if module else {}
        return stamp.staleness(write_with(d, {"commit": commit, **cmd}))


def test_a_change_to_comments_and_docstrings_leaves_a_result_current(tmp_path, monkeypatch):
    """In a repository of its own: a result measured before a commit that only rewords docstrings and comments
    and rewraps lines stays current; one before a commit that changes what the code does, or a file that is not
    Python, is stale, naming the file."""
    repo, m = Repo(tmp_path, monkeypatch), "jaxserve/m.py"
    first = repo.commit({m: '"""A module."""\n\n\ndef f(x):\n    """Twice x."""\n    return 2 * x  # doubled\n'})
    repo.commit({m: '"""A module, reworded."""\n\n\ndef f(x):\n    """Twice x,\n    reworded."""\n    return (2 *\n'
                    '            x)  # a comment\n'})
    assert stamp.changed_code(first, stamp.CODE) == []
    assert repo.staleness(first, "x") is None
    repo.commit({m: repo.read(m).replace("2 *", "3 *")})
    assert stamp.changed_code(first, stamp.CODE) == [m]
    assert "changed the code it measures: jaxserve/m.py" in repo.staleness(first)
    second = repo.commit({m: '"""A module, reworded."""\n\n\ndef f(x):\n    return 3 * x\n'})
    repo.commit({"pyproject.toml": "[project]\nname = 'x'\n"})
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
    assert "bench/vllm_offline.py" in stamp.measured("python -m bench.online --json x")[0]


def test_the_simulator_is_code_only_for_the_benchmarks_that_run_it(tmp_path, monkeypatch):
    """In a repository of its own: a commit to router/sim leaves current a result whose benchmark does not
    import the simulator, and makes stale one whose benchmark imports it through another bench module."""
    repo = Repo(tmp_path, monkeypatch)
    first = repo.commit({"router/sim/run.py": "STEP = 1\n", "router/policy.py": "RULE = 1\n",
                         "bench/live.py": "from router import policy\n",
                         "bench/simmed.py": "from bench import helper\n",
                         "bench/helper.py": "from router.sim.run import STEP\n"})
    repo.commit({"router/sim/run.py": "STEP = 2\n"})
    assert repo.staleness(first, "live") is None
    assert "changed the code it measures: router/sim/run.py" in repo.staleness(first, "simmed")
    repo.commit({"router/policy.py": "RULE = 2\n"})  # the rest of router/ is code for every result
    assert "router/policy.py" in repo.staleness(first, "live")


def test_a_result_describes_only_the_definitions_its_benchmark_takes_from_another(tmp_path, monkeypatch):
    """In a repository of its own: bench/a.py takes f from bench/helper.py (`from bench.helper import f`). A
    commit to helper's g, which f does not use, leaves a's result current and makes helper's own stale; one to
    what f uses (g2, a module constant) makes a's stale too."""
    repo, h = Repo(tmp_path, monkeypatch), "bench/helper.py"
    first = repo.commit({"bench/a.py": "from bench.helper import f\n",
                         h: "K = 1\n\n\ndef f():\n    return g2() + K\n\n\ndef g2():\n    return 2\n\n\n"
                            "def g():\n    return 3\n\n\nif __name__ == '__main__':\n    g()\n"})
    assert stamp.measured("python -m bench.a --json x")[1] == {h: {"f"}}
    repo.commit({h: repo.read(h).replace("return 3", "return 4").replace("    g()", "    g(1)")})
    assert repo.staleness(first, "a") is None
    assert h in repo.staleness(first, "helper")
    second = repo.commit({h: repo.read(h).replace("return 2", "return 5")})
    assert h in repo.staleness(first, "a")
    repo.commit({h: repo.read(h).replace("K = 1", "K = 2")})
    assert h in repo.staleness(second, "a")
