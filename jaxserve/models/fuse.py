"""Projections of one input fused at load time: a GQA layer's Q, K and V into one product, a dense MLP's gate and
up into one.

A decode step's few rows make every product a read of its weight; XLA reads a small weight well below the
memory's rate (on an H200 a 4096 x 1024 K projection at one row ran inside the KV write's loop fusion, ~75 us a
layer: ../shared/gpu/README.md), and three products read their input three times. Fused, a layer makes two
products where it made five. The checkpoint, and the state saved from it, keep the parts: `fuse` rewrites a loaded
model in place, part weights concatenated and then deleted, so the peak is one layer's parts more than the
weights.

Tensor parallel: each part is sharded on its output features, so the fused weight holds, per device, that
device's shards of every part side by side ([in, tp, sum of out / tp]); the split after the product is then
local to each device.

Pure functions over NNX modules, at load (not in any step program).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.pallas_kernels.select import select


class Fused(nnx.Module):
    """Linear parts (modules.Linear) of one input as one product: __call__(x) -> the parts' outputs."""

    def __init__(self, parts: list, tp: int):
        self.kernels, self.tp = parts[0].kernels, tp
        self.sizes = tuple(p.weight.shape[1] // tp for p in parts)  # each part's output features per device
        self.weight = nnx.Param(_concat([p.weight[...] for p in parts], tp))
        self.has_bias = parts[0].has_bias
        if self.has_bias:
            self.bias = nnx.Param(_concat([p.bias[...][None] for p in parts], tp)[0])

    def __call__(self, x):  # x [..., in] -> per part [..., out_i]
        y = select("matmul", self.kernels)(x, self.weight[...])
        if self.has_bias:
            y = y + self.bias[...]
        lead = y.shape[:-1]
        y = y.reshape(*lead, self.tp, -1)
        cuts = [sum(self.sizes[:i + 1]) for i in range(len(self.sizes) - 1)]
        return [part.reshape(*lead, -1) for part in jnp.split(y, cuts, axis=-1)]


def _concat(ws: list, tp: int):
    """[in, out_i] weights -> [in, sum out_i], per device shard the parts' shards side by side; the parts are
    deleted (their memory freed) once it is made."""
    d_in = ws[0].shape[0]
    out = jnp.concatenate([w.reshape(d_in, tp, -1) for w in ws], axis=2).reshape(d_in, -1)
    sh = getattr(ws[0], "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
        out = jax.device_put(out, sh)  # the parts' sharding: on the output features (or replicated)
    for w in ws:
        if isinstance(w, jax.Array) and not w.is_deleted():
            w.delete()
    return out


def fuse(model, tp: int) -> int:
    """Fuse `model`'s GQA Q/K/V and dense-MLP gate/up projections in place -> the number fused."""
    from .attention import GQAAttention
    from .modules import MLP
    n = 0
    even = lambda parts: all(p.weight.shape[1] % tp == 0 for p in parts)  # noqa: E731  (else some replicated)
    for layer in model.layers:
        mixer, mlp = layer.mixer, layer.mlp
        if isinstance(mixer, GQAAttention) and not hasattr(mixer, "qkv"):
            parts = [mixer.q_proj, mixer.k_proj, mixer.v_proj]
            if even(parts):
                mixer.qkv = Fused(parts, tp)
                del mixer.q_proj, mixer.k_proj, mixer.v_proj
                n += 1
        if isinstance(mlp, MLP) and not hasattr(mlp, "gate_up") and even([mlp.gate_proj, mlp.up_proj]):
            mlp.gate_up = Fused([mlp.gate_proj, mlp.up_proj], tp)
            del mlp.gate_proj, mlp.up_proj
            n += 1
    return n
