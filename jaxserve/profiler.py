"""`jaxserve profile`: one instance of a cluster config measured on its real programs, written in the planner's
profile format (router/planner.py), so a profile measured here and one typed from a paper's table are
interchangeable.

- prefill: for each prompt length l, the wall time from queueing a fresh prompt of l random tokens (prefix
  caching cannot hit) to its first token, the median of at least `reps` runs, and of more until the runs have
  taken `min_seconds` of wall time (a short prompt's time is then a median of many), after one untimed pass
  (its compilations); and S_kv(l), the bytes a transfer of that prompt moves, from the model's cache groups
  (full-attention blocks, sliding rings, linear state) in the serving dtype;
- a cached prefix (`prefill.prefix`, with prefix caching on): for each listed length c that is whole blocks, a
  prompt of c tokens is run once (its blocks become cached prefix), then the same c tokens followed by
  `prefix_new_tokens` new ones is timed to its first token; what the prefix adds is that time less a fresh
  prefill of the new tokens alone (medians; 0 where noise makes it negative): attention over the prefix and
  reading it from the cache, what a conversation's next turn pays that a fresh prompt does not;
- decode: for each batch size B, the wall time of a decode step with B requests decoding (the mean over
  `decode_steps` steps, after each request's first tokens and an untimed pass); `max_batch` is the largest B
  whose step meets the TPOT SLO and `step_seconds` that B's step time.

Runs in this process on the instance's cores (pinned before JAX loads, as a worker is) with the config's
engine section, warm-up off: compile time is what the untimed passes absorb and is reported apart.
"""

from __future__ import annotations

import itertools
import os
import statistics
import time

_RUNS = itertools.count()  # request ids unique across runs


def _sizes(given: list[int] | None, hi: int, start: int, what: str, limit: str) -> list[int]:
    """The sizes asked for (each 1 .. hi, else a ValueError naming the option), or start, 2 start, 4 start, ...
    below hi, then hi."""
    if given:
        bad = [n for n in given if not 1 <= n <= hi]
        if bad:
            raise ValueError(f"{what} {bad}: must be 1 .. {hi} ({limit})")
        return sorted(set(given))
    out, n = [], start
    while n < hi:
        out.append(n)
        n *= 2
    return out + [hi]


def _run(llm, prompts: list[list[int]], params, tag: str) -> tuple[float, list]:
    """Queue `prompts`, step until all finish, forget them -> (wall seconds, their sequences)."""
    t0 = time.perf_counter()
    n = next(_RUNS)
    seqs = [s for i, p in enumerate(prompts) for s in llm.add_request(f"{tag}-{n}-{i}", p, params)]
    while llm.has_work:
        llm.step()
    dt = time.perf_counter() - t0
    for s in seqs:
        llm.release(s)
    return dt, seqs


MAX_RUNS = 400  # timed runs of one measurement at most, however short each is


def _median_time(once, reps: int, min_seconds: float, clock=time.perf_counter) -> float:
    """Median of what `once()` returns (its seconds) after one untimed call: at least `reps` timed calls, and
    more until the calls have taken `min_seconds` of wall time (their untimed set-up included; at most
    MAX_RUNS), so a short prefill's median is over many runs rather than a few that one scheduling hiccup of the
    machine can move."""
    once()
    times: list[float] = []
    t0 = clock()
    while len(times) < reps or (clock() - t0 < min_seconds and len(times) < MAX_RUNS):
        times.append(once())
    return statistics.median(times)


def _decode_step(llm, B: int, prompt_len: int, steps: int, rng, tag: str) -> float:
    """Mean decode step (seconds) with B requests decoding: queued together, their prompts prefilled and first
    tokens drawn (not timed), then `steps` steps of B rows timed (wall clock; the engine's step timer confirms
    each was a decode step of its own); then aborted."""
    from .sampling import SamplingParams
    params = SamplingParams(max_tokens=steps + B + 4, temperature=0.0, ignore_eos=True)  # none ends in the window
    vocab = llm.model_config.vocab_size
    seqs = [s for i in range(B) for s in llm.add_request(f"{tag}-{i}", rng.integers(3, vocab, prompt_len).tolist(),
                                                         params)]
    while any(len(s.output) < 2 for s in seqs):
        llm.step()
    llm.timer.reset()
    t0 = time.perf_counter()
    for _ in range(steps):
        llm.step()
    wall = (time.perf_counter() - t0) / steps
    st = llm.timer.summary().get("decode")
    for s in seqs:
        llm.abort(s.request_id)
    while llm.has_work:
        llm.step()
    if not st or st["count"] != steps:
        raise RuntimeError(f"batch {B}: {steps} decode-only steps expected, the step timer saw {st}")
    return wall


class _NoReuse(Exception):
    """The model cannot reuse a cached prefix of this length (no state snapshot there)."""


