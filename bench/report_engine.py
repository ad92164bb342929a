"""bench.report's sections of one engine's figures: offline and online throughput against vLLM, serving, start-up,
engine steps, structured outputs, and the kernels. Each renderer takes {result file: its dict} and returns
markdown lines (bench/report_md.py); what a figure means is said once, in the table's header."""

from __future__ import annotations

import os
import re

from bench.report_md import Headline, Section, median, ms, num, pct, spread, table


def model_name(path: str) -> str:
    """A checkpoint path as a short name: its directory or file, less a conversion's quantisation and hash."""
    return re.sub(r"(\.Q\d\w*)?-[0-9a-f]{16}$", "", os.path.basename(path.rstrip("/")))


def offline(r: dict[str, dict]) -> list[str]:
    cpu = [(n, d) for n, d in r.items() if "vllm" in d]
    gpu = [(n, d) for n, d in r.items() if "vllm" not in d]
    out = []
    if cpu:
        head = ["output tokens/s, median (range)"] + [model_name(d["model"]) + (", each engine's defaults"
                                                                               if d.get("defaults") else "")
                                                      for _, d in cpu]
        tps = lambda t: f"{num(t['median'])} ({num(t['min'])}-{num(t['max'])})"  # noqa: E731
        rows = [[label] + [tps(d[k]["output_tokens_per_s"]) if k in d else "-" for _, d in cpu]
                for label, k in (("vLLM, CPU build", "vllm"), ("jaxserve `LLM.generate`", "jaxserve"),
                                 ("transformers `generate`", "transformers"))]
        rows += [["jaxserve / vLLM"] + [spread(d["ratio_vs_vllm"]) for _, d in cpu],
                 ["jaxserve / transformers"] + [spread(d["ratio_vs_transformers"]) if d.get("ratio_vs_transformers")
                                                else "-" for _, d in cpu],
                 ["requests with the same tokens as vLLM / transformers"] +
                 [f"{d['same_tokens_vllm']}, {d.get('same_tokens_transformers', '-')}" for _, d in cpu],
                 ["KV cache (tokens): jaxserve (its max_num_seqs) / vLLM"] + [cache(d) for _, d in cpu],
                 ["programs compiled inside a timed pass"] +
                 [str(sum(p["compiled_during"] for p in d["jaxserve"]["passes"])) for _, d in cpu]]
        out += table(head, rows)
        out += ["Where a step's time goes (the engine's step timer, the last timed pass; ms per step):", ""]
        for name, d in cpu:
            out += [f"`{name}` ({model_name(d['model'])}):", ""] + step_breakdown(d)
    for name, d in gpu:
        t = d["jaxserve"]["output_tokens_per_s"]
        out += [f"`{name}` ({model_name(d['model'])}, no peer in this run): **{num(t['median'])}** output tokens/s, "
                f"median of {len(d['jaxserve']['passes'])} passes ({num(t['min'])}-{num(t['max'])}).", ""]
        out += step_breakdown(d)
    return out


def cache(d: dict) -> str:
    """The tokens each engine's KV cache held in an offline comparison (vLLM's where its run recorded them)."""
    c, theirs = d["jaxserve_config"], d["vllm"]["passes"][-1].get("cache_tokens")
    return (f"{num(c['num_blocks'] * c['block_size'])} ({c['max_num_seqs']}) / "
            + (num(theirs) if theirs is not None else "-"))


def step_breakdown(d: dict) -> list[str]:
    rows = []
    for kind, step in d["jaxserve"]["passes"][-1]["steps"].items():
        ph = step["phases_ms"]
        part = lambda suffix: sum(v for k, v in ph.items() if k.endswith(suffix))  # noqa: E731
        rows.append([kind, step["count"], num(step["mean_ms"], 1), num(ph.get("schedule", 0), 1),
                     num(part(".prepare"), 1), num(part(".device"), 1), num(part(".output"), 1)])
    return table(["step", "count", "wall", "scheduling", "input preparation", "device program", "output handling"],
                 rows)


# (label, figure, statistic, decimals, scale): TTFT in seconds, the gaps in milliseconds
ONLINE = (("TTFT p50", "ttft_s", "p50", 2, 1), ("TTFT p99", "ttft_s", "p99", 2, 1),
          ("TPOT p50", "tpot_s", "p50", 0, 1e3), ("TPOT p99", "tpot_s", "p99", 0, 1e3),
          ("ITL p50", "itl_s", "p50", 0, 1e3), ("ITL p99", "itl_s", "p99", 0, 1e3))


