"""The engine's own step programs, with the Pallas kernels compiled (a GPU's kernels: engine.kernels auto there),
lower for an NVIDIA GPU, checked on any machine.

An engine with the kernels interpreted serves requests here (prefills, a chunk after cached tokens, decode steps,
a layer-wise prefill instance's layer groups)
while each program call's argument shapes are recorded; an engine of the same model and settings built with the
compiled Pallas kernels (never run here) then lowers every recorded call for the "cuda" platform (the Triton
lowering that enforces the GPU's tile rules), and the split step a GPU runs for constrained rows (its model, then
its sampling: engine/split_step.py) at each decode step's shapes. A program that a GPU would refuse to build fails
here first, not in a lent GPU's few minutes; the kernel-level lowering tests
(tests/pallas_kernels/test_gpu_lowering.py) do not see the programs around the kernels (scans over layers, the KV
writes, sampling)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine import llm_engine
from jaxserve.engine.llm_engine import EngineConfig
from jaxserve.pallas_kernels import check
from jaxserve.transfer.plan import layer_groups

PROGRAMS = ("_prefill", "_decode", "_step", "_first", "_sample", "_insert")


class Recorder:
    """A program's stand-in that records each call's argument shapes and static arguments, then runs it."""

    def __init__(self, fn, calls: list, name: str):
        self.fn, self.calls, self.name = fn, calls, name

    def __call__(self, *args, **static):
        shaped = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if hasattr(a, "shape") else a, args)
        self.calls.append((self.name, shaped, static))
        return self.fn(*args, **static)


def _engine(path: str, kernels: str, scan: bool) -> LLM:
    cfg = EngineConfig(block_size=16, num_blocks=64, chunk_size=32, max_num_batched_tokens=64, max_num_seqs=4,
                       kernels="interpret", scan_layers=scan)
    with pytest.MonkeyPatch.context() as mp:
        if kernels == "pallas":  # the GPU's choice, taken without the self-test (which would run the kernels here)
            mp.setattr(llm_engine.check, "plan", lambda requested, cases, progress=False, store=None: ("pallas", {}))
        llm = LLM(path, engine=cfg, progress=False)
    llm.engine.runner.static_sampling = True  # as on a GPU: the samplers compiled for their rows' mode
    return llm


def _record(llm: LLM) -> list:
    calls: list = []
    r = llm.engine.runner
    for name in PROGRAMS:
        setattr(r, name, Recorder(getattr(r, name), calls, name))
    return calls


@pytest.mark.parametrize("scan", [False, True], ids=["unrolled", "scanned"])
def test_every_step_program_the_engine_runs_lowers_for_the_gpu(checkpoint_dir, scan):
    path = checkpoint_dir("llama")
    served = _engine(path, "interpret", scan)
    calls = _record(served)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 200, n).tolist() for n in (5, 40, 70)]
    greedy = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    served.generate(prompts, greedy)
    served.generate([prompts[1] + [7, 8, 9]], greedy)  # a chunk after cached tokens
    served.generate(prompts[:2], SamplingParams(max_tokens=3, temperature=0.7, seed=1, logprobs=2))
    whole = len(calls)
    served.engine.stream_layers(layer_groups(4, 2), 16)  # a layer-wise prefill instance's groups of 2 layers
    served.generate([rng.integers(3, 200, 50).tolist()], greedy)
    served.engine.stream_layers(None)
    assert {static.get("hi") for name, _, static in calls[whole:] if name == "_prefill"} >= {2}
    gpu = _engine(path, "pallas", scan)
    r = gpu.engine.runner
    assert gpu.engine.kernels == "pallas"
    lowered, texts = set(), []
    for name, shaped, static in calls:
        key = (name, str(jax.tree.map(lambda a: (a.shape, str(a.dtype)), shaped)), tuple(sorted(static.items())))
        if key in lowered:
            continue
        lowered.add(key)
        texts.append((name, check.cuda_text(getattr(r, name), *shaped, **static)))
        if name == "_step":  # the same step split, as a GPU runs a constrained one
            params, pool, prompt_mask, out_counts, last, x, allowed = shaped
            fwd = {"total_blocks": static["total_blocks"]}
            texts.append(("forward", check.cuda_text(r.split._fwd, params, pool, last, x, **fwd)))
            h = jax.eval_shape(lambda *a: r.split._fwd(*a, **fwd), params, pool, last, x)[1]
            texts.append(("pick", check.cuda_text(r.split._pick, params, h, prompt_mask, out_counts, last, x, allowed,
                                                  mode=static["mode"])))
    assert {n for n, _ in texts} >= {"_prefill", "_step", "forward", "pick"} and len(texts) >= 6
    assert all("native" not in t for _, t in texts)  # no CPU kernel in a GPU program
    # no conditional, whose predicate XLA's GPU runtime reads on the host, holding the dispatching thread until
    # the device reaches it
    assert {static.get("mode") for name, _, static in calls if name == "_step"} >= {(False, False), (True, True)}
    assert not [n for n, t in texts if "stablehlo.case" in t or "stablehlo.if" in t]
    # nor, with the layers unrolled (a GPU's decode), a loop (the scanned layers' scan has a known trip count)
    assert scan or not [n for n, t in texts if "stablehlo.while" in t]
    for name, t in texts:  # the paged kernels (Triton) in every program that runs the model, none elsewhere
        assert (check.triton_calls(t) > 0) == (name in ("_prefill", "_step", "forward")), name
