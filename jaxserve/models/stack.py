"""Layers run as one `lax.scan`: runs of identical layers with their weights stacked.

A run is two or more consecutive layers with equal specs (config.py `LayerSpec`): the same modules with weights
of the same shapes. Their weights are stacked once, on a new leading axis, and a step program runs the run as
one scan over the stack (`CausalLM.run_layers`), so XLA compiles the layer body once instead of once per layer
(SmolLM2-135M, 30 layers: a prefill program compiles in half the time, a decode program in a quarter, with the
same step time and the same numbers). A slice of a stacked weight outside a scan is a copy, so every program
that runs a run's layers scans them.

`LayerStack.stack` turns a model state into params `(rest, stacks)`: the state without the stacked layers,
and per run the stacked state of its layers (the only copy of those weights). `LayerStack.merge`, inside a
jitted program, makes the whole model from them: the stacked layers get slices of their stacks, which only
a path that does not scan would read (XLA drops them otherwise).

Pure functions over pytrees.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
from flax import nnx

from .config import ModelConfig


def layer_runs(cfg: ModelConfig) -> tuple[tuple[int, int], ...]:
    """Maximal runs [lo, hi) of two or more consecutive layers with equal specs."""
    runs, lo = [], 0
    for i in range(1, cfg.num_layers + 1):
        if i == cfg.num_layers or cfg.layers[i] != cfg.layers[lo]:
            if i - lo >= 2:
                runs.append((lo, i))
            lo = i
    return tuple(runs)


def _stack(xs):
    """Stack arrays on a new leading axis, keeping their sharding (the new axis unsharded)."""
    out = jnp.stack(xs)
    sh = getattr(xs[0], "sharding", None)
    if isinstance(sh, jax.sharding.NamedSharding):
        out = jax.device_put(out, jax.sharding.NamedSharding(sh.mesh, jax.sharding.PartitionSpec(None, *sh.spec)))
    return out


@dataclass(frozen=True)
class LayerStack:
    runs: tuple[tuple[int, int], ...]  # () : nothing stacked, every layer runs on its own

    def run_of(self, i: int) -> tuple[int, int] | None:
        return next((r for r in self.runs if r[0] <= i < r[1]), None)

    def stack(self, state: nnx.State) -> tuple[nnx.State, list]:
        """A model state -> params (rest, stacks). The stacks are new arrays: drop `state` to free the originals."""
        layers = state["layers"]
        stacks = [jax.tree.map(lambda *xs: _stack(xs), *[layers[i] for i in range(lo, hi)]) for lo, hi in self.runs]
        stacked = {i for lo, hi in self.runs for i in range(lo, hi)}
        rest = nnx.State({k: v for k, v in state.items() if k != "layers"})
        rest["layers"] = nnx.State({i: layers[i] for i in layers.keys() if i not in stacked})
        return rest, stacks

    def merge(self, graphdef, params):
        """(model, {run: (graphdef of one layer, stacked state)}) from params (inside a jitted program)."""
        rest, stacks = params
        layers = dict(rest["layers"].items())
        for (lo, hi), st in zip(self.runs, stacks):
            for i in range(lo, hi):
                layers[i] = jax.tree.map(lambda a, j=i - lo: a[j], st)
        state = nnx.State({k: v for k, v in rest.items() if k != "layers"})
        state["layers"] = nnx.State({i: layers[i] for i in sorted(layers)})
        model = nnx.merge(graphdef, state)
        return model, {(lo, hi): (nnx.split(model.layers[lo])[0], st) for (lo, hi), st in zip(self.runs, stacks)}
