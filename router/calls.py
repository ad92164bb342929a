"""The router's calls to its workers: each request a message model of worker/messages.py (`message`), one
`grpc.aio` channel per worker address, each call presenting the cluster token (worker/rpc.py); a call that fails
at the transport level marks its worker down until its next heartbeat (registry.py), and its entries in the global
KV index are dropped; a call awaited through `watch` is abandoned once its worker stops heartbeating. Runs on the
router's asyncio loop.
"""

from __future__ import annotations

import asyncio
import logging

import grpc

from pydantic import ValidationError

from jaxserve.config import Config
from jaxserve.engine.client import RequestError
from jaxserve.worker import messages, rpc

from .kv_index import KVIndex
from .registry import Registry, WorkerInfo
from .requests import DEAD, Silent

log = logging.getLogger("jaxserve.router")


def message(method: str, **fields):
    """The worker method's request as its message model (worker/messages.py WORKER), checked here as the worker
    will check it; a field out of its bounds (from the client's request) raises RequestError naming it."""
    try:
        return messages.WORKER[method](**fields)
    except ValidationError as e:
        err = e.errors()[0]
        raise RequestError(f"{'.'.join(str(x) for x in err['loc'])}: {err['msg']}", str(err["loc"][-1])) from None


class Workers:
    def __init__(self, cfg: Config, registry: Registry, index: KVIndex):
        self.cfg = cfg
        self.registry = registry
        self.index = index
        self.tls = cfg.transfer.tls.build() if cfg.transfer.tls else None
        self._clients: dict[str, rpc.Client] = {}

    def client(self, w: WorkerInfo) -> rpc.Client:
        if w.address not in self._clients:
            # channels to addresses no worker registers at any more (restarted workers) are closed
            live = self.registry.addresses()
            for addr in [a for a in self._clients if a not in live]:
                asyncio.ensure_future(self._clients.pop(addr).close())
            self._clients[w.address] = rpc.Client(w.address, self.cfg.transfer.token, self.tls)
        return self._clients[w.address]

    def down(self, w: WorkerInfo, e: grpc.aio.AioRpcError) -> None:
        """A call to w failed with e: w is down when the status says it is gone (DEAD)."""
        if e.code() in DEAD:
            log.warning("%s failed (%s: %s); not used until it answers again", w.name, e.code().name, e.details())
            self.registry.mark_down(w.name, f"{e.code().name}: {e.details()}")
            self.index.drop(w.name)  # its cache may be gone: nothing of it counts until it resyncs

    async def watch(self, w: WorkerInfo, aw):
        """Await `aw` (a call to worker w); give up with Silent once the registry no longer counts w up."""
        fut = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=self.cfg.router.heartbeat_s)
                if done:
                    return fut.result()
                if not self.registry.is_up(w):
                    raise Silent(f"{w.name}: no heartbeat for {self.cfg.router.down_after_s}s")
        finally:
            fut.cancel()

    async def close(self) -> None:
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
