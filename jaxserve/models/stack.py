"""Layers run as one `lax.scan`: runs of identical layers with their weights stacked.

A run is two or more consecutive layers with equal specs (config.py `LayerSpec`): the same modules with weights
of the same shapes. Their weights are stacked once, on a new leading axis, and a step program runs the run as
one scan over the stack (`CausalLM.run_layers`), so XLA compiles the layer body once instead of once per layer
(SmolLM2-135M, 30 layers: a prefill program compiles in half the time, a decode program in a quarter, with the
same step time and the same numbers). A slice of a stacked weight outside a scan is a copy, so every program
that runs a run's layers scans them.

A model of several layer kinds (hybrid: linear and full attention, dense and MoE MLPs) has a run per stretch
of each kind, and XLA compiles a body per run: the bundled Kimi Linear's two runs of three KDA layers compile
twice. On a CPU, where compiling is what a hybrid instance's start waits on, the layers are stacked by class
instead (`layer_classes`: every layer of one spec, wherever it lies) and a step program runs any span of layers
as one scan whose body switches on the layer's class (`Switched`, CausalLM.run_layers): each class's layer
compiled once. A layer-wise prefill's layer groups then share one program per group size, wherever they lie:
the group's first layer is an argument, and each position's class, stack index and cache row are looked up from
it (models/model.py `switch_span`). Not on an accelerator: XLA's GPU runtime reads a conditional's branch on the
host, a sync per layer. Where the classes repeat in a period, each class in one run of consecutive layers of it
(`class_period`: gpt-oss's sliding and full layers; a model whose every class is one run is one period), a span
of whole periods runs as a scan over the periods, the body running the period's runs in turn: each class still
compiles once, and no conditional runs (models/model.py `_period_layers`).

`LayerStack.stack` turns a model state into params `(rest, stacks)`: the state without the stacked layers,
and per run (or class) the stacked state of its layers (the only copy of those weights). `LayerStack.merge`,
inside a jitted program, makes the whole model from them: the stacked layers get slices of their stacks, which
only a path that does not scan would read (XLA drops them otherwise).

Pure functions over pytrees.
"""

from __future__ import annotations

import functools
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


def layer_classes(cfg: ModelConfig) -> tuple[tuple[int, ...], ...]:
    """Every layer grouped by spec, each class its layers in order (classes in order of their first layer)."""
    classes: dict = {}
    for i, spec in enumerate(cfg.layers):
        classes.setdefault(spec, []).append(i)
    return tuple(tuple(c) for c in classes.values())


def layer_stack(cfg: ModelConfig, scan: bool, switch: bool) -> LayerStack:
    """How a model's layers run: scan False, each on its own; else runs of identical layers scanned, or with
    switch (a CPU) a model of several classes as switch-mode scans."""
    if not scan:
        return LayerStack(())
    classes = layer_classes(cfg)
    return LayerStack((), classes) if switch and len(classes) > 1 else LayerStack(layer_runs(cfg))


# XLA options for a class-stacked model's step programs: with XLA's older CPU emitters (the MLIR fusion emitters
# off) the bundled Kimi Linear's compile faster (configs/colocated.yaml's warm-up, 21 programs on 2 cores: 65 s
# against 90 s without them) and run as fast; SmolLM2's (runs of identical layers) compile slower with them
# (local.yaml: ready after 78 s against 49 s, as XLA_FLAGS), so they are these programs' own. XLA after JAX 0.10.2
# has no older emitters ("No such compile option"): there they compile with the defaults
_SWITCH_OPTIONS = {"xla_cpu_use_fusion_emitters": False}


@functools.cache
def switch_compiler_options() -> dict | None:
    """The XLA options of a class-stacked model's step programs, where this XLA takes them (one tiny compile)."""
    try:
        jax.jit(lambda x: x + 1).trace(jnp.zeros(1)).lower().compile(compiler_options=dict(_SWITCH_OPTIONS))
    except jax.errors.JaxRuntimeError:
        return None
    return dict(_SWITCH_OPTIONS)


EXPERTS = frozenset({"w_gate_up", "w_gate", "w_up", "w_down"})  # an MoE layer's expert weights (models/modules.py)


