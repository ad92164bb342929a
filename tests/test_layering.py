"""The top-level packages stack `bench -> router -> jaxserve -> transfer`, `pallas_kernels` a leaf: a module
imports only its own package and those below it; and no modules import each other in a cycle, inside a package
or across. Read from the source (every import statement, function-level ones included), so a lazy import cannot
hide a cycle."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# package -> the packages it may import
ALLOWED = {"bench": {"router", "jaxserve", "transfer", "pallas_kernels"},
           "router": {"jaxserve", "transfer", "pallas_kernels"}, "jaxserve": {"transfer", "pallas_kernels"},
           "transfer": set(), "pallas_kernels": set()}


def imports(path: pathlib.Path, root: pathlib.Path) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file; relative imports resolved against its package."""
    pkg = list(path.relative_to(root).with_suffix("").parts)[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[:len(pkg) - node.level + 1]
                out.append((node.lineno, ".".join(base + ([node.module] if node.module else []))))
            else:
                out.append((node.lineno, node.module))
    return out


def sources(root: pathlib.Path, pkg: str) -> list[pathlib.Path]:
    """The package's modules (not what lives in its hidden folders, e.g. a benchmark's virtual environment)."""
    return [f for f in sorted((root / pkg).rglob("*.py"))
            if not any(part.startswith(".") for part in f.relative_to(root).parts)]


def violations(root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in sources(root, pkg):
            for line, mod in imports(f, root):
                top = mod.split(".")[0]
                if top in ALLOWED and top != pkg and top not in allowed:
                    bad.append(f"{f.relative_to(root)}:{line} imports {mod}")
    return bad


def module_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of these packages it imports: `from p import x` counts as importing p.x where that
    is a module (a package's __init__ only where the name is not), lazy imports included."""
    files = {}
    for pkg in ALLOWED:
        for f in sources(root, pkg):
            parts = list(f.relative_to(root).with_suffix("").parts)
            files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph = {}
    for name, f in files.items():
        out = set()
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                pkg = name.split(".") if f.name == "__init__.py" else name.split(".")[:-1]
                mod = (".".join(pkg[:len(pkg) - node.level + 1] + ([node.module] if node.module else []))
                       if node.level else node.module)
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in files else mod for a in node.names]
            else:
                continue
            for t in targets:
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    out.add(t)
        graph[name] = out
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter[0]
                    counter[0] += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(graph.get(w, ())))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    out.append(sorted(comp))
    return out


def test_packages_import_only_downwards():
    assert violations() == []


def test_no_modules_import_each_other_in_a_cycle():
    assert cycles(module_graph()) == []


def test_the_cycle_check_sees_lazy_imports_and_submodules(tmp_path):
    for pkg in ALLOWED:
        (tmp_path / pkg).mkdir()
    (tmp_path / "router" / "__init__.py").write_text("from . import a\n")
    (tmp_path / "router" / "a.py").write_text("from .b import f\n")
    (tmp_path / "router" / "b.py").write_text("def f():\n    from router import a\n")  # lazy, a submodule
    (tmp_path / "router" / "c.py").write_text("from router import b\n")
    assert cycles(module_graph(tmp_path)) == [["router.a", "router.b"]]


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    (tmp_path / "transfer").mkdir()
    (tmp_path / "transfer" / "x.py").write_text("def f():\n    from jaxserve.cache import block_manager\n")
    (tmp_path / "jaxserve" / "server").mkdir(parents=True)
    (tmp_path / "jaxserve" / "server" / "y.py").write_text("from ..engine import client\nimport router.cluster\n")
    for pkg in ("router", "pallas_kernels"):
        (tmp_path / pkg).mkdir()
    assert violations(tmp_path) == ["jaxserve/server/y.py:2 imports router.cluster",
                                    "transfer/x.py:2 imports jaxserve.cache"]


def test_the_console_script_has_every_command():
    """`jaxserve` (pyproject's console script) is router/cli.py: the engine-level commands, `validate`, `serve`,
    `deploy` and `plan`."""
    import tomllib

    from typer.main import get_command
    with open(ROOT / "pyproject.toml", "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["jaxserve"]
    module, _, attr = target.partition(":")
    app = getattr(__import__(module, fromlist=[attr]), attr)
    assert set(get_command(app).commands) == {"convert", "generate", "worker", "certs", "bench", "profile",
                                                   "validate", "serve", "deploy", "plan"}
