"""The README's tables of measured figures quote their result files in bench/results/, every figure as the file
gives it, rounded as printed: offline throughput against vLLM and transformers and where a step's time goes
(offline.json, offline_smollm2.json), online serving against vLLM's server (online_smollm2.json), the step
benchmarks (steps*.json), the KV transfer (CPU per GB, TTFT disaggregated vs colocated, Phi_kv), the fault matrix, the
soak, PrfaaS live and its bandwidth drop, the KV footprint, the serving benchmark, the
global store, migration, load balancing, the simulator's case study and validation, the grammar engines and the
kernels on an H200 (kernels_h200.json). A benchmark re-run without its README table, or a figure copied wrong,
fails here. So do the goal-bearing figures of the running text: transfer efficiency, interference, structured
outputs, start-up and the soak's totals. (Not checked: the planner's table, printed by `jaxserve plan`, and the
rest of the running text.)"""

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


def _row(text: str, after: str, first_cell: str, prefix: bool = False, labels: int = 1) -> list[float]:
    """The numbers (thousands separators dropped) in all but the first `labels` cells of the first table row after
    the text `after` that begins `| first_cell |` (prefix: whose first cell begins with `first_cell`)."""
    start = text.index(after)
    head = f"| {first_cell}" if prefix else f"| {first_cell} |"
    line = next(ln for ln in (x.lstrip() for x in text[start:].splitlines()) if ln.startswith(head))  # or in a list
    cells = line.split("|")[1 + labels:]
    return [float(x) for x in re.findall(r"\d+(?:\.\d+)?", "|".join(cells).replace(",", ""))]


def _agrees(quoted: list[float], exact: list[float], digits: int) -> bool:
    """Each quoted figure is its exact one rounded to `digits` decimals (a half either way)."""
    half = 0.5 * 10 ** -digits + 1e-9
    return len(quoted) == len(exact) and all(abs(q - x) <= half for q, x in zip(quoted, exact))


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


STEPS = {  # result file: (the text before its table, {row: case})
    "steps.json": ("What the decode step gained", {
        "decode, 4 requests, 16 tokens cached each": "decode:4x16", "decode, 4 requests, 300 cached": "decode:4x300",
        "decode, 16 requests, 300 cached": "decode:16x300", "decode, 48 requests, 150 cached": "decode:48x150",
        "prefill, 4 first chunks of 128 tokens": "prefill:4x128",
        "prefill, one first chunk of 256 tokens": "prefill:1x256"}),
    "steps_prefill.json": ("Prefill, then:", {
        "prefill, 4 first chunks of 128 tokens": "prefill:4x128",
        "prefill, 3 first chunks of 100 tokens": "prefill:3x100",
        "prefill, one first chunk of 256 tokens": "prefill:1x256",
        "prefill, 256 tokens after 768 cached": "prefill:1x256@768",
        "prefill, 2 chunks of 132 tokens after 508 cached": "prefill:2x132@508",
        "decode, 48 requests, 150 cached": "decode:48x150"}),
    "steps_matmul.json": ("A light load's decode steps:", {
        "decode, 1 request": "decode:1x150", "decode, 2 requests": "decode:2x150",
        "decode, 3 requests (3 rows; before, 4)": "decode:3x150", "decode, 4 requests": "decode:4x150",
        "decode, 6 requests (6 rows; before, 8)": "decode:6x150", "decode, 16 requests": "decode:16x150",
        "decode, 48 requests": "decode:48x150", "prefill, one first chunk of 256 tokens": "prefill:1x256"}),
}


@pytest.mark.parametrize("name", sorted(STEPS))
def test_step_tables_are_the_files(name):
    """Per row: the step before and now (ms, one decimal), the median and range of the paired ratios."""
    after, rows = STEPS[name]
    cases = _result(name)["cases"]
    for cell, case in rows.items():
        c = cases[case]
        quoted = _row(_readme(), after, cell)
        assert _agrees(quoted[:2], [c["baseline_ms"], c["this_ms"]], 1), (name, cell, quoted)
        assert _agrees(quoted[2:], [c["ratio"][s] for s in ("median", "min", "max")], 2), (name, cell, quoted)


def _sig2(x: float) -> float:
    return float(f"{x:.2g}")


@pytest.mark.parametrize("cell,policy", [("never offload (all on the PD cluster)", "never"),
                                         ("always offload (naive heterogeneous)", "always"),
                                         ("selective (threshold 256, adaptive)", "selective")])
