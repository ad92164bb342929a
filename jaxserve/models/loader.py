"""Load a Hugging Face checkpoint directory into the model's state pytree.

The model is built abstractly (no allocation), every parameter's `ParamInfo` says which checkpoint
tensors make it; each is read from the memory-mapped safetensors files, checked, cast and placed on its
target sharding (replicated, or split over the mesh's "tp" axis). Errors name the tensor and the shapes.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from jax.sharding import Mesh, NamedSharding, PartitionSpec
from tqdm.auto import tqdm

from .config import ModelConfig
from .model import CHECKPOINT_ALIASES, abstract_model
from .params import ParamInfo, collect_param_infos
from .safetensors_io import CheckpointError, TensorIndex


def param_sharding(info: ParamInfo, shape: tuple[int, ...], mesh: Mesh | None):
    if mesh is None:
        return None
    spec = [None] * len(shape)
    tp = mesh.shape.get("tp", 1)
    if info.tp_axis is not None and tp > 1 and shape[info.tp_axis] % tp == 0:
        spec[info.tp_axis] = "tp"
    return NamedSharding(mesh, PartitionSpec(*spec))


def _inverse_perm_shape(shape, perm):
    if perm is None:
        return tuple(shape)
    out = [0] * len(shape)
    for i, p in enumerate(perm):
        out[p] = shape[i]
    return tuple(out)


class _Reader:
    def __init__(self, model_dir: str, model_type: str):
        self.dir = model_dir
        self.index = TensorIndex(model_dir)
        self.aliases = CHECKPOINT_ALIASES.get(model_type, ())

    def resolve(self, alternatives: tuple[str, ...]) -> str | None:
        for name in alternatives:
            if name in self.index:
                return name
            for pat, rep in self.aliases:
                alt = re.sub(pat, rep, name)
                if alt != name and alt in self.index:
                    return alt
        return None

    def read(self, alternatives: tuple[str, ...], expected: tuple[int, ...]) -> np.ndarray:
        name = self.resolve(alternatives)
        if name is None:
            raise CheckpointError(f"{self.dir}: missing tensor {alternatives[0]!r} (expected shape {list(expected)})")
        found = self.index.shape(name)
        if tuple(found) != tuple(expected):
            raise CheckpointError(f"{self.dir}: tensor {name!r} has shape {list(found)}, expected {list(expected)}")
        return self.index.get(name)

    def assemble(self, info: ParamInfo, shape: tuple[int, ...]) -> np.ndarray:
        if info.combine == "one":
            arr = self.read(info.pieces[0], _inverse_perm_shape(shape, info.perm))
            return arr.transpose(info.perm) if info.perm else arr
        if info.combine == "stack":
            if len(info.pieces) != shape[0]:
                raise CheckpointError(f"{self.dir}: {len(info.pieces)} tensors for a stack of {shape[0]}")
            piece_shape = _inverse_perm_shape(shape[1:], info.perm)
            out = None
            for i, alts in enumerate(info.pieces):
                arr = self.read(alts, piece_shape)
                if out is None:
                    out = np.empty(shape, arr.dtype)
                out[i] = arr.transpose(info.perm) if info.perm else arr
            return out
        n = len(info.pieces)
        piece_shape = (shape[0] // n,) + tuple(shape[1:])
        return np.concatenate([self.read(alts, piece_shape) for alts in info.pieces], axis=0)


def load_state(model_dir: str, cfg: ModelConfig, dtype, mesh: Mesh | None = None, progress: bool = True):
    """Read `model_dir` into (graphdef, state) for `cfg` in `dtype` (float32 / bfloat16)."""
    model = abstract_model(cfg, dtype)
    graphdef, abs_state = nnx.split(model)
    infos = collect_param_infos(model)
    flat = flatten_dict(nnx.to_pure_dict(abs_state))
    reader = _Reader(model_dir, cfg.model_type)
    loaded = {}
    for path, sds in tqdm(flat.items(), desc="loading weights", unit="tensor", disable=not progress):
        info = infos[path]
        arr = reader.assemble(info, tuple(sds.shape))
        arr = np.asarray(arr).astype(jnp.dtype(sds.dtype))
        sharding = param_sharding(info, tuple(sds.shape), mesh)
        loaded[path] = jax.device_put(arr, sharding) if sharding is not None else jnp.asarray(arr)
    nnx.replace_by_pure_dict(abs_state, unflatten_dict(loaded))
    return graphdef, abs_state


def state_shardings(cfg: ModelConfig, dtype, mesh: Mesh):
    """Abstract state with target shardings, for restoring a checkpoint directly onto a mesh."""
    model = abstract_model(cfg, dtype)
    graphdef, abs_state = nnx.split(model)
    infos = collect_param_infos(model)
    flat = flatten_dict(nnx.to_pure_dict(abs_state))
    out = {p: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=param_sharding(infos[p], tuple(s.shape), mesh))
           for p, s in flat.items()}
    return graphdef, abs_state, unflatten_dict(out)
