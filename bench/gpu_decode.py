"""The engine on a GPU against the memory floor: decode step time over (weights + KV read) / measured copy rate.

A random checkpoint of Llama-3.1-8B's shape (bf16) is built on the device and written as safetensors; then, in
one engine with the default cache sizing (engine.memory_fraction), batches of 1, 16, 64 and 256 requests (where
the cache holds them) decode at 256- and 2K-token contexts, greedy: per point the engine's decode step (its step
timer, programs compiled before), the HBM floor of that step (weight bytes + the batch's KV bytes, over the
device-to-device copy rate measured in the same run) and their ratio, over steps that decode the whole batch (its
requests ask for more tokens than they decode while later prompts prefill, and are aborted after the timed
steps; a point whose timed steps compiled a program is measured again). Also: the GPU's busy fraction over decode
steps from a profiler trace (the union of the GPU's kernel intervals over the steps' span), prefill's share of
the bf16 matmul rate measured in the same run, one prompt of the longest context prefilled under the profiler
(the step's phases, the GPU's busy fraction and its kernels by time: where prefill's time goes), the engine
again with its layers scanned (engine.scan_layers, a prefill instance's default on a GPU: decode step, prefill
and compile seconds at batch 1 and 64 against the unrolled points, and a layer-wise prefill instance's programs,
warm-up seconds and its prefill of the longest context), the engine again with engine.packed_prefill (one packed
program per prefill step over the pool, a mixed step's decode tokens in it: prefill and decode at batches 16 and
64 and the longest prompt's prefill against the default's), and transformers' `generate` on the same checkpoint
(sdpa, bf16) at batch 1 and 64. Each part runs in a process of its own (JAX and torch do not share the card);
the parts' JSON is merged into one result, stamped, written after every part.

    python -m bench.gpu_decode --json bench/results/gpu_decode_h200.json            # on the GPU (bench/gpu_check.sh)
    python -m bench.gpu_decode --shape tiny --batches 1,4 --contexts 32,64 --no-hf  # anywhere, to try it
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import struct
import subprocess
import sys
import tempfile
import time

SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    "8b8": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=8,
                num_attention_heads=32, num_key_value_heads=8, max_position_embeddings=8192),
    "small": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,  # SmolLM2-135M's
                  num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192),
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, max_position_embeddings=1024),
}


def config_of(shape: str) -> dict:
    s = SHAPES[shape]
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
            "head_dim": s["hidden_size"] // s["num_attention_heads"], "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "hidden_act": "silu", **s}


def tensors(c: dict):
    """(name, shape) of a Llama checkpoint's weights, Hugging Face names ([out, in] projections)."""
    H, I, V, D = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * D, c["num_key_value_heads"] * D
    yield "model.embed_tokens.weight", (V, H)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield from ((p + "input_layernorm.weight", (H,)), (p + "post_attention_layernorm.weight", (H,)),
                    (p + "self_attn.q_proj.weight", (q, H)), (p + "self_attn.k_proj.weight", (kv, H)),
                    (p + "self_attn.v_proj.weight", (kv, H)), (p + "self_attn.o_proj.weight", (H, q)),
                    (p + "mlp.gate_proj.weight", (I, H)), (p + "mlp.up_proj.weight", (I, H)),
                    (p + "mlp.down_proj.weight", (H, I)))
    yield "model.norm.weight", (H,)
    yield "lm_head.weight", (V, H)


def part_make(a) -> dict:
    """Random bf16 weights drawn on the device (N(0, 0.02), norms 1), written tensor by tensor as safetensors."""
    return {"shape": a.shape, **make_checkpoint(a.dir, config_of(a.shape))}


