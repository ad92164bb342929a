"""The paged engine against the model's plain dense-cache prefill path (LLM.score), greedy, per family.

Small blocks (4 tokens) and chunks (8 tokens) so prompts span several blocks and chunks; prompts share
prefixes so later ones hit the prefix cache (and, for hybrid models, restore linear / sliding state from a
snapshot); a tiny pool forces preemption.
"""

import dataclasses
import shutil

import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.client import RequestError
from jaxserve.engine.llm_engine import EngineConfig
from jaxserve.pallas_kernels import native

BASE = [5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 15, 6, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [BASE[:3], BASE[:13], BASE[:9], BASE[:21], [30, 31] + BASE[:11]]
ENGINE = EngineConfig(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
                      max_num_seqs=4, num_snapshots=8)


def reference_greedy(llm: LLM, prompt, n):
    ids, out = list(prompt), []
    for _ in range(n):
        out.append(int(llm.score(ids)[-1].argmax()))
        ids.append(out[-1])
    return out


def answers_with_prefix_hits(llm: LLM, lengths, extend_from: int, n: int, seed: int) -> None:
    """Random prompts of `lengths` tokens, then those from index extend_from on extended by three tokens (a chunk
    after their cached prefix): every greedy answer of n tokens equals the dense path's, prefixes were reused,
    and the block manager is consistent after."""
    rng = np.random.default_rng(seed)
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    prompts = [rng.integers(3, 100, k).tolist() for k in lengths]
    outs = llm.generate(prompts, params)
    extended = [p + [7, 8, 9] for p in prompts[extend_from:]]
    outs += llm.generate(extended, params)
    for p, o in zip(prompts + extended, outs):
        assert o.token_ids == reference_greedy(llm, p, n), p
    assert max(o.cached_tokens for o in outs) > 0
    llm.engine.blocks.check()


@pytest.fixture(scope="module")
def engines(checkpoint_dir):
    made = {}

    def get(name, cfg=ENGINE):
        key = (name, cfg)
        if key not in made:
            made[key] = LLM(checkpoint_dir(name), progress=False, engine=cfg)
        return made[key]
    return get


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3", "kimi_linear", "qwen3_next", "gpt_oss",
                                    "mimo_v2_flash"])
def test_greedy_matches_reference_with_chunks_and_prefix_hits(engines, family):
    llm = engines(family)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    for p, o in zip(PROMPTS, outs):
        assert o.token_ids == reference_greedy(llm, p, 8), (family, p)
    assert max(o.cached_tokens for o in outs) >= 8  # later prompts reused earlier blocks
    eng = llm.engine
    eng.blocks.check()
    assert eng.blocks.num_referenced() == 0 and eng.stats()["running"] == 0
    # a second identical round is served from the cache with the same answers
    again = llm.generate(PROMPTS[3:4], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert again[0].token_ids == outs[3].token_ids and again[0].cached_tokens == 20


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3", "kimi_linear", "qwen3_next", "gpt_oss",
                                    "mimo_v2_flash"])
def test_scanned_layer_runs_match_the_unrolled_model(engines, checkpoint_dir, family):
    """Runs of identical layers run as one lax.scan over stacked weights (models/stack.py), and on a CPU a model
    of several layer classes stacked by class (a scan over the classes' periods, or one switching on each layer's
    class: tests/models/test_periods.py), their projections fused
    (models/fuse.py): the same logits as the model with its own per-layer weights and separate projections,
    every layer unrolled (a separate load of the checkpoint)."""
    import jax.numpy as jnp

    from jaxserve.checkpoint import load_any
    from jaxserve.models.batch import Batch
    from jaxserve.models.cache_spec import init_dense_cache
    from jaxserve.models.model import jit_forward, model_graphdef
    from jaxserve.models.stack import layer_classes, layer_runs
    llm = engines(family)
    cfg = llm.engine.model_config
    stack = llm.engine.runner.stack  # CPU: the reference paged attention, so scanned
    if family in ("llama", "qwen3"):
        assert stack.runs == layer_runs(cfg) == ((0, cfg.num_layers),) and not stack.classes
    else:  # several classes: switch mode, every layer stacked by class
        assert not stack.runs and stack.classes == layer_classes(cfg) and len(stack.classes) > 1
    _, state = load_any(checkpoint_dir(family), cfg, llm.engine.dtype_name, None, False)
    ids = (BASE * 2)[:29]
    tokens = jnp.asarray([ids + [0] * 3], jnp.int32)
    batch = Batch(tokens, jnp.zeros(1, jnp.int32), jnp.asarray([len(ids)], jnp.int32))
    unfused = model_graphdef(cfg, llm.engine.dtype, llm.engine.kernels)
    logits, _ = jit_forward(unfused)(state, batch, init_dense_cache(cfg, 1, 32, llm.engine.dtype),
                                     jnp.arange(len(ids), dtype=jnp.int32)[None])
    np.testing.assert_allclose(llm.score(ids), np.asarray(logits[0]), atol=2e-5, rtol=1e-5)


