"""One colocated instance (role `both`) in this process: its mesh, its engine, and the HTTP app over it.

The router (router/serve.py) calls `build_colocated` for a config of one colocated instance and builds a
cluster for anything else; `jaxserve serve` is router/cli.py.
"""

from __future__ import annotations

import contextlib
import os

from ..bundled import resolve
from ..config import Config, ConfigFileError
from .app import create_app
from .metrics import Metrics


def make_mesh(inst, local: bool = False):
    """The instance's TP mesh (None for tp 1). local: the process sees only its own devices (a worker)."""
    import jax
    if inst.tp == 1:
        return None
    devs = jax.devices()
    if inst.hosts > 1:  # one multi-controller program: the mesh spans every process's devices, process by process
        if len(devs) != inst.tp:
            raise ConfigFileError(f"clusters.instances.tp: {inst.tp} over {inst.hosts} hosts, but the group has "
                                  f"{len(devs)} devices")
        devs = sorted(devs, key=lambda d: (d.process_index, d.id))
        return jax.make_mesh((inst.tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=devs)
    ids = list(range(inst.tp)) if local else inst.devices[:inst.tp]
    if max(ids) >= len(devs):
        raise ConfigFileError(f"clusters.instances.devices: {inst.devices} but only {len(devs)} devices exist")
    return jax.make_mesh((inst.tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=[devs[i] for i in ids])


def build_colocated(cfg: Config, progress: bool = True, on_ready=None):
    """(FastAPI app, AsyncEngine, served model name) for a config of one colocated instance. on_ready: called
    once the server can take requests."""
    from ..engine.async_engine import AsyncEngine  # here: a router serving a cluster runs no model, imports no JAX
    from ..engine.llm_engine import LLMEngine
    inst = cfg.instances()[0]
    mesh = make_mesh(inst)
    path = resolve(cfg.model.path, progress)
    llm = LLMEngine(path, cfg.model.dtype, cfg.engine.engine_config(cfg.server.max_waiting), mesh, progress)
    if progress:
        print(llm.cache_line, flush=True)
    if cfg.engine.warmup:
        n = llm.runner.warmup(progress)
        if progress:
            print(f"{inst.name}: {n} programs compiled", flush=True)
    name = cfg.model.name or os.path.basename(os.path.normpath(path))
    engine = AsyncEngine(llm)
    metrics = Metrics(engine.stats)
    engine.on_finish = metrics.observe_finished

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_ready is not None:
            on_ready()
        yield
    return create_app(cfg, engine, name, metrics, lifespan=lifespan), engine, name
