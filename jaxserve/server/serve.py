"""`jaxserve serve`: build the engine a config describes, warm it up, and run the HTTP server (uvicorn)."""

from __future__ import annotations

import os

from ..bundled import resolve
from ..config import Config, ConfigFileError
from ..engine.async_engine import AsyncEngine
from ..engine.llm_engine import LLMEngine
from .app import create_app
from .metrics import Metrics


def check_servable(cfg: Config) -> None:
    insts = cfg.instances()
    if len(insts) != 1 or insts[0].role != "both":
        raise ConfigFileError("clusters: this server runs one colocated instance (role 'both'); "
                              f"the config has {[(i.name, i.role) for i in insts]}")


def make_mesh(inst, local: bool = False):
    """The instance's TP mesh (None for tp 1). local: the process sees only its own devices (a worker)."""
    import jax
    if inst.tp == 1:
        return None
    devs = jax.devices()
    ids = list(range(inst.tp)) if local else inst.devices[:inst.tp]
    if max(ids) >= len(devs):
        raise ConfigFileError(f"clusters.instances.devices: {inst.devices} but only {len(devs)} devices exist")
    return jax.make_mesh((inst.tp,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,),
                         devices=[devs[i] for i in ids])


def build(cfg: Config, progress: bool = True):
    """(FastAPI app, AsyncEngine) for a colocated config."""
    check_servable(cfg)
    inst = cfg.instances()[0]
    mesh = make_mesh(inst)
    path = resolve(cfg.model.path, progress)
    llm = LLMEngine(path, cfg.model.dtype, cfg.engine.engine_config(cfg.server.max_waiting), mesh, progress)
    if cfg.engine.warmup:
        llm.engine.warmup(progress)
    name = cfg.model.name or os.path.basename(os.path.normpath(path))
    metrics = Metrics(llm.stats)
    engine = AsyncEngine(llm, on_finish=metrics.observe_finished)
    return create_app(cfg, engine, name, metrics), engine, name


def serve(cfg: Config, port: int | None = None, host: str | None = None) -> None:
    import uvicorn
    app, engine, name = build(cfg)
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    shown = "localhost" if host in ("0.0.0.0", "127.0.0.1") else host
    auth = f" -H 'Authorization: Bearer {cfg.server.api_keys[0]}'" if cfg.server.api_keys else ""
    print(f"\njaxserve: serving {name!r} at http://{shown}:{port}/v1  (Ctrl-C stops)\ntry:\n"
          f"  curl -s http://{shown}:{port}/v1/completions -H 'Content-Type: application/json'{auth} "
          f"-d '{{\"model\": \"{name}\", \"prompt\": \"Prefill and decode\", \"max_tokens\": 16}}'\n", flush=True)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        engine.shutdown()
