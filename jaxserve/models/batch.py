"""Batch metadata passed explicitly to every layer (never a global).

A forward step processes, for each of B sequences, `lengths[b]` new tokens (right-padded to T) that
follow `start[b]` tokens already held in the cache. Prefill is start=0; a decode step is T=1; chunked
prefill is anything in between.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp


@jax.tree_util.register_dataclass
@dataclass
class Batch:
    tokens: jax.Array  # [B, T] int32, right-padded
    start: jax.Array  # [B] int32: tokens of this sequence already in the cache
    lengths: jax.Array  # [B] int32: valid new tokens (<= T)

    @property
    def positions(self):  # [B, T] int32
        return self.start[:, None] + jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :]

    @property
    def valid(self):  # [B, T] bool
        return jnp.arange(self.tokens.shape[1], dtype=jnp.int32)[None, :] < self.lengths[:, None]

    @property
    def end(self):  # [B] int32: cache length after this step
        return self.start + self.lengths