def _prefix(llm, Ls: list[int], new: int, reps: int, min_seconds: float, one, rng, progress: bool) -> dict | None:
    """The `prefill.prefix` block (see the module docstring), or None without prefix caching, room, or a
    reusable prefix."""
    from tqdm import tqdm
    bs, vocab = llm.cfg.block_size, llm.model_config.vocab_size
    cs = [c for c in Ls if c % bs == 0 and c + new < llm.max_model_len]
    if not llm.cfg.prefix_caching or not cs:
        return None
    fresh = _median_time(lambda: _run(llm, [rng.integers(3, vocab, new).tolist()], one, "f")[0], reps, min_seconds)
    extra = []

    def behind(c: int) -> float:
        head = rng.integers(3, vocab, c).tolist()
        _run(llm, [head], one, f"c{c}-head")  # its blocks stay cached once released
        dt, (seq,) = _run(llm, [head + rng.integers(3, vocab, new).tolist()], one, f"c{c}")
        if seq.num_cached != c:
            raise _NoReuse
        return dt
    for c in tqdm(cs, desc="cached prefixes", unit="length", disable=not progress):
        try:
            extra.append(max(0.0, _median_time(lambda: behind(c), reps, min_seconds) - fresh))
        except _NoReuse:  # not measured
            return None
    return {"new_tokens": new, "tokens": cs, "extra_seconds": extra, "fresh_seconds": fresh}


def profile(cfg, instance: str, lengths: list[int] | None = None, batches: list[int] | None = None,
            tpot_slo_s: float = 0.1, reps: int = 3, decode_steps: int = 16, progress: bool = True,
            prefix_new_tokens: int = 32, min_seconds: float = 0.5) -> dict:
    """Profile instance `instance` of config `cfg` (see the module docstring) -> the profile dict."""
    from .worker.setup import pin
    inst = cfg.instance(instance)
    pin(inst, cfg.device_share(instance))
    import jax.numpy as jnp
    import numpy as np
    from tqdm import tqdm

    from .bundled import resolve
    from .engine.llm_engine import LLMEngine
    from .sampling import SamplingParams
    from .server.serve import make_mesh
    if not tpot_slo_s > 0:
        raise ValueError(f"--tpot-slo-ms must be > 0, got {tpot_slo_s * 1e3:g}")
    if reps < 1 or decode_steps < 1 or prefix_new_tokens < 1:
        raise ValueError("--reps, --decode-steps and --prefix-new-tokens must be >= 1")
    if not min_seconds >= 0:
        raise ValueError(f"--min-seconds must be >= 0, got {min_seconds:g}")
    ec = cfg.engine.engine_config(cfg.server.max_waiting)
    llm = LLMEngine(resolve(cfg.model.path, progress), cfg.model.dtype, ec, make_mesh(inst, local=True), progress)
    Ls = _sizes(lengths, llm.max_model_len - 1, 16, "--lengths", f"engine.max_model_len {llm.max_model_len}")
    Bs = _sizes(batches, llm.cfg.max_num_seqs, 1, "--batches", "engine.max_num_seqs")
    rng = np.random.default_rng(0)
    vocab = llm.model_config.vocab_size
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    t_start, programs = time.perf_counter(), len(llm.runner.programs)
    seconds, kv = [], []
    itemsize = jnp.dtype(llm.dtype).itemsize
    for n in tqdm(Ls, desc="prefill lengths", unit="length", disable=not progress):
        seconds.append(_median_time(lambda: _run(llm, [rng.integers(3, vocab, n).tolist()], one, f"p{n}")[0], reps,
                                    min_seconds))
        kv.append(llm.cache_spec.transfer_bytes(n, llm.cfg.block_size, itemsize))
    prefix = _prefix(llm, Ls, prefix_new_tokens, reps, min_seconds, one, rng, progress)
    steps = []
    for B in tqdm(Bs, desc="decode batches", unit="batch", disable=not progress):
        _decode_step(llm, B, 16, 2, rng, f"w{B}")  # compiles this batch's programs
        steps.append(_decode_step(llm, B, 16, decode_steps, rng, f"d{B}"))
    meets = [i for i, s in enumerate(steps) if s <= tpot_slo_s]
    if not meets:
        raise RuntimeError(f"no batch size meets the TPOT SLO of {tpot_slo_s * 1e3:g} ms: one request's decode step "
                           f"takes {steps[0] * 1e3:.1f} ms")
    best = meets[-1]
    return {
        "prefill": {"tokens": Ls, "seconds": seconds, "kv_bytes": kv, **({"prefix": prefix} if prefix else {})},
        "decode": {"step_seconds": steps[best], "max_batch": Bs[best], "tpot_slo_s": tpot_slo_s,
                   "batch": Bs, "batch_step_seconds": steps},
        "instance": instance, "role": inst.role, "model": cfg.model.path, "dtype": llm.dtype_name,
        "cores": sorted(os.sched_getaffinity(0)), "reps": reps, "min_seconds": min_seconds,
        "decode_steps": decode_steps,
        "programs_compiled": len(llm.runner.programs) - programs, "seconds_total": time.perf_counter() - t_start,
    }
