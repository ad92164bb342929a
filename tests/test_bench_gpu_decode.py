"""bench/gpu_decode.py's parts that run anywhere: the random checkpoint it writes (read by jaxserve and by
transformers alike) and the busy fraction it reads from a perfetto trace."""

import argparse
import gzip
import json
import os

import numpy as np

from bench import gpu_decode


def test_the_checkpoint_reads_the_same_in_jaxserve_and_transformers(tmp_path, hf_model):
    import torch
    from jaxserve import LLM
    ck = str(tmp_path / "ck")
    made = gpu_decode.part_make(argparse.Namespace(dir=ck, shape="tiny"))
    c = gpu_decode.config_of("tiny")
    assert made["weight_bytes"] == 2 * made["params"] == os.path.getsize(f"{ck}/model.safetensors") - 8 - int.from_bytes(
        open(f"{ck}/model.safetensors", "rb").read(8), "little")
    ids = [5, 9, 300, 17, 2, 44]
    ours = LLM(ck, progress=False).score(ids)  # float32 compute over the bf16 weights
    with torch.no_grad():
        theirs = hf_model(ck)(torch.tensor([ids])).logits[0].numpy()
    assert ours.shape == (len(ids), c["vocab_size"])
    np.testing.assert_allclose(ours, theirs, atol=2e-4)


def _trace(path, events):
    os.makedirs(path, exist_ok=True)
    meta = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "/device:GPU:0"}},
            {"ph": "M", "name": "process_name", "pid": 7, "args": {"name": "/host:CPU"}}]
    with gzip.open(os.path.join(path, "perfetto_trace.json.gz"), "wt") as f:
        json.dump({"traceEvents": meta + events}, f)


def test_the_busy_fraction_is_the_union_of_the_gpus_kernels_over_their_span(tmp_path):
    gpu = [{"ph": "X", "pid": 1, "ts": ts, "dur": d} for ts, d in ((0, 10), (5, 10), (20, 10), (22, 3))]
    host = [{"ph": "X", "pid": 7, "ts": 0, "dur": 1000}]  # the host's events do not count
    _trace(str(tmp_path / "a" / "plugins"), gpu + host)
    got = gpu_decode.busy_fraction(str(tmp_path / "a"))
    assert got == {"busy_fraction": round(25 / 30, 3), "span_ms": 0.03, "kernels": 4}
    _trace(str(tmp_path / "b"), host)
    assert gpu_decode.busy_fraction(str(tmp_path / "b")) is None


def test_the_kernels_by_time_sum_each_names_gpu_events(tmp_path):
    gpu = [{"ph": "X", "pid": 1, "ts": 0, "dur": d, "name": n} for n, d in
           (("gemm_a", 300), ("scatter_b", 900), ("gemm_a", 200), ("tiny", 5), ("tiny2", 4))]
    _trace(str(tmp_path / "a"), gpu + [{"ph": "X", "pid": 7, "ts": 0, "dur": 5000, "name": "host"}])
    assert gpu_decode.top_kernels(str(tmp_path / "a"), n=2) == [
        {"name": "scatter_b", "ms": 0.9, "count": 1}, {"name": "gemm_a", "ms": 0.5, "count": 2},
        {"name": "(others)", "ms": 0.009, "count": 2}]
    assert gpu_decode.top_kernels(str(tmp_path / "none")) is None