def online(r: dict[str, dict]) -> list[str]:
    out = []
    for name, d in r.items():
        engine = ", ".join(f"{k}={v}" for k, v in (d.get("jaxserve_engine") or {}).items())
        out += [f"`{name}`: {d['requests']} requests at {d['rate']}/s, {d['max_tokens']} greedy tokens each, "
                f"{model_name(d['model'])}, {d['reps']} rounds" + (f", jaxserve with `{engine}`" if engine else "")
                + f"; failed: {', '.join(f'{k} {v}' for k, v in d['failed'].items())}.", ""]
        head = ["median of the passes"] + [f"{label} ({'s' if scale == 1 else 'ms'})" for label, *_, scale in ONLINE]
        rows = []
        for system in d["systems"]:
            passes = d["systems"][system]["passes"]
            rows.append([system] + [num(scale * median(p[f][s] for p in passes), digits)
                                    for _, f, s, digits, scale in ONLINE])
        for key, label in (("ratio_jaxserve_over_vllm", "jaxserve / vLLM, per round"),
                           ("ratio_control_over_jaxserve", "control / jaxserve (the same server twice: the noise)")):
            if key in d:
                rows.append([label] + [spread(d[key][f"{f}_{s}"]) for _, f, s, *_ in ONLINE])
        out += table(head, rows)
    return out


def serving(r: dict[str, dict]) -> list[str]:
    d = r["serving.json"]
    j, t, w = d["jaxserve"], d["transformers"], d["workload"]
    return [f"{w['requests']} requests at {w['rate_per_s']}/s, prompts of {w['prompt_len']['min']}-"
            f"{w['prompt_len']['max']} tokens (mean {num(w['prompt_len']['mean'])}), {w['output_len']} output tokens, "
            f"{model_name(d['model'])}; programs compiled inside the timed pass: "
            f"{d['programs_compiled_during_timed_pass']}.", ""] + table(
        ["", "output tokens/s", "TTFT p50 / p90 / p99 (s)", "TPOT p50 / p90 / p99 (s)"],
        [["jaxserve engine", num(j["output_tokens_per_s"], 1), " / ".join(num(j["ttft_s"][p], 2) for p in
                                                                          ("p50", "p90", "p99")),
          " / ".join(num(j["tpot_s"][p], 3) for p in ("p50", "p90", "p99"))],
         ["transformers `generate`, one request at a time", num(t["output_tokens_per_s"], 1),
          f"(end to end p50 {num(t['e2e_s']['p50'], 2)})", ""],
         ["ratio", f"**{d['ratio_output_tokens_per_s']:.2f}x**", "", ""]])


def startup(r: dict[str, dict]) -> list[str]:
    d = r["startup.json"]
    configs = d.get("configs") or {"local.yaml": d}  # one config before the shipped ones were all measured

    def last(run):  # the worker the cluster waited on, by its own engine-ready time (where the result has them)
        ready = run.get("engine_ready_s")
        if not ready:
            return ""
        name, secs = max(ready.items(), key=lambda kv: kv[1])
        return f"{name} {num(secs)}"
    return table(["config", "ready, empty cache (s)", "ready, cache filled (s)", "programs warmed per worker",
                  "last worker's engine ready, empty cache (s)"],
                 [[f"`{name}`", num(c["runs"][0]["ready_s"]), num(c["runs"][1]["ready_s"]),
                   ", ".join(f"{k} {v}" for k, v in c["runs"][0]["programs_warmed"].items()), last(c["runs"][0])]
                  for name, c in configs.items()])


def steps(r: dict[str, dict]) -> list[str]:
    out = ["Cases: `decode:RxC`, one decode step of R requests with C tokens cached each; `prefill:RxT`, one step of R "
           "first chunks of T tokens; `@C`, after C cached tokens. Before: the baseline commit's tree, in a process of "
           "its own, stepped alternately with this one.", ""]
    for name, d in r.items():
        layers = {"true": ", layers scanned", "false": ", layers unrolled"}.get(d.get("scan_layers", "auto"), "")
        out += [f"`{name}`: {model_name(d['model'])}{layers} against commit `{d['baseline']}`, {d['reps']} paired "
                "steps per case.", ""]
        out += table(["case", "before (ms)", "now (ms)", "now / before, median (range)"],
                     [[case, num(c["baseline_ms"], 1), num(c["this_ms"], 1), spread(c["ratio"])]
                      for case, c in d["cases"].items()])
    return out


