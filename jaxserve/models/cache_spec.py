"""Cache groups: what a model keeps per request, described without reference to the architecture.

  full     block-level KV that grows with the sequence (GQA K+V per KV head; MLA latent + rope key, one "head")
  sliding  KV of sliding-window layers: only the last `window` tokens are ever needed
  linear   fixed-size per-request state of linear-attention layers (short-conv inputs + recurrent state)

The engine sizes cache blocks and the transfer layer sizes messages from these numbers alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax.numpy as jnp
import numpy as np

from .config import GDNSpec, GQASpec, KDASpec, MLASpec, ModelConfig


@dataclass(frozen=True)
class CacheGroup:
    kind: Literal["full", "sliding", "linear"]
    layers: tuple[int, ...]
    kv_heads: int = 0
    k_dim: int = 0
    v_dim: int = 0  # 0: values are read from the key storage (MLA latent)
    window: int | None = None
    conv_shape: tuple[int, int] | None = None  # (K - 1, channels)
    ssm_shape: tuple[int, int, int] | None = None  # (heads, Dk, Dv), kept in float32

    def span(self, lo: int, hi: int) -> tuple[int, int]:
        """This group's layer indices [j0, j1) that are model layers in [lo, hi) (j0 == j1: none)."""
        js = [j for j, layer in enumerate(self.layers) if lo <= layer < hi]
        return (js[0], js[-1] + 1) if js else (0, 0)

    def token_bytes(self, itemsize: int) -> int:
        """Bytes per token per layer of this group (attention groups)."""
        return self.kv_heads * (self.k_dim + self.v_dim) * itemsize

    def state_bytes(self, itemsize: int) -> int:
        """Fixed bytes per request per layer (linear groups): conv inputs in the model dtype, state in float32."""
        if self.kind != "linear":
            return 0
        return int(np.prod(self.conv_shape)) * itemsize + int(np.prod(self.ssm_shape)) * 4

    def bytes_for(self, num_tokens: int, itemsize: int) -> int:
        """Bytes this group holds for one request of `num_tokens` tokens (what decode needs after prefill)."""
        n = len(self.layers)
        if self.kind == "full":
            return n * num_tokens * self.token_bytes(itemsize)
        if self.kind == "sliding":
            return n * min(num_tokens, self.window) * self.token_bytes(itemsize)
        return n * self.state_bytes(itemsize)


@dataclass(frozen=True)
class CacheSpec:
    groups: tuple[CacheGroup, ...]

    def bytes_for(self, num_tokens: int, itemsize: int) -> int:
        return sum(g.bytes_for(num_tokens, itemsize) for g in self.groups)

    def transfer_bytes(self, num_tokens: int, block_size: int, itemsize: int, skip_blocks: int = 0) -> int:
        """Bytes a prefill instance sends decode after `num_tokens` tokens: whole blocks of full-attention layers
        (minus the `skip_blocks` decode already holds), the whole ring of sliding layers, the linear state."""
        nb = -(-num_tokens // block_size) - skip_blocks
        out = 0
        for g in self.groups:
            n = len(g.layers)
            if g.kind == "full":
                out += n * nb * block_size * g.token_bytes(itemsize)
            elif g.kind == "sliding":
                out += n * g.window * g.token_bytes(itemsize)
            else:
                out += n * g.state_bytes(itemsize)
        return out

    def group_of(self, layer: int) -> CacheGroup:
        for g in self.groups:
            if layer in g.layers:
                return g
        raise KeyError(layer)


def _signature(mixer):
    if isinstance(mixer, GQASpec):
        return ("sliding" if mixer.window else "full", mixer.num_kv_heads, mixer.head_dim, mixer.v_head_dim,
                mixer.window, None, None)
    if isinstance(mixer, MLASpec):
        return ("full", 1, mixer.kv_lora_rank + mixer.qk_rope_head_dim, 0, None, None, None)
    if isinstance(mixer, GDNSpec):
        return ("linear", 0, 0, 0, None, (mixer.conv_kernel - 1, mixer.conv_dim),
                (mixer.num_v_heads, mixer.head_k_dim, mixer.head_v_dim))
    if isinstance(mixer, KDASpec):
        return ("linear", 0, 0, 0, None, (mixer.conv_kernel - 1, mixer.conv_dim),
                (mixer.num_heads, mixer.head_dim, mixer.head_dim))
    raise TypeError(type(mixer))


def cache_spec(cfg: ModelConfig) -> CacheSpec:
    by_sig: dict[tuple, list[int]] = {}
    for i, layer in enumerate(cfg.layers):
        by_sig.setdefault(_signature(layer.mixer), []).append(i)
    groups = []
    for (kind, heads, kd, vd, window, conv, ssm), layers in by_sig.items():
        groups.append(CacheGroup(kind, tuple(layers), heads, kd, vd, window, conv, ssm))
    return CacheSpec(tuple(sorted(groups, key=lambda g: g.layers[0])))


def init_dense_cache(cfg: ModelConfig, batch_size: int, capacity: int, dtype) -> list[dict]:
    """Zeroed dense per-request cache, one dict per layer (layouts in attention.py / linear_attention.py)."""
    spec = cache_spec(cfg)
    out = []
    for i in range(cfg.num_layers):
        g = spec.group_of(i)
        if g.kind == "linear":
            out.append({"conv": jnp.zeros((batch_size,) + g.conv_shape, dtype),
                        "ssm": jnp.zeros((batch_size,) + g.ssm_shape, jnp.float32)})
        elif g.v_dim == 0:
            out.append({"kv": jnp.zeros((batch_size, capacity, 1, g.k_dim), dtype)})
        else:
            S = g.window if g.kind == "sliding" else capacity
            out.append({"k": jnp.zeros((batch_size, S, g.kv_heads, g.k_dim), dtype),
                        "v": jnp.zeros((batch_size, S, g.kv_heads, g.v_dim), dtype)})
    return out
