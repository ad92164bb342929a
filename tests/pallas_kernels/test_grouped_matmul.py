"""The experts' grouped products (pallas_kernels/grouped_matmul.py): the CPU's native kernel (native.py), its jnp
tiled form and the reference (`lax.ragged_dot`) against a float64 product per group, on groups that are empty,
short, longer than a tile or than the native kernel's 8-row chunks, and rows past the last group; the engine's MoE
layers run the native kernel under the native mode and give the references' tokens."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.config import load_config
from jaxserve.models.model import CausalLM, kernel_cases
from jaxserve.pallas_kernels import check, native, select
from jaxserve.pallas_kernels.grouped_matmul import ref_grouped_matmul, tile_rows, tiled_grouped_matmul
from jaxserve.pallas_kernels.select import KernelPlan
from jaxserve import LLM
from tests.pallas_kernels.test_check import ENGINE, GREEDY, PROMPTS, _tokens


def _float64(x, w, sizes):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    out, at = np.zeros((x.shape[0], w.shape[2])), 0
    for g, n in enumerate(np.asarray(sizes)):
        out[at:at + n] = x[at:at + n] @ w[g]
        at += n
    return out


CASES = [  # (E, K, N, sizes): a tile of 8 rows unless the groups are larger
    (1, 16, 24, [5]),
    (4, 32, 48, [3, 0, 9, 1]),  # an empty group, groups that one tile of 8 rows would hold
    (4, 32, 48, [30, 0, 0, 70]),  # 100 rows over 4: tiles of 16, a group across several
    (8, 24, 40, [0, 0, 0, 0, 0, 0, 0, 6]),  # only the last group has rows
    (32, 16, 24, [1, 0, 2, 0] * 8),  # more groups than tiles (a decode step's few rows)
    (4, 16, 24, [4, 4, 0, 2]),  # rows past the last group come out zero
]


@pytest.mark.parametrize("E,K,N,sizes", CASES)
def test_tiled_and_reference_match_a_float64_product(E, K, N, sizes):
    r = np.random.RandomState(E + K + sum(sizes))
    M = sum(sizes) + (3 if sizes == [4, 4, 0, 2] else 0)
    x, w = jnp.asarray(r.randn(M, K), jnp.float32), jnp.asarray(r.randn(E, K, N) * K ** -0.5, jnp.float32)
    s = jnp.asarray(sizes, jnp.int32)
    want = _float64(x, w, sizes)
    for f in (native.grouped_matmul, tiled_grouped_matmul, ref_grouped_matmul):
        got = jax.jit(f)(x, w, s)
        assert got.shape == (M, N) and got.dtype == jnp.float32
        np.testing.assert_allclose(np.asarray(got), want, atol=2e-5, rtol=0)


def test_a_layer_of_a_stack_is_read_in_place():
    """w [L, E, K, N] with `layer` (traced, as a scan over stacked layers gives it): layer l's experts."""
    r = np.random.RandomState(1)
    x, w = jnp.asarray(r.randn(20, 16), jnp.float32), jnp.asarray(r.randn(3, 4, 16, 8) / 4, jnp.float32)
    s = jnp.asarray([5, 0, 7, 8], jnp.int32)
    for f in (native.grouped_matmul, tiled_grouped_matmul, ref_grouped_matmul):
        for layer in range(3):
            got = jax.jit(lambda x, w, s, i: f(x, w, s, layer=i))(x, w, s, jnp.int32(layer))
            np.testing.assert_allclose(np.asarray(got), _float64(x, w[layer], [5, 0, 7, 8]), atol=2e-5, rtol=0)
    for f in (native.grouped_matmul, tiled_grouped_matmul):
        with pytest.raises(ValueError, match="with a layer"):
            f(x, w, s)


def test_bfloat16_accumulates_in_float32_and_shapes_are_checked():
    r = np.random.RandomState(0)
    x, w = jnp.asarray(r.randn(40, 64), jnp.bfloat16), jnp.asarray(r.randn(4, 64, 32) / 8, jnp.bfloat16)
    s = jnp.asarray([10, 10, 0, 20], jnp.int32)
    got = jax.jit(native.grouped_matmul)(x, w, s)  # not float32: the tiled form
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), _float64(x, w, [10, 10, 0, 20]), atol=3e-2, rtol=0)
    with pytest.raises(ValueError, match=r"x \[M, K\], w \[E, K, N\]"):
        tiled_grouped_matmul(x, w[:, :32], s)
    with pytest.raises(ValueError, match="grouped_matmul"):
        ref_grouped_matmul(x, w, s[:3])