def structured(r: dict[str, dict]) -> list[str]:
    d = r["structured.json"]
    free = [run["tokens_per_s"] for run in d["runs"]["free"]]
    con = [run["tokens_per_s"] for run in d["runs"]["constrained"]]
    out = table(["", "tokens/s, median (range of the passes)"],
                [["free decoding", f"{num(d['free_tokens_per_s'])} ({num(min(free))}-{num(max(free))})"],
                 ["constrained (a JSON schema)", f"{num(d['constrained_tokens_per_s'])} ({num(min(con))}-"
                                                 f"{num(max(con))})"],
                 ["constrained / free", f"**{d['ratio']:.2f}**"]])
    out += [f"{model_name(d['model'])}, batch {d['batch']}, {d['max_tokens']} tokens, {d['reps']} passes each. "
            f"Filling the bitmasks: {d['mask_ms_per_step']:.2f} ms a step, {pct(d['mask_share'], 1)} of the run.", "",
            "Grammar engines along the same answers:", ""]
    eng = d["grammar_engines"]
    names = [k for k in next(iter(eng.values())) if isinstance(next(iter(eng.values()))[k], dict)]
    head = ["schema"] + [f"{e} {what}" for e in names for what in ("compile (ms)", "mask / token (ms)")]
    rows = [[schema] + [x for e in names for x in ((num(1e3 * g[e]["compile_s"], 1), num(g[e]["mask_ms"], 3))
                                                    if "compile_s" in g[e] else ("-", "-"))]
            for schema, g in eng.items()]
    missing = sorted({f"{e}: {g[e]['error']}" for g in eng.values() for e in names if "error" in g[e]})
    return out + table(head, rows) + ([""] + [f"Not measured: {m}." for m in missing] if missing else [])


def kernels(r: dict[str, dict]) -> list[str]:
    out = []
    for name, d in r.items():
        out += [f"`{name}`: {d['device']}, {d['mode']}, {d['dtype']}. {d.get('note', '')}", ""]
        rows = []
        timed = d["mode"] != "interpret"  # interpret mode times the interpreter: only the differences mean anything
        for k in d["results"]:
            if "kernel_s" not in k:
                rows.append([k["kernel"], k.get("shape", ""), "-", f"not run: {k.get('error', '')[:80]}", "-", "-"])
                continue
            if not timed:
                rows.append([k["kernel"], k["shape"], "-", "-", "-", f"{k['max_abs_diff']:.1e}"])
                continue
            rate = (f"{num(k['kernel_TFLOPs'])} TFLOP/s" if k["bound"] == "compute"
                    else f"{k['kernel_GBps'] / 1e3:.2f} TB/s")
            peak = k.get("fraction_of_bf16_peak" if k["bound"] == "compute" else "fraction_of_hbm_peak")
            rows.append([k["kernel"], k["shape"], f"{k['speedup_vs_reference']:.1f}x", rate,
                         "-" if peak is None else pct(peak), f"{k['max_abs_diff']:.1e}"])
        out += table(["kernel", "shape", "kernel vs jnp reference", "rate", "of the device's peak",
                      "largest difference"], rows)
    return out


def kernel_tune(r: dict[str, dict]) -> list[str]:
    out = []
    for name, d in r.items():
        rows = []
        for s in d["results"]:
            best, default = s.get("best") or {}, s["configurations"][0]
            rows.append([s.get("sweep", "-"), s["kernel"], s["shape"], len(s["configurations"]),
                         num(1e6 * default["seconds"]) if default.get("ok") else "failed",
                         num(1e6 * best["seconds"]) if best else "-",
                         ", ".join(f"{k}={v}" for k, v in best.get("params", {}).items()) or "the defaults",
                         f"{s['speedup_best_vs_defaults']:.2f}x" if s.get("speedup_best_vs_defaults") else "-",
                         pct(s["best_fraction_of_bf16_peak" if s["bound"] == "compute"
                               else "best_fraction_of_hbm_peak"])])
        out += [f"`{name}`: {d['device']}, {d['dtype']}, {d['iters']} calls per timing.", ""]
        out += table(["sweep", "kernel", "shape", "configurations", "defaults (us)", "best (us)", "best's parameters",
                      "defaults / best", "best, of the device's peak"], rows)
    return out


def host_path(r: dict[str, dict]) -> list[str]:
    out = []
    for name, d in r.items():
        runs = [("synchronous (the baseline)", d["synchronous"]), ("overlapped", d["overlapped"])]
        if "constrained" in d:
            c = d["constrained"]
            runs += [("constrained, synchronous", c["synchronous"]), ("constrained, overlapped", c["overlapped"])]
            runs += [("constrained, overlapped, split as on an accelerator", c["split"])] if "split" in c else []
        out += [f"`{name}` ({model_name(d['model'])}, {d['overlapped']['batch']} requests, "
                f"{d['overlapped']['steps']} steps):", ""]
        out += table(["loop", "programs a step", "device executions a step", "uploads a step", "reads a step",
                      "reads with the next step already dispatched", "host ms a step (outside the program)",
                      "wall ms a step"],
                     [[label, num(x["programs_per_step"], 2), num(x["executions_per_step"], 2),
                       num(x["uploads_per_step"], 2), num(x["reads_per_step"], 2),
                       pct(x["reads_with_the_next_step_dispatched"]), num(x["host_ms_per_step"], 2),
                       num(x["wall_ms_per_step"], 1)] for label, x in runs])
    return out