def test_the_report_renders_a_result():
    from bench.report_engine import gpu_decode as render
    d = {"shape": "8b", "make": {"weight_bytes": 16.06e9}, "floor": {"device": "NVIDIA H200", "copy_GBps": 4178.5,
         "bf16_TFLOPs": 799.5},
         "jax": {"num_blocks": 53000, "max_num_seqs": 256, "points": [
             {"batch": 1, "context": 256, "decode_step_ms": 4.9, "floor_ms": 3.85, "step_over_floor": 1.27,
              "output_tok_s": 204, "prefill_share_of_bf16": 0.02},
             {"batch": 256, "context": 2048, "skipped": "the cache holds ..."}],
             "trace": {"busy_fraction": 0.91, "span_ms": 80.5, "batch": 16, "context": 256}},
         "hf": {"transformers": [{"batch": 1, "decode_step_ms": 106.7}]}}
    text = "\n".join(render({"gpu_decode_h200.json": d}))
    assert "| 1 | 256 | 4.90 | 3.85 | 1.27x | 204 | 2% |" in text and "Not run (the cache holds too little): 256 x 2048" in text
    assert "busy 91% of 80.5 ms" in text and "106.7 ms a step at 1 requests" in text
    assert "One " not in text  # no prefill trace in this result
    d["jax"]["trace_prefill"] = {"context": 2048, "wall_ms": 61.25, "busy_fraction": 0.5, "span_ms": 70.0,
                                 "steps": {"prefill": {"count": 1, "mean_ms": 60.0,
                                                       "phases_ms": {"prefill.device": 58.0}}},
                                 "top_kernels": [{"name": "scatter", "ms": 31.0, "count": 32}]}
    assert ("One 2048-token prompt prefilled in 61.2 ms (1 prefill step, device phase 58.0 ms a step); under the "
            "profiler the GPU was busy 50% of 70.0 ms; its kernels by time: `scatter` 31.00 ms (32).") in \
        "\n".join(render({"gpu_decode_h200.json": d}))
    assert "did not finish (rc 1)" in "\n".join(render({"x.json": {**d, "jax": {"error": "rc 1"}}}))
    d["jax"]["points"][0].update(prefill_s=0.5, first_pass_s=30.0)
    d["scan"] = {"points": [{"batch": 1, "context": 256, "decode_step_ms": 5.39, "prefill_s": 0.55,
                             "first_pass_s": 6.0}],
                 "prefill_instance": {"layer_groups": 8, "layers_per_group": 4, "programs": 17,
                                      "max_num_batched_tokens": 8192, "warmup_s": 61.2}}
    text = "\n".join(render({"gpu_decode_h200.json": d}))
    assert ("1 x 256: decode step 5.39 ms (1.10x unrolled), prefill 1.10x, first pass (compiling) 6.0 s against "
            "30.0 s") in text
    assert "(8 groups of 4 layers, max_num_batched_tokens 8192) warmed 17 prefill programs in 61.2 s" in text
    d["jax"]["points"].append({"batch": 1, "context": 2048, "prefill_s": 0.1231, "prefill_device_ms": 120.5,
                               "decode_step_ms": 5.1, "first_pass_s": 9.0, "floor_ms": 4.4, "step_over_floor": 1.16,
                               "output_tok_s": 196, "prefill_share_of_bf16": 0.36})
    d["scan"]["prefill_instance"].update(context=2048, prefill_wall_ms=180.25, prefill_device_ms=176.0, prefill_steps=1)
    assert ("It prefilled one 2048-token prompt in 180.2 ms, device 176.0 ms, over 1 steps (unrolled, whole: 123.1 "
            "ms, device 120.5 ms).") in "\n".join(render({"gpu_decode_h200.json": d}))
    assert "scanned did not finish (rc 124)" in "\n".join(render({"x.json": {**d, "scan": {"error": "rc 124"}}}))
    d["packed"] = {"points": [{"batch": 1, "context": 256, "decode_step_ms": 4.9, "prefill_s": 0.4,
                               "prefill_share_of_bf16": 0.03, "prefill_device_share_of_bf16": 0.04}],
                   "long_prefill": {"context": 2048, "prefill_wall_ms": 50.5, "prefill_device_ms": 49.0,
                                    "prefill_steps": 1}}
    assert ("With packed prefill (engine.packed_prefill: a prefill step one program over the pool, first chunks "
            "through the paged prefill kernel, a mixed step's decode tokens in it): 1 x 256: prefill 400.0 ms "
            "(0.80x the default's; 4% of the bf16 rate against 2%), decode step 1.00x. It prefilled one 2048-token "
            "prompt in 50.5 ms, device 49.0 ms, over 1 steps (the default: 61.2 ms).") in \
        "\n".join(render({"gpu_decode_h200.json": d}))
    assert "packed prefill did not finish (rc 1)" in "\n".join(render({"x.json": {**d, "packed": {"error": "rc 1"}}}))


def test_the_report_marks_points_that_did_not_decode_the_whole_batch_or_compiled_while_timed():
    from bench.report_engine import flaws, prefill_flaw
    old = {"batch": 64, "context": 2048, "phases_ms": {"decode.prepare": 1.4}, "prefill_s": 6.5, "first_pass_s": 5.8}
    assert flaws(old) == "†" and prefill_flaw(old) == "§"  # 16 prefill steps of 8,192 tokens before the window
    assert flaws({**old, "context": 256}) == "" and prefill_flaw({**old, "first_pass_s": 30.0}) == ""
    assert flaws({"batch": 16, "context": 256, "phases_ms": {"decode.prepare": 125.2}}) == "‡"
    new = {**old, "window_steps": 48, "finished_in_window": 0, "compiled_in_window": [], "compiled_in_prefill": []}
    assert flaws(new) == "" and prefill_flaw(new) == ""
    assert flaws({**new, "finished_in_window": 3, "compiled_in_window": ["('decode', 64, 1, 8, None)"]}) == "†‡"


def test_a_point_times_steps_that_decode_every_request_of_the_batch(tmp_path):
    """Sixteen 32-token prompts over 128-token prefill steps: the requests prefilled first decode in the later
    prefill steps; the timed window is still `new` steps of all sixteen, and the requests are aborted after it."""
    from jaxserve.engine.llm_engine import EngineConfig
    from jaxserve.llm import LLM
    ck, work = str(tmp_path / "ck"), str(tmp_path)
    made = gpu_decode.part_make(argparse.Namespace(dir=ck, shape="tiny"))
    json.dump(made, open(f"{work}/make.json", "w"))
    json.dump({"copy_GBps": 5.0, "bf16_TFLOPs": 0.2}, open(f"{work}/floor.json", "w"))
    a = argparse.Namespace(shape="tiny", new=6, prefill_tokens=128, work=work, part="jax", batches=[16],
                           contexts=[32])
    llm = LLM(ck, progress=False, engine=EngineConfig(max_num_batched_tokens=128, prefix_caching=False,
                                                      compilation_cache=None, max_model_len=128))
    out = {"points": []}
    [p] = gpu_decode._points(a, llm, a.contexts, a.batches, out)
    assert p["prefill_steps"].get("mixed", 0) >= 3  # the early requests decoded while later prompts prefilled
    assert p["window_steps"] == 6 and p["steps"] == {"decode": 6} and p["finished_in_window"] == 0
    assert p["max_tokens"] == 6 + gpu_decode._slack(a, 16, 32) and not p["compiled_in_window"]
    assert 32 + 1 < p["mean_context"] < 32 + p["max_tokens"]
    kv_token = 2 * 2 * 2 * 16 * 2  # K and V, 2 layers, 2 KV heads of 16, bf16
    assert p["floor_ms"] == round((made["weight_bytes"] + p["mean_context"] * 16 * kv_token) / 5e9 * 1e3, 3)
    assert not llm.engine.has_work and not llm.engine.requests  # aborted, nothing left running
    assert json.load(open(f"{work}/jax.json"))["points"] == [p]  # saved as measured