def test_tile_follows_the_rows_per_group():
    assert [tile_rows(M, E) for M, E in [(4, 32), (96, 4), (256, 32), (2048, 4), (4096, 32)]] == [8, 16, 8, 64, 64]


@pytest.mark.skipif(not native.available()[0], reason="the native library does not build here")
def test_the_native_kernel_reads_the_experts_in_place():
    """Under native the products are the C++ kernel's custom call (float32), reading the stack [L, E, K, N] as it
    lies: no slice of it in the program."""
    x, w = jnp.zeros((12, 16), jnp.float32), jnp.zeros((3, 4, 16, 8), jnp.float32)
    s = jnp.asarray([5, 0, 7, 0], jnp.int32)
    text = jax.jit(lambda x, w, s, i: native.grouped_matmul(x, w, s, layer=i)).lower(x, w, s, 1).as_text()
    assert "jaxserve_grouped_matmul" in text and "dynamic_slice" not in text and "ragged_dot" not in text


def test_native_mode_runs_the_tiled_form_without_the_library(monkeypatch):
    """Under native the products run whether or not the C++ library builds (the tiled form is jnp), for any dtype,
    and the self-test compares them with the reference (a wrong one fails its case)."""
    assert select.select("grouped_matmul", "native") is native.grouped_matmul
    assert select.select("grouped_matmul", "reference") is ref_grouped_matmul
    assert select.mode_of("grouped_matmul", "pallas") == "reference"  # on a GPU: XLA's ragged_dot
    case = check.Case.of("grouped_matmul", E=4, K=24, N=40, dtype=jnp.bfloat16)
    assert check.run_case(case, "native") is None
    monkeypatch.setattr(native, "available", lambda *a, **kw: (False, "g++: not found"))
    assert select.mode_of("grouped_matmul", "native") == "native"
    x, w, s = jnp.ones((6, 8), jnp.float32), jnp.ones((2, 8, 4), jnp.float32), jnp.asarray([2, 4], jnp.int32)
    assert "jaxserve_grouped_matmul" not in jax.jit(native.grouped_matmul).lower(x, w, s).as_text()
    assert select.mode_of("matmul", "native") == "reference"
    monkeypatch.setattr(select, "auto_mode", lambda: "native")
    got, failed = check.plan("auto", [case, check.Case.of("matmul", K=8, N=8, dtype=jnp.float32)])
    assert set(failed) == {"matmul"} and "grouped_matmul" not in got.reference
    monkeypatch.setitem(native.KERNELS, "grouped_matmul", lambda *a: tiled_grouped_matmul(*a) * 1.1)
    assert "differs from its reference" in check.run_case(case, "native")


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next", "deepseek_v3"])
def test_moe_engine_on_the_cpu_runs_the_native_form_with_the_references_tokens(checkpoint_dir, family):
    """gpt-oss (gate and up as one product, biases) and Qwen3-Next (gate, up, down; a gated shared expert), their
    layers scanned by class, and DeepSeek-V3 (a run of identical MoE layers scanned): the engine under native gives
    the tokens of the references (ragged_dot) and of its layers unscanned (each layer's own experts, not read
    from a stack: models/stack.py take_layer), and its model graph has no ragged_dot."""
    path = checkpoint_dir(family)
    _, want = _tokens(path, "reference")
    llm, got = _tokens(path, "native")
    assert got == want and llm.engine.kernels == KernelPlan("native")
    unscanned = LLM(path, "float32", progress=False, engine=dataclasses.replace(ENGINE, kernels="native",
                                                                                  scan_layers=False))
    assert [o.token_ids for o in unscanned.generate(PROMPTS, GREEDY)] == want
    cfg = load_config(path)
    assert any(c.kernel == "grouped_matmul" for c in kernel_cases(cfg, jnp.float32, 4))
    x = jnp.zeros((1, 6, cfg.hidden_size))
    for kernels, ragged in (("native", False), ("reference", True)):
        moe = next(layer.mlp for layer in CausalLM(cfg, jnp.float32, kernels).layers if hasattr(layer.mlp, "experts"))
        assert ("ragged_dot" in str(jax.make_jaxpr(moe)(x))) == ragged
