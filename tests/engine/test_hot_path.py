"""The decode hot path: what a step costs the host, and the packed arrays it moves.

A decode step of the engine makes one upload (its rows' packed inputs), one program (the model and sampling)
and one read (the sampled tokens), whatever the batch, with nothing else crossing between host and device (run
under `jax.transfer_guard("disallow")`, which refuses every implicit copy), the read of each step after the next
one is dispatched (engine/overlap.py); a step with a constrained row adds one upload (its bitmask), and where
it is split (engine/split_step.py) one program (its sampling). A prefill step's new decoders enter the penalty
state in one program. The programs that write the KV pool (and a hybrid's request state) write it in place.
Where samplers are specialised to their rows (a GPU), they answer as the device's decision does.
The packing (engine/step_io.py) against the sampler's own host-built tensors.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine import step_io
from jaxserve.engine.llm_engine import EngineConfig
from jaxserve.engine.rows import DecodeRow
from jaxserve.engine.sampler import MAX_LOGPROBS, SamplingTensors
from jaxserve.transfer.plan import layer_groups
from tests import in_place

CFG = EngineConfig(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
                   max_num_seqs=4, num_snapshots=8, overlap=True)  # the overlapped loop, an accelerator's default
PROGRAMS = ("_step", "_decode", "_sample", "_first", "_insert", "_prefill")


class Counts:
    """Wraps a runner's programs, upload and read with counters."""

    def __init__(self, runner, monkeypatch):
        self.n = {}
        for name in (*PROGRAMS, "_upload", "_read"):
            monkeypatch.setattr(runner, name, self._counted(name, getattr(runner, name)))

    def _counted(self, name, f):
        def call(*a, **k):
            self.n[name] = self.n.get(name, 0) + 1
            return f(*a, **k)
        return call

    def take(self) -> dict:
        out, self.n = self.n, {}
        return out


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_a_decode_step_is_one_upload_one_program_one_read(checkpoint_dir, monkeypatch, family):
    llm = LLM(checkpoint_dir(family), progress=False, engine=CFG)
    eng = llm.engine
    want = [o.token_ids for o in llm.generate([[5, 7, 9, 11, 13], [3, 4, 5]],
                                              SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))]
    counts = Counts(eng.runner, monkeypatch)
    seqs = [eng.add_request(f"r{i}", p, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0]
            for i, p in enumerate([[5, 7, 9, 11, 13], [3, 4, 5]])]
    while any(not s.output for s in seqs):  # prefill: the first tokens, their penalty state in one program
        eng.step()
    assert counts.take().get("_insert") == 1
    got = []
    with jax.transfer_guard("disallow"):
        while eng.has_work:
            eng.step()
            got.append(counts.take())
    # overlapped (engine/overlap.py): the first step is left in flight, each next one dispatched before the one in
    # flight is read, the last only read; a hybrid model too, but a step the scheduler plans with a decode snapshot
    # (the 3-token prompt and its first token complete a block of 4) runs synchronously first
    one = {"_upload": 1, "_step": 1, "_read": 1}
    ahead = [{"_upload": 1, "_step": 1}] + [one] * 4 + [{"_read": 1}]
    assert got == ([one] + ahead[:-2] + [ahead[-1]] if eng.layout.has_request_state else ahead), got
    assert [s.output for s in seqs] == want


MIXED = [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=3, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True),
         SamplingParams(max_tokens=6, temperature=1.2, seed=5, logprobs=2, repetition_penalty=1.3, ignore_eos=True)]


def same_up_to_rounding(a, b, tol: float = 1e-4):
    """Two runs of one request, (tokens, logprobs), from two compiled programs of the same model: the same tokens,
    logprobs within tol, until a step where the two picks' logprobs lie within tol of each other (a near tie that
    the programs' rounding may break either way; after it the runs may part). A step without logprobs to show
    such a tie must agree exactly."""
    (ta, la), (tb, lb) = a, b
    for s, (x, y) in enumerate(zip(ta, tb)):
        if x != y:
            top = dict(la[s][1]) if la else {}
            assert y in top and abs(top[y] - la[s][0]) < tol, (s, a, b)
            return
        if la and lb:
            assert abs(la[s][0] - lb[s][0]) < tol, (s, a, b)
    assert len(ta) == len(tb), (a, b)


