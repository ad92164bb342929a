"""Run a benchmark's requests against a real cluster: the router (router/cluster.py) in this process and
worker processes launched from a config, as `jaxserve serve` does (router/launcher.py)."""

from __future__ import annotations

import asyncio


def unpinned(config: dict) -> dict:
    """A copy of `config` (a config mapping) with none of its instances pinned to cores (`cpus` left out: each
    runs where there is room). Benchmarks pin; their smoke runs in the test suite do not: under `make test` the
    soak holds the first core (tests/test_soak.py), and a worker pinned beside it would get a fraction of it."""
    return {**config, "clusters": [{**c, "instances": [{k: v for k, v in i.items() if k != "cpus"}
                                                       for i in c["instances"]]} for c in config["clusters"]]}


def run(config: dict, fn, pinned: bool = True):
    """Start the workers of `config` (a config mapping; with pinned False, `unpinned`), run `await fn(cluster)`
    against the router once every worker has registered, stop everything; returns fn's result."""
    from jaxserve.config import parse
    from jaxserve.router.cluster import Router
    from jaxserve.router.start import workers
    cfg = parse(config if pinned else unpinned(config))

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