def take_layer(graphdef, stacked, m):
    """Layer m (traced) of a stack, inside a scan: its weights sliced, but an MoE layer's experts left whole in
    their stack [L, E, K, N], the layer told its index (`MoE.stack_at`): its grouped products read each expert
    where it lies, where a slice would copy every expert of the layer at every step (on a CPU, bench.offline's
    gpt-oss-mini: a decode step of 48 requests took 154 ms with those copies, 82 ms without)."""
    def take(path, a):
        return a if any(getattr(k, "key", None) in EXPERTS for k in path) else a[m]
    layer = nnx.merge(graphdef, jax.tree_util.tree_map_with_path(take, stacked))
    for _, module in nnx.iter_modules(layer):
        if hasattr(module, "stack_at"):
            object.__setattr__(module, "stack_at", m)
    return layer


def class_period(classes: tuple[tuple[int, ...], ...]) -> int | None:
    """The shortest period P of the layers' classes (layer i's class that of layer i % P; P = L: the model is one
    period), where each class lies in one run of consecutive layers of the period (gpt-oss: sliding, full;
    Qwen3-Next: 3 linear, 1 full; DeepSeek-V3: 3 dense, 58 MoE, one period); None where there is none (Kimi
    Linear: a first layer of its own, then 3 linear, 1 full)."""
    L = sum(map(len, classes))
    cls = [0] * L
    for c, layers in enumerate(classes):
        for i in layers:
            cls[i] = c
    for P in range(1, L + 1):
        if L % P == 0 and all(cls[i] == cls[i % P] for i in range(L)):
            runs = [cls[k] for k in range(P) if k == 0 or cls[k] != cls[k - 1]]
            return P if len(runs) == len(set(runs)) else None  # a longer period repeats the same runs
    return None


@dataclass(frozen=True)
class Switched:
    """Switch mode's stacks inside a program: per class, its layers and (graphdef of one layer, stacked state);
    period: the classes' period (`class_period`), where a span of whole periods runs as a scan over them."""
    classes: tuple[tuple[int, ...], ...]
    layers: list  # [(graphdef, stacked state)] per class
    period: int | None = None

    def where(self, i: int) -> tuple[int, int]:
        """(class, index in its stack) of layer i."""
        return _locate(self.classes, i)


def _locate(groups, i: int) -> tuple[int, int] | None:
    """(index of the group holding layer i, i's index in it), or None."""
    return next(((s, list(g).index(i)) for s, g in enumerate(groups) if i in g), None)


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
    classes: tuple[tuple[int, ...], ...] = ()  # switch mode (runs empty): every layer, by class (layer_classes)
    periods: bool = True  # switch mode: a span of whole periods (class_period) scans the periods, no conditional

    def run_of(self, i: int) -> tuple[int, int] | None:
        return next((r for r in self.runs if r[0] <= i < r[1]), None)

    def _groups(self) -> list[list[int]]:
        return [list(range(lo, hi)) for lo, hi in self.runs] + [list(c) for c in self.classes]

    def locate(self, i: int) -> tuple[int, int] | None:
        """Where layer i's weights lie: (its stack's index in params' stacks, its index in the stack), or None
        when it is not stacked."""
        return _locate(self._groups(), i)

    def stack(self, state: nnx.State) -> tuple[nnx.State, list]:
        """A model state -> params (rest, stacks). The stacks are new arrays: drop `state` to free the originals."""
        layers = state["layers"]
        stacks = [jax.tree.map(lambda *xs: _stack(xs), *[layers[i] for i in g]) for g in self._groups()]
        stacked = {i for g in self._groups() for i in g}
        rest = nnx.State({k: v for k, v in state.items() if k != "layers"})
        rest["layers"] = nnx.State({i: layers[i] for i in layers.keys() if i not in stacked})
        return rest, stacks

    def merge(self, graphdef, params):
        """(model, {run: (graphdef of one layer, stacked state)}, or switch mode's `Switched`) from params
        (inside a jitted program)."""
        rest, stacks = params
        layers = dict(rest["layers"].items())
        for g, st in zip(self._groups(), stacks):
            for j, i in enumerate(g):
                layers[i] = jax.tree.map(lambda a, j=j: a[j], st)
        state = nnx.State({k: v for k, v in rest.items() if k != "layers"})
        state["layers"] = nnx.State({i: layers[i] for i in sorted(layers)})
        model = nnx.merge(graphdef, state)
        if self.classes:
            return model, Switched(self.classes, [(nnx.split(model.layers[c[0]])[0], st)
                                                  for c, st in zip(self.classes, stacks)],
                                   class_period(self.classes) if self.periods else None)
        return model, {(lo, hi): (nnx.split(model.layers[lo])[0], st) for (lo, hi), st in zip(self.runs, stacks)}
