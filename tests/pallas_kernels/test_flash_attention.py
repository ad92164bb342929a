"""flash_attention / batched_attention (Pallas, interpret mode, jitted) against their references, and the
packed reference against a per-sequence numpy softmax."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.flash_attention import (batched_attention, flash_attention, ref_batched_attention,
                                            ref_flash_attention)
from tests.pallas_kernels.conftest import INTERPRET, close, randn


def _numpy_packed(q, k, v, lens, causal, window, sinks, scale):
    """Loop over sequences and heads: softmax(q k^T) v with the masks spelled out."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    out = np.zeros((sum(lens), q.shape[1], v.shape[-1]))
    G = q.shape[1] // k.shape[1]
    s0 = 0
    for n in lens:
        for h in range(q.shape[1]):
            for i in range(n):
                js = [j for j in range(n) if (not causal or j <= i) and (window is None or j > i - window)]
                logits = np.array([q[s0 + i, h] @ k[s0 + j, h // G] * scale for j in js])
                extra = [] if sinks is None else [float(sinks[h])]
                mx = max(list(logits) + extra)
                w = np.exp(logits - mx)
                den = w.sum() + sum(np.exp(e - mx) for e in extra)
                out[s0 + i, h] = (w[:, None] * v[[s0 + j for j in js], h // G]).sum(0) / den
        s0 += n
    return out


CASES = [  # dtype, Hq, Hkv, Dk, Dv, lens, causal, window, sinks, block_q (rows), block_k
    (jnp.float32, 4, 2, 16, 16, [5, 1, 24, 8], True, None, False, 16, 8),
    (jnp.bfloat16, 4, 2, 16, 16, [5, 1, 24, 8], True, None, False, 16, 8),
    (jnp.float32, 8, 2, 8, 8, [13, 8, 3], True, 3, True, 32, 16),
    (jnp.bfloat16, 2, 2, 16, 16, [9, 16, 2], True, 8, True, 8, 8),
    (jnp.float32, 4, 1, 8, 8, [7, 12], False, None, False, 16, 8),
    (jnp.float32, 6, 3, 24, 16, [17, 4], True, 5, True, 8, 16),  # Dv != Dk (MiMo-V2-Flash)
    (jnp.float32, 4, 2, 16, 16, [40], True, None, False, 128, 128),  # default-size tiles
    (jnp.float32, 6, 2, 16, 16, [11, 5, 20], True, 6, True, 24, 8),  # a group of 3: run as 4 rows
]


@pytest.mark.parametrize("case", CASES)
def test_flash_attention_matches_reference(case):
    dtype, Hq, Hkv, Dk, Dv, lens, causal, window, use_sinks, bq, bk = case
    r = np.random.RandomState(len(lens) + Hq)
    T = sum(lens) + 3  # three padding tokens past cu_seqlens[-1]
    q, k, v = randn(r, (T, Hq, Dk), dtype), randn(r, (T, Hkv, Dk), dtype), randn(r, (T, Hkv, Dv), dtype)
    sinks = randn(r, (Hq,)) if use_sinks else None
    cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)
    kw = dict(cu_seqlens=cu, causal=causal, sliding_window=window, sinks=sinks)
    run = jax.jit(functools.partial(flash_attention, interpret=INTERPRET, block_q=bq, block_k=bk, **kw))
    got = run(q, k, v)
    want = ref_flash_attention(q, k, v, **kw)
    assert got.shape == (T, Hq, Dv) and got.dtype == dtype
    close(got, want, dtype)
    assert not np.asarray(got[sum(lens):], np.float32).any()  # padding tokens: zeros
    if dtype == jnp.float32:
        naive = _numpy_packed(q, k, v, lens, causal, window, None if sinks is None else np.asarray(sinks), Dk ** -0.5)
        np.testing.assert_allclose(np.asarray(want[:sum(lens)]), naive, atol=2e-5)


@pytest.mark.parametrize("dtype,G,window", [(jnp.float32, 2, None), (jnp.bfloat16, 4, 3), (jnp.float32, 1, 6),
                                            (jnp.float32, 3, None)])
def test_batched_attention_matches_reference(dtype, G, window):
    """Keys at scattered positions (a sliding-window ring), invalid keys, and a row with no valid key."""
    r = np.random.RandomState(G)
    B, T, S, Hkv, D = 3, 5, 20, 2, 8
    q, k, v = randn(r, (B, T, Hkv * G, D), dtype), randn(r, (B, S, Hkv, D), dtype), randn(r, (B, S, Hkv, D), dtype)
    q_pos = jnp.asarray(r.randint(0, 20, (B, T)), jnp.int32)
    k_pos = jnp.asarray(np.stack([r.permutation(S) for _ in range(B)]), jnp.int32)
    k_valid = jnp.asarray(r.rand(B, S) > 0.3).at[2].set(False)
    sinks = randn(r, (Hkv * G,))
    kw = dict(scale=0.3, window=window, sinks=sinks)
    got = jax.jit(functools.partial(batched_attention, interpret=INTERPRET, block_q=8, block_k=8, **kw))(
        q, k, v, q_pos, k_pos, k_valid)
    close(got, ref_batched_attention(q, k, v, q_pos, k_pos, k_valid, **kw), dtype)
    assert not np.asarray(got[2], np.float32).any()


@pytest.mark.parametrize("window", [None, 100])
def test_reference_in_query_tiles_equals_whole(window):
    """A long prompt goes through the reference a tile of query rows at a time: same numbers as all at once
    (causal over a prefix already cached, sinks, a window, GQA)."""
    from jaxserve.pallas_kernels import flash_attention as fa
    r = np.random.RandomState(1)
    B, T, S, Hkv, G, D = 2, 2 * fa.REF_QUERY_TILE, 3 * fa.REF_QUERY_TILE, 2, 2, 8
    q, k, v = randn(r, (B, T, Hkv * G, D)), randn(r, (B, S, Hkv, D)), randn(r, (B, S, Hkv, D))
    q_pos = jnp.asarray(np.arange(S - T, S)[None].repeat(B, 0), jnp.int32)
    k_pos = jnp.asarray(np.arange(S)[None].repeat(B, 0), jnp.int32)
    k_valid = jnp.asarray(np.arange(S)[None] < np.array([[S], [S - 7]]))
    kw = dict(scale=0.35, window=window, sinks=randn(r, (Hkv * G,)))
    tiled = jax.jit(functools.partial(ref_batched_attention, **kw))(q, k, v, q_pos, k_pos, k_valid)
    whole = fa._ref_rows(q, k, v, q_pos, k_pos, k_valid, kw["scale"], window, kw["sinks"])
    np.testing.assert_allclose(np.asarray(tiled), np.asarray(whole), atol=1e-6, rtol=1e-6)


def test_flash_attention_rejects_bad_shapes():
    q, k = jnp.zeros((4, 3, 8)), jnp.zeros((4, 2, 8))
    cu = jnp.array([0, 4], jnp.int32)
    with pytest.raises(ValueError, match="not a multiple of KV heads"):
        flash_attention(q, k, k, cu_seqlens=cu)
    with pytest.raises(ValueError, match="sliding_window must be >= 1"):
        flash_attention(k, k, k, cu_seqlens=cu, sliding_window=0)
    with pytest.raises(ValueError, match="cu_seqlens"):
        flash_attention(k, k, k, cu_seqlens=jnp.array([4], jnp.int32))
    with pytest.raises(ValueError, match="dtypes differ"):
        flash_attention(k, k.astype(jnp.bfloat16), k, cu_seqlens=cu)
    with pytest.raises(ValueError, match="sinks"):
        flash_attention(k, k, k, cu_seqlens=cu, sinks=jnp.zeros(3))


@pytest.mark.parametrize("S", [256, 192])
def test_aligned_reference_skips_only_future_keys(S):
    """aligned (a fresh prefill: token t at position t): the reference meets each query tile with the keys up to
    its end only; same numbers as the full product, with sinks, GQA, rows of different lengths, and a key view
    shorter or as long as the queries."""
    from jaxserve.pallas_kernels import flash_attention as fa
    r = np.random.RandomState(2)
    B, T, Hkv, G, D = 3, 4 * fa.REF_ALIGNED_TILE, 2, 3, 8
    q, k, v = randn(r, (B, T, Hkv * G, D)), randn(r, (B, S, Hkv, D)), randn(r, (B, S, Hkv, D))
    q_pos = jnp.asarray(np.arange(T)[None].repeat(B, 0), jnp.int32)
    k_pos = jnp.asarray(np.arange(S)[None].repeat(B, 0), jnp.int32)
    k_valid = jnp.asarray(np.arange(S)[None] < np.array([[S], [130], [5]]))
    kw = dict(scale=0.35, sinks=randn(r, (Hkv * G,)))
    aligned = jax.jit(functools.partial(ref_batched_attention, aligned=True, **kw))(q, k, v, q_pos, k_pos, k_valid)
    whole = fa._ref_rows(q, k, v, q_pos, k_pos, k_valid, kw["scale"], None, kw["sinks"])
    np.testing.assert_allclose(np.asarray(aligned), np.asarray(whole), atol=1e-6, rtol=1e-6)
    assert not np.allclose(np.asarray(aligned[:, 64:]), 0)  # later tiles saw keys
