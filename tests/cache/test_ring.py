"""A decode step's sliding-window layers over their rings in place (cache/layout.py `ring_table`: each ring a
`PagedKV` whose blocks are `window` tokens) against the dense path (the rings gathered, attended as the model's
dense caches, written back, models/attention.py): the same attention outputs and the same pool after the step,
for rings before and after they wrap, a padding row, K and V of one head dim or two, and snapshot rows taken
or not. Every kernel mode the engine runs: the jnp reference, the native CPU kernel and the Pallas kernel
(interpreted)."""

from __future__ import annotations

import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache.layout import PoolLayout, gather, ring_table, scatter
from jaxserve.models.attention import kv_attention
from jaxserve.models.batch import Batch
from jaxserve.models.cache_spec import CacheGroup, CacheSpec
from jaxserve.models.paged import PagedKV

SLOTS, SNAPS, HQ, HKV = 4, 3, 4, 2
native = pytest.param("native", marks=pytest.mark.skipif(not (shutil.which("g++") or shutil.which("c++")),
                                                         reason="no C++ compiler for the native kernels"))


def step(layout, pool, q, k, v, batch, table, rows, snap, *, dense, window, sinks, kernels):
    """One decode step of the sliding group's two layers (layer 1 after layer 0, as a model runs them)
    -> (outputs [2, B, 1, Hq, Dv], pool)."""
    cache = gather(layout, pool, table, rows, batch.start, dense=dense)
    outs = []
    for i in range(2):
        c = cache[i]
        if isinstance(c, PagedKV) and i:
            c = PagedKV(cache[0].pool, c.table, c.group, c.layer)  # the pool as layer 0 left it
        out, cache[i] = kv_attention(q[i], k[i], v[i], c, batch, scale=0.3, window=window, sinks=sinks,
                                     kernels=kernels)
        outs.append(out)
    outs = jnp.stack(outs)
    return outs, scatter(layout, pool, cache, rows, snap, after=outs)


@pytest.mark.parametrize("kernels", ["reference", native, "interpret"])
@pytest.mark.parametrize("dv", [8, 4])
def test_rings_in_place_equal_the_dense_rings(kernels, dv):
    window, dk = 8, 8
    spec = CacheSpec((CacheGroup("sliding", (0, 1), HKV, dk, dv, window=window),))
    layout = PoolLayout.build(spec, block_size=4, num_blocks=16, num_slots=SLOTS, num_snapshots=SNAPS)
    rng = np.random.default_rng(dv)
    pool = [jnp.asarray(rng.standard_normal(layout.shapes(jnp.float32)[0].shape), jnp.float32)]
    start = np.array([1, 7, 8, 21, 0], np.int32)  # before, at and after a ring's wrap; a padding row
    B = len(start)
    rows = np.array([2, 0, 3, 1, layout.scratch_row], np.int32)
    batch = Batch(jnp.zeros((B, 1), jnp.int32), jnp.asarray(start), jnp.asarray((start > 0).astype(np.int32)))
    table = jnp.zeros((B, 6), jnp.int32)  # the full groups' table: 24 tokens a row
    q = jnp.asarray(rng.standard_normal((2, B, 1, HQ, dk)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, B, 1, HKV, dk)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, B, 1, HKV, dv)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(HQ), jnp.float32)
    for snap in ([SLOTS + 1, layout.scratch_row, SLOTS, layout.scratch_row, layout.scratch_row],
                 [layout.scratch_row] * B):
        snap = jnp.asarray(snap, jnp.int32)
        args = (q, k, v, batch, table, jnp.asarray(rows), snap)
        kw = dict(window=window, sinks=sinks, kernels=kernels)
        want_out, want_pool = step(layout, pool, *args, dense=True, **kw)
        got_out, got_pool = jax.jit(lambda p: step(layout, p, *args, dense=False, **kw))(pool)
        real = start > 0
        np.testing.assert_allclose(np.asarray(got_out)[:, real], np.asarray(want_out)[:, real], rtol=2e-5, atol=2e-5)
        # each written ring as the dense path writes it (its slot for the new token; the others as they were),
        # the snapshots taken: rows other than the scratch row (which padding writes) bit for bit
        keep = np.arange(layout.num_rows) != layout.scratch_row
        np.testing.assert_array_equal(np.asarray(got_pool[0])[keep], np.asarray(want_pool[0])[keep])
        taken = np.asarray(snap) != layout.scratch_row
        np.testing.assert_array_equal(np.asarray(got_pool[0])[np.asarray(snap)[taken]],
                                      np.asarray(got_pool[0])[rows[taken]])


