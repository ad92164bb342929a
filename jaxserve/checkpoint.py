"""Checkpoint formats: Hugging Face safetensors directories and jaxserve's Orbax conversion of them.

An Orbax checkpoint directory holds `jaxserve_checkpoint.json` (format marker, dtype, state layout), the
original `config.json` and tokenizer files, and `params/` (an Orbax StandardCheckpointer tree of the model
state). Restoring reads every array straight into its target sharding on the mesh. `LAYOUT` numbers the
state's layout (2: linear weights [in, out]); a checkpoint of another layout is refused with what to do.
"""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import Mesh

from .models.config import ModelConfig
from .models.loader import load_state, state_shardings
from .models.safetensors_io import CheckpointError

MARKER = "jaxserve_checkpoint.json"
LAYOUT = 2  # 1 (unmarked): linear weights [out, in] as in Hugging Face checkpoints; 2: [in, out]
_COPIED = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
           "special_tokens_map.json", "chat_template.jinja", "chat_template.json")


def _checkpointer():
    """Orbax's checkpointer, imported here: Orbax takes ~0.35 s to import, and a process loading a Hugging Face
    checkpoint (most worker starts) never needs it."""
    import orbax.checkpoint as ocp
    return ocp.StandardCheckpointer()


def is_orbax(model_dir: str) -> bool:
    return os.path.isfile(os.path.join(model_dir, MARKER))


def convert(hf_dir: str, out_dir: str, cfg: ModelConfig, dtype: str = "bfloat16", progress: bool = True) -> str:
    """Write `hf_dir` as an Orbax checkpoint in `dtype` to `out_dir` (which must not exist or be empty)."""
    if os.path.exists(out_dir) and os.listdir(out_dir):
        raise FileExistsError(f"{out_dir}: exists and is not empty")
    graphdef, state = load_state(hf_dir, cfg, jnp.dtype(dtype), progress=progress)
    os.makedirs(out_dir, exist_ok=True)
    ckptr = _checkpointer()
    ckptr.save(os.path.abspath(os.path.join(out_dir, "params")), nnx.to_pure_dict(state))
    ckptr.wait_until_finished()
    for name in _COPIED:
        src = os.path.join(hf_dir, name)
        if os.path.isfile(src):
            shutil.copy2(src, os.path.join(out_dir, name))
    with open(os.path.join(out_dir, MARKER), "w") as f:
        json.dump({"format": "orbax", "dtype": dtype, "layout": LAYOUT, "source": os.path.abspath(hf_dir)}, f,
                  indent=1)
    return out_dir


def restore(model_dir: str, cfg: ModelConfig, dtype, mesh: Mesh | None = None):
    """Restore an Orbax checkpoint into (graphdef, state), each array placed on its target sharding."""
    with open(os.path.join(model_dir, MARKER)) as f:
        layout = json.load(f).get("layout", 1)
    if layout != LAYOUT:
        raise CheckpointError(f"{model_dir}: an Orbax checkpoint of state layout {layout}, written by an earlier "
                              f"jaxserve; this one reads layout {LAYOUT}: convert the source checkpoint again "
                              "(`jaxserve convert SRC OUT`)")
    if mesh is None:
        mesh = jax.make_mesh((1,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,))
    graphdef, abs_state, target = state_shardings(cfg, jnp.dtype(dtype), mesh)
    ckptr = _checkpointer()
    restored = ckptr.restore(os.path.abspath(os.path.join(model_dir, "params")), target)
    nnx.replace_by_pure_dict(abs_state, restored)
    return graphdef, abs_state


def load_any(model_dir: str, cfg: ModelConfig, dtype, mesh: Mesh | None = None, progress: bool = True):
    """Load either format into (graphdef, state)."""
    if is_orbax(model_dir):
        return restore(model_dir, cfg, dtype, mesh)
    return load_state(model_dir, cfg, jnp.dtype(dtype), mesh=mesh, progress=progress)
