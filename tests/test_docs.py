"""The README and docs/: what is generated is current (bench/report.py: docs/benchmarks.md and the README's headline
table from bench/results, the configuration keys from jaxserve/config.py), the figures come from the result files
and the errors from validation, every link lands, and the commands the README and docs show run as shown."""

import copy
import json
import os
import re
import shlex
import subprocess
import sys

import pytest

from bench import report

ROOT = report.ROOT
DOCS = sorted(os.path.join(ROOT, "docs", f) for f in os.listdir(os.path.join(ROOT, "docs")) if f.endswith(".md"))
PAGES = [os.path.join(ROOT, "README.md")] + DOCS


def read(path: str) -> str:
    with open(path) as f:
        return f.read()


def test_generated_docs_are_what_the_results_and_the_config_give():
    stale = [os.path.relpath(p, ROOT) for p, text in report.outputs().items() if read(p) != text]
    assert not stale, f"{stale}: run `python -m bench.report`"


def test_every_result_file_has_a_section_and_every_headline_its_file():
    results = report.load_results()
    claimed = {f for s in report.SECTIONS for f in s.files}
    assert set(results) <= claimed, set(results) - claimed
    assert {h.file for h in report.HEADLINES} <= set(results)
    assert {h.section for h in report.HEADLINES} <= {s.title for s in report.SECTIONS}


def test_a_figure_in_the_docs_follows_its_result_file():
    """Change a figure in a result (as a re-run would) and the page and the README's table change with it."""
    results = copy.deepcopy(report.load_results())
    before = report.benchmarks_md(results)
    assert "1.26x (1.02-1.33)" in before and "**0.94**" in before
    results["offline.json"]["ratio_vs_vllm"] = {"median": 1.5, "min": 1.4, "max": 1.6}
    results["transfer.json"]["efficiency"]["efficiency"] = 0.5
    after, table = report.benchmarks_md(results), report.headline_table(results)
    assert "1.50x (1.40-1.60)" in after and "**0.50**" in after and "1.26x (1.02-1.33)" not in after
    assert "1.50x (1.40-1.60)" in table and "**0.50**" in table
    stamp = results["offline.json"]["stamp"]
    assert f"commit `{stamp['commit'][:7]}`" in after and stamp["command"] in after


def test_a_result_without_a_stamp_says_so():
    assert "no stamp" in report.provenance("x.json", {"device": "NVIDIA H100 80GB HBM3"})
    assert report.machine({"stamp": {"machine": {"cpus": 16, "affinity": 2}}}) == "CPU, 2 cores"
    assert report.machine({"stamp": {"machine": {"devices": ["NVIDIA H200"]}}}) == "NVIDIA H200"


def test_every_config_key_is_described_and_a_wrong_value_of_it_refused():
    from jaxserve.config_reference import PATHS, RULES, error_of, key_errors, section_keys
    doc, errors = read(report.CONFIG_DOC), key_errors()
    for path, model in PATHS:
        for key, field in section_keys(path, model).items():
            assert field.description, f"{path}.{key} has no description"
            assert f"| `{key}` |" in doc, f"{path}.{key} is not in docs/03-configuration.md"
            assert errors[path, key], f"{path}.{key}: the value meant to be wrong was taken"
    for rule, data in RULES:
        assert error_of(data), f"the rule {rule!r}: its example config is valid"


def test_the_readme_is_a_front_door():
    lines = read(os.path.join(ROOT, "README.md")).splitlines()
    assert len(lines) < 250
    text = "\n".join(lines)
    for must in ("make serve", "make test", "curl ", "from openai import OpenAI", "docs/benchmarks.md"):
        assert must in text, must


LINK = re.compile(r"\]\(([^)\s]+)\)")


def anchors(text: str) -> set[str]:
    """GitHub's anchors of a page's headings."""
    out = set()
    for line in text.splitlines():
        m = re.match(r"#+ (.*)", line)
        if m:
            out.add(re.sub(r"[^a-z0-9 _-]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_every_link_lands(page):
    text = read(page)
    for target in LINK.findall(text):
        if target.startswith(("http://", "https://")):
            continue
        path, _, anchor = target.partition("#")
        dest = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(dest), f"{target}: no {os.path.relpath(dest, ROOT)}"
        if anchor:
            assert anchor in anchors(read(dest)), f"{target}: no heading with that anchor"


def code_blocks(text: str) -> list[str]:
    """The text of each fenced code block, in order."""
    out, inside = [], None
    for line in text.splitlines(keepends=True):
        if line.startswith("```"):
            if inside is None:
                inside = []
            else:
                out.append("".join(inside))
                inside = None
        elif inside is not None:
            inside.append(line)
    return out


def shown_commands(text: str) -> list[str]:
    """The `jaxserve` commands of a page's code blocks that need no model and no GPU (--help, validate, plan), a
    continued line joined, comments dropped."""
    out = []
    for block in code_blocks(text):
        for cmd in block.replace("\\\n", " ").splitlines():
            cmd = cmd.split("#")[0].strip()
            if cmd.startswith("$ "):
                cmd = cmd[2:]
            if re.match(r"jaxserve (--help|validate|plan)\b", cmd):
                out.append(cmd)
    return out


def run_shown(cmd: str) -> subprocess.CompletedProcess:
    args = shlex.split(cmd)
    return subprocess.run([sys.executable, "-m", "jaxserve.router.cli", *args[1:]], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: os.path.relpath(p, ROOT))
def test_the_commands_shown_run_as_shown(page):
    for cmd in shown_commands(read(page)):
        out = run_shown(cmd)
        assert out.returncode == 0, (cmd, out.stderr[-2000:])


def test_the_readme_shows_the_commands_that_need_no_model():
    cmds = shown_commands(read(os.path.join(ROOT, "README.md")))
    assert any(c.startswith("jaxserve --help") for c in cmds) and any(c.startswith("jaxserve validate") for c in cmds)
    assert any(c.startswith("jaxserve plan") for c in cmds)


def test_shown_output_is_what_the_command_prints():
    """docs/03's `jaxserve validate` example: its printed lines as the page shows them."""
    block = next(b for b in code_blocks(read(os.path.join(ROOT, "docs", "03-configuration.md")))
                 if b.startswith("$ jaxserve validate"))
    cmd, shown = block.split("\n", 1)
    out = run_shown(cmd[2:])
    assert out.returncode == 0 and out.stdout == shown, out.stdout


def test_validate_refuses_a_bad_config_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text(json.dumps({"engine": {"block_size": 0}}))
    out = run_shown(f"jaxserve validate --config {bad}")
    assert out.returncode == 2 and "engine.block_size: Input should be greater than or equal to 1" in out.stderr
    exposed = tmp_path / "exposed.yaml"
    exposed.write_text(json.dumps({"router": {"host": "0.0.0.0"}, "clusters": [{"name": "c", "instances": [
        {"name": "p", "role": "prefill"}, {"name": "d", "role": "decode"}]}]}))
    out = run_shown(f"jaxserve validate --config {exposed}")
    assert out.returncode == 2 and "transfer.token" in out.stderr
