"""JSON schema rewrites for structured outputs (structured.py): what makes a schema's answers close and end.

- `closed(schema)`: OpenAI's `strict: true`. Every object without `additionalProperties` gets `false`, as OpenAI's
  API and vLLM's default grammar backend treat a strict schema, so the model cannot invent keys. An `allOf` over
  objects cannot be closed exactly (each branch closed alone would refuse the other's properties), so a strict schema
  with one is refused (GuidedError), as is a schema that is not an object.
- `bounded(schema)`: numbers end. A number the schema does not bound is limited to what a float64 holds exactly as
  a decimal the grammar can write: |x| <= 2^53 (NUMBER_LIMIT) with at most 10 decimals (NUMBER_STEP, the finest
  `multipleOf` llguidance compiles); an integer to |x| <= INT_LIMIT, inside int64 (llguidance reads bounds as
  float64: INT_LIMIT is one it holds exactly). A bound or `multipleOf` the schema gives stays; `enum` and `const`
  are left alone. Without these a small model writes digits until max_tokens.
- `COMPACT`: no whitespace at all, `,` and `:` between items (as `json.dumps(separators=(",", ":"))` writes and
  OpenAI's structured outputs answer): a small model given room for whitespace fills it with newlines, and with
  `", "` / `": "` SmolLM2 repeats array items where with `,` it closes them. `flexible(spec)` asks for JSON's own
  whitespace anywhere instead (`server.json_whitespace: flexible`); a schema's own `x-guidance` options win over
  both.

Strings need no rewrite: a `maxLength` the schema sets is enforced by the grammar; without one a string ends when
the model closes it (or at max_tokens). Pure functions over the schema's dicts; nothing is mutated.
"""

from __future__ import annotations

import json

INT_LIMIT = 9_200_000_000_000_000_000  # < 2^63 - 1, exact as a float64
NUMBER_LIMIT = 2 ** 53  # the integers a float64 holds exactly
NUMBER_STEP = 1e-10  # at most 10 decimals
COMPACT = {"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}
FLEXIBLE = {**COMPACT, "whitespace_flexible": True}

# where a schema holds subschemas: a mapping of them, one, or a list of them
_MAPS = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")
_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
        "unevaluatedProperties", "unevaluatedItems", "additionalItems")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems", "items")


class SchemaError(ValueError):
    """A schema that cannot be served as asked."""


def _walk(node, fn):
    """`fn` applied to every subschema of `node`, innermost first -> a new schema."""
    if not isinstance(node, dict):
        return node  # a boolean schema
    out = dict(node)
    for k in _MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _walk(s, fn) for name, s in out[k].items()}
    for k in _ONE:
        if isinstance(out.get(k), dict):
            out[k] = _walk(out[k], fn)
    for k in _LISTS:
        if isinstance(out.get(k), list):
            out[k] = [_walk(s, fn) for s in out[k]]
    return fn(out)


def _types(node: dict) -> set:
    t = node.get("type")
    return {t} if isinstance(t, str) else set(t) if isinstance(t, list) else set()


def _is_object(node) -> bool:
    return isinstance(node, dict) and ("object" in _types(node) or ("type" not in node and any(
        k in node for k in ("properties", "patternProperties", "required"))))


def closed(schema: dict) -> dict:
    """`schema` under `strict: true` (SchemaError when it cannot be closed exactly)."""
    if not isinstance(schema, dict):
        raise SchemaError("a strict schema is an object")

    def close(node: dict) -> dict:
        if any(_is_object(b) for b in node.get("allOf") or ()):
            raise SchemaError("strict: an allOf of objects cannot be closed exactly (each branch would refuse the "
                              "other's properties); give the properties in one object, or strict: false")
        if _is_object(node) and "additionalProperties" not in node:
            node["additionalProperties"] = False
        return node
    return _walk(schema, close)


def _bound(node: dict) -> dict:
    types = _types(node)
    if "enum" in node or "const" in node or not types & {"number", "integer"}:
        return node
    limit = NUMBER_LIMIT if "number" in types else INT_LIMIT
    low, high = node.get("minimum", node.get("exclusiveMinimum")), node.get("maximum", node.get("exclusiveMaximum"))
    if low is None and (high is None or high > -limit):  # a bound added never empties the range the schema gave
        node["minimum"] = -limit
    if high is None and (low is None or low < limit):
        node["maximum"] = limit
    if "number" in types and "multipleOf" not in node:
        node["multipleOf"] = NUMBER_STEP
    return node


def bounded(schema):
    """`schema` with its numbers limited (the module docstring)."""
    return _walk(schema, _bound)


def flexible(spec: str) -> str:
    """A JSON schema's text asking for flexible whitespace, unless it sets its own `x-guidance`."""
    schema = json.loads(spec)
    if not isinstance(schema, dict) or "x-guidance" in schema:
        return spec
    return json.dumps({**schema, "x-guidance": FLEXIBLE})