@pytest.mark.parametrize("family", ["llama", "qwen3_next"])
def test_samplers_specialised_to_their_rows_answer_as_the_device_decides(checkpoint_dir, family):
    """Where a conditional would hold the dispatching thread (a GPU: runner.static_sampling), each program that
    samples is compiled for what its rows ask (greedy or drawn, top logprobs or not: sampler.py `mode`); its
    tokens and logprobs equal the one program's that decides on the device (up to the two programs' rounding:
    `same_up_to_rounding`), greedy, seeded and logprob requests batched together and each alone, prefill's first
    tokens and decode steps."""
    def run(static: bool):
        llm = LLM(checkpoint_dir(family), progress=False, engine=CFG)
        eng = llm.engine
        eng.runner.static_sampling = static
        got = []
        for batch in ([0, 1, 2, 3], [0], [2], [1]):
            seqs = [eng.add_request(f"r{i}-{len(got)}", [5 + i, 7, 9 + 2 * i, 11, 13][: 3 + i], MIXED[i])[0]
                    for i in batch]
            while eng.has_work:
                eng.step()
            got += [(s.output, s.logprobs) for s in seqs]
        return got, eng.runner.programs
    decided, programs = run(False)
    specialised, static_programs = run(True)
    assert len(specialised) == len(decided)
    for a, b in zip(specialised, decided):
        same_up_to_rounding(a, b)
    modes = {key[-1] for key in static_programs if key[0] in ("decode", "first")}
    assert modes == {"greedy", "draw", "greedy+top", "draw+top"}, static_programs
    assert not any(k in ("greedy", "draw", "greedy+top", "draw+top") for key in programs for k in key)


def test_warmup_compiles_greedy_and_drawing_samplers_where_they_are_specialised(checkpoint_dir):
    """With the samplers specialised (runner.static_sampling), warm-up compiles every sampling program for
    greedy rows and for drawing ones: greedy and seeded traffic of varied lengths compiles nothing after it."""
    llm = LLM(checkpoint_dir("llama"), progress=False, engine=CFG)
    runner = llm.engine.runner
    runner.static_sampling = True
    runner.warmup(progress=False)
    warmed, runner.programs = set(runner.programs), set()
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 100, n).tolist() for n in (1, 5, 9, 17, 30)]
    for p in (MIXED[0], MIXED[1]):
        llm.generate(prompts, p)
        llm.generate(prompts[2], p)
    assert runner.programs <= warmed, sorted(runner.programs - warmed)
    assert {k[-1] for k in runner.programs if k[0] == "decode"} == {"greedy", "draw"}


def test_a_constrained_step_adds_its_bitmask_and_is_split_ahead(smollm2_dir, monkeypatch):
    """A constrained row's mask follows its last token: a steady step dispatches its model (one upload, one
    program) before the step in flight is read, and its sampling (the mask's upload, one program) after; while
    those two programs compile (the first time a shape runs), and on a CPU, the whole step runs after the read."""
    llm = LLM(smollm2_dir, progress=False, engine=EngineConfig(num_blocks=64, max_num_seqs=4, num_snapshots=0,
                                                                overlap=True))
    eng = llm.engine
    from jaxserve.structured import Guided
    seq, = eng.add_request("g", "Reply with JSON:", SamplingParams(max_tokens=12, temperature=0, guided=Guided(
        "json", '{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}')))
    eng.step()  # the prefill and first token
    eng.runner.split_steps = True  # as on an accelerator (on a CPU the whole step runs after the read)
    eng.runner.static_sampling = True  # as there too: the pick compiled for its rows' mode (greedy)
    log = []
    for name in ("_upload", "_read", "_step", "forward", "pick"):
        f = getattr(eng.runner, name)
        monkeypatch.setattr(eng.runner, name, lambda *a, _f=f, _n=name, **k: (log.append(_n), _f(*a, **k))[1])
    eng.step()  # left in flight, its mask known
    eng.step()  # the next one's programs compile: dispatched whole, after the read
    eng.runner.split.wait()
    assert log == ["_upload", "_upload", "_step", "forward", "_read", "_upload", "_upload", "_step"], log
    with jax.transfer_guard("disallow"):
        while not seq.finished:
            log.clear()
            eng.step()
            # (a call is logged as it starts: forward uploads the rows, pick the mask)
            assert log in (["forward", "_upload", "_read", "pick", "_upload"], ["_read"]), log
    assert log == ["_read"]  # the step that ends it reads only
    assert llm.tokenizer.decode(seq.output).startswith('{"a":')
    assert ("pick", 1, "greedy") in eng.runner.programs


