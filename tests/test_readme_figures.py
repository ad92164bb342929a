"""The README's headline tables quote their result files: offline throughput against vLLM and transformers
(bench/results/offline.json, offline_smollm2.json) and online serving against vLLM's server
(bench/results/online_smollm2.json), every figure as the file gives it, rounded as printed. A re-run benchmark
whose figures the README does not carry fails here."""

import json
import os
import re
import statistics

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _readme() -> str:
    with open(os.path.join(ROOT, "README.md")) as f:
        return f.read()


def _result(name: str) -> dict:
    with open(os.path.join(ROOT, "bench", "results", name)) as f:
        return json.load(f)


def _row(text: str, after: str, first_cell: str) -> list[float]:
    """The numbers in the cells after the first of the first table row beginning `| first_cell |` that follows
    the text `after` (thousands separators dropped)."""
    start = text.index(after)
    line = next(ln for ln in text[start:].splitlines() if ln.startswith(f"| {first_cell} |"))
    cells = line.split("|")[2:]
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", "|".join(cells).replace(",", ""))]


def _agrees(quoted: list[float], exact: list[float], digits: int) -> bool:
    return len(quoted) == len(exact) and all(q == round(x, digits) for q, x in zip(quoted, exact))


OFFLINE = "On this 2-core CPU machine, output tokens/s, median (range):"
ONLINE = "Online, against vLLM's OpenAI server:"


@pytest.mark.parametrize("cell,key", [("vLLM, CPU build", "vllm"), ("jaxserve `LLM.generate`", "jaxserve"),
                                      ("transformers `generate`, batch 16", "transformers")])
def test_offline_throughput_is_the_files(cell, key):
    exact = [r[key]["output_tokens_per_s"][s] for r in (_result("offline.json"), _result("offline_smollm2.json"))
             for s in ("median", "min", "max")]
    quoted = _row(_readme(), OFFLINE, cell)
    assert _agrees(quoted, exact, 0), (cell, quoted, [round(x) for x in exact])


@pytest.mark.parametrize("cell,key", [("jaxserve / vLLM", "ratio_vs_vllm"),
                                      ("jaxserve / transformers", "ratio_vs_transformers")])
def test_offline_ratios_are_the_files(cell, key):
    exact = [r[key][s] for r in (_result("offline.json"), _result("offline_smollm2.json"))
             for s in ("median", "min", "max")]
    quoted = _row(_readme(), OFFLINE, cell)
    assert _agrees(quoted, exact, 2), (cell, quoted, [round(x, 2) for x in exact])


def test_offline_same_tokens_are_the_files():
    exact = [float(n) for r in (_result("offline.json"), _result("offline_smollm2.json"))
             for k in ("same_tokens_vllm", "same_tokens_transformers") for n in r[k].split("/")]
    assert _row(_readme(), OFFLINE, "requests with the same tokens as vLLM / transformers") == exact


FIGURES = ("ttft_s_p50", "ttft_s_p99", "tpot_s_p50", "tpot_s_p99", "itl_s_p50", "itl_s_p99")


@pytest.mark.parametrize("cell,key", [("jaxserve / vLLM", "ratio_jaxserve_over_vllm"),
                                      ("control / jaxserve (the same server twice)", "ratio_control_over_jaxserve")])
def test_online_ratios_are_the_files(cell, key):
    r = _result("online_smollm2.json")[key]
    exact = [r[f][s] for f in FIGURES for s in ("median", "min", "max")]
    quoted = _row(_readme(), ONLINE, cell)
    assert _agrees(quoted, exact, 2), (cell, quoted, [round(x, 2) for x in exact])


@pytest.mark.parametrize("cell,key", [("vLLM OpenAI server, CPU build", "vllm"), ("`jaxserve serve`", "jaxserve")])
def test_online_figures_are_the_files(cell, key):
    """TTFT in seconds (two decimals), TPOT and ITL in milliseconds (whole): medians of the passes."""
    passes = _result("online_smollm2.json")["systems"][key]["passes"]

    def med(figure, stat):
        return statistics.median(p[figure][stat] for p in passes)
    quoted = _row(_readme(), ONLINE, cell)
    assert _agrees(quoted[:2], [med("ttft_s", "p50"), med("ttft_s", "p99")], 2), (cell, quoted)
    ms = [1e3 * med(f, s) for f, s in (("tpot_s", "p50"), ("tpot_s", "p99"), ("itl_s", "p50"), ("itl_s", "p99"),
                                        ("itl_s", "max"))]
    assert _agrees(quoted[2:], ms, 0), (cell, quoted[2:], [round(x) for x in ms])
