"""A CI check over the project's own source: nothing that deserialises into code or runs strings as code enters
it (pickle / marshal / shelve, eval / exec, unsafe YAML loading, numpy's allow_pickle, torch.load without
weights_only, shell=True, an unsandboxed Jinja environment for checkpoint templates)."""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parent.parent
PACKAGES = ("jaxserve", "transfer", "router", "pallas_kernels", "bench")
BANNED_MODULES = {"pickle", "cPickle", "dill", "marshal", "shelve", "cloudpickle", "jsonpickle"}
BANNED_CALLS = {"eval", "exec", "compile", "__import__"}


def findings(tree: ast.AST, name: str) -> list[str]:
    out = []
    for node in ast.walk(tree):
        where = f"{name}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Import):
            out += [f"{where}: import {a.name}" for a in node.names if a.name.split(".")[0] in BANNED_MODULES]
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in BANNED_MODULES:
            out.append(f"{where}: from {node.module} import")
        elif isinstance(node, ast.Call):
            f = node.func
            fname = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
            owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else ""
            kw = {k.arg: k.value for k in node.keywords}
            if isinstance(f, ast.Name) and fname in BANNED_CALLS:
                out.append(f"{where}: {fname}()")
            if owner == "yaml" and fname in ("load", "load_all", "unsafe_load", "full_load", "unsafe_load_all"):
                out.append(f"{where}: yaml.{fname}() (use yaml.safe_load)")
            if fname == "load" and owner in ("np", "numpy") and isinstance(kw.get("allow_pickle"), ast.Constant) \
                    and kw["allow_pickle"].value:
                out.append(f"{where}: np.load(allow_pickle=True)")
            if owner == "torch" and fname == "load" and not (isinstance(kw.get("weights_only"), ast.Constant)
                                                             and kw["weights_only"].value is True):
                out.append(f"{where}: torch.load without weights_only=True")
            if isinstance(kw.get("shell"), ast.Constant) and kw["shell"].value is True:
                out.append(f"{where}: shell=True")
            if owner == "jinja2" and fname == "Environment":
                out.append(f"{where}: jinja2.Environment (templates from checkpoints need the sandbox)")
    return out


def test_no_unsafe_deserialisation_or_code_execution_in_the_source():
    files = [p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")
             if not any(part.startswith(".") for part in p.relative_to(ROOT).parts)]  # not bench/.vllm-venv
    assert len(files) > 40
    found = [f for p in files for f in findings(ast.parse(p.read_text(), str(p)), str(p.relative_to(ROOT)))]
    assert found == [], "\n".join(found)


def test_the_check_finds_what_it_bans():
    src = ("import pickle\nfrom marshal import loads\nimport yaml, numpy as np, torch, jinja2, subprocess\n"
           "eval('1')\nyaml.load(s)\nnp.load(f, allow_pickle=True)\ntorch.load(f)\n"
           "subprocess.run('x', shell=True)\njinja2.Environment()\nyaml.safe_load(s)\ntorch.load(f, weights_only=True)\n")
    got = findings(ast.parse(src), "x.py")
    assert len(got) == 8, got