def make_checkpoint(path: str, c: dict) -> dict:
    """A random bf16 Llama checkpoint of config `c` in `path`, drawn on JAX's default device -> its size."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)
    names = list(tensors(c))
    header, off = {}, 0
    for name, shape in names:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [off, off + n]}
        off += n
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    t0 = time.perf_counter()
    key = jax.random.key(0)
    draw = jax.jit(lambda k, shape: (0.02 * jax.random.normal(k, shape, jnp.float32)).astype(jnp.bfloat16),
                   static_argnums=1)
    with open(os.path.join(path, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for i, (name, shape) in enumerate(names):
            x = jnp.ones(shape, jnp.bfloat16) if len(shape) == 1 else draw(jax.random.fold_in(key, i), shape)
            f.write(np.asarray(jax.device_get(x)).view(np.uint16).tobytes())
    return {"params": off // 2, "weight_bytes": off, "make_s": round(time.perf_counter() - t0, 2)}


def part_floor(a) -> dict:
    """The device's copy rate (bytes read + written) and bf16 matmul rate, with JAX."""
    import jax
    import jax.numpy as jnp
    n = (2 << 30) if a.shape != "tiny" else (64 << 20)
    x = jnp.zeros(n // 4, jnp.float32)
    copy = jax.jit(lambda x: x + 1.0)
    m = 8192 if a.shape != "tiny" else 512
    w = jnp.ones((m, m), jnp.bfloat16)
    mm = jax.jit(lambda w: w @ w)

    def best(f, arg, reps=10):
        jax.block_until_ready(f(arg))
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            jax.block_until_ready(f(arg))
            ts.append(time.perf_counter() - t0)
        return min(ts)
    return {"device": str(jax.devices()[0].device_kind), "copy_GBps": round(2 * n / best(copy, x) / 1e9, 1),
            "bf16_TFLOPs": round(2 * m ** 3 / best(mm, w) / 1e12, 1)}


def _gpu_events(trace_dir: str) -> list[dict] | None:
    """The GPU's complete events ("X") in the perfetto trace jax.profiler wrote under trace_dir (None: no trace)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*trace.json.gz"), recursive=True)
    if not files:
        return None
    with gzip.open(files[0]) as f:
        events = json.load(f)
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    gpu = {p for p, n in names.items() if "GPU" in n or "gpu" in n}
    return [e for e in events if e.get("ph") == "X" and e.get("pid") in gpu]


def busy_fraction(trace_dir: str) -> dict | None:
    """The GPU's busy share of the traced span: the union of the device's kernel intervals over the span from its
    first to its last (perfetto trace that jax.profiler writes)."""
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e.get("dur", 0))) for e in _gpu_events(trace_dir) or [])
    if not spans:
        return None
    busy, cur_lo, cur_hi = 0.0, *spans[0]
    for lo, hi in spans[1:]:
        if lo > cur_hi:
            busy, cur_lo = busy + cur_hi - cur_lo, lo
        cur_hi = max(cur_hi, hi)
    busy += cur_hi - cur_lo
    total = max(hi for _, hi in spans) - spans[0][0]
    return {"busy_fraction": round(busy / total, 3), "span_ms": round(total / 1e3, 2), "kernels": len(spans)}


def top_kernels(trace_dir: str, n: int = 12) -> list[dict] | None:
    """The GPU's kernels in a perfetto trace by total time, longest first: [{"name", "ms", "count"}] (the first
    n; the rest summed as "(others)")."""
    events = _gpu_events(trace_dir)
    if events is None:
        return None
    by: dict[str, list] = {}
    for e in events:
        t = by.setdefault(e.get("name", "?"), [0.0, 0])
        t[0] += float(e.get("dur", 0))
        t[1] += 1
    rows = sorted(([k, v[0], v[1]] for k, v in by.items()), key=lambda r: -r[1])
    if len(rows) > n:
        rows = rows[:n] + [["(others)", sum(r[1] for r in rows[n:]), sum(r[2] for r in rows[n:])]]
    return [{"name": k, "ms": round(us / 1e3, 3), "count": c} for k, us, c in rows]


def _engine(a, scan_layers: bool | None, packed_prefill: bool | None = None):
    """(LLM on the checkpoint, the part's first facts): the default cache sizing, compilation cache off."""
    from jaxserve.engine.llm_engine import EngineConfig
    from jaxserve.llm import LLM
    t0 = time.perf_counter()
    llm = LLM(a.dir, dtype="bfloat16", progress=False, engine=EngineConfig(
        max_num_batched_tokens=a.prefill_tokens, prefix_caching=False, compilation_cache=None,
        max_model_len=max(a.contexts) + a.new + _slack(a, max(a.batches), max(a.contexts)) + 16,
        scan_layers=scan_layers, packed_prefill=packed_prefill))
    eng = llm.engine
    return llm, {"load_s": round(time.perf_counter() - t0, 1), "num_blocks": eng.cfg.num_blocks,
                 "max_num_seqs": eng.cfg.max_num_seqs, "kernels": str(eng.kernels),
                 "scan_layers": bool(eng.runner.stack.runs), "packed_prefill": eng.runner.paged_prefill, "points": []}


def _save(a, out: dict) -> None:
    """The part's result so far, in its file: a part cut at its limit keeps the points it measured."""
    with open(os.path.join(a.work, f"{a.part}.json"), "w") as f:
        json.dump(out, f)


def _slack(a, B: int, C: int) -> int:
    """Tokens a request may decode while later prompts of its batch still prefill: prefill steps carry the
    running requests' decode rows (one token a step, their rows taking from the step's token budget), about one
    step per `prefill_tokens` of the batch's prompts; twice that and a few, to be safe."""
    return 2 * -(-B * C // a.prefill_tokens) + 4


def _points(a, llm, contexts, batches, out: dict) -> list[dict]:
    """Per (context, batch): the decode step against the HBM floor, prefill's share of the bf16 rate, and the
    seconds of the untimed first pass at that shape (its programs compiled: mostly compile time); each point
    appended to out["points"] and saved as it is measured.

    The B requests ask for `new` tokens plus what they may decode while later prompts prefill (`_slack`), and
    the timed window is the `new` decode steps after the last prompt's prefill: every request decoding, none
    finished (a request prefilled early would otherwise finish before it and the steps decode fewer rows); the
    requests are aborted after it. The floor counts the KV the window's rows hold, and a window in which
    programs were compiled (a shape the first pass did not reach) is measured again."""
    import numpy as np
    from jaxserve.sampling import SamplingParams
    c, eng, new = config_of(a.shape), llm.engine, a.new
    kv_token = 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * c["head_dim"] * 2  # bf16 K and V, all layers
    floor = json.load(open(os.path.join(a.work, "floor.json")))
    weights = json.load(open(os.path.join(a.work, "make.json")))["weight_bytes"]
    rng = np.random.default_rng(0)
    points = out["points"]
    for C in contexts:
        for B in batches:
            # the tokens each request asks for: new + slack, as far as the cache holds them (the window then
            # ends at the first request to finish)
            bs, room = eng.cfg.block_size, eng.cfg.num_blocks * 99 // 100
            tokens = min(new + _slack(a, B, C), (room // max(B, 1)) * bs - C)
            blocks = B * -(-(C + max(tokens, new)) // bs)
            if B > eng.cfg.max_num_seqs or tokens < new:
                points.append({"batch": B, "context": C, "skipped": f"the cache holds {eng.cfg.num_blocks} "
                               f"blocks, {eng.cfg.max_num_seqs} requests; this needs {blocks}, {B}"})
                _save(a, out)
                continue
            t_first = time.perf_counter()
            llm.generate([rng.integers(3, c["vocab_size"], C).tolist() for _ in range(B)],
                         SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # compiles
            first_s = time.perf_counter() - t_first
            recompiled = []
            for attempt in range(2):
                point = _point(eng, [rng.integers(3, c["vocab_size"], C).tolist() for _ in range(B)], new,
                               SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True), f"{C}-{B}-{attempt}")
                if not point["compiled_in_window"]:
                    break
                recompiled = point["compiled_in_window"]  # measured again: what the first pass had not compiled
            kv = point["mean_context"] * B * kv_token
            floor_ms = (weights + kv) / (floor["copy_GBps"] * 1e9) * 1e3
            step = point["decode_step_ms"]
            flops = 2 * (weights / 2 - 2 * c["vocab_size"] * c["hidden_size"]) * B * C  # the layers' matmuls
            point.update({"batch": B, "context": C, "floor_ms": round(floor_ms, 3),
                          "step_over_floor": round(step / floor_ms, 2),
                          "output_tok_s": round(B / point["wall_step_ms"] * 1e3, 1),
                          "first_pass_s": round(first_s, 1), "attempts": attempt + 1, "max_tokens": tokens,
                          "compiled_in_first_window": recompiled,
                          "prefill_share_of_bf16": round(flops / point["prefill_s"] / 1e12 / floor["bf16_TFLOPs"], 3),
                          "prefill_device_share_of_bf16": round(
                              flops / (point["prefill_device_ms"] / 1e3) / 1e12 / floor["bf16_TFLOPs"], 3)
                          if point["prefill_device_ms"] else None})
            points.append(point)
            _save(a, out)
            print(f"== B {B} C {C}: step {step:.2f} ms, floor {floor_ms:.2f} ms, {step / floor_ms:.2f}x", flush=True)
    return points


def _point(eng, prompts: list[list[int]], new: int, params, tag: str) -> dict:
    """One batch: prefilled (the steps until every request has its first token), then up to `new` decode steps
    timed while every request runs (the window ends at the first to finish), then aborted -> the point's
    timings."""
    before = set(eng.runner.programs)
    seqs = [eng.add_request(f"{tag}-{i}", p, params)[0] for i, p in enumerate(prompts)]
    eng.timer.reset()
    t_pre = time.perf_counter()
    while any(not s.output for s in seqs):
        eng.step()
    prefill_s = time.perf_counter() - t_pre
    pre = eng.timer.summary()
    # the prefill program's device phase over the prefill and mixed steps (mixed ones carry decode rows too)
    device_ms = sum(st["count"] * st.get("phases_ms", {}).get("prefill.device", 0.0)
                    for k, st in pre.items() if k in ("prefill", "mixed"))
    programs = set(eng.runner.programs)
    compiled_in_prefill = sorted(map(str, programs - before))
    context = sum(s.num_tokens for s in seqs)
    eng.timer.reset()
    n, t1 = 0, time.perf_counter()
    while n < new and not any(s.finished for s in seqs):
        eng.step()
        n += 1
    wall = (time.perf_counter() - t1) / max(n, 1)  # (no step: a request finished during the prefill steps)
    st = eng.timer.summary()
    context = (context + sum(s.num_tokens for s in seqs)) / 2
    finished = sum(s.finished for s in seqs)
    for s in seqs:
        eng.abort(s.request_id)
    while eng.has_work:
        eng.step()
    dec = st.get("decode", {})
    return {"decode_step_ms": round(dec.get("mean_ms", wall * 1e3), 3), "wall_step_ms": round(wall * 1e3, 3),
            "window_steps": n, "steps": {k: v["count"] for k, v in st.items()}, "phases_ms": dec.get("phases_ms", {}),
            "mean_context": round(context / len(seqs), 1), "finished_in_window": finished,
            "prefill_s": round(prefill_s, 3), "prefill_device_ms": round(device_ms, 3),
            "prefill_steps": {k: v["count"] for k, v in pre.items()}, "compiled_in_prefill": compiled_in_prefill,
            "compiled_in_window": sorted(map(str, set(eng.runner.programs) - programs))}


def part_jax(a) -> dict:
    """The engine as it runs by default (on a GPU: layers unrolled): every batch at the shortest context, the
    GPU's busy fraction over decode steps from a profiler trace, then every batch at the longer contexts."""
    llm, out = _engine(a, None)
    _points(a, llm, a.contexts[:1], a.batches, out)
    out["trace"] = _trace(a, llm)
    _save(a, out)
    out["trace_prefill"] = _trace_prefill(a, llm)
    _save(a, out)
    _points(a, llm, a.contexts[1:], a.batches, out)
    return out


def _timed_prefill(a, llm, seed: int):
    """One prompt of the longest context prefilled (one alike before it, untimed: anything it needs compiled) ->
    (its wall ms, the engine's step timer summary over it, the prompt maker for more)."""
    import numpy as np
    from jaxserve.sampling import SamplingParams
    eng, c = llm.engine, config_of(a.shape)
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def prefill():
        llm.generate([rng.integers(3, c["vocab_size"], max(a.contexts)).tolist()], params)
    prefill()
    eng.timer.reset()
    t0 = time.perf_counter()
    prefill()
    return (time.perf_counter() - t0) * 1e3, eng.timer.summary(), prefill


def _trace_prefill(a, llm) -> dict:
    """One prompt of the longest context prefilled, then another under the profiler: the step's wall and
    device-phase milliseconds, the GPU's busy fraction and its kernels by time: where prefill's time goes when it
    is short of the bf16 rate."""
    import jax
    wall_ms, unprofiled, prefill = _timed_prefill(a, llm, 2)
    trace = tempfile.mkdtemp(prefix="gpu_decode_prefill_trace_")
    jax.profiler.start_trace(trace, create_perfetto_trace=True)
    prefill()
    jax.profiler.stop_trace()
    steps = {k: {"count": v["count"], "mean_ms": round(v["mean_ms"], 3),
                 "phases_ms": {p: round(x, 3) for p, x in v.get("phases_ms", {}).items()}}
             for k, v in unprofiled.items()}
    return {"batch": 1, "context": max(a.contexts), "wall_ms": round(wall_ms, 3), "steps": steps,
            **(busy_fraction(trace) or {"error": "no device events in the trace"}),
            "top_kernels": top_kernels(trace)}


def _trace(a, llm) -> dict:
    """The GPU's busy fraction over 16 decode steps of the middle batch at the shortest context, every request
    running (they ask for `_slack` more tokens than the steps before and in the trace, and are aborted after)."""
    import jax
    import numpy as np
    from jaxserve.sampling import SamplingParams
    eng, c = llm.engine, config_of(a.shape)
    rng = np.random.default_rng(1)
    B, C = a.batches[len(a.batches) // 2], a.contexts[0]
    params = SamplingParams(max_tokens=16 + 3 + _slack(a, B, C), temperature=0, ignore_eos=True)
    seqs = [eng.add_request(f"trace-{i}", rng.integers(3, c["vocab_size"], C).tolist(), params)[0]
            for i in range(B)]
    while any(not s.output for s in seqs):
        eng.step()
    for _ in range(3):
        eng.step()
    trace = tempfile.mkdtemp(prefix="gpu_decode_trace_")
    jax.profiler.start_trace(trace, create_perfetto_trace=True)
    for _ in range(16):
        eng.step()
    jax.profiler.stop_trace()
    finished = sum(s.finished for s in seqs)
    for s in seqs:
        eng.abort(s.request_id)
    while eng.has_work:
        eng.step()
    return {"batch": B, "context": C, "steps": 16, "finished_in_trace": finished,
            **(busy_fraction(trace) or {"error": "no device events in the trace"})}


def part_packed(a) -> dict:
    """The engine with engine.packed_prefill (a prefill step one packed program over the pool: first chunks through
    the paged prefill kernel instead of flash attention, a mixed step's decode tokens in the same program, the
    weights read once for both): the points of batches 16 and 64 (where asked; steps of several prompts, mixed
    steps) at the shortest context and one prompt of the longest context prefilled, to set against part_jax's
    (whether a GPU's engine should pack by default)."""
    llm, out = _engine(a, None, packed_prefill=True)
    _points(a, llm, a.contexts[:1], [b for b in a.batches if b in (16, 64)] or a.batches[-1:], out)
    out["long_prefill"] = _long_prefill(a, llm)
    return out


def part_scan(a) -> dict:
    """The engine with its layers scanned (engine.scan_layers, a prefill instance's default on a GPU): the decode
    step and prefill at the goal's batches (1 and 64, where asked) at the shortest context, to set against
    part_jax's unrolled points, then a layer-wise prefill instance's warm-up (bench/gpu_disagg.py's layer groups
    and streaming threshold): its prefill programs and seconds, the compilation cache off."""
    from jaxserve.transfer.plan import layer_groups
    llm, out = _engine(a, True)
    _points(a, llm, a.contexts[:1], [b for b in a.batches if b in (1, 64)] or a.batches[:1], out)
    eng = llm.engine
    groups = layer_groups(eng.layout.num_layers, 4)
    eng.stream_layers(groups, 512)
    before = {k for k in eng.runner.programs if k[0] == "prefill"}
    t0 = time.perf_counter()
    eng.runner.warmup(progress=False, stages=groups, decode=False)
    made = {k for k in eng.runner.programs if k[0] == "prefill"} - before
    out["prefill_instance"] = {"layer_groups": len(groups), "layers_per_group": 4, "programs": len(made),
                               "max_num_batched_tokens": a.prefill_tokens,
                               "warmup_s": round(time.perf_counter() - t0, 1)}
    print(f"== scanned prefill instance: {len(made)} programs in {out['prefill_instance']['warmup_s']} s", flush=True)
    _save(a, out)
    out["prefill_instance"].update(_long_prefill(a, llm))
    return out


def _long_prefill(a, llm) -> dict:
    """One prompt of the longest context prefilled as the engine runs it (a prefill instance: its layer groups,
    one program each, the warm-up compiled them): wall and device-phase milliseconds, to set against part_jax's
    unrolled prefill of the same length (bench/gpu_disagg.py's TTFT: is a disaggregated prefill slower?)."""
    wall_ms, summary, _ = _timed_prefill(a, llm, 3)
    st = summary.get("prefill", {})
    return {"context": max(a.contexts), "prefill_wall_ms": round(wall_ms, 3), "prefill_steps": st.get("count", 0),
            "prefill_device_ms": round(st.get("phases_ms", {}).get("prefill.device", 0.0) * st.get("count", 0), 3)}


def part_hf(a) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(a.dir, dtype=torch.bfloat16, attn_implementation="sdpa").to(dev)
    model.eval().generation_config.eos_token_id = None
    sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
    out = []
    for B in (1, 64):
        ids = torch.randint(3, model.config.vocab_size, (B, a.contexts[0]), device=dev)

        def gen(n):
            sync()
            t0 = time.perf_counter()
            with torch.no_grad():
                model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=n,
                               min_new_tokens=n, do_sample=False, pad_token_id=0)
            sync()
            return time.perf_counter() - t0
        gen(2)
        one, many = gen(1), gen(a.new)
        out.append({"batch": B, "context": a.contexts[0], "decode_step_ms": round((many - one) / (a.new - 1) * 1e3, 3)})
    return {"transformers": out}


PARTS = {"make": part_make, "floor": part_floor, "jax": part_jax, "packed": part_packed, "scan": part_scan,
         "hf": part_hf}


def main(argv=None) -> int:
    from bench.stamp import arguments, write
    ap = arguments(__doc__)
    ap.add_argument("--shape", default="8b", choices=list(SHAPES))
    ap.add_argument("--batches", default="1,16,64,256")
    ap.add_argument("--contexts", default="256,2048")
    ap.add_argument("--new", type=int, default=48, help="tokens decoded per point")
    ap.add_argument("--prefill-tokens", type=int, default=8192, help="engine.max_num_batched_tokens")
    ap.add_argument("--no-hf", action="store_true", help="skip transformers")
    ap.add_argument("--no-scan", action="store_true", help="skip the engine with its layers scanned")
    ap.add_argument("--no-packed", action="store_true", help="skip the engine with engine.packed_prefill")
    ap.add_argument("--part", choices=list(PARTS), help=argparse.SUPPRESS)  # one part, in this process
    ap.add_argument("--dir", help=argparse.SUPPRESS)
    ap.add_argument("--work", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.batches, a.contexts = [int(x) for x in a.batches.split(",")], [int(x) for x in a.contexts.split(",")]
    if a.part:
        with open(os.path.join(a.work, f"{a.part}.json"), "w") as f:
            json.dump(PARTS[a.part](a), f)
        return 0
    work = tempfile.mkdtemp(prefix="gpu_decode_")
    ck = os.path.join(work, "checkpoint")
    result = {"shape": a.shape, "batches": a.batches, "contexts": a.contexts, "new": a.new}
    # the figures first, where a run is cut at its share; transformers, measured before, last
    for part in (["make", "floor", "jax"] + ([] if a.no_scan else ["scan"]) + ([] if a.no_packed else ["packed"])
                 + ([] if a.no_hf else ["hf"])):
        cmd = [sys.executable, "-m", "bench.gpu_decode", "--part", part, "--dir", ck, "--work", work,
               "--shape", a.shape, "--batches", ",".join(map(str, a.batches)),
               "--contexts", ",".join(map(str, a.contexts)), "--new", str(a.new),
               "--prefill-tokens", str(a.prefill_tokens), "--json", a.json]
        t0 = time.perf_counter()
        rc = subprocess.run(cmd).returncode
        print(f"gpu_decode: {part}: rc {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
        path = os.path.join(work, f"{part}.json")
        result[part] = json.load(open(path)) if os.path.exists(path) else {}  # what a failed part saved, too
        if rc != 0:
            result[part]["error"] = f"rc {rc}"
        write(a.json, result)  # after every part: a run cut short keeps what it measured
        if rc != 0 and part in ("make", "floor"):
            break
    print(json.dumps(result)[:3000])
    return 0


if __name__ == "__main__":
    sys.exit(main())
