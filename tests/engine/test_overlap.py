"""The overlapped decode loop (engine/overlap.py) gives the synchronous loop's outputs: per family, with end-of-
sequence and stop tokens, max_tokens of every length, seeded sampling with n > 1 and logprobs, a repetition
penalty, prefix caching, a tight pool (preemption), an abort mid-stream, stop strings and a constrained request
beside free ones; the next step is dispatched before the one in flight is read; no block is left referenced."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import EngineConfig
from jaxserve.structured import Guided

CFG = EngineConfig(block_size=4, num_blocks=96, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
                   max_num_seqs=6, num_snapshots=8, prefix_caching=True, overlap=True)
BASE = [5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 15, 6, 16, 17, 18, 19, 20, 21, 22]


def workload(rng):
    """(prompt, params) pairs: shared prefixes, every max_tokens from 1, EOS honoured or not, stop tokens,
    seeded sampling with logprobs and n = 2, a repetition penalty."""
    out = []
    for i in range(14):
        prompt = BASE[:3 + i] if i % 3 else rng.integers(3, 200, 5 + i).tolist()
        p = dict(max_tokens=1 + i % 7 * 3, temperature=0.0, ignore_eos=i % 2 == 0)
        if i % 4 == 1:
            p.update(temperature=0.9, top_p=0.9, seed=i, logprobs=2, n=2 if i == 5 else 1)
        if i % 5 == 2:
            p.update(stop_token_ids=(int(rng.integers(3, 200)),), repetition_penalty=1.3)
        out.append((prompt, SamplingParams(**p)))
    return out


def run(llm, items, abort_at: int | None = None) -> list:
    """Every request added at once, stepped to the end (the third aborted once it has `abort_at` tokens) -> per
    sequence (tokens, finish reason, logprobs)."""
    eng = llm.engine
    seqs = [s for i, (prompt, p) in enumerate(items) for s in eng.add_request(f"q{i}", prompt, p)]
    while eng.has_work:
        eng.step()
        if abort_at is not None and len(seqs[2].output) >= abort_at and not seqs[2].finished:
            eng.abort(seqs[2].request_id)
    for s in seqs:
        eng.release(s)
    eng.blocks.check()
    assert eng.blocks.num_referenced() == 0 and not eng.scheduler.running
    return [(s.output, s.finish_reason, s.logprobs) for s in seqs]


def same(a: list, b: list) -> bool:
    """Equal tokens, finish reasons and top-logprob ids; logprobs within 1e-4 (a row's last bits follow the batch
    it ran in, as in the synchronous loop)."""
    for (ta, ra, la), (tb, rb, lb) in zip(a, b, strict=True):
        assert (ta, ra) == (tb, rb) and len(la) == len(lb)
        for (x, tops_a), (y, tops_b) in zip(la, lb):
            assert [t for t, _ in tops_a] == [t for t, _ in tops_b]
            np.testing.assert_allclose([x] + [v for _, v in tops_a], [y] + [v for _, v in tops_b], atol=1e-4)
    return True


def both(path, cfg, items, **kw):
    sync = LLM(path, progress=False, engine=dataclasses.replace(cfg, overlap=False))
    over = LLM(path, progress=False, engine=dataclasses.replace(cfg, overlap=True))
    a, b = run(sync, items, **kw), run(over, items, **kw)
    return a, b, sync.engine, over.engine


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3", "qwen3_next", "kimi_linear", "gpt_oss"])
def test_overlapped_outputs_are_the_synchronous_ones(checkpoint_dir, family):
    items = workload(np.random.default_rng(0))
    a, b, sync, over = both(checkpoint_dir(family), CFG, items)
    assert same(a, b)
    # the steady decode steps ran ahead (hybrid models: a step that begins with a snapshot planned runs synchronously)
    assert sync.overlapped == 0 and over.overlapped > (5 if over.layout.has_request_state else 10)
    assert {r for _, r, _ in b} == {"stop", "length"}


def test_preemption_and_an_abort_mid_stream(checkpoint_dir):
    items = [(p, dataclasses.replace(sp, max_tokens=sp.max_tokens + 10)) for p, sp in
             workload(np.random.default_rng(1))]
    tight = dataclasses.replace(CFG, num_blocks=16, prefix_caching=False)
    a, b, sync, over = both(checkpoint_dir("llama"), tight, items, abort_at=3)
    assert same(a, b) and over.overlapped > 0
    assert sync.scheduler.num_preemptions > 0 and over.scheduler.num_preemptions > 0
    assert a[2][1] == "abort" and len(a[2][0]) == 3


def test_a_hybrid_model_steps_ahead_and_keeps_its_decode_snapshots(checkpoint_dir):
    """Hybrid models step ahead too (their state lives in slot rows). A step whose token completes a block saves
    the request-level state there, its row keyed by the block's hash once that token is read: the snapshots kept
    are as many as the synchronous loop keeps, each keyed by a block boundary of a request's tokens (one that ended
    on a boundary keeps the snapshot of that boundary, which the synchronous loop never ran a step for), and a
    follow-up turn over prompt + answer reuses a snapshot, as in the synchronous loop."""
    from jaxserve.cache.block_manager import block_hashes
    items = workload(np.random.default_rng(2))[:6]
    a, b, sync, over = both(checkpoint_dir("qwen3_next"), CFG, items)
    assert same(a, b) and over.overlapped > 0
    prompts = [prompt for prompt, p in items for _ in range(p.n)]
    valid = {h for pr, (out, _, _) in zip(prompts, a) for h in block_hashes(pr + out, CFG.block_size)}
    kept = [eng.blocks.snapshots.keys() for eng in (sync, over)]
    assert kept[0] and len(kept[0]) == len(kept[1]) and set(kept[1]) <= valid
    longest = max(range(len(a)), key=lambda i: len(prompts[i]) + len(a[i][0]))
    turn = prompts[longest] + a[longest][0] + [7, 9, 11]
    cached = []
    for eng in (sync, over):
        seq, = eng.add_request("turn", turn, SamplingParams(max_tokens=2, temperature=0.0))
        while eng.has_work:
            eng.step()
        cached.append(seq.num_cached)
        eng.release(seq)
    assert cached[1] >= cached[0] > 0, cached


def test_the_next_step_is_dispatched_before_the_one_in_flight_is_read(checkpoint_dir, monkeypatch):
    llm = LLM(checkpoint_dir("llama"), progress=False, engine=CFG)
    runner, log = llm.engine.runner, []
    for name in ("dispatch", "collect"):
        f = getattr(runner, name)
        monkeypatch.setattr(runner, name, lambda *a, _f=f, _n=name, **k: (log.append(_n), _f(*a, **k))[1])
    llm.generate([BASE[:5]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    # the first decode step is left in flight; each later one dispatched before its predecessor is read
    assert "".join(x[0] for x in log) == "d" + "dc" * 4 + "c"


def test_stop_strings_and_constrained_requests_beside_free_ones(smollm2_dir, monkeypatch):
    """Constrained rows step ahead too: on an accelerator each step's model is dispatched before the step in
    flight is read, its sampling once the grammars have taken that step's tokens (engine/split_step.py); the
    first time a shape runs, and always on a CPU, the whole step runs right after the read. Every way gives the
    synchronous loop's outputs, a request whose grammar ends sampling one dropped token freely."""
    cfg = EngineConfig(num_blocks=128, max_num_seqs=6, num_snapshots=0, compilation_cache=None, overlap=True)
    sync = LLM(smollm2_dir, progress=False, engine=dataclasses.replace(cfg, overlap=False))
    over = LLM(smollm2_dir, progress=False, engine=cfg)
    schema = '{"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}'
    items = [("The capital of France is", SamplingParams(max_tokens=24, temperature=0, stop=(".", " and"))),
             ("Count: one, two, three,", SamplingParams(max_tokens=20, temperature=0, stop=(" six",))),
             ("Give a JSON number:", SamplingParams(max_tokens=12, temperature=0, guided=Guided("json", schema))),
             ("The best city:", SamplingParams(max_tokens=12, temperature=0, guided=Guided(
                 "choice", '["Paris", "Lyon", "Marseille"]'))),
             ("A phone number:", SamplingParams(max_tokens=12, temperature=0.8, seed=3, guided=Guided(
                 "regex", "[0-9]{3}-[0-9]{4}"))),
             ("Once upon a time", SamplingParams(max_tokens=16, temperature=0))]

    def run(llm):
        eng = llm.engine
        seqs = [eng.add_request(f"s{i}", p, sp)[0] for i, (p, sp) in enumerate(items)]
        while eng.has_work:
            eng.step()
        for s in seqs:
            eng.release(s)
        assert eng.blocks.num_referenced() == 0
        return [(s.output, s.detok.text, s.finish_reason) for s in seqs]

    want = run(sync)
    assert want[0][2] == "stop" and not want[0][1].endswith(".")  # cut before the stop string
    assert want[3][1] in ("Paris", "Lyon", "Marseille") and want[3][2] == "stop"
    runner = over.engine.runner
    assert not runner.split_steps  # a CPU: the whole step once the masks are filled
    assert run(over) == want and over.engine.overlapped > 0
    runner.split_steps = True  # as on an accelerator
    assert run(over) == want  # the split programs compiling: whole steps
    runner.split.wait()
    picks, pick = [], runner.pick
    monkeypatch.setattr(runner, "pick", lambda *a: (picks.append(a[0]), pick(*a))[1])
    assert run(over) == want  # the same shapes again, each step's sampling split off its model
    assert any(len(rows) > 1 for rows in picks) and len(picks) >= 5
    assert sync.engine.overlapped == 0
