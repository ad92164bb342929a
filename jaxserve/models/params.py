"""Parameter declaration: every weight says where it comes from in a checkpoint and how it shards.

A module creates its weights with `declare(...)`, which records a `ParamInfo` next to the `nnx.Param`:
the checkpoint tensor name(s) (with alternatives, since hub checkpoints and `save_pretrained` sometimes
spell the same tensor differently), how several tensors combine (stacked experts, concatenated conv
channels), an optional axis permutation (HF linear weights are [out, in], kept [in, out]; experts [E, in, out]
for grouped matmuls), and the axis sharded over the tensor-parallel mesh axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import jax.numpy as jnp
from flax import nnx


@dataclass(frozen=True)
class ParamInfo:
    pieces: tuple[tuple[str, ...], ...]  # one entry per source tensor; each lists alternative names
    combine: Literal["one", "stack", "concat0"] = "one"
    perm: tuple[int, ...] | None = None  # permutation applied to each source tensor
    tp_axis: int | None = None  # axis of the (combined) parameter sharded over the "tp" mesh axis
    fp32: bool = False  # kept in float32 whatever the model dtype (router biases, decay logs)

    @property
    def primary_name(self) -> str:
        return self.pieces[0][0]


def names(*alternatives: str) -> tuple[str, ...]:
    return tuple(alternatives)


def declare(module: nnx.Module, attr: str, shape: tuple[int, ...], dtype, info: ParamInfo, init=0.0):
    """Create `module.<attr>` as an nnx.Param of `shape` and record its ParamInfo on the module."""
    dt = jnp.float32 if info.fp32 else dtype
    setattr(module, attr, nnx.Param(jnp.full(shape, init, dt)))
    rules = dict(getattr(module, "param_infos", ()))
    rules[attr] = info
    module.param_infos = tuple(sorted(rules.items()))


def collect_param_infos(model: nnx.Module) -> dict[tuple, ParamInfo]:
    """Map every parameter path in `model`'s state to its ParamInfo."""
    out: dict[tuple, ParamInfo] = {}
    for path, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for attr, info in getattr(node, "param_infos", ()):
                out[tuple(path) + (attr,)] = info
    return out
