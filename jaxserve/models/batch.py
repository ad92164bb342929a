"""Batch metadata passed explicitly to every layer (never a global).

A forward step processes, for each of B sequences, `lengths[b]` new tokens (right-padded to T) that
follow `start[b]` tokens already held in the cache. Prefill is start=0; a decode step is T=1; chunked
prefill is anything in between.

Fresh (engine prefill of first chunks only): `fresh` says statically that no row has cached tokens.

Paged prefill (engine prefill with the native kernels, models/paged.py): full-attention layers take the packed
tokens as they are, each with its row and position (`packed_rows`, `packed_positions`).

Packed (engine prefill): with `packed` set, the residual stream holds only the real tokens, N of them in a
row [1, N, ...] (N bucketed, the rest padding), so embeddings, norms, MLPs and MoEs do no work on the [B, T]
padding; GQA attention projects the packed tokens and unpacks only for attention itself; the other mixers
(MLA, linear attention) see their rows as [B, T] (`unpack` before, `pack` after).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class Batch:
    tokens: jax.Array  # [B, T] int32, right-padded (or, as uploaded for a paged prefill, [N] packed: `spread`)
    start: jax.Array  # [B] int32: tokens of this sequence already in the cache
    lengths: jax.Array  # [B] int32: valid new tokens (<= T)
    packed: jax.Array | None = None  # [N] int32: packed token i is [B, T] token packed[i] // T, packed[i] % T,
    #                                   row by row, the real tokens first; B * T marks padding
    # static: every row starts at 0 (nothing cached), so token t of a row sits at position t: full attention
    # then needs no cached keys and its reference skips the key tiles above the diagonal
    fresh: bool = field(default=False, metadata=dict(static=True))

    def pack(self, x):
        """[B, T, ...] -> [1, N, ...] the real tokens in packed order (padding zeros); x itself unpacked."""
        if self.packed is None:
            return x
        flat = x.reshape((-1,) + x.shape[2:])
        flat = jnp.concatenate([flat, jnp.zeros((1,) + flat.shape[1:], flat.dtype)])
        return flat[self.packed][None]

    def spread(self, width: int) -> "Batch":
        """A packed batch whose tokens came as they are packed ([N], what a paged prefill step uploads: not its
        [B, T] padding) -> the same batch with tokens [B, width] (the padding zeros). Otherwise itself."""
        if self.tokens.ndim == 2:
            return self
        B = self.start.shape[0]
        rows = jnp.zeros(B * width + 1, self.tokens.dtype).at[self.packed].set(self.tokens)
        return replace(self, tokens=rows[:B * width].reshape(B, width))

    def unpack(self, x):
        """[1, N, ...] packed -> [B, T, ...] (padding zeros); x itself unpacked."""
        if self.packed is None:
            return x
        B, T = self.tokens.shape
        N = self.packed.shape[0]
        where = jnp.full(B * T + 1, N, jnp.int32).at[self.packed].set(jnp.arange(N, dtype=jnp.int32))[:B * T]
        flat = jnp.concatenate([x[0], jnp.zeros((1,) + x.shape[2:], x.dtype)])
        return flat[where].reshape((B, T) + x.shape[2:])

    def last_tokens(self, x):
        """[B, T, H] or packed [1, N, H] -> [B, 1, H] each row's last token (rows with none: an arbitrary one). Packed
        tokens are in row order (the engine packs row by row), so row b's last is at cumsum(lengths)[b] - 1."""
        if self.packed is None:
            return jnp.take_along_axis(x, jnp.maximum(self.lengths - 1, 0)[:, None, None], axis=1)
        return x[0, jnp.maximum(jnp.cumsum(self.lengths) - 1, 0)][:, None]

    @property
    def positions(self):  # [B, T] int32
        return self.start[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]

    @property
    def packed_rows(self):  # [N] int32: the row of each packed token, B for padding
        return self.packed // self.tokens.shape[1]

    @property
    def packed_positions(self):  # [N] int32: the position of each packed token (0 for padding)
        return self.pack(self.positions)[0]

    @property
    def valid(self):  # [B, T] bool
        return jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :] < self.lengths[:, None]

    @property
    def end(self):  # [B] int32: cache length after this step
        return self.start + self.lengths