@pytest.mark.parametrize("family,scan", [("llama", False), ("llama", True), ("qwen3_next", False), ("qwen3_next", None),
                                         ("gpt_oss", False), ("gpt_oss", None), ("deepseek_v3", None),
                                         ("mimo_v2_flash", None)])
def test_the_kv_pool_and_request_state_are_written_in_place(checkpoint_dir, family, scan):
    """Every prefill and decode program as XLA compiles it for serving (the whole model, and a layer-wise
    prefill's layer groups): each array of the pool argument (the KV pool; a hybrid's recurrent state and
    snapshots beside it), and a decode step's penalty counts, are donated and aliased to outputs, and no copy of
    one is made. A step that copied the pool would move all of it, not the tokens it writes: on an 8B model more
    bytes than its weights. Unrolled (as on a GPU), a hybrid's batch-1 steps copied their state (cache/layout.py
    `_read_rows`); class-stacked (switch mode, a CPU), DeepSeek-V3's and MiMo's layers each copied the KV pool
    (models/model.py `_switch_scan`)."""
    llm = LLM(checkpoint_dir(family), progress=False,
              engine=EngineConfig(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16,
                                  max_num_seqs=4, scan_layers=scan))
    runner, calls = llm.engine.runner, []
    for name in ("_prefill", "_step"):
        fn = getattr(runner, name)
        setattr(runner, name, lambda *a, _f=fn, _n=name, **k: (calls.append((_n, _f, a, k)), _f(*a, **k))[1])
    greedy = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    llm.generate([list(range(5, 19)), [3, 4, 5]], greedy)
    llm.engine.stream_layers(layer_groups(llm.engine.model_config.num_layers, 2), 1)  # a prefill instance's groups
    llm.generate([list(range(30, 41))], greedy)
    checked = {}
    for name, fn, args, static in calls:
        key = (name, tuple(sorted(static.items())))
        if key not in checked:
            donated = [args[i] for i in ((1,) if name == "_prefill" else (1, 3))]  # _step: and the counts [S, V]
            checked[key] = in_place.check(fn, args, static, donated)
    assert {name for name, _ in checked} == {"_prefill", "_step"}
    assert any(dict(static)["hi"] == 2 for name, static in checked if name == "_prefill")  # a layer group's
    assert all(ok and not copied for ok, copied in checked.values()), checked


def test_a_batch_of_ones_state_read_sits_behind_a_barrier_where_the_program_is_for_a_gpu():
    """`_read_rows` of a batch of one, lowered for each platform: for CUDA the read is behind an optimization
    barrier (XLA:GPU fused the two-row read into users after the step's write and copied a Kimi Linear's whole
    conv state twice a step: bench/gpu_programs.py); for the CPU it is not (XLA:CPU needs none, and its step
    stays as it was); a batch of two needs neither. The choice is made as the program is lowered: the compiled
    program holds no conditional."""
    from jaxserve.cache.layout import _read_rows
    state = jax.ShapeDtypeStruct((9, 3, 4), jnp.float32)  # [slots + 1, ...]
    read = jax.jit(lambda a, rows: _read_rows(a, rows, lambda r: r))

    def lowered(batch: int, platform: str) -> str:
        rows = jax.ShapeDtypeStruct((batch,), jnp.int32)
        return read.trace(state, rows).lower(lowering_platforms=(platform,)).as_text()

    assert "optimization_barrier" in lowered(1, "cuda")
    assert "optimization_barrier" not in lowered(1, "cpu") and "optimization_barrier" not in lowered(2, "cuda")
    a = np.arange(9 * 3 * 4, dtype=np.float32).reshape(9, 3, 4)
    compiled = read.lower(a, np.array([5], np.int32)).compile()
    assert "conditional" not in compiled.as_text()
    np.testing.assert_array_equal(compiled(a, np.array([5], np.int32)), a[5:6])


