"""Run a benchmark's requests against a real cluster: the router (router/cluster.py) in this process and
worker processes launched from a config, as `jaxserve serve` does (router/launcher.py)."""

from __future__ import annotations

import asyncio


def run(config: dict, fn):
    """Start the workers of `config` (a config mapping), run `await fn(cluster)` against the router once every
    worker has registered, stop everything; returns fn's result."""
    from jaxserve.config import parse
    from router.cluster import Router
    from router.launcher import workers
    cfg = parse(config)

    async def go():
        cluster = Router(cfg, None)
        async with workers(cluster, cfg, [i.name for i in cfg.instances()]):
            return await fn(cluster)
    return asyncio.run(go())


async def finish(q: asyncio.Queue, on_update=None):
    """The final Update of one request's queue (calls on_update(update) for every update); raises on error."""
    while True:
        u = await q.get()
        if on_update is not None:
            on_update(u)
        if u.finished:
            if u.error:
                raise RuntimeError(f"request failed: {u.error}")
            return u