def test_prfaas_live_table_is_the_file(cell, policy):
    """requests/s and goodput (two decimals), SLO met (whole %), TTFT p50 / p90 (two significant figures),
    routes, failed (of requests)."""
    p = _result("prfaas_live.json")["policies"][policy]
    quoted = _row(_readme(), "`python -m bench.prfaas_live --json bench/results/prfaas_live.json", cell)
    assert _agrees(quoted[:2], [p["throughput_rps"], p["goodput_rps"]], 2), (cell, quoted)
    assert quoted[2] == round(100 * p["slo_attainment"]), (cell, quoted)
    assert quoted[3:5] == [_sig2(p["ttft_p50_s"]), _sig2(p["ttft_p90_s"])], (cell, quoted)
    assert quoted[5:8] == [p["routes"].get(r, 0) for r in ("pd", "prfaas", "colocated")], (cell, quoted)
    assert quoted[8:] == ([p["failed"], p["requests"]] if p["failed"] else [0]), (cell, quoted)


STEP_KINDS = [("decode only (48 rows)", "decode"), ("prefill (512-token budget) + decode, one program", "mixed"),
              ("prefill only (the first step)", "prefill")]


@pytest.mark.parametrize("cell,kind", STEP_KINDS)
def test_step_breakdown_is_the_file(cell, kind):
    """Where a step's time goes, the last timed pass of offline.json: count, then ms (one decimal) of the wall,
    scheduling, input preparation, device program and output handling (every output phase together)."""
    step = _result("offline.json")["jaxserve"]["passes"][-1]["steps"][kind]
    phases = step["phases_ms"]
    ms = [step["mean_ms"], phases["schedule"], phases[f"{kind}.prepare"], phases[f"{kind}.device"],
          sum(v for k, v in phases.items() if k.endswith(".output"))]
    quoted = _row(_readme(), "Where a step's time goes", cell)
    assert quoted[0] == step["count"] and _agrees(quoted[1:], ms, 1), (cell, quoted, [round(x, 1) for x in ms])


def test_kv_footprint_table_is_the_file():
    """Each model the table lists: MiB per request after 1K-128K tokens (one decimal), and at 32K how many times
    smaller than each dense baseline (one decimal)."""
    r = _result("kv_footprint.json")
    text = _readme()
    table = text[text.index("| model | 1K |"):].split("\n\n")[0].splitlines()[2:]
    assert len(table) >= 6
    for line in table:
        model = line.split("|")[1].strip().split(" (")[0]
        m = r["models"][model]
        quoted = _row(text, "`python -m bench.kv_footprint", model, prefix=True)
        mib = [m["kv_bytes"][str(n)] / 2 ** 20 for n in r["lengths"]]
        smaller = [m["ratio_vs_dense"][d]["32768"] for d in r["dense_baseline"]]
        assert _agrees(quoted, mib + smaller, 1), (model, quoted)


def test_serving_table_is_the_file():
    r = _result("serving.json")
    j, t = r["jaxserve"], r["transformers"]
    after = "`python -m bench.serving --json bench/results/serving.json`"
    quoted = _row(_readme(), after, "jaxserve engine")
    assert _agrees(quoted[:1], [j["output_tokens_per_s"]], 1), quoted
    assert _agrees(quoted[1:4], [j["ttft_s"][p] for p in ("p50", "p90", "p99")], 2), quoted
    assert _agrees(quoted[4:], [j["tpot_s"][p] for p in ("p50", "p90", "p99")], 3), quoted
    quoted = _row(_readme(), after, "transformers generate (sequential)")  # 70.5 | (e2e p50 5.54)
    assert _agrees(quoted[:1], [t["output_tokens_per_s"]], 1) and _agrees(quoted[-1:], [t["e2e_s"]["p50"]], 2), quoted
    assert _agrees(_row(_readme(), after, "ratio"), [r["ratio_output_tokens_per_s"]], 2)


@pytest.mark.parametrize("cell,key", [("fixed 256", "fixed"), ("adaptive", "selective")])
def test_bandwidth_drop_table_is_the_file(cell, key):
    """Both runs of each threshold after the drop: time to the 2nd token p90 (one decimal), TTFT p90 (two),
    requests offloaded, failed."""
    r = _result("prfaas_live_drop.json")
    v, runs = r["verdict_drop"][key], r["bandwidth_drop"][key]
    quoted = _row(_readme(), "The bandwidth drop,", cell)
    assert _agrees(quoted[:2], v["tt2t_p90_after_s"], 1) and _agrees(quoted[2:4], v["ttft_p90_after_s"], 2), quoted
    assert quoted[4:] == [run["after"]["routes"].get("prfaas", 0) for run in runs] + \
        [run["after"]["failed"] for run in runs], quoted