def test_switch_mode_options_only_where_xla_takes_them(monkeypatch):
    """A class-stacked model's step programs take XLA:CPU's older emitters where XLA still has them (JAX 0.10.2,
    this checkout's), and compile with the defaults where the option is unknown (XLA after 0.10.2)."""
    import jax

    from jaxserve.models import stack
    stack.switch_compiler_options.cache_clear()
    want = {"xla_cpu_use_fusion_emitters": False} if jax.__version_info__[:2] <= (0, 10) else None
    assert stack.switch_compiler_options() == want
    monkeypatch.setattr(stack, "_SWITCH_OPTIONS", {"xla_no_such_option_anywhere": True})
    stack.switch_compiler_options.cache_clear()
    try:
        assert stack.switch_compiler_options() is None
    finally:
        stack.switch_compiler_options.cache_clear()


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_decode_batches_and_ragged_attention_match_reference(engines, family):
    """Eighteen requests on twenty slots: decode runs in batch buckets (4 rows while at most four requests
    decode, 16, then 20, padding after the running rows) with the ragged reference attention, keyed by the
    blocks in use; prefill packs its rows. Tokens equal the dense path's, and the step timer accounts for every
    step."""
    llm = engines(family, dataclasses.replace(ENGINE, max_num_seqs=20, num_blocks=192, max_prefill_seqs=4,
                                              max_num_batched_tokens=32, kernels="reference"))
    eng = llm.engine
    assert eng.runner.ragged  # the jnp reference (a CPU's default, the native kernel, has its own tests)
    eng.timer.reset()
    # one chunk each, so all eighteen are decoding together before the first finishes
    prompts = [BASE[:n] for n in (3, 5, 7, 4, 6, 2, 8, 3, 5, 7, 6, 4, 8, 2, 5, 3, 7, 6)]
    prompts = [[t + 7 * i for t in p] for i, p in enumerate(prompts)]  # no prefix hits
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm, p, 10), (family, p)
    decodes = {k[1] for k in eng.runner.programs if k[0] == "decode"}
    assert {16, 20} <= decodes <= {4, 16, 20}, decodes
    assert [eng.runner.decode_batch(n) for n in (1, 4, 5, 16, 17, 20)] == [4, 4, 16, 16, 20, 20]
    prefills = [k for k in eng.runner.programs if k[0] == "prefill"]
    # GQA layers take packed input: first chunks admitted together ran packed; MLA layers run [B, T] rows: alone
    assert eng.runner.pack_first == (family == "llama")
    if family == "llama":
        assert any(k[6] < k[1] * k[2] for k in prefills)
    else:
        assert {k[1] for k in prefills} == {1}
    steps = eng.timer.summary()
    assert sum(s["count"] for s in steps.values()) >= 5
    for s in steps.values():
        assert sum(s["phases_ms"].values()) == pytest.approx(s["mean_ms"], rel=1e-6)


@pytest.mark.parametrize("family", ["llama", "kimi_linear", "gpt_oss"])
def test_next_turn_reuses_the_kv_of_the_answer(engines, family):
    """Generated tokens' full blocks join the prefix cache (and, for a hybrid model, decode saves its linear /
    sliding state at each block boundary): a conversation's next turn (prompt + answer + a new message) reuses
    the answer's KV as well as the prompt's, with the same tokens as a cold run."""
    llm = engines(family)
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    first = llm.generate([BASE[:9]], greedy)[0]
    turn = BASE[:9] + first.token_ids + [23, 24]
    second = llm.generate([turn], greedy)[0]
    # 9 prompt + 8 generated tokens: the KV of all but the last generated one was computed (16 = 4 blocks)
    assert second.cached_tokens == 16
    assert second.token_ids == reference_greedy(llm, turn, 8)
    llm.engine.blocks.check()


def test_preemption_gives_the_same_tokens(engines):
    tight = EngineConfig(block_size=4, num_blocks=12, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
                         max_num_seqs=4, num_snapshots=4, prefix_caching=False)
    llm = engines("kimi_linear", tight)
    prompts = [[40 + i, 41 + i, 42 + i, 43 + i, 44 + i, 45 + i] for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=10, temperature=0, ignore_eos=True))
    assert llm.engine.scheduler.num_preemptions > 0
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm, p, 10)
    llm.engine.blocks.check()
    assert llm.engine.blocks.num_free == 12