def test_split_programs_that_fail_to_compile_leave_the_whole_step(smollm2_dir, monkeypatch, caplog):
    llm = LLM(smollm2_dir, progress=False, engine=EngineConfig(num_blocks=64, max_num_seqs=4, num_snapshots=0,
                                                                overlap=True))
    from jaxserve.structured import Guided
    runner = llm.engine.runner
    sp = SamplingParams(max_tokens=8, temperature=0, guided=Guided("regex", "[a-z]{8}"))
    want = llm.generate(["Eight letters:"], sp)[0].token_ids  # on the CPU: whole steps
    runner.split_steps = True

    def broken(*a):
        raise RuntimeError("no program for this shape")
    monkeypatch.setattr(runner.split, "_compile", broken)
    assert llm.generate(["Eight letters:"], sp)[0].token_ids == want  # compiling behind: whole steps
    runner.split.wait()
    assert llm.generate(["Eight letters:"], sp)[0].token_ids == want  # failed: whole steps, for good
    assert "did not compile" in caplog.text and not any(p[0] == "pick" for p in runner.programs)


def _params(rng, i):
    return SamplingParams(temperature=float(rng.uniform(0, 2)), top_p=float(rng.uniform(0.1, 1)),
                          top_k=int(rng.integers(0, 50)), min_p=float(rng.uniform(0, 0.5)),
                          repetition_penalty=float(rng.uniform(0.5, 2)), presence_penalty=float(rng.uniform(-1, 1)),
                          frequency_penalty=float(rng.uniform(-1, 1)), seed=[None, 7, 2**32 - 3, 2**31][i % 4],
                          logprobs=[None, 0, 5][i % 3])


def test_packed_rows_carry_what_the_sampler_and_model_read():
    rng = np.random.default_rng(0)
    params = [_params(rng, i) for i in range(5)]
    steps = [int(s) for s in rng.integers(0, 100, 5)]
    rows = [DecodeRow(slot=i + 1, token=100 + i, position=10 * i + 3, block_ids=list(range(i, 2 * i + 1)),
                      params=p, step=s, snap_row=None if i % 2 else 40 + i) for i, (p, s) in enumerate(zip(params, steps))]
    B, W = 8, 6
    x = step_io.pack_rows(rows, B, W, scratch=99, spare=4, tables=[r.block_ids for r in rows])
    want = SamplingTensors.from_params(params, steps, B)
    for got, ref in ((step_io.pack_sampling(params, steps, B, spare=4), want), (x, want)):
        st = step_io.sampling_tensors(jax.numpy.asarray(got))
        for f in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty",
                  "frequency_penalty", "seed", "step", "top"):
            np.testing.assert_array_equal(np.asarray(getattr(st, f)), getattr(ref, f), err_msg=f)
            assert np.asarray(getattr(st, f)).dtype == getattr(ref, f).dtype, f
    batch, table, state, snap = (np.asarray(a) if not hasattr(a, "tokens") else a
                                 for a in step_io.unpack_decode(jax.numpy.asarray(x)))
    assert np.asarray(batch.tokens)[:, 0].tolist() == [100, 101, 102, 103, 104, 0, 0, 0]
    assert np.asarray(batch.start).tolist()[:5] == [3, 13, 23, 33, 43]
    assert np.asarray(batch.lengths).tolist() == [1] * 5 + [0] * 3
    assert state.tolist() == [1, 2, 3, 4, 5, 99, 99, 99] and snap.tolist() == [40, 99, 42, 99, 44, 99, 99, 99]
    assert x[:, step_io.SLOT].tolist() == [1, 2, 3, 4, 5, 4, 4, 4]
    for i, r in enumerate(rows):
        assert table[i].tolist() == r.block_ids + [0] * (W - len(r.block_ids))
    assert not table[5:].any()


def test_sampled_results_come_back_in_one_array():
    rng = np.random.default_rng(1)
    B, K = 3, MAX_LOGPROBS
    tok = rng.integers(0, 2**31 - 1, B).astype(np.int32)
    lp, tlp = rng.normal(size=B).astype(np.float32), rng.normal(size=(B, K)).astype(np.float32)
    ids = rng.integers(0, 200_000, (B, K)).astype(np.int32)
    out = jax.device_get(jax.jit(step_io.pack_sampled)(tok, lp, ids, tlp))
    assert out.shape == (B, 2 + 2 * K) and out.dtype == np.float32
    for a, b in zip(step_io.read_sampled(out), (tok, lp, ids, tlp)):
        np.testing.assert_array_equal(a, b)