def test_store_table_is_the_file():
    """Per prefix share and prompt: TTFT medians (whole ms) with the per-repetition ratios to the instance's own
    cache (median and quartiles, two decimals)."""
    for key, c in _result("store.json")["by_hit_and_length"].items():
        quoted = _row(_readme(), "`python -m bench.store", f"{c['hit']} / {int(c['length']):,}", prefix=True)
        med = {k: 1e3 * v for k, v in c["median_s"].items()}
        assert _agrees(quoted[:1] + quoted[1:13:4] + quoted[13:],
                       [med[k] for k in ("local", "store", "store_tcp", "store_serial", "cold")], 0), (key, quoted)
        ratios = [c[k][s] for k in ("store_over_local", "tcp_over_local", "serial_over_local")
                  for s in ("median", "p25", "p75")]
        assert _agrees([q for i, q in enumerate(quoted[1:13]) if i % 4], ratios, 2), (key, quoted)


def test_migration_table_is_the_file():
    """Per prompt: TPOT medians (ms, one decimal) and over no move (one decimal); each move's median bytes (MB,
    one decimal) and seconds (whole ms)."""
    for length, c in _result("migration.json")["by_length"].items():
        quoted = _row(_readme(), "`python -m bench.migration", f"{int(length):,} tokens")
        tpot = [1e3 * c[k]["tpot_median_s"] for k in ("none", "heads", "layers")]
        assert _agrees([quoted[0], quoted[1], quoted[3]], tpot, 1), (length, quoted)
        assert _agrees([quoted[2], quoted[4]], [c[k]["over_none"] for k in ("heads", "layers")], 1), (length, quoted)
        moves = [x for k in ("heads", "layers") for x in (statistics.median(c[k]["move_bytes"]) / 1e6,
                                                         1e3 * statistics.median(c[k]["move_s"]))]
        assert _agrees(quoted[5::2], moves[::2], 1) and _agrees(quoted[6::2], moves[1::2], 0), (length, quoted)


BALANCE_HOT = [("cache_aware (sglang)", "cache_aware_sglang"), ("cache_aware (dynamo)", "cache_aware_dynamo"),
               ("least_loaded", "least_loaded"), ("banaserve, no store", "banaserve_no_store"),
               ("banaserve over the store", "banaserve_store")]
BALANCE_LIVE = [("cache_aware (sglang)", "cache_aware_sglang"), ("cache_aware (dynamo)", "cache_aware_dynamo"),
                ("banaserve over the store (its shared pool)", "banaserve_store"),
                ("banaserve over the store (transfer layer)", "banaserve_store_tcp")]


def test_balance_tables_are_the_file():
    """Simulated at 16 req/s: TTFT p50 / p90 (s, three decimals), prefill utilisation max / min (two); live:
    TTFT p50 / p90 (whole ms), each prefill instance's busy fraction (two decimals) and requests."""
    r = _result("balance.json")
    text = _readme()
    for cell, key in BALANCE_HOT:
        p = r["hot"]["by_rate"]["16.0"][key]
        quoted = _row(text, "| 4 prefill + 2 decode, 8 hot 6K-token prefixes", cell)
        assert _agrees(quoted[:2], [p["ttft_s"]["p50"], p["ttft_s"]["p90"]], 3), (cell, quoted)
        assert _agrees(quoted[2:], [p["utilisation_max_over_min"]], 2), (cell, quoted)
    for cell, key in BALANCE_LIVE:
        p = r["live"]["by_policy"][key]
        quoted = _row(text, "| live | TTFT p50 / p90 |", cell)
        assert _agrees(quoted[:2], [1e3 * p["ttft_s"]["p50"], 1e3 * p["ttft_s"]["p90"]], 0), (cell, quoted)
        assert _agrees(quoted[2:4], [p["busy_mean"]["p0"], p["busy_mean"]["p1"]], 2), (cell, quoted)
        assert quoted[4:] == [p["per_instance_requests"]["p0"], p["per_instance_requests"]["p1"]], (cell, quoted)