def test_sampling_seeded_penalties_logprobs_n_stop(engines):
    llm = engines("llama")
    p = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.9, top_k=20, seed=3, ignore_eos=True)
    alone = llm.generate([PROMPTS[1]], p)[0].token_ids
    mixed = llm.generate([PROMPTS[0], PROMPTS[1], PROMPTS[2]], p)[1].token_ids
    assert alone == mixed  # reproducible whatever the batch
    assert llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0.9, seed=4,
                                                     ignore_eos=True))[0].token_ids != alone
    # n: seeds seed, seed+1 -> different samples; logprobs of the model distribution
    outs = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=6, temperature=1.0, seed=1, n=2, logprobs=3,
                                                     ignore_eos=True))
    assert len(outs) == 2 and outs[0].token_ids != outs[1].token_ids
    for o in outs:
        assert len(o.logprobs) == 6 and all(len(top) == 3 for _, top in o.logprobs)
    ref = llm.score(PROMPTS[1])[-1]
    lp = ref - np.log(np.exp(ref - ref.max()).sum()) - ref.max()
    first_lp, top = outs[0].logprobs[0]
    assert abs(first_lp - lp[outs[0].token_ids[0]]) < 1e-4
    assert [t for t, _ in top] == list(np.argsort(-lp)[:3])
    # a huge repetition penalty forbids repeating any prompt / output token under greedy decoding
    o = llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0, repetition_penalty=1e6,
                                                  ignore_eos=True))[0]
    assert not set(o.token_ids) & set(PROMPTS[1]) and len(set(o.token_ids)) == 8
    # top_k=1 and min_p=1 are greedy whatever the temperature
    g = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))[0].token_ids
    assert llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=2.0, top_k=1, seed=9,
                                                     ignore_eos=True))[0].token_ids == g
    assert llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=2.0, min_p=1.0, seed=9,
                                                     ignore_eos=True))[0].token_ids == g
    # stop token ids end the output (the stop token is kept in token_ids, finish_reason "stop")
    s = llm.generate([PROMPTS[2]], SamplingParams(max_tokens=6, temperature=0, stop_token_ids=(g[2],),
                                                  ignore_eos=True))[0]
    assert s.token_ids == g[:g.index(g[2]) + 1] and s.finish_reason == "stop"


def test_a_resumed_request_continues_as_if_uninterrupted(engines):
    """add_request(output=...), how a request whose instance failed mid-stream goes on elsewhere: the engine
    recomputes prompt + output and samples on; with a seed, the tokens and logprobs are the uninterrupted run's."""
    llm = engines("llama")
    p = SamplingParams(max_tokens=8, temperature=0.9, top_k=20, seed=3, logprobs=2, ignore_eos=True)
    whole = llm.generate([PROMPTS[1]], p)[0]
    assert whole.token_ids != llm.generate([PROMPTS[1]], SamplingParams(max_tokens=8, temperature=0))[0].token_ids
    eng = llm.engine
    for k in (1, 5):
        seq, = eng.add_request(f"resume{k}", PROMPTS[1], p, output=whole.token_ids[:k], logprobs=whole.logprobs[:k])
        while eng.has_work:
            eng.step()
        assert seq.output == whole.token_ids and seq.finish_reason == "length"
        for (a, top_a), (b, top_b) in zip(seq.logprobs, whole.logprobs):
            assert abs(a - b) < 1e-4 and [t for t, _ in top_a] == [t for t, _ in top_b]
        eng.release(seq)
    with pytest.raises(RequestError, match="fewer output tokens"):  # nothing left to generate
        eng.add_request("bad", PROMPTS[1], p, output=whole.token_ids)
    with pytest.raises(RequestError, match="logprobs entry per output token"):
        eng.add_request("bad", PROMPTS[1], p, output=whole.token_ids[:2])
    assert eng.stats()["running"] == 0 and eng.blocks.num_referenced() == 0


def test_bad_requests(engines):
    llm = engines("llama")
    with pytest.raises(RequestError, match="empty prompt"):
        llm.generate([[]])
    with pytest.raises(RequestError, match="out of range"):
        llm.generate([[1, 10**6]])
    with pytest.raises(RequestError, match="maximum context"):
        llm.generate([[1, 2]], SamplingParams(max_tokens=10**6))
    assert llm.engine.stats()["waiting"] == 0


