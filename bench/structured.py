"""Structured outputs: constrained decoding throughput against free decoding in the same run, and the grammar engine's costs.

Throughput: SmolLM2-135M-Instruct, a batch of `--batch` chat requests ("describe person i as JSON"), greedy,
`--max-tokens` output tokens each. Free: no constraint, end-of-sequence ignored. Constrained: a JSON schema (an
object with a name, an age in bounds, languages from an enum and a biography of at least 600 characters, so
every answer runs the full max_tokens as the free ones do). The two alternate, `--reps` passes each after one
warm-up pass each (compiles excluded, with the two programs of a constrained step run ahead: engine/
split_step.py); each pass's output tokens per second over its wall time. The figure is
the ratio of the medians (goal: 0.9 or more), with the host's share: the time the engine spent filling the
bitmasks (its `_masks` hook), per step.

Grammar engine: for each of SCHEMAS, the compile time (a fresh engine: the check and the first matcher) and the
mean time to fill one token's mask, then consume the token, along the constrained answer the engine gave, for
llguidance (what jaxserve uses) and xgrammar when it can be imported (the comparison behind the choice).
"""

from __future__ import annotations

import json
import statistics
import time

import numpy as np

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages", "biography"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]},
                                       "minItems": 1, "maxItems": 3},
                         "biography": {"type": "string", "minLength": 600}}}
SCHEMAS = {
    "person": PERSON,
    "flat": {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]},
    "nested": {"type": "object", "required": ["items"], "properties": {"items": {"type": "array", "items": {
        "type": "object", "required": ["id", "tags", "price"], "properties": {
            "id": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
            "price": {"type": "number", "minimum": 0}}}}}},
}


def _costs(t0: float, t1: float, t2: float, fill, accept, tokens: list[int]) -> dict:
    """The tokenizer (t0..t1) and compile (t1..t2) times, and the mean time of `fill` along `tokens`."""
    fills = []
    for t in tokens:
        s = time.perf_counter()
        fill()
        fills.append(time.perf_counter() - s)
        accept(t)
    return {"tokenizer_s": round(t1 - t0, 4), "compile_s": round(t2 - t1, 5),
            "mask_ms": round(1e3 * statistics.mean(fills), 4) if fills else None}


def _llguidance(tok_json: str, V: int, eos: list[int], schema: dict, tokens: list[int]) -> dict:
    from jaxserve.structured import Grammars, Guided, words
    t0 = time.perf_counter()
    g = Grammars(tok_json, V, eos)
    g.tokenizer  # noqa: B018 - the tokenizer, built once per model, apart from the compile
    t1 = time.perf_counter()
    guide = g.guide(Guided("json", json.dumps(schema)))
    t2 = time.perf_counter()
    row = np.zeros(words(V), np.int32)
    return _costs(t0, t1, t2, lambda: guide.fill(row), guide.advance, tokens)


def _xgrammar(model_dir: str, V: int, schema: dict, tokens: list[int]) -> dict | None:
    try:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast
    except ImportError as e:
        return {"error": f"not importable here: {e}"}
    t0 = time.perf_counter()
    info = xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json"),
                                              vocab_size=V)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t1 = time.perf_counter()
    matcher = xgr.GrammarMatcher(compiler.compile_json_schema(json.dumps(schema)))
    t2 = time.perf_counter()
    mask = xgr.allocate_token_bitmask(1, V)
    return _costs(t0, t1, t2, lambda: matcher.fill_next_token_bitmask(mask), matcher.accept_token, tokens)


def main(argv=None):
    from bench.stamp import arguments, write
    ap = arguments(__doc__)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args(argv)
    from tqdm import tqdm

    from jaxserve import LLM, SamplingParams
    from jaxserve.engine.llm_engine import EngineConfig
    from jaxserve.models import gguf
    from jaxserve.structured import Guided
    model = gguf.resolve(gguf.SMOLLM2)
    llm = LLM(model, engine=EngineConfig(max_num_seqs=a.batch, block_size=16, num_blocks=1024, chunk_size=256,
                                         max_num_batched_tokens=512, max_prefill_seqs=4, max_model_len=2048))
    eng, tok = llm.engine, llm.tokenizer
    prompts = [tok.apply_chat_template([{"role": "user", "content": f"Describe person number {i} as JSON."}])
               for i in range(a.batch)]
    modes = {"free": SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True),
             "constrained": SamplingParams(max_tokens=a.max_tokens, temperature=0,
                                           guided=Guided("json", json.dumps(PERSON)))}
    masks = {"s": 0.0, "calls": 0}
    fill = eng._masks

    def timed(rows):
        t = time.perf_counter()
        try:
            return fill(rows)
        finally:
            masks["s"] += time.perf_counter() - t
            masks["calls"] += 1
    eng._masks = timed
    runs: dict = {m: [] for m in modes}
    answers = {}
    bar = tqdm(total=2 * (a.reps + 1), desc="structured", unit="pass")
    for rep in range(a.reps + 1):
        for mode, sp in modes.items():
            masks.update(s=0.0, calls=0)
            t0 = time.perf_counter()
            outs = llm.generate(prompts, sp)
            wall = time.perf_counter() - t0
            n = sum(len(o.token_ids) for o in outs)
            bar.update(1)
            if rep == 0:  # the warm-up pass: compiles (a constrained step's split programs behind it: waited for)
                answers[mode] = outs
                eng.runner.split.wait()
                continue
            runs[mode].append({"tokens": n, "seconds": round(wall, 4), "tokens_per_s": round(n / wall, 2),
                               "mask_s": round(masks["s"], 4), "mask_calls": masks["calls"]})
    bar.close()
    med = {m: statistics.median(r["tokens_per_s"] for r in runs[m]) for m in modes}
    valid = sum(1 for o in answers["constrained"] if o.text.startswith("{"))
    # the grammar engines over the constrained answers the engine gave (the person schema) and short answers to
    # the other schemas (each schema's own greedy answer from a fresh request)
    engines = {}
    for name, schema in SCHEMAS.items():
        if name == "person":
            tokens = answers["constrained"][0].token_ids
        else:
            tokens = llm.generate([tok.apply_chat_template([{"role": "user", "content": "Answer as JSON."}])],
                                  SamplingParams(max_tokens=64, temperature=0,
                                                 guided=Guided("json", json.dumps(schema))))[0].token_ids
        engines[name] = {"tokens": len(tokens),
                         "llguidance": _llguidance(tok.to_json(), eng.model_config.vocab_size,
                                                   sorted(eng.model_config.eos_token_ids), schema, tokens),
                         "xgrammar": _xgrammar(model, eng.model_config.vocab_size, schema, tokens)}
    c = runs["constrained"]
    result = {
        "what": __doc__.splitlines()[0], "model": "SmolLM2-135M-Instruct", "batch": a.batch,
        "max_tokens": a.max_tokens, "reps": a.reps,
        "free_tokens_per_s": med["free"], "constrained_tokens_per_s": med["constrained"],
        "ratio": round(med["constrained"] / med["free"], 3),
        "mask_ms_per_step": round(1e3 * statistics.median(r["mask_s"] / max(r["mask_calls"], 1) for r in c), 3),
        "mask_share": round(statistics.median(r["mask_s"] / r["seconds"] for r in c), 4),
        "constrained_answers_starting_an_object": valid, "runs": runs, "grammar_engines": engines}
    write(a.json, result)
    print(json.dumps({k: v for k, v in result.items() if k not in ("runs", "grammar_engines")}, indent=1))
    print(json.dumps(engines, indent=1))


if __name__ == "__main__":
    main()
