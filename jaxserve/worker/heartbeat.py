"""A worker's registration with the router: `Register` every router.heartbeat_s with fresh stats, carrying the
prefix-cache events the router's KV index asked for last time (router/kv_index.py); each answer replaces the peer
table. A wrong cluster token or a registration the router refuses stops the worker (setup.Refused).

Concurrency: the registrations run on a loop of their own thread (rpc.LoopThread), so a busy request loop or a
long engine step never delays one; what they read of the engine is its last snapshot, and the full cache state the
router may ask for is taken on the engine thread and sent by a later heartbeat.
"""

from __future__ import annotations

import asyncio
import logging

from .setup import Refused

log = logging.getLogger("jaxserve.worker")


class Heartbeat:
    def __init__(self, cfg, name: str, engine, llm, describe, on_peers, tls):
        """engine: the worker's AsyncEngine; llm: its LLMEngine (cache events); describe(stats) -> the
        registration message; on_peers(table): a new peer table (called on the heartbeat thread)."""
        from . import rpc
        self.cfg, self.name = cfg, name
        self.engine, self.llm = engine, llm
        self.describe, self.on_peers = describe, on_peers
        self.tls = tls
        self.thread = rpc.LoopThread(f"{name}-heartbeat")
        self._router = None
        self._kv_want: int | None = None  # the cache event the router's KV index expects next (None: full)
        self._kv_full = None  # the full cache state being taken on the engine thread

    def start(self, router: str):
        """Register with `router` now and every heartbeat_s -> the concurrent future of the loop (it ends only
        with Refused, or when stopped)."""
        return self.thread.submit(self._run(router))

    async def refresh(self) -> None:
        """One registration now (from another loop), for a fresh peer table."""
        await asyncio.wrap_future(self.thread.submit(self._register()))

    def stop(self) -> None:
        self.thread.stop()  # cancels the loop, which closes its channel to the router, then ends the thread

    async def _register(self) -> None:
        # the engine thread's last snapshot: a long step or compile must not look like a dead worker
        msg = {**self.describe(self.engine.stats()), "kv_epoch": self.llm.cache_events.epoch}
        batch = self._cache_batch()
        if batch is not None:
            msg["kv"] = batch
        ans = await self._router.call("Register", msg, timeout=max(self.cfg.router.heartbeat_s, 1.0))
        if not isinstance(ans, dict):
            return
        if isinstance(ans.get("peers"), dict):
            self.on_peers(ans["peers"])
        want = ans.get("kv_want")
        self._kv_want = want if isinstance(want, int) else None

    def _cache_batch(self) -> dict | None:
        """The events from the number the router wants; when it wants the full state (or the events are no
        longer held), the full state, taken on the engine thread: asked for now and sent by a later heartbeat,
        so a long step never delays a heartbeat."""
        batch = self.llm.cache_events.since(self._kv_want)
        if batch is not None:
            return batch
        if self._kv_full is None:
            self._kv_full = asyncio.ensure_future(self.engine.call(lambda eng: eng.blocks.full_state()))
            return None
        if not self._kv_full.done():
            return None
        fut, self._kv_full = self._kv_full, None
        return None if fut.cancelled() or fut.exception() is not None else fut.result()

    async def _run(self, router: str) -> None:
        import grpc

        from . import rpc
        self._router = rpc.Client(router, self.cfg.transfer.token, self.tls)
        every = self.cfg.router.heartbeat_s
        failing = False
        try:
            while True:
                try:
                    await self._register()
                    if failing:
                        log.warning("router %s reachable again", router)
                    failing = False
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        raise Refused(f"the router {router} refused this worker: wrong cluster token "
                                      f"(transfer.token)") from None
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise Refused(f"the router {router} refused this worker: {e.details()}") from None
                    if not failing:
                        log.warning("router %s unreachable (%s); retrying every %.1fs", router, e.code().name, every)
                    failing = True
                await asyncio.sleep(every)
        finally:
            await self._router.close()
