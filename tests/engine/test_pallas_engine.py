"""The engine on the Pallas kernels (interpreted here, compiled on a GPU): chunks after cached tokens attend over
the pool in place, scanned layers (engine.scan_layers) share one program per layer-group size, and a GPU's plan
takes the step budget as its chunk. Answers are compared with the dense path's (tests/engine/test_engine.py's
helpers)."""

import dataclasses

import jax
import jax.numpy as jnp

from jaxserve.engine.llm_engine import EngineConfig
from tests.engine.test_engine import ENGINE, answers_with_prefix_hits, engines  # noqa: F401 - engines: a fixture


def test_chunks_after_cached_tokens_read_the_pool_in_place_with_the_pallas_kernels(engines, monkeypatch):
    """The Pallas paged prefill kernel (interpreted here, compiled on a GPU) attends a chunk after cached tokens
    over the pool in place: warm-up compiles one such program per chunk bucket, its table max_blocks_per_seq wide
    even where a dense view of that width would be too large to gather (an 8B model's: one program per bucket
    and width), first chunks keep programs of their own (flash attention over their own keys), traffic (prompts
    longer than a chunk, prompts extending cached ones) runs nothing else, and the answers equal the dense
    path's."""
    from jaxserve.engine import llm_engine
    monkeypatch.setattr(llm_engine, "WIDE_GATHER_BYTES", 0)  # the tiny model's context as costly as an 8B's
    llm = engines("llama", dataclasses.replace(ENGINE, chunk_size=16, max_num_batched_tokens=16, num_blocks=96,
                                               kernels="interpret"))
    runner = llm.engine.runner
    assert runner.inplace_prefill and runner.wide_cached and not (runner.inplace_first or runner.paged_prefill)
    runner.warmup(progress=False)
    W, L = runner.max_blocks_per_seq, runner.layout.num_layers
    assert {k for k in runner.programs if k[0] == "prefill" and not k[-1]} == {("prefill", 1, 16, W, 0, L, 16, False)}
    assert {k[1:3] for k in runner.programs if k[0] == "prefill" and k[-1]} == {(1, 16), (2, 16)}  # first chunks
    programs, runner.programs = set(runner.programs), set()
    answers_with_prefix_hits(llm, (5, 30, 61), 1, 4, seed=2)
    assert runner.programs <= programs, sorted(runner.programs - programs)
    assert {k[-1] for k in runner.programs if k[0] == "prefill"} == {True, False}


def test_scanned_layers_with_the_pallas_kernels_share_the_layer_groups_programs(engines):
    """engine.scan_layers with the Pallas kernels (interpreted here; a GPU prefill instance's default): the paged
    decode and prefill kernels take the scan's traced layer, so a layer-wise prefill's layer groups of one size
    share one program (the model's layers are one run: the first group's embedding and the last's hidden states
    come from it too) where unrolled layers compile one per group; prefills, prompts extending cached ones and
    decode steps give the dense path's answers."""
    from jaxserve.transfer.plan import layer_groups
    cfg = dataclasses.replace(ENGINE, chunk_size=16, max_num_batched_tokens=16, num_blocks=96, kernels="interpret")
    groups = {}
    for scan in (True, False):
        llm = engines("llama", dataclasses.replace(cfg, scan_layers=scan))
        runner = llm.engine.runner
        assert bool(runner.stack.runs) == scan
        stages = layer_groups(runner.layout.num_layers, 1)
        llm.engine.stream_layers(stages, 16)
        try:
            runner.warmup(progress=False, stages=stages, decode=False)
            groups[scan] = {k[4:6] for k in runner.programs if k[0] == "prefill"}
            if scan:
                answers_with_prefix_hits(llm, (5, 30), 1, 3, seed=4)
        finally:
            llm.engine.stream_layers(None)
    L = 4
    assert groups[False] == {(i, i + 1) for i in range(L)}
    assert groups[True] == {(0, 1)}  # every group runs the program of layer 0, shifted


def test_the_default_chunk_is_the_step_budget_where_the_prefill_kernels_are_compiled(checkpoint_dir, monkeypatch):
    """With the Pallas kernels compiled (a GPU's plan, taken here without running them, as bench/gpu_programs.py
    does) a request's chunk is the step's budget too, up to COMPILED_CHUNK: a 2,048-token prompt is one step, not
    eight; interpreted kernels (and the references) keep DENSE_CHUNK. Unconfigured on a GPU (its platform faked),
    the step budget is 2,048 tokens, dtype auto bfloat16, and decode steps overlap."""
    from jaxserve.engine import llm_engine, overlap
    from jaxserve.engine.llm_engine import COMPILED_CHUNK, DENSE_CHUNK, LLMEngine, default_chunk_size
    cfg = EngineConfig(max_num_batched_tokens=96, num_blocks=64, compilation_cache=None)
    monkeypatch.setattr(llm_engine.check, "plan", lambda requested, cases, progress=False, store=None: ("pallas", {}))
    gpu = LLMEngine(checkpoint_dir("llama"), "float32", cfg, progress=False)
    assert gpu.cfg.chunk_size == gpu.runner.chunk_size == gpu.scheduler.cfg.chunk_size == 96
    assert default_chunk_size(False, 8192, 16, compiled_prefill=True) == COMPILED_CHUNK == 2048
    assert default_chunk_size(True, 8192, 16) == 8192  # one packed program over the pool: the whole budget
    # unconfigured, the step's budget comes from the device: on a GPU 2,048 tokens, a 2,048-token prompt one step;
    # dtype auto is bfloat16 there
    monkeypatch.setattr(llm_engine, "device_platform", lambda mesh=None: "gpu")
    sized = LLMEngine(checkpoint_dir("llama"), config=dataclasses.replace(cfg, max_num_batched_tokens=None),
                      progress=False)
    assert sized.dtype_name == "bfloat16" and sized.dtype == jnp.bfloat16
    assert {x.dtype for x in jax.tree.leaves(sized.runner.params) if jnp.issubdtype(x.dtype, jnp.floating)} == \
        {jnp.dtype(jnp.bfloat16)}
    assert sized.cfg.max_num_batched_tokens == sized.scheduler.cfg.max_num_batched_tokens == 2048
    assert sized.cfg.chunk_size == sized.runner.chunk_size == 2048
    assert sized.cfg.overlap is True and overlap.enabled(sized)  # decode steps left in flight there
    assert sized.cache_line.endswith("; max_num_batched_tokens 2048 (on a gpu: engine.max_num_batched_tokens sets "
                                     "it); bfloat16 (dtype auto on a gpu)")
    monkeypatch.undo()  # the CPU's platform and kernel plan again
    interpreted = LLMEngine(checkpoint_dir("llama"), "float32", dataclasses.replace(cfg, kernels="interpret"),
                            progress=False)
    assert interpreted.cfg.chunk_size == DENSE_CHUNK
