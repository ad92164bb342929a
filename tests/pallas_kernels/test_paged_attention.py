"""paged_attention / paged_mla_attention (Pallas, interpret mode, jitted) against their references, and the
references against attention over K/V laid out densely by hand."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels.flash_attention import ref_batched_attention
from jaxserve.pallas_kernels.paged_attention import (paged_attention, paged_mla_attention, ref_paged_attention,
                                            ref_paged_mla_attention, ref_paged_mla_prefill_attention)
from tests.pallas_kernels.conftest import INTERPRET, close, randn


def _tables(r, B, W, NB):
    """Distinct shuffled block ids per request (a request never shares a block with itself)."""
    return jnp.asarray(np.stack([r.permutation(NB)[:W] for _ in range(B)]), jnp.int32)


CASES = [  # dtype, E, Hq, Hkv, Dk, D, block_size, lengths, window, sinks, pages_per_tile, pages_per_partition
    (jnp.float32, 2, 4, 2, 8, 8, 4, [0, 1, 4, 13, 24], None, False, None, None),  # empty, 1, one block, ragged, full
    (jnp.bfloat16, 2, 4, 2, 8, 8, 4, [0, 1, 4, 13, 24], None, False, None, None),
    (jnp.float32, 2, 8, 2, 16, 16, 8, [3, 17, 48, 8], 6, True, 1, 2),
    (jnp.bfloat16, 2, 2, 2, 16, 16, 8, [3, 17, 48, 8], 9, True, 2, 2),
    (jnp.float32, 1, 4, 1, 12, 20, 4, [24, 5, 9], None, True, 2, 4),  # K|V concatenated (Dv = 8 != Dk)
    (jnp.float32, 2, 4, 4, 8, 8, 16, [1, 16, 33, 96], 20, False, 1, 1),  # MHA, one block per partition
    (jnp.float32, 2, 9, 3, 8, 8, 4, [5, 17, 24], 7, True, 2, 2),  # a group of 3 (9 / 3 heads): run as 4 rows
]


@pytest.mark.parametrize("case", CASES)
def test_paged_attention_matches_reference(case):
    dtype, E, Hq, Hkv, Dk, D, bs, lengths, window, use_sinks, ppt, ppp = case
    r = np.random.RandomState(bs + Hq)
    B, L, NB = len(lengths), 3, 40
    W = -(-max(lengths) // bs)
    pool = randn(r, (NB, L, E, bs, Hkv, D), dtype)
    q = randn(r, (B, Hq, Dk), dtype)
    table = _tables(r, B, W, NB)
    lens = jnp.asarray(lengths, jnp.int32)
    kw = dict(layer=1, sliding_window=window, sinks=randn(r, (Hq,)) if use_sinks else None, pages_per_tile=ppt,
              pages_per_partition=ppp)
    got = jax.jit(functools.partial(paged_attention, interpret=INTERPRET, **kw))(q, pool, table, lens)
    want = ref_paged_attention(q, pool, table, lens, **kw)
    assert got.shape == (B, Hq, D if E == 2 else D - Dk) and got.dtype == dtype
    close(got, want, dtype)
    if lengths[0] == 0:
        assert not np.asarray(got[0], np.float32).any()
    # the ragged reference (only the blocks in use, one list over the batch, padded) gives the same numbers
    used = sum(-(-n // bs) for n in lengths)
    for total in (used, used + 5):
        ragged = jax.jit(functools.partial(ref_paged_attention, total_blocks=total, **kw))(q, pool, table, lens)
        close(ragged, want, dtype)


def test_the_partitions_cover_each_seen_tile_once_and_start_inside_the_table():
    """split_tiles over every length up to 9 tiles, with and without a window, 1 to 4 partitions: the partitions'
    ranges are disjoint, in order and together the tiles from the window's first to the length's last; each starts
    at a tile the request's table holds (the prefetching kernel reads it even when the partition is empty)."""
    from jaxserve.pallas_kernels.paged_attention import split_tiles
    tk = 16
    for n in range(0, 9 * tk + 1):
        for window in (None, 1, 20, 50):
            tok_lo = 0 if window is None else max(n - window, 0)
            tiles = -(-n // tk)
            for parts in (1, 2, 3, 4):
                ranges = [tuple(int(x) for x in split_tiles(jnp.int32(n), jnp.int32(tok_lo), tk, parts,
                                                            jnp.int32(p))) for p in range(parts)]
                covered = [t for lo, hi in ranges for t in range(lo, hi)]
                assert covered == list(range(tok_lo // tk, tiles)), (n, window, parts, ranges)
                assert all(lo <= max(tiles - 1, 0) for lo, _ in ranges), (n, window, parts, ranges)


@pytest.mark.parametrize("mla", [False, True])
def test_a_table_wider_than_its_requests_gives_the_same_numbers(mla):
    """The engine's decode tables are as wide as the longest context (one program per batch bucket): each
    request's own tiles are split into the partitions, so a table of 64 blocks for requests of 1 to 13 blocks
    gives the narrow table's numbers (and the reference's), its unused entries pointing anywhere."""
    r = np.random.RandomState(7)
    bs, NB, lengths = 16, 80, [1, 30, 97, 200]
    W = -(-max(lengths) // bs)
    lens = jnp.asarray(lengths, jnp.int32)
    narrow = _tables(r, len(lengths), W, NB)
    wide = jnp.concatenate([narrow, _tables(r, len(lengths), 64 - W, NB)], axis=1)
    if mla:
        q, pool = randn(r, (4, 16, 96), jnp.float32), randn(r, (NB, 2, 1, bs, 1, 96), jnp.float32)
        kw = dict(layer=1, kv_lora_rank=64, scale=0.1)
        kernel, ref = paged_mla_attention, ref_paged_mla_attention
    else:
        q, pool = randn(r, (4, 8, 32), jnp.float32), randn(r, (NB, 2, 2, bs, 2, 32), jnp.float32)
        kw = dict(layer=1, sliding_window=50, sinks=randn(r, (8,)))
        kernel, ref = paged_attention, ref_paged_attention
    run = functools.partial(kernel, interpret=INTERPRET, **kw)
    got = jax.jit(run)(q, pool, wide, lens)
    close(got, jax.jit(run)(q, pool, narrow, lens), jnp.float32)
    close(got, ref(q, pool, narrow, lens, **kw), jnp.float32)


@pytest.mark.parametrize("mla", [False, True])
def test_a_scan_over_the_layers_reads_each_layer(mla):
    """The decode kernels inside a lax.scan over a group's layers, the layer index traced (as a run of stacked
    layers runs them, models/model.py): each step reads its own layer, as the reference and a static index do."""
    r = np.random.RandomState(5)
    bs, NB, L, lengths = 16, 40, 3, [1, 30, 70]
    lens = jnp.asarray(lengths, jnp.int32)
    table = _tables(r, len(lengths), 5, NB)
    if mla:
        q, pool = randn(r, (3, 16, 96), jnp.float32), randn(r, (NB, L, 1, bs, 1, 96), jnp.float32)
        kw = dict(kv_lora_rank=64, scale=0.1)
        kernel, ref = paged_mla_attention, ref_paged_mla_attention
    else:
        q, pool = randn(r, (3, 8, 32), jnp.float32), randn(r, (NB, L, 2, bs, 2, 32), jnp.float32)
        kw = dict(sliding_window=50, sinks=randn(r, (8,)))
        kernel, ref = paged_attention, ref_paged_attention
    def body(_, layer):
        return None, kernel(q, pool, table, lens, layer=layer, interpret=INTERPRET, **kw)
    _, outs = jax.jit(lambda: jax.lax.scan(body, None, jnp.arange(L, dtype=jnp.int32)))()
    for layer in range(L):
        close(outs[layer], ref(q, pool, table, lens, layer=layer, **kw), jnp.float32)
        close(outs[layer], kernel(q, pool, table, lens, layer=layer, interpret=INTERPRET, **kw), jnp.float32)
    assert np.abs(np.asarray(outs[0]) - np.asarray(outs[1])).max() > 1e-2  # the index is not ignored


@pytest.mark.parametrize("order", ["hpb", "phb", "pbh"])
def test_paged_attention_grid_orders_give_the_same_numbers(order):
    """The launch grid's axes in another order: every (request, KV head, partition) program still runs once,
    on its own inputs and outputs (the same numbers as the default order); a bad order is refused."""
    r = np.random.RandomState(7)
    B, Hq, Hkv, D, bs, NB = 5, 8, 2, 64, 16, 40
    lengths = [1, 70, 0, 33, 128]
    pool, q = randn(r, (NB, 2, 2, bs, Hkv, D), jnp.bfloat16), randn(r, (B, Hq, D), jnp.bfloat16)
    table, lens = _tables(r, B, 8, NB), jnp.asarray(lengths, jnp.int32)
    kw = dict(layer=1, pages_per_tile=2, pages_per_partition=2, interpret=INTERPRET)
    want = jax.jit(functools.partial(paged_attention, **kw))(q, pool, table, lens)
    got = jax.jit(functools.partial(paged_attention, grid_order=order, **kw))(q, pool, table, lens)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    close(got, ref_paged_attention(q, pool, table, lens, layer=1), jnp.bfloat16)
    with pytest.raises(ValueError, match="grid_order"):
        paged_attention(q, pool, table, lens, grid_order="bhh", **kw)


def test_paged_reference_reads_the_right_tokens():
    """Write a dense K/V sequence into scattered blocks by hand; the paged reference equals dense attention."""
    r = np.random.RandomState(0)
    bs, NB, Hkv, D, n = 4, 12, 2, 8, 10
    k, v = r.randn(n, Hkv, D).astype(np.float32), r.randn(n, Hkv, D).astype(np.float32)
    blocks = [7, 2, 9]
    pool = np.zeros((NB, 2, 2, bs, Hkv, D), np.float32)
    for t in range(n):
        pool[blocks[t // bs], 1, 0, t % bs], pool[blocks[t // bs], 1, 1, t % bs] = k[t], v[t]
    q = jnp.asarray(r.randn(1, 4, D), jnp.float32)
    got = ref_paged_attention(q, jnp.asarray(pool), jnp.asarray([blocks], jnp.int32), jnp.asarray([n], jnp.int32),
                              layer=1)
    pos = jnp.arange(n, dtype=jnp.int32)[None]
    want = ref_batched_attention(q[:, None], jnp.asarray(k)[None], jnp.asarray(v)[None], jnp.asarray([[n - 1]]), pos,
                                 pos >= 0, scale=D ** -0.5)[:, 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-6)


@pytest.mark.parametrize("dtype,bs,ppt,ppp", [(jnp.float32, 4, 1, 2), (jnp.bfloat16, 8, None, None)])
def test_paged_mla_attention_matches_reference(dtype, bs, ppt, ppp):
    r = np.random.RandomState(bs)
    B, H, Lr, R, NB = 4, 4, 16, 8, 30
    lengths = [1, bs, 3 * bs + 1, 0]
    W = -(-max(lengths) // bs)
    pool = randn(r, (NB, 2, 1, bs, 1, Lr + R), dtype)
    q = randn(r, (B, H, Lr + R), dtype)
    table, lens = _tables(r, B, W, NB), jnp.asarray(lengths, jnp.int32)
    kw = dict(layer=0, kv_lora_rank=Lr, scale=0.2, pages_per_tile=ppt, pages_per_partition=ppp)
    got = jax.jit(functools.partial(paged_mla_attention, interpret=INTERPRET, **kw))(q, pool, table, lens)
    assert got.shape == (B, H, Lr)
    want = ref_paged_mla_attention(q, pool, table, lens, **kw)
    close(got, want, dtype)
    total = sum(-(-n // bs) for n in lengths) + 3  # the ragged reference, padded
    close(jax.jit(functools.partial(ref_paged_mla_attention, total_blocks=total, **kw))(q, pool, table, lens), want,
          dtype)


def test_mla_prefill_reference_is_each_token_decoded_at_its_own_length():
    """ref_paged_mla_prefill_attention of a packed step (a first chunk, a chunk after cached tokens, a one-token
    chunk, padding) equals the MLA decode reference run per token with the context up to it; padding gives zeros."""
    r = np.random.RandomState(5)
    B, H, Lr, R, NB, bs = 3, 4, 16, 8, 40, 4
    chunks = [(0, 0, 11), (1, 13, 6), (2, 29, 1)]  # (row, first position, tokens)
    rows = np.concatenate([np.full(n, b) for b, _, n in chunks] + [np.full(2, B)]).astype(np.int32)
    pos = np.concatenate([np.arange(p, p + n) for _, p, n in chunks] + [np.zeros(2)]).astype(np.int32)
    pool, q = randn(r, (NB, 2, 1, bs, 1, Lr + R)), randn(r, (len(rows), H, Lr + R)) * 0.3
    table = _tables(r, B, 8, NB)
    kw = dict(layer=1, kv_lora_rank=Lr, scale=0.2)
    got = jax.jit(functools.partial(ref_paged_mla_prefill_attention, **kw))(q, pool, table, jnp.asarray(rows),
                                                                              jnp.asarray(pos))
    assert got.shape == (len(rows), H, Lr)
    real = rows < B
    want = ref_paged_mla_attention(q[real], pool, table[rows[real]], jnp.asarray(pos[real] + 1), **kw)
    close(got[real], want, jnp.float32)
    assert not np.asarray(got[~real]).any()
    with pytest.raises(ValueError, match="rows and positions must be"):
        ref_paged_mla_prefill_attention(q, pool, table, jnp.asarray(rows[:-1]), jnp.asarray(pos), **kw)


def test_paged_attention_rejects_bad_inputs():
    pool = jnp.zeros((8, 2, 2, 4, 2, 8))
    q, table, lens = jnp.zeros((2, 4, 8)), jnp.zeros((2, 3), jnp.int32), jnp.zeros(2, jnp.int32)
    with pytest.raises(ValueError, match="layer 2 outside"):
        paged_attention(q, pool, table, lens, layer=2)
    with pytest.raises(ValueError, match="block_tables must be"):
        paged_attention(q, pool, table[:1], lens, layer=0)
    with pytest.raises(ValueError, match="dtype"):
        paged_attention(q.astype(jnp.bfloat16), pool, table, lens, layer=0)
    with pytest.raises(ValueError, match="multiple of pages_per_tile"):
        paged_attention(q, pool, table, lens, layer=0, pages_per_tile=2, pages_per_partition=3)
    with pytest.raises(ValueError, match="MLA pool"):
        paged_mla_attention(q, pool, table, lens, layer=0, kv_lora_rank=4, scale=1.0)
