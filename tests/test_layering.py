"""The top-level packages stack `router -> jaxserve -> transfer`, `pallas_kernels` a leaf: a module imports
only its own package and those below it. Read from the source (every import statement, function-level ones
included), so a lazy import cannot hide a cycle."""

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
# package -> the packages it may import
ALLOWED = {"router": {"jaxserve", "transfer", "pallas_kernels"}, "jaxserve": {"transfer", "pallas_kernels"},
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


def violations(root: pathlib.Path = ROOT) -> list[str]:
    bad = []
    for pkg, allowed in ALLOWED.items():
        for f in sorted((root / pkg).rglob("*.py")):
            for line, mod in imports(f, root):
                top = mod.split(".")[0]
                if top in ALLOWED and top != pkg and top not in allowed:
                    bad.append(f"{f.relative_to(root)}:{line} imports {mod}")
    return bad


def test_packages_import_only_downwards():
    assert violations() == []


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
