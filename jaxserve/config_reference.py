"""The configuration reference of docs/03-configuration.md, generated from the pydantic models of config.py.

Every key with its type, default and meaning (the field's own description), and the error a wrong value of it
gets: found by validating a config that holds such a value (`bad_value`), so the page shows exactly what `parse`
says. Then the rules between keys, each with a config that breaks it and, again, the error it gets.
`python -m bench.report` writes the result into the chapter; a test checks that the chapter holds it.
"""

from __future__ import annotations

import os
import tempfile
import types
import typing

import annotated_types as at
from pydantic import BaseModel

from .config import ClusterSection, Config, ConfigFileError, InstanceSection, LinkSection, TlsSection, parse
from .policy_config import BY_NAME, DEFAULT

BASE_CLUSTER = {"name": "c", "instances": [{"name": "i"}]}
# every section, by where it sits in a config; `policy` is one section per policy (`policy:NAME`, keyed by `name`)
PATHS = [(name, Config.model_fields[name].annotation) for name in ("model", "engine")] + [
    ("clusters[]", ClusterSection), ("clusters[].instances[]", InstanceSection), ("links[]", LinkSection),
    ("transfer", Config.model_fields["transfer"].annotation), ("transfer.tls", TlsSection),
    ("router", Config.model_fields["router"].annotation)] + [
    (f"policy:{name}", section) for name, section in BY_NAME.items()] + [
    ("server", Config.model_fields["server"].annotation)]


def section_keys(path: str, model) -> dict:
    """The section's keys in the tables (a policy's `name` picks the section: said once, above them)."""
    return {k: f for k, f in model.model_fields.items() if not (path.startswith("policy:") and k == "name")}


def _heading(path: str) -> list[str]:
    if not path.startswith("policy:"):
        return [f"### `{path}`", ""]
    name = path.partition(":")[2]
    intro = (["### `policy`", "", f"`policy.name` picks the placement policy, one of "
              f"{', '.join(f'`{n}`' for n in BY_NAME)} (default `{DEFAULT}`); each takes the keys of its own section "
              f"below, and a key of another policy's section is an error naming the policies that take it.", ""]
             if name == DEFAULT else [])
    return intro + [f"#### `policy` with `name: {name}`", ""]


def _place(path: str, key: str, value, tls_files: dict) -> dict:
    """A minimal config holding `value` for `key` of the section at `path` (tls_files: the TLS section's files,
    which must exist)."""
    item = {key: value}
    if path == "clusters[].instances[]":
        return {"clusters": [{"name": "c", "instances": [{"name": "i", **item}]}]}
    if path == "clusters[]":
        return {"clusters": [{**BASE_CLUSTER, **item}]}
    if path == "links[]":
        return {"clusters": [BASE_CLUSTER], "links": [{"src": "c", "dst": "c", **item}]}
    if path == "transfer.tls":
        return {"transfer": {"tls": {**tls_files, **item}}}
    if path.startswith("policy:"):
        return {"policy": {"name": path.partition(":")[2], **item}}
    return {path: item}


def _inner(ann):
    """The annotation less Optional: (the type, whether null is allowed)."""
    args = typing.get_args(ann)
    if typing.get_origin(ann) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return ann, False


def _bounds(field) -> dict:
    out = {}
    for m in field.metadata:
        for name in ("ge", "gt", "le", "lt"):
            if isinstance(m, getattr(at, name.capitalize())):
                out[name] = getattr(m, name)
    return out


def _nested(field) -> bool:
    """Whether the key holds a section of its own (a mapping, or a list of them)."""
    ann, _ = _inner(field.annotation)
    if typing.get_origin(ann) is list:
        ann = typing.get_args(ann)[0]
    return isinstance(ann, type) and issubclass(ann, BaseModel)


def type_name(field) -> str:
    ann, nullable = _inner(field.annotation)
    if typing.get_origin(ann) is typing.Literal:
        text = "one of " + ", ".join(f"`{a}`" for a in typing.get_args(ann))
    elif _nested(field):
        text = "list of mappings" if typing.get_origin(ann) is list else "mapping"
    else:
        text = getattr(ann, "__name__", None) or str(ann)
        if typing.get_origin(ann) is list:
            text = f"list of {typing.get_args(ann)[0].__name__}"
        b = _bounds(field)
        words = {"ge": ">=", "gt": ">", "le": "<=", "lt": "<"}
        if b:
            text += " " + ", ".join(f"{words[k]} {v}" for k, v in b.items())
    return text + (" or null" if nullable else "")


def bad_value(field):
    """A value of the field's key that validation refuses."""
    ann, _ = _inner(field.annotation)
    b = _bounds(field)
    if typing.get_origin(ann) is typing.Literal:
        return "bogus"
    if ann is bool:
        return "maybe"
    if ann in (int, float):
        if "ge" in b:
            return b["ge"] - 1
        if "gt" in b:
            return b["gt"]
        if "le" in b:
            return b["le"] + 1
        return "many"
    if typing.get_origin(ann) is list:
        return "not-a-list"
    if _nested(field):
        return "not-a-mapping"
    return ["not", "a", "string"] if ann is str else 5


def _default(field) -> str:
    if field.is_required():
        return "required"
    v = field.get_default(call_default_factory=True)
    if isinstance(v, BaseModel):
        return "(its keys' defaults)"
    if v is None:
        return "null"
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, list):
        return f"`{v}`" if v else "`[]`"
    return f"`{v}`"


