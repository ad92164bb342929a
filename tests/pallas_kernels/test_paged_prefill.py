"""The Pallas paged prefill kernels (interpret mode on a CPU, compiled on a GPU) against their jnp references:
packed steps whose query tiles straddle rows, an engine's [B, T] chunk after cached tokens, windows and sinks,
K|V concatenated on the head dim, GQA groups padded to a power of two, MLA's latent pool, and a traced layer
index (a layer-wise prefill's program shared by the groups of a run)."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import check
from jaxserve.pallas_kernels.paged_attention import ref_paged_mla_prefill_attention, ref_paged_prefill_attention
from jaxserve.pallas_kernels.paged_prefill import paged_mla_prefill_attention, paged_prefill_attention
from tests.pallas_kernels.conftest import INTERPRET, close, randn

G2, G3, KV = dict(Hq=4, Hkv=2, Dk=64, Dv=64), dict(Hq=9, Hkv=3, Dk=64, Dv=64), dict(Hq=8, Hkv=2, Dk=64, Dv=32)
CASES = [  # dtype, heads (groups of 2; of 3, padded to 4: SmolLM2; K|V concatenated: MiMo), window, sinks, block_q
    (jnp.float32, G2, None, False, None),
    (jnp.bfloat16, G2, None, False, 16),
    (jnp.bfloat16, G3, 21, True, None),
    (jnp.float32, G3, None, False, 16),
    (jnp.float32, KV, 21, True, 16),
    (jnp.bfloat16, KV, None, False, None),
]


@pytest.mark.parametrize("dtype,heads,window,sinks,block_q", CASES)
def test_a_packed_step_matches_the_reference(dtype, heads, window, sinks, block_q):
    """check.py's packed step: a first chunk of 35 tokens, a chunk of 7 after 46 cached tokens, 3 padding tokens
    (zeros out); with 16 query rows a tile, tiles hold tokens of both rows and of the padding."""
    args, kw = check.inputs("paged_prefill_attention", np.random.RandomState(0), **heads, dtype=jnp.dtype(dtype).name,
                            block_size=16, window=window, sinks=sinks, ctx=53)
    got = paged_prefill_attention(*args, interpret=INTERPRET, block_q=block_q, **kw)
    want = ref_paged_prefill_attention(*args, **kw)
    assert got.shape == want.shape == (45, heads["Hq"], heads["Dv"])
    assert not np.asarray(got[-3:], np.float32).any()  # padding
    close(got, want, dtype)


def test_an_engine_chunk_after_cached_tokens_reads_only_its_context():
    """The engine's [B, T] chunk (PagedKV.packed: padding at row B) over a table as wide as the longest context:
    each token sees its row's blocks up to itself, wherever the table's unused entries point."""
    r = np.random.RandomState(1)
    B, T, W, bs, Hq, Hkv, D = 2, 16, 8, 16, 4, 2, 64
    NB = B * W + 1
    table = np.asarray(r.permutation(B * W).reshape(B, W) + 1, np.int32)
    table[1, 3:] = 0  # row 1 holds 3 blocks: the rest of its table is unused
    start, n = np.array([90, 21]), np.array([16, 9])
    pos = start[:, None] + np.arange(T)[None]
    rows = np.where(np.arange(T)[None] < n[:, None], np.arange(B)[:, None], B).reshape(-1)
    pool = randn(r, (NB, 1, 2, bs, Hkv, D))
    q = randn(r, (B * T, Hq, D))
    args = (q, pool, jnp.asarray(table), jnp.asarray(rows, jnp.int32), jnp.asarray(pos.reshape(-1), jnp.int32))
    got = paged_prefill_attention(*args, layer=0, interpret=INTERPRET)
    close(got, ref_paged_prefill_attention(*args, layer=0), jnp.float32)
    assert not np.asarray(got[T + 9:]).any()


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_mla_matches_the_reference(dtype):
    args, kw = check.inputs("paged_mla_prefill_attention", np.random.RandomState(2), H=4, L=64, R=32,
                            dtype=jnp.dtype(dtype).name, block_size=16, scale=0.1, ctx=53)
    got = paged_mla_prefill_attention(*args, interpret=INTERPRET, **kw)
    want = ref_paged_mla_prefill_attention(*args, **kw)
    assert got.shape == want.shape == (45, 4, 64)
    close(got, want, dtype)


def test_a_traced_layer_reads_that_layer():
    """One program over a 3-layer pool with the layer an argument (as a layer-wise prefill's shifted groups run)
    gives each layer's answer, as the reference and a static index do."""
    r = np.random.RandomState(3)
    (q, pool, table, rows, pos), kw = check.inputs("paged_prefill_attention", r, Hq=4, Hkv=2, Dk=64, Dv=64,
                                                   dtype="float32", block_size=16, ctx=40)
    kw.pop("layer")
    pool = randn(r, (pool.shape[0], 3) + pool.shape[2:])
    run = jax.jit(lambda layer: paged_prefill_attention(q, pool, table, rows, pos, layer=layer, interpret=INTERPRET,
                                                        **kw))
    outs = []
    for layer in range(3):
        got = run(jnp.int32(layer))
        close(got, ref_paged_prefill_attention(q, pool, table, rows, pos, layer=layer, **kw), jnp.float32)
        close(got, paged_prefill_attention(q, pool, table, rows, pos, layer=layer, interpret=INTERPRET, **kw),
              jnp.float32)
        outs.append(np.asarray(got))
    assert np.abs(outs[0] - outs[1]).max() > 1e-2  # the layers differ: the index is not ignored


def test_bad_calls_are_refused():
    args, kw = check.inputs("paged_prefill_attention", np.random.RandomState(0), Hq=4, Hkv=2, Dk=64, Dv=64,
                            dtype="float32", block_size=16)
    q, pool, table, rows, pos = args
    with pytest.raises(ValueError, match="one per query token"):
        paged_prefill_attention(q, pool, table, rows[:-1], pos, interpret=True, **kw)
    with pytest.raises(ValueError, match="outside the group"):
        paged_prefill_attention(*args, interpret=True, **dict(kw, layer=1))
    if not INTERPRET:
        return
    compiled = functools.partial(paged_prefill_attention, interpret=False)
    with pytest.raises(ValueError, match="compiled for the GPU needs"):  # a head dim below Triton's smallest
        args8, kw8 = check.inputs("paged_prefill_attention", np.random.RandomState(0), Hq=4, Hkv=2, Dk=8, Dv=8,
                                  dtype="float32", block_size=16)
        compiled(*args8, **kw8)
