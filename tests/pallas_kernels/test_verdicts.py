"""The self-test's passes kept in a store (pallas_kernels/verdicts.py): a case that passed is not checked again on
the same device and stack, a failure is, and so is a case whose stack, mode or compared functions changed; an
engine keeps its passes beside its compilation cache, so the next engine over that cache checks nothing."""

import dataclasses
import os
import shutil

import jax.numpy as jnp
import pytest

from jaxserve.engine.llm_engine import EngineConfig, LLMEngine
from jaxserve.models.config import load_config
from jaxserve.models.model import kernel_cases
from jaxserve.pallas_kernels import check, select, verdicts


@pytest.fixture
def counted(monkeypatch):
    """run_case counted; the cases named in `failing` fail."""
    calls, failing = [], set()
    monkeypatch.setattr(check, "run_case", lambda case, mode: calls.append((str(case), mode)) or
                        ("differs from its reference by 1 (tolerance 0.005)" if case.kernel in failing else None))
    return calls, failing


def test_a_pass_is_kept_a_failure_is_not(tmp_path, counted, monkeypatch, checkpoint_dir):
    calls, failing = counted
    cases = kernel_cases(load_config(checkpoint_dir("llama")), jnp.float32, 4)
    store = str(tmp_path / "store")
    assert check.self_test(cases, "interpret", store=store) == {} and len(calls) == len(set(cases)) > 1
    assert len(os.listdir(os.path.join(store, verdicts.SUBDIR))) == len(calls)
    calls.clear()
    assert check.self_test(cases, "interpret", store=store) == {} and calls == []  # all passed before
    assert check.self_test(cases, "interpret") == {} and len(calls) == len(set(cases))  # no store: all checked
    calls.clear()
    assert check.self_test(cases, "pallas", store=store) == {} and len(calls) == len(set(cases))  # another mode

    # a kernel replaced at run time (a test's stand-in, a patched build) is another function: checked afresh
    shutil.rmtree(os.path.join(store, verdicts.SUBDIR))
    calls.clear()
    failing.add("paged_attention")
    failed = check.self_test(cases, "interpret", store=store)
    assert list(failed) == ["paged_attention"] and ("differs from its reference" in failed["paged_attention"])
    calls.clear()
    assert list(check.self_test(cases, "interpret", store=store)) == ["paged_attention"]  # a failure: again
    assert [k for k, _ in calls] == [str(c) for c in cases if c.kernel == "paged_attention"]
    failing.clear()
    ref, kernel = select.KERNELS["matmul"]
    monkeypatch.setitem(select.KERNELS, "matmul", (lambda *a, **kw: ref(*a, **kw), kernel))
    calls.clear()
    assert check.self_test(cases, "interpret", store=store) == {}
    assert sorted(k for k, _ in calls) == sorted(str(c) for c in set(cases) if c.kernel in ("matmul",
                                                                                              "paged_attention"))


def test_another_stack_checks_again(tmp_path, counted, monkeypatch):
    """The key holds the device, JAX's versions and this package's sources: any change misses the passes."""
    calls, _ = counted
    cases = [check.Case.of("matmul", K=40, N=24, dtype=jnp.float32)]
    store = str(tmp_path)
    check.self_test(cases, "interpret", store=store)
    check.self_test(cases, "interpret", store=store)
    assert len(calls) == 1
    monkeypatch.setattr(verdicts, "_sources", lambda: "an edited kernel")
    verdicts._stack.cache_clear()
    try:
        check.self_test(cases, "interpret", store=store)
    finally:
        verdicts._stack.cache_clear()
    assert len(calls) == 2


def test_an_engine_keeps_its_passes_beside_its_compilation_cache(checkpoint_dir, monkeypatch):
    """Native kernels where a compiler builds them (else the store stays empty and the test says so by skipping)."""
    path = checkpoint_dir("llama")
    cfg = EngineConfig(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_num_seqs=4,
                       num_snapshots=8, kernels="auto")
    first = LLMEngine(path, "float32", cfg, progress=False)
    if first.kernels == "reference" or first.kernels.mode != "native":
        pytest.skip(f"the kernels here: {first.kernels} (no native library)")
    store = first.compilation_cache
    cases = [c for c in kernel_cases(first.model_config, first.dtype, cfg.block_size) if c.kernel in
             check.native.KERNELS]
    assert store and cases and all(verdicts.passed(store, "native", check._checked(c, "native")) for c in cases)
    calls = []
    run_case = check.run_case
    monkeypatch.setattr(check, "run_case", lambda *a: calls.append(a) or run_case(*a))
    second = LLMEngine(path, "float32", dataclasses.replace(cfg, max_num_seqs=2), progress=False)
    assert second.kernels == first.kernels and second.kernel_fallbacks == {} and calls == []

