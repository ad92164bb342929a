"""jaxserve/disagg/ touches the engine only through its KV connector (engine/connector.py): it imports nothing of
jaxserve.engine, and every attribute it reads off the connector it is given is one the connector defines (which
forwards nothing else: no __getattr__). Read from the source."""

import ast
import pathlib

from jaxserve.engine.connector import KVConnector

DISAGG = pathlib.Path(__file__).resolve().parents[2] / "jaxserve" / "disagg"
# how disagg/ names the connector it is given: a parameter `kv`, kept as self.kv (KVIntake) or self._kv (Handoff)
NAMES = {"kv"}
HELD = {"kv", "_kv"}


def _connector_uses(tree) -> set[str]:
    """Attributes read off the connector: kv.X, self.kv.X, self._kv.X."""
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in NAMES:
            out.add(node.attr)
        elif (isinstance(v, ast.Attribute) and v.attr in HELD and isinstance(v.value, ast.Name)
              and v.value.id == "self"):
            out.add(node.attr)
    return out


def _engine_imports(tree, path) -> list[str]:
    bad = []
    for node in ast.walk(tree):
        mods = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                [("." * node.level) + (node.module or "")] if isinstance(node, ast.ImportFrom) else [])
        bad += [f"{path.name}: {m}" for m in mods if m.startswith(("jaxserve.engine", "..engine"))]
    return bad


def test_disagg_reaches_the_engine_through_the_connector_only():
    public = {n for n in dir(KVConnector) if not n.startswith("_")}
    assert not hasattr(KVConnector, "__getattr__")
    used, bad = set(), []
    for path in sorted(DISAGG.glob("*.py")):
        tree = ast.parse(path.read_text())
        used |= _connector_uses(tree)
        bad += _engine_imports(tree, path)
        # no other handle on the engine: its runner, block manager or the engine object itself
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
            n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        bad += [f"{path.name}: {n}" for n in sorted(names & {"llm", "runner", "eng", "scheduler"})]
    assert bad == []
    assert used and used <= public, sorted(used - public)
    # what the receiving and sending sides need, and nothing of the step side
    assert {"reserve", "kv_arrived", "reserve_prefix", "import_kv", "cache_arrived", "export"} <= used
    assert not used & {"stage", "settle_chunk", "hand_off"}


def test_the_check_sees_a_reach_past_the_connector(tmp_path):
    src = "def f(self, kv):\n    kv.reserve(1)\n    self._kv.runner.x\n    self.kv.blocks.free([])\n"
    tree = ast.parse(src)
    assert _connector_uses(tree) == {"reserve", "runner", "blocks"}
    public = {n for n in dir(KVConnector) if not n.startswith("_")}
    assert _connector_uses(tree) - public == {"runner", "blocks"}
    assert _engine_imports(ast.parse("from ..engine.runner import Prefix\n"), tmp_path / "x.py") == [
        "x.py: ..engine.runner"]
