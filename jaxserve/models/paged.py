"""A full-attention layer's view of the engine's block pool: its cache without a copy of the whole group.

The engine hands each layer of a full cache group a `PagedKV`: the group's pool array
[num_blocks, layers_in_group, E, block_size, kv_heads, D] (cache/layout.py), the batch's block tables and
the layer's index in the group. The layer writes its new tokens' K/V (or MLA latent) into the blocks, then
  decode   attends with paged attention (pallas_kernels/paged_attention.py), which reads the blocks in place;
  prefill  (`dense`) attends over a dense copy of its own layer's blocks (`view`): the chunk's own keys for a
           first chunk, which reads nothing; or (`dense` and `inplace`, the native kernels) with paged prefill
           attention, each token of the [B, T] chunk over its row's blocks in place up to itself: its cost
           follows the context, not the table's width, so a first chunk and a chunk after cached tokens share
           one program; or, paged (not `dense`, a packed batch: the native kernels), writes the packed tokens
           (`write_packed`) and attends with paged prefill attention likewise.
Layers of one group share the array: the model passes each layer the array the previous one returned, and a
scan over a run of layers carries it (the layer index traced), so a program has one write and one read per
run, not per layer. In switch mode, where layers of several classes write one pool (models/model.py
`_switch_scan`), a layer's write can be deferred: `deferred="capture"` records the scatter in `pending` instead
of doing it, `deferred="written"` skips it (the pool already holds the step's entries).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp

from .batch import Batch


@jax.tree_util.register_dataclass
@dataclass
class PagedKV:
    pool: jax.Array  # [NB, L, E, bs, Hkv, D] the layer's cache group
    table: jax.Array  # [B, W] int32 block ids per request
    group: int = field(metadata=dict(static=True))  # index of the group in the pool list
    layer: int | jax.Array  # index of this layer within the group (traced where a scan runs the layers)
    # a bound on the blocks the batch holds (sum over rows of ceil(length / block_size)): the reference
    # attention then gathers only those (pallas_kernels/paged_attention.py); None: table width per row
    total_blocks: int | None = field(default=None, metadata=dict(static=True))
    dense: bool = field(default=False, metadata=dict(static=True))  # prefill: attend over `view`
    inplace: bool = field(default=False, metadata=dict(static=True))  # dense prefill over the pool in place instead
    # decode after an attention-level migration (models/split.py): the moved heads, each row's length when it
    # moved [B], the migration's id [] int32 and each row's index in the helper's group [B]
    split: object = field(default=None, metadata=dict(static=True))  # HeadSplit
    since: jax.Array | None = None
    mid: jax.Array | None = None
    gidx: jax.Array | None = None
    deferred: str | None = field(default=None, metadata=dict(static=True))  # None, "capture" or "written"
    pending: tuple | None = None  # captured: (blocks [M], offsets [M], entries [M, E, Hkv, D]) for `scatter`

    def split_key(self):
        """[3] int32: the migration, this cache group, this layer in it (models/split.py `remote_partial`)."""
        return jnp.stack([self.mid, jnp.int32(self.group), jnp.asarray(self.layer, jnp.int32)])

    @staticmethod
    def pack(k, v, entries: int):
        """k [B, T, Hkv, Dk], v [B, T, Hkv, Dv] -> the pool's entries [B, T, E, Hkv, D]: 2 (K and V), or 1 with K
        and V concatenated on D (head dims that differ)."""
        if entries == 2:
            return jnp.stack([k, v], axis=2)
        return jnp.concatenate([k, v.astype(k.dtype)], axis=-1)[:, :, None]

    @staticmethod
    def unpack(x, k_dim: int):
        """`view`'s [B, E, S, Hkv, D] -> (k [B, S, Hkv, Dk], v [B, S, Hkv, Dv]), the inverse of `pack`."""
        return (x[:, 0], x[:, 1]) if x.shape[1] == 2 else (x[:, 0, ..., :k_dim], x[:, 0, ..., k_dim:])

    def view(self):
        """The layer's blocks of the batch as a dense cache [B, E, W * block_size, Hkv, D]."""
        x = self.pool[self.table, self.layer]  # [B, W, E, bs, Hkv, D]
        B, W, E, bs = x.shape[:4]
        return jnp.swapaxes(x, 1, 2).reshape((B, E, W * bs) + x.shape[4:])

    def write(self, vals, batch: Batch) -> "PagedKV":
        """Store vals [B, T, E, Hkv, D] at the batch's positions (padding tokens are dropped)."""
        NB, _, _, bs = self.pool.shape[:4]
        pos = batch.positions
        blk = jnp.take_along_axis(self.table, jnp.clip(pos // bs, 0, self.table.shape[1] - 1), axis=1)
        blk = jnp.where(batch.valid, blk, NB)
        return self._store(blk, pos % bs, vals)

    def write_packed(self, vals, rows, positions) -> "PagedKV":
        """Store vals [N, E, Hkv, D] of packed tokens at their rows [N] and positions [N] (rows outside the table,
        padding, are dropped)."""
        NB, _, _, bs = self.pool.shape[:4]
        B, W = self.table.shape
        blk = self.table[jnp.minimum(rows, B - 1), jnp.clip(positions // bs, 0, W - 1)]
        blk = jnp.where(rows < B, blk, NB)
        return self._store(blk, positions % bs, vals)

    def _store(self, blk, off, vals) -> "PagedKV":
        """vals [..., E, Hkv, D] into blocks blk [...] (NB: dropped) at offsets off [...], or as `deferred` says."""
        if self.deferred == "written":
            return self
        vals = vals.astype(self.pool.dtype)
        if self.deferred == "capture":
            entry = self.pool.shape[2:3] + self.pool.shape[4:]  # (E, Hkv, D)
            vals = jnp.broadcast_to(vals, blk.shape + entry).reshape((-1,) + entry)
            return replace(self, pending=(blk.reshape(-1), off.reshape(-1), vals))
        return replace(self, pool=scatter(self.pool, self.layer, blk, off, vals))

    @staticmethod
    def packed(batch: Batch):
        """A [B, T] chunk's tokens as paged prefill attention takes them: (rows [B * T], positions [B * T]) int32,
        padding tokens at row B (outside the table: their outputs are zeros)."""
        B, T = batch.tokens.shape
        rows = jnp.where(batch.valid, jnp.arange(B, dtype=jnp.int32)[:, None], B)
        return rows.reshape(B * T), batch.positions.reshape(B * T).astype(jnp.int32)

    @staticmethod
    def lengths(batch: Batch):
        """[B] tokens in the cache after this step; 0 for rows with nothing to attend (idle decode slots)."""
        if batch.tokens.shape[1] != 1:
            raise ValueError("paged attention runs one token per request (decode)")
        return jnp.where(batch.lengths > 0, batch.end, 0)


def scatter(pool, layer, blk, off, vals):
    """pool [NB, L, E, bs, Hkv, D] with vals [..., E, Hkv, D] at its layer `layer`, blocks blk [...] and offsets
    off [...] (a block NB, out of range, drops its entry)."""
    return pool.at[blk, layer, :, off].set(vals, mode="drop")