def gpu_decode(r: dict[str, dict]) -> list[str]:
    out = []
    for name, d in r.items():
        f, j = d["floor"], d.get("jax", {})
        if "points" not in j:
            out += [f"`{name}`: the engine's part did not finish ({j.get('error', 'no result')}).", ""]
            continue
        gb = d["make"]["weight_bytes"] / 1e9
        out += [f"`{name}`: {f['device']}, the {d['shape']} shape ({num(gb, 2)} GB of bf16 weights); measured there: "
                f"device copy {num(f['copy_GBps'])} GB/s, bf16 matmul {num(f['bf16_TFLOPs'])} TFLOP/s. The default "
                f"cache: {num(j['num_blocks'])} blocks, max_num_seqs {j['max_num_seqs']}.", ""]
        rows = [[p["batch"], p["context"], num(p["decode_step_ms"], 2), num(p["floor_ms"], 2),
                 f"{p['step_over_floor']:.2f}x{flaws(p)}", num(p["output_tok_s"]),
                 pct(p.get("prefill_device_share_of_bf16") or p["prefill_share_of_bf16"]) + prefill_flaw(p)]
                for p in j["points"] if "skipped" not in p]
        out += table(["requests", "context (tokens)", "decode step (ms)", "HBM floor (ms): weights + KV / copy rate",
                      "step / floor", "output tokens/s", "prefill, of the bf16 rate"], rows)
        marked = "".join(flaws(p) + prefill_flaw(p) for p in j["points"] if "skipped" not in p)
        out += [x for mark, line in FLAWS.items() if mark in marked for x in (line, "")]
        skipped = [f"{p['batch']} x {p['context']}" for p in j["points"] if "skipped" in p]
        if skipped:
            out += [f"Not run (the cache holds too little): {', '.join(skipped)}.", ""]
        t = j.get("trace", {})
        if "busy_fraction" in t:
            kernel_ms = t["busy_fraction"] * t["span_ms"] / t.get("steps", 16)  # (16 before the count was kept)
            same = next((p for p in j["points"] if (p["batch"], p["context"]) == (t["batch"], t["context"])
                         and "skipped" not in p), None)
            vs = (f"; their kernels, {num(kernel_ms, 2)} ms a step, are {pct(kernel_ms / same['decode_step_ms'])} of "
                  f"the step measured without the profiler ({num(same['decode_step_ms'], 2)} ms)") if same else ""
            out += [f"The GPU was busy {pct(t['busy_fraction'])} of {num(t['span_ms'], 1)} ms of decode steps under "
                    f"the profiler ({t['batch']} requests, {t['context']}-token context){vs}.", ""]
        out += _prefill_trace(j.get("trace_prefill", {}))
        out += _packed(j, d.get("packed", {}))
        out += _scanned(j, d.get("scan", {}))
        hf = d.get("hf", {}).get("transformers", [])
        if hf:
            out += ["transformers `generate` (sdpa, bf16) on the same checkpoint: " + ", ".join(
                f"{num(x['decode_step_ms'], 1)} ms a step at {x['batch']} requests" for x in hf) + ".", ""]
    return out


def _prefill_trace(t: dict) -> list[str]:
    """gpu_decode's prefill under the profiler: wall and device phase, busy fraction, the kernels by time."""
    if "wall_ms" not in t:
        return []
    st = t["steps"].get("prefill", {})
    device = st.get("phases_ms", {}).get("prefill.device")
    busy = (f"; under the profiler the GPU was busy {pct(t['busy_fraction'])} of {num(t['span_ms'], 1)} ms"
            if "busy_fraction" in t else "")
    kern = ", ".join(f"`{k['name']}` {num(k['ms'], 2)} ms ({k['count']})" for k in t.get("top_kernels") or [])
    return [f"One {t['context']}-token prompt prefilled in {num(t['wall_ms'], 1)} ms ({st.get('count', 0)} prefill "
            f"step{'s' if st.get('count', 0) != 1 else ''}"
            + (f", device phase {num(device, 1)} ms a step" if device is not None else "") + f"){busy}"
            + (f"; its kernels by time: {kern}." if kern else "."), ""]


FLAWS = {
    "†": "† Not the whole batch: measured before the timed steps were those with every request running (results "
         "since record `window_steps`), over the steps after the last prompt's first token, by when requests "
         "prefilled early (prefill steps carry the running requests' decode rows) had finished; the step decoded "
         "fewer rows than the batch, so its floor is too high.",
    "‡": "‡ A program compiled inside the timed steps (their host phase `decode.prepare` over 20 ms a step): one "
         "the untimed first pass had not reached (results since measure such a point again).",
    "§": "§ Prefill timed with a compile inside (slower than the untimed first pass that should have compiled it).",
}


