"""`jaxserve serve`: build what a config describes and run the HTTP server (uvicorn).

One colocated instance (role `both`) runs in this process. Anything else is a cluster: this process is the
router (router/cluster.py) and starts every instance with `launch: true` as a child worker process
(router/launcher.py) when the server starts, waits until each has registered, and stops them all on exit.
"""

from __future__ import annotations

import contextlib
import os
import sys

from ..bundled import resolve
from ..config import Config, ConfigFileError
from ..engine.async_engine import AsyncEngine
from ..engine.llm_engine import LLMEngine
from .app import create_app
from .metrics import Metrics


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


def build(cfg: Config, progress: bool = True, echo=None, on_ready=None):
    """(FastAPI app, engine, served model name): an AsyncEngine for a colocated config, else a ClusterEngine
    whose workers start with the app (lifespan). echo: prints the workers' output lines (None: keep quiet);
    on_ready: called once the server can take requests."""
    if cfg.disaggregated:
        return build_cluster(cfg, progress, echo, on_ready)
    inst = cfg.instances()[0]
    mesh = make_mesh(inst)
    path = resolve(cfg.model.path, progress)
    llm = LLMEngine(path, cfg.model.dtype, cfg.engine.engine_config(cfg.server.max_waiting), mesh, progress)
    if cfg.engine.warmup:
        llm.engine.warmup(progress)
    name = cfg.model.name or os.path.basename(os.path.normpath(path))
    metrics = Metrics(llm.stats)
    engine = AsyncEngine(llm, on_finish=metrics.observe_finished)

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if on_ready is not None:
            on_ready()
        yield
    return create_app(cfg, engine, name, metrics, lifespan=lifespan), engine, name


def build_cluster(cfg: Config, progress: bool = True, echo=None, on_ready=None):
    from router.cluster import ClusterEngine
    from router.launcher import workers
    from ..tokenizer import Tokenizer
    path = resolve(cfg.model.path, progress)  # before the workers start, so they find the bundled model built
    name = cfg.model.name or os.path.basename(os.path.normpath(path))
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": path})})
    cluster = ClusterEngine(cfg, Tokenizer.maybe_load(path))
    metrics = Metrics(cluster.engine.stats, cluster.metrics_state)
    cluster.on_finish = metrics.observe_update
    names = [i.name for i in cfg.instances() if i.launch]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with workers(cluster, cfg, names, progress, echo):
            if on_ready is not None:
                on_ready()
            yield

    app = create_app(cfg, cluster, name, metrics, lifespan=lifespan)
    return app, cluster, name


def serve(cfg: Config, port: int | None = None, host: str | None = None) -> None:
    import uvicorn
    cfg.check_exposure()
    host = host or cfg.server.host
    port = cfg.server.port if port is None else port
    shown = "localhost" if host in ("0.0.0.0", "127.0.0.1") else host
    auth = " -H \"Authorization: Bearer $JAXSERVE_API_KEY\"" if cfg.server.api_keys else ""  # never the key

    def banner():
        print(f"\njaxserve: serving {name!r} at http://{shown}:{port}/v1  (Ctrl-C stops)\ntry:\n"
              f"  curl -s http://{shown}:{port}/v1/completions -H 'Content-Type: application/json'{auth} "
              f"-d '{{\"model\": \"{name}\", \"prompt\": \"Prefill and decode\", \"max_tokens\": 16}}'\n",
              flush=True)
    app, engine, name = build(cfg, echo=lambda line: print(line, file=sys.stderr, flush=True), on_ready=banner)
    try:
        uvicorn.run(app, host=host, port=port, log_level="warning")
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