@pytest.mark.parametrize("family", ["kimi_linear", "gpt_oss", "mimo_v2_flash"])
def test_engine_with_pallas_kernels_matches_references(engines, family):
    """Interpret-mode kernels in the engine: flash prefill, paged decode over the pool (GQA with sinks, K|V
    concatenated, MLA), the delta-rule kernels; same greedy tokens as the jnp references."""
    ref = engines(family).generate(PROMPTS[:3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    llm = engines(family, dataclasses.replace(ENGINE, kernels="interpret"))
    assert llm.engine.kernels == "interpret"
    outs = llm.generate(PROMPTS[:3], SamplingParams(max_tokens=5, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == [o.token_ids for o in ref]
    llm.engine.blocks.check()


@pytest.mark.parametrize("kernels", ["reference", pytest.param("native", marks=pytest.mark.skipif(
    not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler for the native kernels")),
    "interpret-packed"])
def test_a_varied_workload_compiles_nothing_after_warmup(engines, kernels):
    """After warm-up (runner.warmup: every prefill_groups and decode_batch shape), traffic of varied lengths runs
    only programs warm-up compiled: prompts from 1 token to several chunks and block-table widths, together
    (first chunks batched, later chunks after cached tokens, decode in every batch bucket) and alone, and
    prompts that extend cached ones (a first chunk after prefix-cache hits). Answers equal the dense path's.
    With the native kernels, and with the Pallas ones (interpreted here) where engine.packed_prefill asks, every
    prefill step is one packed program over the pool, its tokens uploaded packed, and every table one width."""
    packed = kernels == "interpret-packed"
    llm = engines("llama", dataclasses.replace(ENGINE, max_model_len=80, max_num_seqs=8, max_prefill_seqs=3,
                                              max_num_batched_tokens=24, num_blocks=256,
                                              kernels="interpret" if packed else kernels,
                                              packed_prefill=packed or None))
    runner = llm.engine.runner
    if packed:  # a step's tokens go up as packed, not as its 11 rows of a whole chunk each
        uploads = []
        prepare = runner._prefill_inputs
        runner._prefill_inputs = lambda rows: uploads.append(prepare(rows)) or uploads[-1]
    runner.warmup(progress=False)
    warmed, runner.programs = set(runner.programs), set()
    rng = np.random.default_rng(0)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [rng.integers(1, 100, n).tolist() for n in (1, 3, 8, 12, 17, 30, 45, 50, 9, 26)]
    outs = llm.generate(prompts, params)
    extended = [p + [7, 8, 9] for p in prompts[5:8]]
    outs += llm.generate(extended, params)
    alone = [rng.integers(1, 100, n).tolist() for n in (5, 21, 40)]
    outs += [llm.generate([p], params)[0] for p in alone]
    for p, o in zip(prompts + extended + alone, outs):
        assert o.token_ids == reference_greedy(llm, p, 12), p
    assert max(o.cached_tokens for o in outs) > 0
    assert runner.programs <= warmed, sorted(runner.programs - warmed)
    ran = runner.programs
    prefills = [k for k in ran if k[0] == "prefill"]
    # decode batch buckets: with the native kernels' full tables the powers of two and the midpoints between them
    # (synchronous steps, a CPU's default; the overlapped loop also decodes the rows left while finished ones wait to
    # be read: 6 of 8 there)
    assert {k[1] for k in ran if k[0] == "decode"} == ({4, 8} if kernels == "reference" else {1, 2, 3, 4, 8})
    # the scheduler fits a mixed step's tokens to the runner's packed-token buckets (none where steps are not packed)
    assert llm.engine.scheduler.cfg.token_buckets == (tuple(runner.buckets) if runner.paged_prefill else ())
    if kernels == "reference":
        assert not runner.paged_prefill and not runner.full_tables
        assert {k[1] for k in prefills} == {1, 3}  # alone and batched
        assert {k[-1] for k in prefills if k[1] == 1} == {True, False}  # first and later chunks
    else:  # rows (3 prefill + 8 decode), chunk (8) and table width (80 / 4 blocks) fixed; token buckets up to the
        # budget and a mixed step's decode tokens on top; steps that prefill while others decode ran as one program
        assert runner.paged_prefill and runner.full_tables
        assert {k[1:4] for k in prefills} == {(11, 8, 20)} and {k[6] for k in prefills} == {16, 24, 32}
        assert {k[3] for k in ran if k[0] == "decode"} == {20}
        assert {k for k in ran if k[0] == "sample" and k[2] == 3}  # a mixed step's decode rows, after the 3
        assert "decode.device" not in llm.engine.timer.summary()["mixed"]["phases_ms"]
        assert len(warmed) < 26  # 6 decode + 3 token-bucket prefill programs, their samplers, not widths x buckets
    if packed:
        assert uploads and all(args[0].tokens.shape == (N,) for (_, _, _, N, _), args, *_ in uploads)


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler for the native kernels")
def test_a_hybrid_prefill_reads_the_pool_in_place_one_program_per_chunk_bucket(engines):
    """With the native kernels a hybrid model's [B, T] prefill programs attend over the pool in place (each token
    over its own row's blocks up to itself, however wide the table), so a first chunk alone runs the program of a
    chunk after cached tokens of its bucket: warm-up compiles one prefill program per chunk bucket where the
    references (a dense view per program) need two, traffic (first chunks, later chunks, prompts extending cached
    ones) runs nothing else, and the answers equal the dense path's."""
    cfg = dataclasses.replace(ENGINE, chunk_size=32, max_num_batched_tokens=32, max_prefill_seqs=2, num_blocks=96)
    warmed = {}
    for kernels in ("reference", "native"):
        llm = engines("kimi_linear", dataclasses.replace(cfg, kernels=kernels))
        runner = llm.engine.runner
        runner.warmup(progress=False)
        warmed[kernels] = {k for k in runner.programs if k[0] == "prefill"}
    assert runner.inplace_prefill and runner.inplace_first and not llm.engine.runner.pack_first
    W = runner.max_blocks_per_seq
    assert warmed["native"] == {("prefill", 1, t, W, 0, runner.layout.num_layers, t, False) for t in (16, 32)}
    assert {k[2] for k in warmed["reference"]} == {16, 32} and len(warmed["reference"]) == 4
    programs, runner.programs = set(runner.programs), set()
    answers_with_prefix_hits(llm, (3, 14, 20, 40, 75), 3, 6, seed=1)
    assert runner.programs <= programs, sorted(runner.programs - programs)
    assert {k[-1] for k in runner.programs if k[0] == "prefill"} == {False}


@pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler for the native kernels")
def test_full_decode_tables_past_their_cap_widen_in_powers_of_two(engines, monkeypatch):
    """With full tables (the native kernels here, the Pallas ones on a GPU) a decode table is max_blocks_per_seq
    wide up to FULL_TABLE_BLOCKS; past it (a long-context model, whose whole table would be megabytes a step to
    upload) the cap or a power of two above it: warm-up compiles those widths, a short and a long request decode
    in them, nothing else compiles, and the answers equal the dense path's. Paged prefill's tables (the native
    kernels' packed program over the pool) are bounded the same way: a short prompt's steps upload [B, 4]."""
    from jaxserve.engine import runner as runner_module
    monkeypatch.setattr(runner_module, "FULL_TABLE_BLOCKS", 4)
    llm = engines("llama", dataclasses.replace(ENGINE, max_num_seqs=1, num_blocks=80))
    runner = llm.engine.runner
    assert runner.full_tables and runner.max_blocks_per_seq == 80 and runner.full_width == 4
    runner.warmup(progress=False)
    warmed, runner.programs = set(runner.programs), set()
    assert {k[3] for k in warmed if k[0] == "decode"} == {4, 8, 16, 32, 64, 80}
    assert runner.paged_prefill and {k[3] for k in warmed if k[0] == "prefill"} == {4, 8, 16, 32, 64, 80}
    params = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    prompts = [BASE[:5], [t % 97 + 3 for t in range(150)]]
    tables, inputs = [], runner._prefill_inputs
    runner._prefill_inputs = lambda rows: (lambda got: tables.append(got[1][1].shape) or got)(inputs(rows))
    for p in prompts:
        out, = llm.generate([p], params)
        assert out.token_ids == reference_greedy(llm, p, 3)
    assert runner.programs <= warmed, sorted(runner.programs - warmed)
    assert {k[3] for k in runner.programs if k[0] == "decode"} == {4, 64}
    B = runner.max_prefill_seqs + runner.num_slots
    assert tables[0] == (B, 4) and (B, 64) in tables and all(w <= 64 for _, w in tables), tables


def test_first_chunks_of_a_hybrid_model_run_alone(engines):
    """Layers whose mixer runs the [B, T] rows (KDA, MLA) would compute every padded row of a packed program, so a
    hybrid model's first chunks admitted together run each in a program of its own length: warm-up compiles
    those and no packed one, traffic runs nothing else, and the answers equal the dense path's."""
    llm = engines("kimi_linear", dataclasses.replace(ENGINE, max_prefill_seqs=3, max_num_batched_tokens=24))
    runner = llm.engine.runner
    assert not runner.pack_first
    runner.warmup(progress=False)
    warmed, runner.programs = set(runner.programs), set()
    assert {k[1] for k in warmed if k[0] == "prefill"} == {1}
    steps, prefill = [], runner.prefill
    runner.prefill = lambda rows, *a, **k: steps.append(runner.prefill_groups(rows)) or prefill(rows, *a, **k)
    prompts = [[t + 5 * i for t in BASE[:n]] for i, n in enumerate((3, 6, 9))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
    for p, o in zip(prompts, outs):
        assert o.token_ids == reference_greedy(llm, p, 4), p
    assert runner.programs <= warmed, sorted(runner.programs - warmed)
    assert [len(g) for g in steps[0]] == [1, 1, 1]  # one step admitted all three, a program each
    llm.engine.blocks.check()


def paged_defaults(kernels):
    return dataclasses.replace(ENGINE, chunk_size=None, max_num_batched_tokens=26, num_blocks=96, max_model_len=80,
                               max_num_seqs=32, kernels=kernels)


@pytest.mark.parametrize("kernels", ["reference", "native"])
def test_decode_row_buckets_where_tables_are_full(engines, kernels):
    """With full tables (native kernels: one decode program per row bucket) the powers of two and the midpoints
    between them are buckets, so one request decodes in 1 row and 5 in 6, not 8 or 16; otherwise (a program per
    bucket and table width) at most four buckets: 4, then from max(16, num_slots / 4)."""
    runner = engines("llama", paged_defaults(kernels)).engine.runner
    got = {n: runner.decode_batch(n) for n in range(1, 33)}
    assert got[4] == 4 and got[32] == 32 and all(got[n] >= n for n in got)
    if kernels == "native":
        assert [got[n] for n in (1, 2, 3, 5, 6, 7, 9, 13, 17, 25)] == [1, 2, 3, 6, 6, 8, 12, 16, 24, 32]
        assert set(got.values()) == {1, 2, 3, 4, 6, 8, 12, 16, 24, 32}
    else:
        assert got[1] == got[3] == 4 and got[5] == got[16] == 16 and set(got.values()) == {4, 16, 32}


@pytest.mark.parametrize("kernels", ["reference", "native"])
def test_the_default_chunk_is_the_step_budget_where_prefill_is_paged(engines, kernels):
    """chunk_size unset: where a step prefills in one packed program over the pool (the native kernels), a
    request's chunk is the step's whole token budget, so a prompt within it is prefilled in one step; dense
    [B, T] prefill programs keep DENSE_CHUNK (a multiple of the block size). Answers stay the dense path's."""
    from jaxserve.engine.llm_engine import DENSE_CHUNK
    llm = engines("llama", paged_defaults(kernels))
    eng = llm.engine
    want = 24 if kernels == "native" else DENSE_CHUNK  # the budget (26) down to a whole block
    assert eng.cfg.chunk_size == eng.scheduler.cfg.chunk_size == eng.runner.chunk_size == want
    prompt = np.random.default_rng(3).integers(1, 100, 23).tolist()
    eng.timer.reset()
    out, = llm.generate([prompt], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert out.token_ids == reference_greedy(llm, prompt, 3)
    assert eng.timer.summary()["prefill"]["count"] == 1


@pytest.mark.parametrize("family,chunk,kernels", [("llama", 8, "auto"), ("llama", None, "auto"),
                                                  ("llama", 8, "interpret-packed"), ("deepseek_v3", 8, "auto"),
                                                  ("deepseek_v3", 8, "reference")])
def test_layerwise_warmup_covers_a_streamed_prompts_chunks(engines, family, chunk, kernels):
    """A layer-wise prefill instance (LLMEngine.stream_layers) gives every prefill step its layer groups: a
    program shape at least stage_min_tokens long runs layer group by layer group whatever its rows, a shorter one
    whole unless a row needs its groups (a streamed prompt's last chunk). Warm-up compiles each shape one way,
    never both, and covers every chunk of streamed prompts; the staged result is the dense path's. Paged prefill
    (llama) and in-place prefill (MLA, native kernels: every table as wide as the longest context) run every shape
    as layer groups; dense programs over dense views (MLA, references) the short ones whole. Also with the default
    chunk (the step budget, 16), and with the Pallas kernels (interpreted) prefilling packed (engine.packed_prefill)
    with the layers scanned, as a GPU's prefill instance runs them."""
    from jaxserve.engine.rows import PrefillRow
    from jaxserve.transfer.plan import layer_groups
    packed = kernels == "interpret-packed"
    llm = engines(family, dataclasses.replace(ENGINE, max_model_len=80, num_blocks=96, prefix_caching=False,
                                              chunk_size=chunk, kernels="interpret" if packed else kernels,
                                              packed_prefill=packed or None, scan_layers=packed or None))
    runner = llm.engine.runner
    C = runner.chunk_size
    assert C == (chunk or ENGINE.max_num_batched_tokens)
    assert runner.paged_prefill == (family == "llama")
    stages = layer_groups(runner.layout.num_layers, 1)
    llm.engine.stream_layers(stages, 24)
    try:
        runner.warmup(progress=False, stages=stages, decode=False)
        warmed, runner.programs = set(runner.programs), set()
        params = SamplingParams(max_tokens=1, temperature=0)
        for n in (26, 41, 77):
            prompt = [int(t) for t in np.random.default_rng(n).integers(1, 100, n)]
            blocks = list(range(1, -(-n // ENGINE.block_size) + 1))
            for start in range(0, n, C):
                end = min(start + C, n)
                row = PrefillRow(f"r{n}", prompt[start:end], start, blocks, 0, 0, None, end == n, params, 0,
                                 prompt if end == n else None)
                out, = runner.prefill([row], stages, None, {f"r{n}"} if end == n else set())
            assert out.token == int(llm.score(prompt)[-1].argmax())
    finally:
        llm.engine.stream_layers(None)
    assert runner.programs <= warmed, sorted(runner.programs - warmed)
    L = runner.layout.num_layers

    def shapes(whole: bool) -> set:
        return {k[1:4] + k[6:] for k in warmed if k[0] == "prefill" and (k[4:6] == (0, L)) == whole}
    assert shapes(False) and not shapes(True) & shapes(False)  # each shape one way
    if family == "llama":  # every layer in one run: one program for the four groups, shifted
        assert {k[4:6] for k in runner.programs if k[0] == "prefill"} == {(0, 1)}
        assert not shapes(True)
    elif runner.inplace_first:
        assert not shapes(True)
    else:
        assert shapes(True) and (0, L) in {k[4:6] for k in runner.programs if k[0] == "prefill"}
    assert runner.inplace_prefill == (family == "deepseek_v3" and kernels == "auto" and native.available()[0])


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v3", "kimi_linear", "qwen3_next", "gpt_oss",
                                    "mimo_v2_flash"])
def test_layer_by_layer_prefill_writes_what_the_whole_model_writes(engines, family):
    """A prompt prefilled one layer group per layer (a first chunk, then a chunk after it, each group its own
    program; groups of a run of stacked layers share one program, their layers shifted) leaves the
    same KV in its blocks, the same request-level state in its row, and samples the same token, as the
    whole-model programs do for the same prompt in other blocks and another row."""
    import jax

    from jaxserve.engine.rows import PrefillRow
    from jaxserve.transfer.plan import layer_groups
    llm = engines(family)
    runner, bs = llm.engine.runner, ENGINE.block_size
    stages = layer_groups(runner.layout.num_layers, 1)
    params = SamplingParams(max_tokens=1, temperature=0)
    prompt, n = BASE[:14], 14
    nb = -(-n // bs)
    runner.programs = set()
    toks = []
    for blocks, row, st in ((list(range(40, 40 + nb)), 1, None), (list(range(50, 50 + nb)), 2, stages)):
        for start in range(0, n, ENGINE.chunk_size):
            end = min(start + ENGINE.chunk_size, n)
            out, = runner.prefill([PrefillRow("r", prompt[start:end], start, blocks, row, row, None, end == n, params,
                                              0, prompt if end == n else None)], st)
        toks.append(out.token)
    assert toks[0] == toks[1] == int(llm.score(prompt)[-1].argmax())
    for gl, arr in zip(runner.layout.groups, runner.pool):
        if gl.kind == "full":  # [blocks, layers, E, bs, H, D] -> the prompt's tokens [n, layers, E, H, D]
            a, b = (block_tokens(arr, list(range(b0, b0 + nb)))[:n] for b0 in (40, 50))
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5, err_msg=family)
        else:
            for x in jax.tree.leaves(arr):
                np.testing.assert_allclose(np.asarray(x[1]), np.asarray(x[2]), rtol=1e-5, atol=1e-5, err_msg=family)
    # programs: the whole model, and per layer group its own, except the middle groups (neither first nor last)
    # of each run of stacked layers, which share one; layers stacked by class (a CPU's hybrid models), or all in
    # one run (a dense model): every group of one layer, whatever its class and wherever it lies, runs one program
    spans = {k[4:6] for k in runner.programs if k[0] == "prefill"}
    L = runner.layout.num_layers
    if runner.stack.classes or runner.stack.runs == ((0, L),):
        assert spans == {(0, L), (0, 1)}, (family, spans)
        assert family in ("llama", "qwen3") or runner.stack.classes
        return
    middle = [(lo, hi) for lo, hi in stages[1:-1] if runner.stack.run_of(lo)]
    runs = {runner.stack.run_of(lo) for lo, _ in middle}
    assert len(spans) == 1 + len(stages) - len(middle) + len(runs), family
    assert family == "gpt_oss" or len(middle) > len(runs)  # gpt-oss alternates layer kinds: no runs


def block_tokens(arr, blocks):
    """A full group's blocks [NB, L, E, bs, H, D] -> their tokens in order [len(blocks) * bs, L, E, H, D]."""
    x = np.asarray(arr)[blocks]  # [b, L, E, bs, H, D]
    return np.moveaxis(x, 3, 1).reshape((-1,) + x.shape[1:3] + x.shape[4:])


@pytest.mark.slow
def test_decode_warmup_covers_what_a_resumed_request_runs(checkpoint_dir):
    """A decode instance that took KV for all but a request's last token computes that token as a one-token
    prefill chunk at the end of the sequence; a decode instance's warm-up (decode programs and tails, no
    whole-prompt prefill) compiles those programs for every block-table width, so no resumed request compiles on
    the decode instance (a compile stalls every request there for seconds)."""
    from jaxserve.transfer.bufpool import aligned_empty
    from jaxserve.transfer.plan import bucket, layer_groups, staging
    eng = LLM(checkpoint_dir("llama"), progress=False, engine=dataclasses.replace(ENGINE, max_model_len=32)).engine
    runner = eng.runner
    runner.warmup(progress=False, tails=True, whole=False)  # what jaxserve/worker/main.py runs for a decode role
    runner.warmup_transfer(eng.dtype_name, layer_groups(eng.layout.num_layers, 1), export=False, receive=True,
                           progress=False)
    warmed = set(runner.programs)
    runner.programs = set()  # a record of the programs run: now, those the requests run
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    seqs = []
    for i, n in enumerate((2, 7, 13, 26)):  # prompt + output lengths across the block-table widths
        prompt, output = (BASE * 2)[:n - 1], [6]
        kv = len(prompt) + len(output) - 1
        seq, skip = eng.connector.reserve(f"resumed{i}", prompt, params, kv, output=output, logprobs=[(0.0, [])])
        st = staging(eng.layout, eng.dtype_name, bucket(-(-kv // ENGINE.block_size) - skip),
                     layer_groups(eng.layout.num_layers, 1))
        buf = aligned_empty(st.nbytes)
        buf[:] = 0
        eng.connector.kv_arrived(seq, st, st.views(buf), kv, None)
        seqs.append(seq)
    while eng.has_work:
        eng.step()
    assert all(s.finish_reason == "length" and len(s.output) == 4 for s in seqs)
    assert runner.programs <= warmed, sorted(runner.programs - warmed)
    assert not any(k[0] == "prefill" and k[-1] for k in warmed)  # the decode role compiles no first chunks


def test_warmup_in_reverse_runs_the_same_shapes_from_the_other_end(engines, monkeypatch):
    """A second instance of a role warms up in reverse (worker/main.py `_warm`), so two sharing XLA's persistent
    cache each find the other's programs in it: the same shapes, in the opposite order (the runner's step calls
    recorded instead of run)."""
    runner = engines("kimi_linear").engine.runner
    calls = []
    monkeypatch.setattr(runner, "generate", lambda rows: calls.append(("decode", len(rows), len(rows[0].block_ids))))
    monkeypatch.setattr(runner, "mixed", lambda p, d: calls.append(("mixed", tuple(len(r.tokens) for r in p), len(d))))
    monkeypatch.setattr(runner, "prefill", lambda rows, st, staged=None: calls.append(
        ("prefill", tuple((len(r.tokens), r.start) for r in rows), None if st is None else tuple(st))))
    monkeypatch.setattr(runner, "_insert", lambda m, c, ids, masks: (m, c))

    def shapes(reverse):
        calls.clear()
        runner.warmup(progress=False, reverse=reverse)
        return list(calls)
    forward = shapes(False)
    assert len(set(forward)) == len(forward) > 4 and shapes(True) == forward[::-1]
