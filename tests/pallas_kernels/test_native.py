"""The native CPU kernels (pallas_kernels/native.py, C++ through XLA's FFI) against their jnp references, the
layer index traced inside a scan as the engine runs them, and what happens where the library does not build."""

import dataclasses
import functools
import re
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.pallas_kernels import check, native, select
from jaxserve.pallas_kernels.matmul import ref_matmul
from jaxserve.pallas_kernels.paged_attention import (ref_paged_attention, ref_paged_mla_attention,
                                                     ref_paged_mla_prefill_attention, ref_paged_prefill_attention)
from jaxserve.pallas_kernels.select import KernelPlan
from tests.pallas_kernels.conftest import close, randn
from tests.pallas_kernels.test_check import ENGINE, GREEDY, PROMPTS, _tokens
from tests.pallas_kernels.test_paged_attention import CASES, _tables

# a machine without a C++ compiler skips these; where one is installed, a source that does not build fails here.
# On a GPU the programs compile for the GPU, where the library is not registered (available() says so).
pytestmark = [pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")), reason="no C++ compiler"),
              pytest.mark.skipif(jax.default_backend() != "cpu", reason="the native kernels run on XLA's CPU")]


def test_the_library_builds_with_the_machines_compiler():
    ok, why = native.available()
    assert ok, why

F32_CASES = [c for c in CASES if c[0] == jnp.float32]