def test_simulator_validation_table_is_the_file():
    """Live, replayed and drawn: throughput (req/s, three decimals), TTFT p50 and p90 (whole ms) with the ratios
    to live (two decimals), and TTFT p50 / p90 by route (whole ms)."""
    r = _result("sim_validate.json")
    live, sim, drawn = r["live"], r["simulated"], r["simulated_drawn"]
    ratio, ratio_drawn = r["ratio_sim_over_live"], r["ratio_drawn_over_live"]
    text, after = _readme(), "| | live | replayed | replayed / live |"
    quoted = _row(text, after, "throughput (req/s)")
    assert _agrees(quoted[:2] + quoted[3:4], [live["throughput_rps"], sim["throughput_rps"], drawn["throughput_rps"]],
                   3), quoted
    assert _agrees(quoted[2::2], [ratio["throughput"], ratio_drawn["throughput"]], 2), quoted
    for p in ("p50", "p90"):
        quoted = _row(text, after, f"TTFT {p} (ms)")
        ms = [1e3 * live[f"ttft_{p}_s"], 1e3 * sim["ttft_s"][p], 1e3 * drawn["ttft_s"][p]]
        assert _agrees(quoted[:2] + quoted[3:4], ms, 0), (p, quoted)
        assert _agrees(quoted[2::2], [ratio[f"ttft_{p}"], ratio_drawn[f"ttft_{p}"]], 2), (p, quoted)
    for cell, route in [("TTFT p50 / p90 by route (ms): colocated (next turns)", "colocated"),
                        ("pd (up to 256 tokens)", "pd"), ("prfaas (longer)", "prfaas")]:
        ms = [1e3 * s["ttft_by_route"][route][f"{p}_s"] for s in (live, sim, drawn) for p in ("p50", "p90")]
        assert _agrees(_row(text, after, cell), ms, 0), (cell, _row(text, after, cell))


@pytest.mark.parametrize("cell,schema", [("person (600-character string)", "person"), ("flat object", "flat"),
                                         ("nested arrays of objects", "nested")])
def test_grammar_engine_table_is_the_file(cell, schema):
    """Per engine: compile (ms, one decimal; whole from 100 ms) and mask per token (ms, three decimals)."""
    g = _result("structured.json")["grammar_engines"][schema]
    quoted = _row(_readme(), "Grammar engine costs", cell)
    for i, engine in enumerate(("llguidance", "xgrammar")):
        compile_ms = 1e3 * g[engine]["compile_s"]
        assert _agrees(quoted[2 * i:2 * i + 1], [compile_ms], 0 if compile_ms >= 100 else 1), (cell, engine, quoted)
        assert _agrees(quoted[2 * i + 1:2 * i + 2], [g[engine]["mask_ms"]], 3), (cell, engine, quoted)


@pytest.mark.parametrize("cell,key", [("PrfaaS-PD (t 19.4K, 4 / 3 / 5)", "prfaas_pd"),
                                      ("homogeneous PD (9 / 3)", "homogeneous"),
                                      ("naive heterogeneous (4 / - / 8)", "naive")])
def test_case_study_table_is_the_file(cell, key):
    """The document's, the planner's and the simulated capacity (req/s, two decimals); simulated TTFT mean / p90
    at 1.5 req/s with the document's (s, two decimals)."""
    c = _result("prfaas_sim.json")["case"][key]
    quoted = _row(_readme(), "| case study (4 PrfaaS + 8 PD, 100 Gbit/s) |", cell)
    sim = c["sim_ttft_at_1_5_rps"]
    exact = [c["paper"]["lambda_max"], c["planner_lambda_max"], c["sim_throughput_rps"], sim["mean"], sim["p90"],
             c["paper"]["ttft_mean_s"], c["paper"]["ttft_p90_s"]]
    assert _agrees(quoted, exact, 2), (cell, quoted)


@pytest.mark.parametrize("cell,kernel", [("flash attention (prefill), Mosaic GPU", "flash_attention"),
                                         ("flash attention (prefill), Triton", "flash_attention_triton"),
                                         ("paged attention (decode)", "paged_attention"),
                                         ("recurrent gated delta rule (decode)", "recurrent_gated_delta_rule")])
