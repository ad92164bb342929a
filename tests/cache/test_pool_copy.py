"""The one-pass copy out of a store's pool (cache/pool_copy.py) against numpy: a pool of a full-attention group
(bfloat16, carried as uint16 bits like the store's segment), a sliding-window group and a linear-state group,
copied from a store pool of other block and row counts. Only the named blocks and the state row change, for
every prefix length one compiled program serves, including the longest."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.cache.pool_copy import PoolCopy

KINDS = ("full", "sliding", "linear")
MAX_BLOCKS = 6


def pools(rng, blocks: int, rows: int, wire: bool) -> list:
    """A pool pytree with random contents: the full group [blocks, 2, 2, 4, 2, 8] bfloat16 (its uint16 bits when
    `wire`), the sliding ring [rows, 2, 2, 8, 2, 8] and the linear state {conv, ssm} [rows, 2, ...] float32."""
    full = rng.standard_normal((blocks, 2, 2, 4, 2, 8)).astype(np.float32)
    full = jnp.asarray(full, jnp.bfloat16)
    return [jax.lax.bitcast_convert_type(full, jnp.uint16) if wire else full,
            jnp.asarray(rng.standard_normal((rows, 2, 2, 8, 2, 8)), jnp.float32),
            {"conv": jnp.asarray(rng.standard_normal((rows, 2, 3, 16)), jnp.float32),
             "ssm": jnp.asarray(rng.standard_normal((rows, 2, 2, 8, 8)), jnp.float32)}]


def test_only_the_named_blocks_and_row_change_for_every_length():
    rng = np.random.default_rng(0)
    mine = pools(rng, 10, 4, wire=False)
    store = pools(rng, 32, 7, wire=True)  # the store's pool: more blocks and rows, bfloat16 as its bits
    copy = PoolCopy(KINDS, MAX_BLOCKS, mine)
    assert not copy.ready(store, 1)
    assert copy.compile(store) == 1 and copy.compile(store) == 0
    assert copy.ready(store, MAX_BLOCKS) and not copy.ready(store, MAX_BLOCKS + 1)
    bits = lambda x: np.array(jax.lax.bitcast_convert_type(x, jnp.uint16))  # noqa: E731 - a writable copy
    for n in (1, 3, MAX_BLOCKS):
        before = jax.tree.map(np.asarray, mine)
        src_blocks = rng.choice(32, n, replace=False).tolist()
        blocks = rng.choice(10, n, replace=False).tolist()
        src_row, row = int(rng.integers(7)), int(rng.integers(4))
        mine = copy.copy(mine, store, src_blocks, blocks, src_row, row)
        want_full = bits(jnp.asarray(before[0]))
        want_full[blocks] = np.asarray(store[0])[src_blocks]
        np.testing.assert_array_equal(bits(mine[0]), want_full)  # bit for bit; the rest untouched
        want_ring = before[1].copy()
        want_ring[row] = np.asarray(store[1])[src_row]
        np.testing.assert_array_equal(np.asarray(mine[1]), want_ring)
        for k in ("conv", "ssm"):
            want = before[2][k].copy()
            want[row] = np.asarray(store[2][k])[src_row]
            np.testing.assert_array_equal(np.asarray(mine[2][k]), want)
        per_block = 2 * 2 * 4 * 2 * 8 * 2  # bytes of one block of the full group (uint16)
        per_row = (2 * 2 * 8 * 2 * 8 + 2 * 3 * 16 + 2 * 2 * 8 * 8) * 4
        assert copy.nbytes(store, n, True) == n * per_block + per_row
        assert copy.nbytes(store, n, False) == n * per_block
    assert len(copy) == 1  # one program for every length


def test_a_store_of_other_shapes_needs_its_own_program():
    rng = np.random.default_rng(1)
    mine, store = pools(rng, 10, 4, wire=False), pools(rng, 32, 7, wire=True)
    copy = PoolCopy(KINDS, MAX_BLOCKS, mine)
    copy.compile(store)
    other = pools(rng, 48, 7, wire=True)
    assert not copy.ready(other, 1)
    with pytest.raises(KeyError):
        copy.copy(mine, other, [0], [0], 0, 0)
