"""The JSON schema rewrites of structured outputs (jaxserve/schema.py), without a model: strict closes every object
at any depth and refuses what it cannot close exactly; numbers get bounds and a step unless the schema gives its
own; the whitespace switch; and, on a byte-level tokenizer, what the compiled grammars then accept and refuse."""

from __future__ import annotations

import json

import pytest

from jaxserve.schema import INT_LIMIT, NUMBER_LIMIT, NUMBER_STEP, SchemaError, bounded, closed, flexible

NESTED = {"type": "object", "required": ["a"],
          "properties": {"a": {"type": "object", "properties": {"x": {"type": "integer"}}},
                         "b": {"type": "array", "items": {"type": "object", "properties": {"y": {"type": "string"}}}},
                         "c": {"anyOf": [{"type": "object", "properties": {"z": {"type": "boolean"}}},
                                         {"type": "null"}]},
                         "d": {"$ref": "#/$defs/point"},
                         "e": {"type": "object", "additionalProperties": True},
                         "f": {"type": ["object", "null"], "properties": {"w": {"type": "number"}}}},
          "$defs": {"point": {"properties": {"lat": {"type": "number"}}, "required": ["lat"]}}}


def objects(node, path="$"):
    """(path, schema) of every object schema in `node`."""
    if not isinstance(node, dict):
        return []
    out = []
    t = node.get("type")
    if t == "object" or (isinstance(t, list) and "object" in t) or ("type" not in node and "properties" in node):
        out.append((path, node))
    for k, v in node.items():
        if isinstance(v, dict):
            out += objects(v, f"{path}.{k}")
            if k in ("properties", "$defs"):
                for name, s in v.items():
                    out += objects(s, f"{path}.{k}.{name}")
        elif isinstance(v, list):
            for i, s in enumerate(v):
                out += objects(s, f"{path}.{k}[{i}]")
    return out


def test_strict_closes_every_object_and_keeps_an_explicit_choice():
    before = json.dumps(NESTED)
    out = closed(NESTED)
    assert json.dumps(NESTED) == before  # nothing mutated
    found = dict(objects(out))
    assert len(found) == 7  # the root, a, b's items, c's object, the $def, e, f
    for path, node in found.items():
        want = True if path.endswith(".e") else False
        assert node["additionalProperties"] is want, path
    assert "additionalProperties" not in out["properties"]["c"]  # an anyOf is not itself an object
    assert out["properties"]["a"]["properties"] == NESTED["properties"]["a"]["properties"]


def test_strict_refuses_what_it_cannot_close_exactly():
    with pytest.raises(SchemaError, match="allOf"):
        closed({"allOf": [{"type": "object", "properties": {"a": {"type": "string"}}},
                          {"properties": {"b": {"type": "string"}}}]})
    with pytest.raises(SchemaError):
        closed(["not", "an", "object"])
    # an allOf of non-objects closes fine
    assert closed({"type": "object", "properties": {"n": {"allOf": [{"minimum": 0}, {"maximum": 5}]}}})