def test_gpu_kernel_table_is_the_file(cell, kernel):
    """The H200 table, from its third cell (the second describes the shape): times faster than the reference (one
    decimal), then TFLOP/s (whole) or TB/s (two decimals) and the share of the peak (whole %)."""
    r = next(x for x in _result("kernels_h200.json")["results"] if x["kernel"] == kernel)
    text = _readme()
    line = next(ln for ln in text[text.index("| kernel | shape | kernel vs jnp reference |"):].splitlines()
                if ln.startswith(f"| {cell} |"))
    quoted = [float(x) for x in re.findall(r"\d+(?:\.\d+)?", "|".join(line.split("|")[3:5]).replace("bf16", ""))]
    assert _agrees(quoted[:1], [r["speedup_vs_reference"]], 1), (cell, quoted)
    if r["bound"] == "compute":
        rate = [r["kernel_TFLOPs"], 100 * r["fraction_of_bf16_peak"]]
        assert _agrees(quoted[1:], rate, 0), (cell, quoted, rate)
    else:
        assert _agrees(quoted[1:2], [r["kernel_GBps"] / 1e3], 2), (cell, quoted)
        assert _agrees(quoted[2:], [100 * r["fraction_of_hbm_peak"]], 0), (cell, quoted)


TRANSFER_CPU = [("raw sockets", "raw"), ("raw sockets + the link's checksum", "raw_checksum"), ("KV link (TCP)", "kv"),
                ("KV link over mutual TLS", "kv_tls"), ("device backend (JAX transfer server)", "device")]
TRANSFER_TTFT = [("colocated", "colocated"), ("disaggregated, shared memory, sent after prefill", "disagg"),
                 ("disaggregated, shared memory, layer groups of 2", "disagg_layerwise"),
                 ("emulated 0.2 Gb/s link, sent after prefill", "disagg_link"),
                 ("emulated 0.2 Gb/s link, layer groups of 2", "disagg_link_layerwise")]


def test_transfer_tables_are_the_file():
    """transfer.json: CPU seconds per GB moved (three decimals); TTFT and the second token's time per prompt length
    (whole ms), each with its overhead over colocated (whole % from 10%, else one decimal); Phi_kv per family
    (MB/s, one decimal)."""
    r = _result("transfer.json")
    text = _readme()
    for cell, key in TRANSFER_CPU:
        c = r["efficiency"]["cpu_s_per_gb"][key]
        quoted = _row(text, "| transfer | sender | receiver | total |", cell)
        assert _agrees(quoted, [c["sender"], c["receiver"], c["total"]], 3), (cell, quoted)
    lengths = [str(n) for n in r["ttft"]["lengths"]]
    for cell, key in TRANSFER_TTFT:
        c = r["ttft"]["setups"][key]
        quoted = _row(text, "| setup | TTFT 256 tokens |", cell)
        ms = [1e3 * c[f][n] for f in ("ttft_s_median", "second_token_s_median") for n in lengths]
        if key == "colocated":
            assert _agrees(quoted, ms, 0), (cell, quoted)
            continue
        assert _agrees(quoted[::2], ms, 0), (cell, quoted)
        for q, x in zip(quoted[1::2], [100 * c[f][n] for f in ("overhead", "second_token_overhead") for n in lengths]):
            assert _agrees([q], [x], 0 if x >= 10 else 1), (cell, quoted, x)
    for family, f in r["phi_kv"]["families"].items():
        quoted = _row(text, "| family | 256 | 1024 | 2048 |", family, prefix=True)
        assert _agrees(quoted, [f["by_length"][n]["phi_kv_bytes_per_s"] / 1e6 for n in lengths], 1), (family, quoted)


FAULTS = {"sigkill": "SIGKILL", "sigstop_10s": "SIGSTOP 10 s", "sigstop": "SIGSTOP forever",
          "partition": "partition (veth down)", "corrupt": "corrupting link (10 s)"}


def test_fault_matrix_table_is_the_file():
    """Per victim and fault, its three phases: token-exact answers, failed, hung, recovery p50 / p99 (s, one
    decimal), leaked blocks and pool bytes."""
    cells = _result("faults.json")["cells"]
    phases = ("first_token", "transfer", "stream")
    rows = {(c["role"], c["fault"]) for c in cells}
    assert len(rows) == len(FAULTS) * 2
    for role, fault in sorted(rows):
        by = {c["phase"]: c for c in cells if (c["role"], c["fault"]) == (role, fault)}
        quoted = _row(_readme(), "| victim | fault | token-exact", f"{role} | {FAULTS[fault]}", labels=2)
        assert quoted[:3] == [by[p]["token_exact"] for p in phases], (role, fault, quoted)
        assert quoted[3:5] == [sum(by[p][k] for p in phases) for k in ("failed", "hung")], (role, fault, quoted)
        recovery = [by[p][f"recover_{q}_s"] for p in phases for q in ("p50", "p99")]
        assert _agrees(quoted[5:11], recovery, 1), (role, fault, quoted, recovery)
        assert quoted[11:] == [sum(by[p][k] for p in phases) for k in ("leaked_blocks", "leaked_pool_bytes")], quoted