@pytest.mark.parametrize("case", F32_CASES)
def test_native_paged_attention_matches_reference(case):
    _, E, Hq, Hkv, Dk, D, bs, lengths, window, use_sinks, _, _ = case
    r = np.random.RandomState(bs + Hq)
    B, L, NB = len(lengths), 3, 40
    W = -(-max(lengths) // bs) + 1  # a table wider than the longest row: the blocks after it are not read
    pool, q = randn(r, (NB, L, E, bs, Hkv, D)), randn(r, (B, Hq, Dk))
    table, lens = _tables(r, B, W, NB), jnp.asarray(lengths, jnp.int32)
    kw = dict(layer=1, sliding_window=window, sinks=randn(r, (Hq,)) if use_sinks else None)
    got = jax.jit(functools.partial(native.paged_attention, **kw))(q, pool, table, lens)
    assert got.shape == (B, Hq, D if E == 2 else D - Dk) and got.dtype == jnp.float32
    close(got, ref_paged_attention(q, pool, table, lens, **kw), jnp.float32)
    if lengths[0] == 0:
        assert not np.asarray(got[0]).any()


def test_native_mla_matches_reference():
    r = np.random.RandomState(3)
    B, H, Lr, R, NB, bs = 4, 4, 16, 8, 30, 4
    lengths = [1, bs, 3 * bs + 1, 0]
    pool, q = randn(r, (NB, 2, 1, bs, 1, Lr + R)), randn(r, (B, H, Lr + R))
    table, lens = _tables(r, B, -(-max(lengths) // bs), NB), jnp.asarray(lengths, jnp.int32)
    kw = dict(layer=1, kv_lora_rank=Lr, scale=0.2)
    got = jax.jit(functools.partial(native.paged_mla_attention, **kw))(q, pool, table, lens)
    assert got.shape == (B, H, Lr)
    close(got, ref_paged_mla_attention(q, pool, table, lens, **kw), jnp.float32)


# (E, Hq, Hkv, Dk, D, block size, window, sinks): K and V as two entries or concatenated, GQA groups of 1-3,
# the block size the kernel specialises (16) and others
PREFILL_CASES = [(2, 9, 3, 16, 16, 16, None, False), (2, 4, 2, 8, 8, 4, None, True), (1, 4, 4, 8, 20, 8, 5, False),
                 (2, 6, 2, 12, 12, 16, 20, True)]


@pytest.mark.parametrize("case", PREFILL_CASES)
def test_native_paged_prefill_matches_reference(case):
    """A packed step: a first chunk longer than a query tile, a chunk after cached tokens, a one-token chunk, a
    row's tokens split in two runs, padding (zeros out)."""
    E, Hq, Hkv, Dk, D, bs, window, use_sinks = case
    r = np.random.RandomState(Hq + bs)
    B, L, NB, W = 4, 2, 80, 12
    chunks = [(0, 0, 37), (1, 70, 9), (2, 41, 1), (3, 3, 5), (3, 20, 6)]  # (row, first position, tokens)
    rows = np.concatenate([np.full(n, b) for b, _, n in chunks] + [np.full(4, B)]).astype(np.int32)
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in chunks] + [np.zeros(4)]).astype(np.int32)
    pool, q = randn(r, (NB, L, E, bs, Hkv, D)), randn(r, (len(rows), Hq, Dk))
    table = _tables(r, B, max(W, -(-80 // bs)), NB)
    kw = dict(layer=1, sliding_window=window, sinks=randn(r, (Hq,)) if use_sinks else None)
    args = (q, pool, table, jnp.asarray(rows), jnp.asarray(pos))
    got = jax.jit(functools.partial(native.paged_prefill_attention, **kw))(*args)
    assert got.shape == (len(rows), Hq, D if E == 2 else D - Dk) and got.dtype == jnp.float32
    close(got, ref_paged_prefill_attention(*args, **kw), jnp.float32)
    assert not np.asarray(got[-4:]).any()


@pytest.mark.parametrize("bs", [16, 4])
def test_native_mla_prefill_matches_reference(bs):
    """MLA over the latent pool for a packed step (as a [B, T] prefill program hands it: rows in order, padding
    after each row's tokens): a first chunk longer than a query tile, a chunk after cached tokens, a one-token
    chunk; padding gives zeros."""
    r = np.random.RandomState(bs)
    B, H, Lr, R, NB, T = 3, 4, 32, 16, 60, 24
    chunks = [(0, 0, 21), (1, 5 * bs + 3, 9), (2, 40, 1)]  # (row, first position, tokens)
    rows = np.full((B, T), B, np.int32)
    pos = np.zeros((B, T), np.int32)
    for b, p, n in chunks:
        rows[b, :n], pos[b, :n] = b, np.arange(p, p + n)
    pool, q = randn(r, (NB, 2, 1, bs, 1, Lr + R)), randn(r, (B * T, H, Lr + R)) * 0.3
    table = _tables(r, B, -(-64 // bs), NB)
    kw = dict(layer=1, kv_lora_rank=Lr, scale=0.15)
    args = (q, pool, table, jnp.asarray(rows.ravel()), jnp.asarray(pos.ravel()))
    got = jax.jit(functools.partial(native.paged_mla_prefill_attention, **kw))(*args)
    assert got.shape == (B * T, H, Lr) and got.dtype == jnp.float32
    assert _native_calls(functools.partial(native.paged_mla_prefill_attention, **kw), *args) == \
        ["jaxserve_paged_prefill"]
    close(got, ref_paged_mla_prefill_attention(*args, **kw), jnp.float32)
    assert not np.asarray(got[rows.ravel() == B]).any()


def test_native_reads_the_layer_a_scan_gives_it():
    """Inside lax.scan the layer is a traced int32 (models/stack.py): every layer's output is its own layer's."""
    r = np.random.RandomState(1)
    B, L, NB, bs = 3, 4, 24, 4
    pool, q = randn(r, (NB, L, 2, bs, 2, 8)), randn(r, (B, 4, 8))
    table, lens = _tables(r, B, 4, NB), jnp.asarray([5, 16, 9], jnp.int32)

    @jax.jit
    def per_layer(q, pool):
        return jax.lax.scan(lambda c, i: (c, native.paged_attention(q, pool, table, lens, layer=i)), 0,
                            jnp.arange(L, dtype=jnp.int32))[1]
    got = per_layer(q, pool)
    for i in range(L):
        close(got[i], ref_paged_attention(q, pool, table, lens, layer=i), jnp.float32)
    assert not np.allclose(np.asarray(got[0]), np.asarray(got[1]))


def _native_calls(f, *args) -> list[str]:
    """The native custom calls in f's program."""
    text = str(jax.make_jaxpr(f)(*args))
    return re.findall(r"target_name=(jaxserve_\w+)", text)


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("K,N", [(576, 192), (64, 1000), (37, 53), (1536, 17)])
def test_native_matmul_matches_a_float64_product(K, N, transposed):
    """A decode step's rows (1-8, odd ones and padding-free tails of K and N included) against [K, N] and [N, K]
    weights, inside a scan over stacked weights as the engine's layers run: the float64 product's values. The
    native call is in the program where it should run (2-8 rows; 1-8 transposed) and not elsewhere."""
    r = np.random.RandomState(K + N)
    w64 = r.randn(3, K, N) / np.sqrt(K)
    ws = jnp.asarray(np.swapaxes(w64, 1, 2) if transposed else w64, jnp.float32)
    for rows in (1, 2, 3, 5, 8, 9):
        x64 = r.randn(rows, 1, K)

        def f(x, ws):  # the layers' weights sliced by a scan, each product's result fed to nothing else
            return jax.lax.scan(lambda c, w: (c, native.matmul(x, w, transposed=transposed)), 0, ws)[1]

        got = np.asarray(jax.jit(f)(jnp.asarray(x64, jnp.float32), ws))
        want = np.einsum("rtk,lkn->lrtn", x64, w64)
        assert got.shape == (3, rows, 1, N)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
        native_rows = (1 if transposed else 2) <= rows <= native.MATMUL_ROWS
        target = "jaxserve_matmul_t" if transposed else "jaxserve_matmul"
        assert _native_calls(f, jnp.asarray(x64, jnp.float32), ws) == ([target] if native_rows else []), rows


def test_matmul_modes_and_bad_shapes():
    """bfloat16 runs the reference; mismatched shapes are refused naming both; the self-test catches a wrong
    product."""
    r = np.random.RandomState(4)
    x, w = randn(r, (3, 16), jnp.bfloat16), randn(r, (16, 8), jnp.bfloat16)
    assert not _native_calls(native.matmul, x, w)
    close(native.matmul(x, w), ref_matmul(x, w), jnp.bfloat16)
    with pytest.raises(ValueError, match=r"x \[..., K\] and w \[K, N\]; got \(3, 16\) and \(8, 16\)"):
        native.matmul(x.astype(jnp.float32), w.T.astype(jnp.float32))
    case = check.Case.of("matmul", K=40, N=24, dtype=jnp.float32)
    assert check.run_case(case, "native") is None
    assert select.select("matmul", "native") is native.matmul and select.mode_of("matmul", "pallas") == "reference"


def test_other_dtypes_and_rejected_inputs():
    """A bfloat16 pool runs the reference (the library takes float32); bad shapes fail as the reference's do."""
    r = np.random.RandomState(2)
    pool, q = randn(r, (8, 1, 2, 4, 2, 8), jnp.bfloat16), randn(r, (2, 4, 8), jnp.bfloat16)
    table, lens = _tables(r, 2, 2, 8), jnp.asarray([3, 8], jnp.int32)
    close(native.paged_attention(q, pool, table, lens, layer=0), ref_paged_attention(q, pool, table, lens, layer=0),
          jnp.bfloat16)
    with pytest.raises(ValueError, match="layer 2 outside"):
        native.paged_attention(q.astype(jnp.float32), pool.astype(jnp.float32), table, lens, layer=2)
    with pytest.raises(ValueError, match="not a multiple of KV heads"):
        native.paged_attention(jnp.zeros((2, 3, 8)), pool.astype(jnp.float32), table, lens, layer=0)


def test_modes_route_to_the_native_kernels(monkeypatch):
    monkeypatch.setattr(select, "auto_mode", lambda: "native")
    assert select.select("paged_attention", "auto") is native.paged_attention
    assert select.select("paged_mla_attention", "native") is native.paged_mla_attention
    assert select.mode_of("batched_attention", "native") == "reference"  # no native implementation
    assert select.select("paged_attention", KernelPlan("native", frozenset({"paged_attention"}))) is \
        ref_paged_attention
    case = check.Case.of("paged_attention", Hq=4, Hkv=2, Dk=8, Dv=8, dtype=jnp.float32, block_size=4)
    assert check.run_case(case, "native") is None
    monkeypatch.setitem(native.KERNELS, "paged_attention", lambda *a, **kw: native.paged_attention(*a, **kw) * 1.1)
    assert "differs from its reference" in check.run_case(case, "native")
    monkeypatch.setitem(native.KERNELS, "matmul", lambda *a, **kw: native.matmul(*a, **kw) * 1.1)
    assert "differs from its reference" in check.run_case(check.Case.of("matmul", K=40, N=24, dtype=jnp.float32),
                                                          "native")


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_engine_native_matches_reference_and_falls_back_when_the_library_does_not_build(checkpoint_dir, family,
                                                                                        monkeypatch):
    """The engine with native kernels (GQA; MLA) gives the references' tokens. Where the library does not build,
    auto runs the references (the reason recorded as a kernel fallback) with the same tokens, and an explicit
    'native' refuses to start, naming the compiler's complaint."""
    path = checkpoint_dir(family)
    _, want = _tokens(path, "reference")
    llm, got = _tokens(path, "native")
    assert got == want and llm.engine.kernel_fallbacks == {}
    assert llm.engine.kernels == KernelPlan("native") and not llm.engine.runner.ragged

    monkeypatch.setattr(native, "_state", {})
    monkeypatch.setattr(native, "build", lambda *a, **kw: (_ for _ in ()).throw(RuntimeError("g++: not found")))
    monkeypatch.setattr(select, "auto_mode", lambda: "native")
    llm, got = _tokens(path, "auto")
    assert got == want
    assert llm.engine.runner.ragged  # the references' ragged gather, as on any machine without the library
    assert llm.engine.kernel_fallbacks and all("does not build: g++: not found" in why
                                               for why in llm.engine.kernel_fallbacks.values())
    with pytest.raises(check.KernelCheckError, match="engine.kernels: native, but on this device"):
        _tokens(path, "native")


def test_a_tensor_parallel_engine_runs_the_references(checkpoint_dir):
    """The native kernels are opaque to XLA's partitioner (it would gather the sharded pool for each call): a tp 2
    instance under auto runs the references, with the same tokens, and an explicit 'native' is refused."""
    path = checkpoint_dir("llama")
    _, want = _tokens(path, "reference")
    llm = LLM(path, progress=False, tp=2, engine=ENGINE)
    assert llm.engine.kernels == "reference" and llm.engine.runner.ragged
    assert [o.token_ids for o in llm.generate(PROMPTS, GREEDY)] == want
    with pytest.raises(ValueError, match="engine.kernels: native runs on one device"):
        LLM(path, progress=False, tp=2, engine=dataclasses.replace(ENGINE, kernels="native"))