def prefill_flaw(p: dict) -> str:
    """"§" where a gpu_decode point's timed prefill compiled a program (results before `compiled_in_prefill`: it
    took longer than the first pass, which compiles and prefills the same shapes)."""
    if "compiled_in_prefill" in p:
        return "§" if p["compiled_in_prefill"] else ""
    return "§" if p.get("prefill_s", 0) > p.get("first_pass_s", float("inf")) else ""


def flaws(p: dict) -> str:
    """FLAWS' marks of a gpu_decode point: a batch not whole over the timed steps, a compile inside them (for
    results without `window_steps`, from before the whole-batch window: a batch whose prompts took over two
    8,192-token prefill steps)."""
    if "window_steps" in p:
        whole = not p.get("finished_in_window")
    else:
        whole = -(-p["batch"] * p["context"] // 8192) <= 2
    compiled = p.get("compiled_in_window") or p.get("phases_ms", {}).get("decode.prepare", 0) > 20
    return ("" if whole else "†") + ("‡" if compiled else "")


def gpu_programs(r: dict[str, dict]) -> list[str]:
    out = []
    for name, d in r.items():
        big = lambda p: [c for c in p["copies"] if c[1] >= 1 << 20]  # noqa: E731
        out += [f"`{name}`: compiled for the {d['target']} by {', '.join(d['gpu_jax'])}, on a machine without one. "
                "Llama-3.1-8B's shape with 2 layers; a layer's kernels: the 2-layer program's less the 1-layer "
                "one's.", ""]
        rows = [[p["program"].lstrip("_"), p["rows"], p["kernels"], p.get("per_layer", ""),
                 ", ".join(f"{v} {k}" for k, v in p.get("per_layer_by_kind", {}).items()),
                 p.get("at_32_layers", ""), f"{len(p['copies'])} ({num(sum(c[1] for c in p['copies']))} B)",
                 f"{p['writes']['in_place']} / {p['writes']['whole']}", p["dots_in_loop_kernels"],
                 num(p["compile_s"], 1)] for p in d["programs"]]
        out += table(["program", "rows", "kernels", "a layer's", "a layer's, by kind", "at 32 layers", "copies",
                      "pool and state writes: in place / whole", "products outside gemms", "compile (s, this host)"],
                     rows)
        fams = [[f, "failed: " + ps["error"]] + [""] * 4 if "error" in ps else
                [f, len(ps), max(p["by_kind"].get("pallas", 0) for p in ps), sum(len(big(p)) for p in ps),
                 sum(p["writes"]["whole"] for p in ps), sum(p["dots_in_loop_kernels"] for p in ps)]
                for f, ps in d.get("families", {}).items()]
        if fams:
            out += ["Every family's bench-size checkpoint (bench/families.py), 1 prompt then 8, its programs summed "
                    "(at these sizes, hidden 256, XLA computes a one-row product in a loop kernel by choice; at the "
                    "8B shape it makes none):", ""]
            out += table(["family", "programs compiled", "Pallas kernels in a program, at most", "copies of 1 MiB "
                          "or more", "pool and state writes, whole", "products outside gemms"], fams)
    return out


def _packed(default: dict, packed: dict) -> list[str]:
    """The engine with engine.packed_prefill against the default engine's points and longest prefill."""
    if not packed:
        return []
    if "points" not in packed:
        return [f"The engine with packed prefill did not finish ({packed.get('error', 'no result')}).", ""]
    base = {(p["batch"], p["context"]): p for p in default["points"] if "skipped" not in p}
    share = lambda p: p.get("prefill_device_share_of_bf16") or p["prefill_share_of_bf16"]  # noqa: E731
    parts = [f"{p['batch']} x {p['context']}: prefill {num(p['prefill_s'] * 1e3, 1)} ms "
             f"({p['prefill_s'] / b['prefill_s']:.2f}x the default's; {pct(share(p))} of the bf16 rate against "
             f"{pct(share(b))}), decode step {p['decode_step_ms'] / b['decode_step_ms']:.2f}x"
             for p in packed["points"] if "skipped" not in p
             for b in [base.get((p["batch"], p["context"]))] if b is not None]
    out = ["With packed prefill (engine.packed_prefill: a prefill step one program over the pool, first chunks "
           "through the paged prefill kernel, a mixed step's decode tokens in it): "
           + ("; ".join(parts) if parts else "no point to set against the default's") + "."]
    lp = packed.get("long_prefill")
    if lp:
        one = default.get("trace_prefill", {})
        vs = f" (the default: {num(one['wall_ms'], 1)} ms)" if "wall_ms" in one else ""
        out[0] += (f" It prefilled one {lp['context']}-token prompt in {num(lp['prefill_wall_ms'], 1)} ms, device "
                   f"{num(lp['prefill_device_ms'], 1)} ms, over {lp['prefill_steps']} steps{vs}.")
    return out + [""]


def _scanned(unrolled: dict, scan: dict) -> list[str]:
    """The scanned engine's points against the unrolled ones of the same run, and its prefill instance."""
    if not scan:
        return []
    if "points" not in scan:
        return [f"The engine with its layers scanned did not finish ({scan.get('error', 'no result')}).", ""]
    base = {(p["batch"], p["context"]): p for p in unrolled["points"] if "skipped" not in p}
    parts = [f"{p['batch']} x {p['context']}: decode step {num(p['decode_step_ms'], 2)} ms "
             f"({p['decode_step_ms'] / b['decode_step_ms']:.2f}x unrolled), prefill "
             f"{p['prefill_s'] / b['prefill_s']:.2f}x, first pass (compiling) {num(p['first_pass_s'], 1)} s against "
             f"{num(b['first_pass_s'], 1)} s" for p in scan["points"] if "skipped" not in p
             for b in [base.get((p["batch"], p["context"]))] if b is not None and "first_pass_s" in b]
    out = ["With its layers scanned (engine.scan_layers; a prefill instance's default on a GPU): "
           + ("; ".join(parts) if parts else "no point to set against the unrolled ones") + "."]
    pi = scan.get("prefill_instance")
    if pi:
        out[0] += (f" A layer-wise prefill instance ({pi['layer_groups']} groups of {pi['layers_per_group']} layers, "
                   f"max_num_batched_tokens {pi['max_num_batched_tokens']}) warmed {pi['programs']} prefill programs "
                   f"in {num(pi['warmup_s'], 1)} s, the compilation cache off.")
        if "prefill_wall_ms" in pi:
            one = next((p for p in unrolled["points"] if (p["batch"], p["context"]) == (1, pi["context"])
                        and "skipped" not in p), None)
            vs = (f" (unrolled, whole: {num(one['prefill_s'] * 1e3, 1)} ms, device "
                  f"{num(one.get('prefill_device_ms', 0), 1)} ms)") if one else ""
            out[0] += (f" It prefilled one {pi['context']}-token prompt in {num(pi['prefill_wall_ms'], 1)} ms, device "
                       f"{num(pi['prefill_device_ms'], 1)} ms, over {pi['prefill_steps']} steps{vs}.")
    return out + [""]


def gpu_disagg(r: dict[str, dict]) -> list[str]:
    out = []
    for name, d in r.items():
        c = d.get("colocated", {"error": "not run"})
        backends = {b for dep in ("disaggregated", "sequential") for x in d.get(dep, {}).get("lengths", {}).values()
                    for b in x["kv_backend"]}
        via = ("CUDA IPC" if d["cuda_ipc"] == "on" else "JAX's transfer server") if backends & {"device", "cuda_ipc"} \
            else ", ".join(sorted(backends)) or "-"
        prfaas = (f"; PrfaaS: prompts over {d['threshold_tokens']} uncached tokens prefilled across a "
                  f"{num(d['link_gbps'])} Gbit/s link" if "prfaas" in d else "")
        out += [f"`{name}`: {d['model']}, greedy, {d['new']} tokens per request, medians of {d['reps']}; KV inside a "
                f"cluster through {via}{prfaas}." + (f" Colocated failed: {c['error']}." if "error" in c else ""), ""]
        if "error" in c:
            continue
        for dep in ("disaggregated", "sequential", "prfaas"):
            g = d.get(dep)
            if g is None:  # not asked for (--deployments)
                continue
            if "error" in g:
                out += [f"{dep}: failed: {g['error']}.", ""]
                continue
            x = d["compared"][dep]
            what = (" (disaggregated with the Prefill call after decode's reservation: router.early_prefill off)"
                    if dep == "sequential" else "")
            out += [f"{dep}{what}: answers equal colocated for {x['answers_equal']} of {d['answers']} prompts"
                    f"{_differences(x.get('differ', []))}; ready after {num(g['ready_s'])} s ({num(c['ready_s'])} s "
                    "colocated).", ""]
            rows = []
            steps = any("steps" in g["lengths"][n] for n in x["ratios"])
            where = any(g["lengths"][n].get("placed_s") is not None for n in x["ratios"])
            second = any(g["lengths"][n].get("second_s") is not None for n in x["ratios"])
            for n, y in x["ratios"].items():
                cn, gn = c["lengths"][n], g["lengths"][n]
                rows.append([n, f"{num(cn['ttft_s'], 3)} / {num(gn['ttft_s'], 3)}",
                             f"{num(cn['tpot_s'] * 1e3, 1)} / {num(gn['tpot_s'] * 1e3, 1)}",
                             f"{y['ttft']:.2f}x, {y['tpot']:.2f}x", f"{num(gn['kv_bytes'] / 1e6, 1)}, "
                             f"{', '.join(gn['kv_backend'])}, {', '.join(gn['prefill_instance'])}"]
                            + ([f"{_ms(cn.get('placed_s'))} / {_ms(gn.get('placed_s'))}",
                                f"{_ms(cn.get('engine_ttft_s'))} / {_ms(gn.get('prefill_ttft_s'))}",
                                _ms(gn.get('engine_ttft_s'))] if where else [])
                            + ([f"{_ms(cn.get('second_s'))} / {_ms(gn.get('second_s'))}"] if second else [])
                            + ([f"{prefill_steps(cn)} / {prefill_steps(gn)}"] if steps else []))
            out += table(["prompt (tokens)", f"TTFT colocated / {dep} (s)", f"TPOT colocated / {dep} (ms)",
                          f"{dep} / colocated: TTFT, TPOT", "KV per request (MB), backend, prefilled by"]
                         + ([f"placed colocated / {dep} (ms)", f"prefilling engine's TTFT colocated / {dep} (ms)",
                             f"{dep}: decode's reservation to its first token (ms)"] if where else [])
                         + ([f"first token to the second colocated / {dep} (ms)"] if second else [])
                         + ([f"prefill steps colocated / {dep}: count x ms (device ms)"] if steps else []), rows)
            if "load" in x:
                out += [_load(d["load"], c["load"], g["load"], dep, x["load"]), ""]
            if "busy" in x:
                out += [_busy(c["busy"], g["busy"], dep, x["busy"]), ""]
    return out


def _busy(c: dict, g: dict, dep: str, ratio: dict) -> str:
    """A gpu_disagg deployment's TTFT with decode busy against colocated's."""
    return (f"With {g['requests']} requests decoding: a {g['prompt']}-token prompt's TTFT colocated / {dep} "
            f"{num(c['ttft_s'] * 1e3, 1)} / {num(g['ttft_s'] * 1e3, 1)} ms ({ratio['ttft_s']:.2f}x; median of "
            f"{g['probes']}), {dep}'s placement {_ms(g.get('placed_s'))} ms and its prefilling engine's TTFT "
            f"{_ms(g.get('prefill_ttft_s'))} ms.")


def _load(how: dict, c: dict, g: dict, dep: str, ratio: dict) -> str:
    """A gpu_disagg deployment under load against colocated: TPOT median and p90, output tokens/s, decode steps."""
    def step(r: dict) -> str:
        got = [st["decode"] for st in r.get("steps", {}).values() if "decode" in st]
        return ", ".join(f"{p['count']} x {num(p['mean_ms'], 1)} ms" for p in got) or "-"
    return (f"Under load ({how['requests']} requests at once, {how['prompt']}-token prompts, {how['new']} tokens "
            f"each): TPOT colocated / {dep} {num(c['tpot_s'] * 1e3, 1)} / {num(g['tpot_s'] * 1e3, 1)} ms "
            f"({ratio['tpot_s']:.2f}x; 90th percentile {ratio['tpot_p90_s']:.2f}x), output "
            f"{num(c['tokens_per_s'])} / {num(g['tokens_per_s'])} tokens/s ({ratio['tokens_per_s']:.2f}x); decode "
            f"steps {step(c)} / {step(g)}.")


def _differences(differ: list) -> str:
    """Where each answer that differs first differs, and colocated's top-two gap there where recorded."""
    if not differ:
        return ""
    said = [f"prompt {d[0]} at token {d[1]}" + (f" (colocated's two likeliest tokens there {d[4]:.4f} apart in "
                                                  "log-probability)" if len(d) > 4 and d[4] is not None else "")
            for d in differ]
    return " (the others first differ: " + "; ".join(said) + ")"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else num(seconds * 1e3, 1)


def prefill_steps(length: dict) -> str:
    """A gpu_disagg length's prefill steps over its timed requests, on the instances that prefilled them: "count x
    mean ms (the device phase's ms)"."""
    got = [st[k] for inst, st in length.get("steps", {}).items()
           if inst in length["prefill_instance"] or inst == "local" for k in ("prefill", "mixed") if k in st]
    return ", ".join(f"{p['count']} x {num(p['mean_ms'], 1)} ({num(p['phases_ms'].get('prefill.device', 0), 1)})"
                     for p in got) or "-"


SECTIONS = [
    Section("Offline throughput", "bench.offline", ("offline.json", "offline_smollm2.json", "offline_defaults.json",
                                                    "offline_defaults_smollm2.json", "offline_defaults_qwen3.json",
                                                    "offline_defaults_gpt_oss.json", "offline_h100.json",
                                                    "offline_h200.json"), offline),
    Section("Online serving against vLLM's server", "bench.online", ("online_smollm2.json",
                                                                     "online_smollm2_mixed128.json"), online),
    Section("Serving under Poisson arrivals", "bench.serving", ("serving.json",), serving),
    Section("Start-up", "bench.startup", ("startup.json",), startup),
    Section("Engine steps against earlier commits", "bench.steps",
            ("steps.json", "steps_prefill.json", "steps_matmul.json", "steps_matmul_32m.json", "steps_migration.json",
             "steps_inplace.json", "steps_switch_writes.json", "steps_state_reads.json"), steps),
    Section("Structured outputs", "bench.structured", ("structured.json",), structured),
    Section("The host's part of a decode step", "bench.host_path", ("host_path.json",), host_path),
    Section("Decode against the memory floor on a GPU", "bench.gpu_decode", ("gpu_decode_h200.json",
                                                                             "gpu_decode_h100.json"), gpu_decode),
    Section("GPU programs compiled without a GPU", "bench.gpu_programs", ("gpu_programs_h200.json",), gpu_programs),
    Section("Disaggregated against colocated on one GPU", "bench.gpu_disagg",
            ("gpu_disagg_h200.json", "gpu_disagg_h100.json", "gpu_disagg_early_cpu.json"), gpu_disagg),
    Section("Kernels", "bench.kernels", ("kernels_h200.json", "kernels_h100.json", "kernels.json"), kernels),
    Section("Kernel launch parameters", "bench.kernel_tune", ("kernel_tune_h200.json", "kernel_tune_hopper_h200.json",
                                                              "kernel_tune_h100.json"), kernel_tune),
]

HEADLINES = [
    Headline("offline output tokens/s, jaxserve / vLLM's CPU build (32M Llama)", "offline.json",
             lambda d: spread(d["ratio_vs_vllm"]), "Offline throughput"),
    Headline("offline output tokens/s, jaxserve / vLLM's CPU build (SmolLM2-135M)", "offline_smollm2.json",
             lambda d: spread(d["ratio_vs_vllm"]), "Offline throughput"),
    Headline("offline output tokens/s, jaxserve / vLLM's CPU build, each with its defaults (SmolLM2-135M)",
             "offline_defaults_smollm2.json", lambda d: spread(d["ratio_vs_vllm"]), "Offline throughput"),
    Headline("offline output tokens/s, jaxserve / vLLM's CPU build, each with its defaults (Qwen3-0.6B's shape)",
             "offline_defaults_qwen3.json", lambda d: spread(d["ratio_vs_vllm"]), "Offline throughput"),
    Headline("offline output tokens/s, jaxserve / vLLM's CPU build, each with its defaults (gpt-oss-mini: 32 experts)",
             "offline_defaults_gpt_oss.json", lambda d: spread(d["ratio_vs_vllm"]), "Offline throughput"),
    Headline("online TTFT p50 / TPOT p50, jaxserve / vLLM's server (SmolLM2-135M)", "online_smollm2.json",
             lambda d: f"{d['ratio_jaxserve_over_vllm']['ttft_s_p50']['median']:.2f}x / "
                       f"{d['ratio_jaxserve_over_vllm']['tpot_s_p50']['median']:.2f}x",
             "Online serving against vLLM's server"),
    Headline("constrained decoding / free decoding", "structured.json", lambda d: f"{d['ratio']:.2f}",
             "Structured outputs"),
    Headline("paged decode attention (32 x 2K context)", "kernels_h200.json",
             lambda d: next(f"{k['kernel_GBps'] / 1e3:.2f} TB/s, {pct(k['fraction_of_hbm_peak'])} of HBM"
                            for k in d["results"] if k["kernel"] == "paged_attention"), "Kernels"),
    Headline("decode step / HBM floor (weights + KV over the measured copy rate), 8B shape, 256-token prompts: "
             "1 and 64 requests", "gpu_decode_h200.json",
             lambda d: " and ".join(f"{p['step_over_floor']:.2f}x" for b in (1, 64) for p in d["jax"]["points"]
                                    if p.get("batch") == b and p.get("context") == 256 and "skipped" not in p),
             "Decode against the memory floor on a GPU"),
    Headline("offline output tokens/s (32M Llama)", "offline_h200.json",
             lambda d: num(d["jaxserve"]["output_tokens_per_s"]["median"]), "Offline throughput"),
]
