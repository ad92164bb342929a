"""The layers stack `bench -> router -> jaxserve -> transfer`, `pallas_kernels` a leaf: a module imports only its
own layer and those below it; and no modules import each other in a cycle, inside a package or across. Read from
the source (every import statement, function-level ones included), so a lazy import cannot hide a cycle.

router/, transfer/ and pallas_kernels/ sit at the repository's top but are the packages jaxserve.router,
jaxserve.transfer and jaxserve.pallas_kernels (jaxserve/ links to them); the layer `jaxserve` is the rest of
jaxserve/. Nothing imports them by their folder's name (`import router`), which the wheel does not install."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# layer -> the layers it may import
ALLOWED = {"bench": {"router", "jaxserve", "transfer", "pallas_kernels"},
           "router": {"jaxserve", "transfer", "pallas_kernels"}, "jaxserve": {"transfer", "pallas_kernels"},
           "transfer": set(), "pallas_kernels": set()}
# layer -> its package's name; each layer's folder is its own name at the repository's top
PACKAGE = {"bench": "bench", "router": "jaxserve.router", "jaxserve": "jaxserve", "transfer": "jaxserve.transfer",
           "pallas_kernels": "jaxserve.pallas_kernels"}
FOLDERS = ("router", "transfer", "pallas_kernels")  # linked into jaxserve/, imported only through it


def layer_of(module: str) -> str | None:
    """The layer a module name belongs to (None: outside the project)."""
    for layer, pkg in sorted(PACKAGE.items(), key=lambda kv: -len(kv[1])):
        if module == pkg or module.startswith(pkg + "."):
            return layer
    return None


def module_name(path: pathlib.Path, root: pathlib.Path, layer: str) -> list[str]:
    """The dotted parts of a source file's module, e.g. router/cluster.py -> jaxserve.router.cluster."""
    rel = list(path.relative_to(root / layer).with_suffix("").parts)
    return PACKAGE[layer].split(".") + rel


def imports(path: pathlib.Path, root: pathlib.Path, layer: str) -> list[tuple[int, str]]:
    """(line, absolute module) of every import in the file; relative imports resolved against its package."""
    pkg = module_name(path, root, layer)[:-1]
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


def sources(root: pathlib.Path, layer: str) -> list[pathlib.Path]:
    """The layer's modules (not what lives in its hidden folders, e.g. a benchmark's virtual environment, nor
    jaxserve/'s links to the other layers)."""
    return [f for f in sorted((root / layer).rglob("*.py"))
            if not any(part.startswith(".") for part in f.relative_to(root).parts)
            and not (layer == "jaxserve" and f.relative_to(root / layer).parts[0] in FOLDERS)]


def violations(root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for layer, allowed in ALLOWED.items():
        for f in sources(root, layer):
            for line, mod in imports(f, root, layer):
                if mod.split(".")[0] in FOLDERS:
                    bad.append(f"{f.relative_to(root)}:{line} imports {mod} (not installed: jaxserve.{mod})")
                    continue
                top = layer_of(mod)
                if top is not None and top != layer and top not in allowed:
                    bad.append(f"{f.relative_to(root)}:{line} imports {mod}")
    return bad


def module_graph(root: pathlib.Path = ROOT) -> dict[str, set[str]]:
    """module -> the modules of these packages it imports: `from p import x` counts as importing p.x where that
    is a module (a package's __init__ only where the name is not), lazy imports included."""
    files = {}
    for layer in ALLOWED:
        for f in sources(root, layer):
            parts = module_name(f, root, layer)
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
    (tmp_path / "router" / "b.py").write_text("def f():\n    from jaxserve.router import a\n")  # lazy, a submodule
    (tmp_path / "router" / "c.py").write_text("from jaxserve.router import b\n")
    assert cycles(module_graph(tmp_path)) == [["jaxserve.router.a", "jaxserve.router.b"]]


def test_the_check_sees_lazy_and_relative_imports(tmp_path):
    (tmp_path / "transfer").mkdir()
    (tmp_path / "transfer" / "x.py").write_text("def f():\n    from jaxserve.cache import block_manager\n")
    (tmp_path / "jaxserve" / "server").mkdir(parents=True)
    (tmp_path / "jaxserve" / "server" / "y.py").write_text("from ..engine import client\nimport jaxserve.router.cluster\n"
                                                           "from router import cli\n")
    (tmp_path / "router").mkdir()
    (tmp_path / "router" / "z.py").write_text("from ..transfer import tcp\n")  # jaxserve.transfer: allowed
    (tmp_path / "pallas_kernels").mkdir()
    (tmp_path / "pallas_kernels" / "w.py").write_text("from ..engine import runner\n")  # jaxserve.engine
    (tmp_path / "jaxserve" / "router").mkdir()  # as the link: its files are the router layer's, not jaxserve's
    (tmp_path / "jaxserve" / "router" / "v.py").write_text("from jaxserve.router import cli\n")
    assert violations(tmp_path) == ["jaxserve/server/y.py:2 imports jaxserve.router.cluster",
                                    "jaxserve/server/y.py:3 imports router (not installed: jaxserve.router)",
                                    "transfer/x.py:2 imports jaxserve.cache",
                                    "pallas_kernels/w.py:1 imports jaxserve.engine"]


LONG = 600  # lines a module may have without saying why


def test_long_modules_say_why():
    """No module over LONG lines without a reason in its docstring (a paragraph starting `Size:`)."""
    quiet = []
    for top in ("bench", "router", "jaxserve", "transfer", "pallas_kernels", "tests"):
        for f in sources(ROOT, top):
            text = f.read_text()
            if text.count("\n") > LONG and "\nSize: " not in (ast.get_docstring(ast.parse(text), clean=False) or ""):
                quiet.append(f"{f.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert quiet == []


def test_the_console_script_has_every_command():
    """`jaxserve` (pyproject's console script) is jaxserve.router.cli (router/cli.py): the engine-level commands, `validate`, `serve`,
    `deploy` and `plan`."""
    import tomllib

    from typer.main import get_command
    with open(ROOT / "pyproject.toml", "rb") as f:
        target = tomllib.load(f)["project"]["scripts"]["jaxserve"]
    module, _, attr = target.partition(":")
    app = getattr(__import__(module, fromlist=[attr]), attr)
    assert set(get_command(app).commands) == {"convert", "generate", "worker", "certs", "bench", "profile",
                                                   "validate", "serve", "deploy", "plan"}