def error_of(data: dict) -> str:
    """What `parse` says of a config (the first line, its source left out); '' when it is valid."""
    try:
        parse(data)
    except ConfigFileError as e:
        return str(e).splitlines()[0].removeprefix("<config>: ")
    return ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def key_errors() -> dict[tuple[str, str], str]:
    """{(section path, key): the error a wrong value of the key gets ('' if one were taken)}."""
    with tempfile.TemporaryDirectory() as d:
        files = {k: os.path.join(d, k) for k in ("ca_file", "cert_file", "key_file")}
        for f in files.values():
            open(f, "w").close()
        return {(path, key): error_of(_place(path, key, bad_value(field), files))
                for path, model in PATHS for key, field in section_keys(path, model).items()}


def key_tables() -> list[str]:
    errors = key_errors()
    lines = []
    for path, model in PATHS:
        lines += _heading(path)
        if model.__doc__:
            lines += [" ".join(model.__doc__.split()), ""]
        if not section_keys(path, model):
            lines += ["No keys beyond `name`.", ""]
            continue
        lines += ["| key | type | default | meaning | a wrong value's error |", "|---|---|---|---|---|"]
        for key, field in section_keys(path, model).items():
            meaning = field.description or ("its keys: below" if _nested(field) else "")
            lines.append(f"| `{key}` | {_cell(type_name(field))} | {_cell(_default(field))} | {_cell(meaning)} | "
                         f"{_cell(errors[path, key])} |")
        lines.append("")
    return lines


# rules between keys: a config that breaks each, and the error it gets
RULES = [
    ("an unknown key, anywhere", {"engine": {"blocksize": 16}}),
    ("`engine.chunk_size` a multiple of `block_size`", {"engine": {"block_size": 16, "chunk_size": 24}}),
    ("an instance's `devices` cover `tp` / `hosts`", {"clusters": [{"name": "c", "instances": [
        {"name": "i", "tp": 2}]}]}),
    ("`hosts` divide `tp`", {"clusters": [{"name": "c", "instances": [{"name": "i", "tp": 3, "hosts": 2,
                                                                       "devices": [0, 1]}]}]}),
    ("`kv_advertise` is host:port", {"clusters": [{"name": "c", "instances": [{"name": "i",
                                                                                "kv_advertise": "host"}]}]}),
    ("only a store spills", {"clusters": [{"name": "c", "instances": [{"name": "i", "spill_mb": 64}]}]}),
    ("a standby instance is launched by the router", {"clusters": [{"name": "c", "instances": [
        {"name": "i"}, {"name": "j", "standby": True, "launch": False}]}]}),
    ("launched instances sharing a device on this machine take at most all of it", {"clusters": [{
        "name": "c", "instances": [{"name": "p", "role": "prefill", "device_memory": 0.6},
                                   {"name": "d", "role": "decode", "device_memory": 0.6}]}]}),
    ("instance names are unique", {"clusters": [{"name": "c", "instances": [{"name": "i"}, {"name": "i"}]}]}),
    ("some instance decodes", {"clusters": [{"name": "c", "instances": [{"name": "i", "role": "prefill"}]}]}),
    ("one store at most", {"clusters": [{"name": "c", "instances": [{"name": "i"}, {"name": "s1", "role": "store"},
                                                                    {"name": "s2", "role": "store"}]}]}),
    ("a `prfaas` cluster holds prefill instances only", {"clusters": [BASE_CLUSTER, {
        "name": "x", "kind": "prfaas", "instances": [{"name": "x0", "role": "decode"}]}]}),
    ("a link's ends are clusters", {"clusters": [BASE_CLUSTER], "links": [{"src": "c", "dst": "elsewhere"}]}),
    ("`transfer.token` or `token_file`, not both", {"transfer": {"token": "t", "token_file": "/dev/null"}}),
    ("`router.down_after_s` exceeds `heartbeat_s`", {"router": {"heartbeat_s": 2, "down_after_s": 1}}),
    ("a policy's keys in its own section", {"policy": {"replan_s": 60}}),
    ("`policy.replan_s` needs both profiles", {"policy": {"name": "prfaas", "replan_s": 60}}),
    ("`policy.load_low` below `load_high`", {"policy": {"name": "flowkv", "load_low": 2, "load_high": 1}}),
    ("banaserve's `control_s` and `migrate` go together", {"policy": {"name": "banaserve", "control_s": 5}}),
    ("banaserve's `migrate` needs `control_s`", {"policy": {"name": "banaserve", "migrate": True}}),
    ("the threshold's band is wider than one step", {"policy": {"name": "prfaas", "raise_utilisation": 0.5,
                                                                "lower_utilisation": 0.4}}),
]


def rules_table() -> list[str]:
    import yaml
    lines = ["| rule | a config that breaks it | its error |", "|---|---|---|"]
    for rule, data in RULES:
        snippet = yaml.safe_dump(data, default_flow_style=True, sort_keys=False).strip()
        lines.append(f"| {_cell(rule)} | `{_cell(snippet)}` | {_cell(error_of(data))} |")
    return lines + [""]


def reference() -> str:
    """The markdown of every key and rule."""
    return "\n".join(["## Keys", ""] + key_tables() + ["## Rules between keys", ""] + rules_table()).rstrip() + "\n"
