"""Where a benchmark result came from, and whether the code has moved on since.

Every benchmark writes its JSON through `write(path, result)`, which adds a "stamp": the commit (and whether
tracked files differed from it), the UTC date, the machine (platform, cores, JAX backend and devices) and the
exact command line. `python -m bench.stamp` lists bench/results/*.json with their stamps and marks a result
stale when a commit after its own changed the code it measures (CODE, the benchmark's own module and the bench
modules it imports, of one it takes definitions from by name only those and what they use; the simulator,
router/sim, only where those import it; a Python file changed only in comments and docstrings has not
changed); `--check` exits 1 when any result is stale or unstamped. `make bench` regenerates them all from one
commit.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import glob
import json
import os
import platform
import shlex
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
CODE = ("jaxserve", "pallas_kernels", "transfer", "router", "pyproject.toml")  # what every result describes
SIMULATOR = "router/sim"  # ...but for the simulator: only results of benchmarks that import it describe it


def bench_uses(module: str, others: set | None = None) -> dict[str, set | None]:
    """The bench modules `module` (bench.NAME) imports, directly or through each other, itself first (its
    source in this tree, read statically; bench.stamp, which only writes the stamp, left out), each with the
    names taken from it where only `from bench.X import a, b` reach it (None: all of it). `others`, when given,
    collects the names of the other modules they import."""
    uses: dict[str, set | None] = {}
    todo: list = [(module, None)]
    others = set() if others is None else others
    while todo:
        mod, names = todo.pop(0)
        path = os.path.join(ROOT, *mod.split(".")) + ".py"
        if mod == "bench.stamp" or not os.path.isfile(path):
            continue
        if mod in uses:
            had = uses[mod]
            uses[mod] = None if had is None or names is None else had | names
            continue
        uses[mod] = None if names is None else set(names)
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                todo += [(a.name, None) for a in node.names if a.name.startswith("bench.")]
                others.update(a.name for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module == "bench":
                todo += [(f"bench.{a.name}", None) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("bench."):
                todo.append((node.module, {a.name for a in node.names}))
            elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
                others.add(node.module)
                others.update(f"{node.module}.{a.name}" for a in node.names)
    return uses


def bench_imports(module: str, others: set | None = None) -> list[str]:
    """bench_uses' modules, in order."""
    return list(bench_uses(module, others))


def _module(command: str | None) -> str | None:
    parts = shlex.split(command or "")
    mods = [parts[i + 1] for i, p in enumerate(parts[:-1]) if p == "-m" and parts[i + 1].startswith("bench.")]
    return mods[0] if mods else None


def _path(mod: str) -> str:
    return os.path.join(*mod.split(".")) + ".py"


def measured(command: str | None) -> tuple[tuple[str, ...], dict[str, set]]:
    """The code a result describes, from one read of its benchmark's imports -> (paths: CODE, the benchmark's own
    module (`python -m bench.NAME ...`; every benchmark when the command names none) and the bench modules it
    imports, and the simulator (SIMULATOR) where one of those imports it (nothing that serves does); names: the
    bench files among them whose result depends on some of their definitions only -> those names (a file reached
    only through `from bench.X import a, b`))."""
    mod = _module(command)
    if mod is None:
        return CODE + ("bench",), {}
    others: set = set()
    uses = bench_uses(mod, others)
    sim = SIMULATOR.replace("/", ".")
    runs_sim = any(m == sim or m.startswith(sim + ".") for m in others)
    paths = CODE + tuple(_path(m) for m in uses) + (() if runs_sim else (f":(exclude){SIMULATOR}",))  # pathspec
    return paths, {_path(m): n for m, n in uses.items() if n is not None}


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
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no", "--", *CODE, "bench",
                               ":(exclude)bench/results")),
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


def _program(source: str, names: set | None = None) -> str | None:
    """A Python source's syntax tree with its docstrings left out (comments and line breaks never reach it), as
    text; None where it does not parse. names: only what importing those names from it runs: its module-level
    statements (but `if __name__ == "__main__"`), and of its top-level functions and classes those named and
    those they or the module-level statements refer to, and so on."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return None
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    if names is not None:
        is_def = lambda n: isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))  # noqa: E731
        defs = {n.name: n for n in tree.body if is_def(n)}
        rest = [n for n in tree.body if not is_def(n)
                and not (isinstance(n, ast.If) and "'__main__'" in ast.dump(n.test))]
        keep, todo = set(), list(names) + [x.id for n in rest for x in ast.walk(n) if isinstance(x, ast.Name)]
        while todo:
            name = todo.pop()
            if name in defs and name not in keep:
                keep.add(name)
                todo += [x.id for x in ast.walk(defs[name]) if isinstance(x, ast.Name)]
        tree.body = [n for n in tree.body if n in rest or (is_def(n) and n.name in keep)]
    return ast.dump(tree)


def changed_code(since: str, paths, names: dict[str, set] | None = None) -> list[str]:
    """The files under `paths` whose code differs between commit `since` and HEAD. A Python file whose syntax
    tree is the same but for docstrings (a comment, a docstring, a rewrapped line) has not changed; nor has one
    in `names` whose named definitions (and what they use: _program) are the same. Any other file that differs
    has."""
    out = []
    for name in _git("diff", "--name-only", since, "HEAD", "--", *paths).splitlines():
        if name.endswith(".py"):
            before, after = _git("show", f"{since}:{name}"), _git("show", f"HEAD:{name}")
            keep = (names or {}).get(name)
            tree = _program(before, keep) if before and after else None  # added or deleted: changed
            if tree is not None and tree == _program(after, keep):
                continue
        out.append(name)
    return out


def staleness(path: str) -> str | None:
    """Why the result at `path` no longer describes the code (None: it does)."""
    try:
        with open(path) as f:
            st = json.load(f).get("stamp")
    except (OSError, ValueError, AttributeError):
        return "unreadable"
    if not st or not st.get("commit"):
        return "no stamp"
    if not _git("rev-parse", "--verify", "-q", f"{st['commit']}^{{commit}}"):
        return f"commit {st['commit'][:10]} is not in this repository"
    changed = changed_code(st["commit"], *measured(st.get("command")))
    if changed:
        return f"later commits changed the code it measures: {', '.join(changed[:3])}" + (
            f" and {len(changed) - 3} more" if len(changed) > 3 else "")
    return "measured with uncommitted changes" if st.get("dirty") else None


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when a result is stale or unstamped")
    a = ap.parse_args(argv)
    bad = 0
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        why = staleness(path)
        with open(path) as f:
            st = (json.load(f).get("stamp") or {}) if why != "unreadable" else {}
        bad += why is not None
        print(f"{os.path.basename(path):34s} {(st.get('commit') or '-')[:10]:10s} {st.get('date', '-'):25s} "
              f"{'STALE: ' + why if why else 'current'}")
    return 1 if a.check and bad else 0


if __name__ == "__main__":
    sys.exit(main())