def test_numbers_are_bounded_unless_the_schema_bounds_them():
    s = bounded({"type": "object", "properties": {
        "i": {"type": "integer"}, "n": {"type": "number"}, "pos": {"type": "integer", "minimum": 0},
        "ex": {"type": "number", "exclusiveMaximum": 1}, "step": {"type": "number", "multipleOf": 0.5},
        "e": {"type": "integer", "enum": [1, 2]}, "c": {"const": 3.25, "type": "number"},
        "opt": {"type": ["number", "null"]}, "s": {"type": "string"},
        "deep": {"type": "array", "items": {"anyOf": [{"type": "integer"}]}}}})
    p = s["properties"]
    assert p["i"] == {"type": "integer", "minimum": -INT_LIMIT, "maximum": INT_LIMIT}
    assert p["n"] == {"type": "number", "minimum": -NUMBER_LIMIT, "maximum": NUMBER_LIMIT, "multipleOf": NUMBER_STEP}
    assert p["pos"] == {"type": "integer", "minimum": 0, "maximum": INT_LIMIT}
    assert p["ex"] == {"type": "number", "exclusiveMaximum": 1, "minimum": -NUMBER_LIMIT, "multipleOf": NUMBER_STEP}
    assert p["step"]["multipleOf"] == 0.5 and p["step"]["maximum"] == NUMBER_LIMIT
    assert p["e"] == {"type": "integer", "enum": [1, 2]} and p["c"] == {"const": 3.25, "type": "number"}
    assert p["opt"]["multipleOf"] == NUMBER_STEP and p["s"] == {"type": "string"}
    assert p["deep"]["items"]["anyOf"][0]["maximum"] == INT_LIMIT
    assert INT_LIMIT < 2 ** 63 - 1 and float(INT_LIMIT) == INT_LIMIT  # inside int64, exact as a float64
    # a bound beyond the limit: the other side is left open rather than emptying the range
    assert "maximum" not in bounded({"type": "number", "minimum": 1e17})
    assert "minimum" not in bounded({"type": "integer", "exclusiveMaximum": -10 ** 19})


def test_flexible_whitespace_unless_the_schema_says_otherwise():
    spec = json.dumps({"type": "object"})
    assert json.loads(flexible(spec))["x-guidance"]["whitespace_flexible"] is True
    own = json.dumps({"type": "object", "x-guidance": {"whitespace_flexible": False}})
    assert flexible(own) == own


@pytest.fixture(scope="module")
def grammars():
    """A grammar engine over a byte-level BPE tokenizer with no merges (every byte one token) and an end-of-text
    token of its own: what it accepts is the grammar's own language, not a model's vocabulary. (Without an EOS id
    the grammar engine takes one of the byte tokens for it, and the alphabet's order differs from run to run:
    a `"` or a newline then ended the text in some runs.)"""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from jaxserve.structured import Grammars
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    eos = vocab["<eos>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return Grammars(tok.to_str(), len(vocab), [eos]), tok


def accepts(grammars, spec: str, text: str) -> bool:
    from jaxserve.structured import Guided
    g, tok = grammars
    guide = g.guide(Guided("json", spec))
    for t in tok.encode(text).ids:
        if not guide.advance(t):
            return False
    return guide.m.is_accepting()


def test_the_grammars_accept_compact_closed_bounded_answers(grammars):
    open_ = {"type": "object", "required": ["answer", "confidence"],
             "properties": {"answer": {"type": "boolean"}, "confidence": {"type": "number", "minimum": 0,
                                                                          "maximum": 1}}}
    strict, loose = json.dumps(closed(open_)), json.dumps(open_)
    assert accepts(grammars, strict, '{"answer":true,"confidence":0.95}')
    assert not accepts(grammars, strict, '{"answer":true,"confidence":0.95,"type":"x"}')  # closed
    assert accepts(grammars, loose, '{"answer":true,"confidence":0.95,"type":"x"}')  # JSON Schema's own meaning
    assert not accepts(grammars, strict, '{"answer": true, "confidence": 0.95}')  # compact
    assert not accepts(grammars, strict, '{\n"answer":true,"confidence":0.95}')
    assert accepts(grammars, flexible(strict), '{\n  "answer": true,\n  "confidence": 0.95\n}')
    assert accepts(grammars, strict, '{"answer":true,"confidence":0.1234567891}')
    assert not accepts(grammars, strict, '{"answer":true,"confidence":0.12345678912}')  # 11 decimals
    population = json.dumps({"type": "integer", "minimum": 0})
    assert accepts(grammars, population, "9" * 18) and not accepts(grammars, population, "1" * 20)
    assert not accepts(grammars, population, "-1")
    number = json.dumps({"type": "number"})
    assert accepts(grammars, number, "-12.5") and not accepts(grammars, number, "1" * 17)
    words = json.dumps({"type": "string", "maxLength": 5})
    assert accepts(grammars, words, '"abcde"') and not accepts(grammars, words, '"abcdef"')