def test_a_step_snapshots_at_most_ring_snapshots_rings(monkeypatch):
    """The first RING_SNAPSHOTS rows that ask have their rings copied into their snapshot rows; the rows past them
    (the scheduler asks for no more, engine/scheduler.py decode_snapshots) and the others are not written."""
    from jaxserve.cache import layout as layout_mod
    monkeypatch.setattr(layout_mod, "RING_SNAPSHOTS", 2)
    a = jnp.arange(10 * 3, dtype=jnp.float32).reshape(10, 3)
    rows, snap = jnp.asarray([0, 1, 2, 3, 4], jnp.int32), jnp.asarray([9, 5, 9, 6, 7], jnp.int32)  # 9: scratch
    got = np.asarray(layout_mod._snapshot(a, rows, snap, 9, jnp.zeros(2)))
    want = np.asarray(a).copy()
    want[5], want[6] = want[1], want[3]  # rows 1 and 3 ask first; row 4's snapshot is past the two
    np.testing.assert_array_equal(got, want)
    got = np.asarray(layout_mod._snapshot(a, rows, snap, 9, jnp.full(2, jnp.nan)))
    np.testing.assert_array_equal(got, np.asarray(a))  # a step whose output is NaN takes none


def test_the_ring_table_names_each_rows_ring_for_every_block():
    got = np.asarray(ring_table(jnp.asarray([3, 0, 6], jnp.int32), capacity=40, window=16))
    np.testing.assert_array_equal(got, [[3, 3, 3], [0, 0, 0], [6, 6, 6]])


@pytest.mark.parametrize("kernels", [native, "reference-paged"])
@pytest.mark.parametrize("dv", [8, 4])
def test_a_chunk_over_its_ring_equals_the_dense_attention(kernels, dv):
    """A prefill chunk of a sliding layer laid out in a scratch pool with the ring before it and attended by paged
    prefill attention (models/attention.py `ring_prefill`: the native kernel; "reference-paged": the same layout
    with that kernel's jnp reference) equals the dense path's attention over ring and chunk, for rows that start
    fresh, before the ring is full, after it wraps, chunks longer than the window and padding tokens; the rings
    after the chunk are the dense path's."""
    from jaxserve.models import attention
    window, dk, T = 8, 8, 11
    rng = np.random.default_rng(dv + 10)
    start = np.array([0, 5, 8, 30], np.int32)
    lengths = np.array([11, 4, 11, 7], np.int32)
    B = len(start)
    batch = Batch(jnp.zeros((B, T), jnp.int32), jnp.asarray(start), jnp.asarray(lengths))
    ring = {"k": jnp.asarray(rng.standard_normal((B, window, HKV, dk)), jnp.float32),
            "v": jnp.asarray(rng.standard_normal((B, window, HKV, dv)), jnp.float32)}
    q = jnp.asarray(rng.standard_normal((B, T, HQ, dk)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((B, T, HKV, dk)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((B, T, HKV, dv)), jnp.float32)
    sinks = jnp.asarray(rng.standard_normal(HQ), jnp.float32)
    kw = dict(scale=0.3, window=window, sinks=sinks)
    want, want_ring = kv_attention(q, k, v, ring, batch, kernels="reference", **kw)
    if kernels == "reference-paged":
        got, got_ring = attention.ring_prefill(q, k, v, ring, batch, kernels="reference", **kw), want_ring
    else:
        got, got_ring = jax.jit(lambda q: kv_attention(q, k, v, ring, batch, kernels=kernels, **kw))(q)
    real = np.arange(T)[None, :] < lengths[:, None]
    np.testing.assert_allclose(np.asarray(got)[real], np.asarray(want)[real], rtol=2e-5, atol=2e-5)
    for name in ("k", "v"):
        np.testing.assert_array_equal(np.asarray(got_ring[name]), np.asarray(want_ring[name]))
