"""The router speaks to workers through the message models of jaxserve/worker/messages.py: every call it makes
passes `message(method, ...)` for that method (read from the source), a field out of bounds is a RequestError
naming it before anything is sent, and a model goes over the wire as the JSON the worker's schema takes."""

import ast
import json
import pathlib

import pytest

from jaxserve.engine.client import RequestError
from jaxserve.router.calls import message
from jaxserve.worker import messages, rpc

ROUTER = pathlib.Path(__file__).resolve().parents[2] / "router"


def _made_by_message(node, method: str) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "message"
            and node.args and isinstance(node.args[0], ast.Constant) and node.args[0].value == method)


def _calls(path: pathlib.Path) -> list[tuple[int, str, bool]]:
    """(line, method, whether its request is `message(method, ...)`) of every .call / .stream to a worker method:
    the argument itself, or a name the enclosing function assigns from `message(...)` (or a variable method whose
    message is built with the same variable)."""
    tree = ast.parse(path.read_text())
    out = []
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        assigned = {}
        for node in ast.walk(fn):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                assigned[node.targets[0].id] = node.value
        for node in ast.walk(fn):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                    and node.func.attr in ("call", "stream") and len(node.args) >= 2):
                continue
            name, msg = node.args[0], node.args[1]
            if isinstance(name, ast.Constant) and name.value in messages.WORKER:
                method = name.value
                ok = _made_by_message(msg, method) or (isinstance(msg, ast.Name)
                                                       and _made_by_message(assigned.get(msg.id), method))
            elif isinstance(name, ast.Name) and isinstance(msg, ast.Name):  # stream(method, msg)
                made = assigned.get(msg.id)
                method = f"<{name.id}>"
                ok = (isinstance(made, ast.Call) and isinstance(made.func, ast.Name) and made.func.id == "message"
                      and isinstance(made.args[0], ast.Name) and made.args[0].id == name.id)
            else:
                continue
            out.append((node.lineno, method, ok))
    return out


def test_every_router_call_passes_its_message_model():
    seen = {}
    for path in sorted(ROUTER.rglob("*.py")):
        for line, method, ok in _calls(path):
            assert ok, f"{path.name}:{line}: {method} is sent without message({method!r}, ...)"
            seen[method] = seen.get(method, 0) + 1
    # the request path, prefix moves and admin operations each reach their methods
    assert {"Prefill", "Import", "Export", "Load", "Profile", "SetLink", "SetRole", "Migrate", "<method>"} <= set(seen)


def test_the_source_check_sees_a_raw_dict(tmp_path):
    bad = tmp_path / "x.py"
    bad.write_text("async def f(c):\n    await c.call('SetRole', {'role': 'decode'})\n"
                   "async def g(c, method):\n    m = {'request_id': 'r'}\n    c.stream(method, m)\n")
    assert [ok for _, _, ok in _calls(bad)] == [False, False]


def test_a_field_out_of_bounds_is_a_request_error_naming_it():
    with pytest.raises(RequestError, match=r"params\.n: Input should be less than or equal to 64") as e:
        message("Generate", request_id="r", prompt=[1, 2], params={"n": 65})
    assert e.value.param == "n"
    with pytest.raises(RequestError, match="prompt"):
        message("Decode", request_id="r", prompt=[], kv_tokens=1)


def test_a_model_goes_as_the_json_its_schema_takes():
    msg = message("Prefill", request_id="r.1", prompt=[3, 4, 5], params={"max_tokens": 4, "temperature": 0.0},
                  kv_tokens=2, sample=False, dst={"instance": "d0", "blocks": [7], "skip": 0},
                  prefix_from={"import_id": "r.1.prefix", "tokens": 1})
    wire = json.loads(rpc._enc(msg))
    assert wire["dst"] == {"instance": "d0", "blocks": [7], "skip": 0} and "store" not in wire  # unset: left out
    assert messages.Prefill.model_validate(wire) == msg


def test_an_update_stream_carries_each_steps_new_tokens_and_rebuilds_the_cumulative_updates():
    """A worker's stream sends each Update as what the one before did not carry (engine/client.py
    update_message): the receiver rebuilds every cumulative Update exactly, through JSON; a text that does not
    extend what was sent goes whole, the finished update whole; a message that does not follow what the receiver
    holds is refused."""
    from jaxserve.engine.client import Update, update_message, update_of
    steps, ids, lps = [], [], []
    for k, text in enumerate(["He", "Hell", "Hello", "Hello", "Hi!", "Hi! there"]):
        ids, lps = ids + [10 + k], lps + [[-0.5 * k, [[10 + k, -0.5 * k], [3, -2.0]]]]
        steps.append(Update(0, list(ids), text, k == 5, "length" if k == 5 else None, list(lps), 4, 9,
                            ttft_s=0.25))
    sent, held, sizes = (0, ""), None, []
    for u in steps:
        msg, sent = update_message(u, sent)
        msg = json.loads(json.dumps(msg))
        sizes.append((len(msg["token_ids"]), len(msg["logprobs"]), msg["text"]))
        held = update_of(msg, held)
        assert held == u
    # one token a step, the text's new characters (whole where "Hi!" does not extend "Hello"), the last whole
    assert sizes == [(1, 1, "He"), (1, 1, "ll"), (1, 1, "o"), (1, 1, ""), (1, 1, "Hi!"), (6, 6, "Hi! there")]
    msg, _ = update_message(steps[3], (2, "Hell"))
    with pytest.raises(ValueError, match="from token 2"):
        update_of(msg, None)  # a stream's first message must start at 0
    with pytest.raises(ValueError, match="text 4"):
        update_of(msg, Update(0, [10, 11], "He", False, None, lps[:2], 4, 9))


def test_a_grown_view_reads_the_first_items_of_a_growing_list_as_a_list_would():
    """Grown (a running request's token_ids and logprobs in an Update): indexing, slices, iteration, equality and
    concatenation as a list of its first n items, whatever was appended after; `after` shares the list only where
    the view is all of it."""
    from jaxserve.engine.client import Grown
    items = [10, 11, 12]
    g = Grown(items)
    items.append(13)  # the engine appends the next step's token
    assert len(g) == 3 and g == [10, 11, 12] and [10, 11, 12] == g and list(g) == [10, 11, 12]
    assert g[-1] == 12 and g[1:] == [11, 12] and g[::-2] == [12, 10] and g[5:] == [] and [1] + g == [1, 10, 11, 12]
    with pytest.raises(IndexError):
        g[3]
    assert g != [10, 11, 12, 13] and not g == [10, 11]
    shared = Grown(items).after(4, [14])
    assert shared == [10, 11, 12, 13, 14] and items[-1] == 14  # extended in place: the view was the whole list
    copied = g.after(2, [99])
    assert copied == [10, 11, 99] and items == [10, 11, 12, 13, 14]  # an older view copies
    assert json.dumps(g[:]) == "[10, 11, 12]"