def test_soak_table_is_the_file():
    """Per process: resident MB over the settled load, start -> end (whole), its slope (MB/h, whole), threads (flat:
    one figure), file descriptors (with the count after the load where it differs)."""
    r = _result("soak.json")
    for cell, key in [("router (HTTP + router)", "router"), ("prefill worker", "prefill-0"),
                      ("decode worker", "decode-0")]:
        s = r["slopes"][key]
        quoted = _row(_readme(), "| process | resident MB", cell)
        assert _agrees(quoted[:3], [s["rss_mb"]["start"], s["rss_mb"]["end"], s["rss_mb"]["slope_per_hour"]], 0), \
            (cell, quoted)
        t = s["threads"]
        assert t["start"] == t["end"] == t["after"] and quoted[3] == t["end"], (cell, quoted)
        fds = s["fds"]
        assert quoted[4:] == ([fds["end"]] if fds["after"] == fds["end"] else [fds["end"], fds["after"]]), (cell, quoted)


def _prose() -> str:
    return " ".join(_readme().split())  # the README's lines wrap anywhere


def test_running_text_figures_are_the_files():
    t = _result("transfer.json")["efficiency"]
    ratios = [k / r for k, r in zip(t["kv_bytes_per_s"], t["raw_bytes_per_s"])]
    i = _result("interference.json")
    co, dis = i["setups"]["colocated"], i["setups"]["disaggregated"]
    st = _result("structured.json")
    free = [run["tokens_per_s"] for run in st["runs"]["free"]]
    constrained = [run["tokens_per_s"] for run in st["runs"]["constrained"]]
    up = _result("startup.json")["runs"]
    soak = _result("soak.json")
    expected = [
        f"ran at {t['kv_bytes_per_s_median'] / 1e9:.2f} GB/s, against {t['raw_bytes_per_s_median'] / 1e9:.2f} GB/s",
        f"**{t['efficiency']:.2f}** of raw (medians of {t['reps']}; the per-repetition ratios "
        f"{min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f}; goal {t['goal']:.2f})",
        f"p99 TPOT was {1e3 * co['tpot_p99_s']:.1f} ms colocated and {1e3 * dis['tpot_p99_s']:.1f} ms disaggregated: "
        f"**{i['p99_tpot_ratio']:.1f}x lower** (goal {i['goal']:.0f}x)",
        f"p50 TPOT was {1e3 * co['tpot_p50_s']:.1f} vs {1e3 * dis['tpot_p50_s']:.1f} ms",
        f"prefill TTFT, {1e3 * co['prefill_ttft_median_s']:.0f} ms vs {1e3 * dis['prefill_ttft_median_s']:.0f} ms",
        f"at {st['constrained_tokens_per_s']:.0f} tokens/s, against {st['free_tokens_per_s']:.0f} for free decoding: "
        f"a ratio of {st['ratio']:.2f}",
        f"free {min(free):.0f}-{max(free):.0f} and constrained {min(constrained):.0f}-{max(constrained):.0f} tokens/s",
        f"Filling the bitmasks cost {st['mask_ms_per_step']:.2f} ms per step, {100 * st['mask_share']:.1f}% of the run",
        f"the first start takes {up[0]['ready_s']:.0f} s to be ready, a restart {up[1]['ready_s']:.0f} s",
        f"The prefill instance warms {up[0]['programs_warmed']['local-p0']} programs",
        f"The decode instance warms {up[0]['programs_warmed']['local-d0']}:",
        f"{soak['locust']['requests']:,} requests, {soak['locust']['failures']} failed, latency p50 / p99 "
        f"{soak['locust']['latency_s']['50']:.2f} / {soak['locust']['latency_s']['99']:.2f} s; free blocks "
        f"{soak['blocks']['baseline_free']:,.0f} before and after",
        f"{soak['capacity']['requests_per_s']:.1f} requests/s), then locust",
        f"{soak['locust']['requests_per_s']:.1f} requests/s sent of the {soak['rate_requests_per_s']:.1f} asked",
    ]
    text = _prose()
    missing = [e for e in expected if e not in text]
    assert not missing, missing
