"""`jaxserve serve`: build what a config describes and run the HTTP server (uvicorn).

One colocated instance (role `both`) runs in this process (jaxserve/server/serve.py). Anything else is a
cluster: this process is the router (cluster.py) and starts every instance with `launch: true` as a child
worker process (launcher.py) when the server starts, waits until each has registered, and stops them all on
exit.
"""

from __future__ import annotations

import contextlib
import os
import sys

from jaxserve.bundled import resolve
from jaxserve.config import Config, ConfigFileError, ServerSection
from jaxserve.server.app import create_app
from jaxserve.server.metrics import Metrics
from jaxserve.server.serve import build_colocated
from jaxserve.tokenizer import Tokenizer

from .cluster import Router
from .start import workers


def build(cfg: Config, progress: bool = True, echo=None, on_ready=None, ray_address: str | None = None):
    """(FastAPI app, engine client, served model name): an AsyncEngine for a colocated config, else a Router
    whose workers start with the app (lifespan). echo: prints the workers' output lines (None: keep quiet);
    on_ready: called once the server can take requests; ray_address: the workers start on that Ray cluster."""
    if not cfg.disaggregated:
        if ray_address is not None:
            raise ConfigFileError("--launcher ray: this config is served in-process (one colocated instance); "
                                  "there are no workers to place")
        return build_colocated(cfg, progress, on_ready)
    path = resolve(cfg.model.path, progress)  # before the workers start, so they find the bundled model built
    name = cfg.model.name or os.path.basename(os.path.normpath(path))
    cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"path": path})})
    router = Router(cfg, Tokenizer.maybe_load(path))
    metrics = Metrics(router.stats, router.metrics_state)
    router.on_finish = metrics.observe_update
    names = [i.name for i in cfg.instances() if i.launch and not i.standby]

    @contextlib.asynccontextmanager
    async def lifespan(app):
        async with workers(router, cfg, names, progress, echo, ray_address):
            if on_ready is not None:
                on_ready()
            yield

    return create_app(cfg, router, name, metrics, lifespan=lifespan), router, name


def http_options(srv: ServerSection) -> dict:
    """uvicorn's options for the HTTP server: its keep-alive from the config (uvicorn's own is 5 s, shorter than
    most client pools' idle time, so a request sent as the server drops an idle connection would be lost)."""
    return {"log_level": "warning", "timeout_keep_alive": srv.keep_alive_s}


def serve(cfg: Config, port: int | None = None, host: str | None = None, ray_address: str | None = None) -> None:
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
    app, engine, name = build(cfg, echo=lambda line: print(line, file=sys.stderr, flush=True), on_ready=banner,
                              ray_address=ray_address)
    try:
        uvicorn.run(app, host=host, port=port, **http_options(cfg.server))
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()
