"""Run a FastAPI app under uvicorn on a free local port in a background thread (real HTTP for tests)."""

from __future__ import annotations

import contextlib
import threading
import time

import httpx
import uvicorn

from jaxserve.config import ServerSection
from jaxserve.router.launcher import free_ports
from jaxserve.router.serve import http_options


@contextlib.contextmanager
def running(app, headers: dict | None = None, start_timeout: float = 300.0, server: ServerSection | None = None):
    """-> an httpx.Client for the app, served as `jaxserve serve` serves it (router/serve.py http_options, with
    `server`'s settings); the app's lifespan (a cluster's workers) runs at start and stop."""
    port = free_ports()
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, **http_options(server or ServerSection())))
    t = threading.Thread(target=srv.run, daemon=True)
    t.start()
    deadline = time.monotonic() + start_timeout
    while not srv.started:
        assert t.is_alive(), "the server failed to start (see the log above)"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)
    client = httpx.Client(base_url=f"http://127.0.0.1:{port}", headers=headers or {}, timeout=300)
    try:
        yield client
    finally:
        client.close()
        srv.should_exit = True
        t.join(timeout=60)
