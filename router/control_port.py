"""The router's control port: workers register there, and their registrations are their heartbeats.

It runs a gRPC server on an asyncio loop of its own thread (worker/rpc.py `LoopThread`), so a request path
that keeps the router's main loop busy (a large body being parsed, many streams) cannot starve the
heartbeats and get healthy workers marked down. Every call must present the cluster token (rpc.py); a
registration whose fields do not fit the schema is INVALID_ARGUMENT, one the registry refuses (an instance or
role the config does not list) too. The answer carries the peer table (registry.py `peers`): the only place a
worker learns other instances' data addresses from. A registration's prefix-cache events go to the global KV
index (kv_index.py), and the answer says which event the index wants next (`kv_want`; None: the full state).
Concurrency: this module's handlers run on the control thread; `on_join` is called there after each accepted
registration.
"""

from __future__ import annotations

import logging

from jaxserve.worker import messages, rpc

from .registry import Registry, RegistrationError

log = logging.getLogger("jaxserve.router")


class ControlPort:
    def __init__(self, registry: Registry, token: str, heartbeat_s: float, on_join=None, tls=None, index=None):
        self.registry, self.token, self.heartbeat_s, self.on_join = registry, token, heartbeat_s, on_join
        self.index = index  # kv_index.KVIndex: each heartbeat's prefix-cache events go there
        self.tls = tls  # transfer.tls.Tls: the port speaks TLS
        self.address: str | None = None
        self._thread: rpc.LoopThread | None = None
        self._server = None

    def start(self, host: str, port: int) -> str:
        """Serve on host:port (0: any free port); returns host:port."""
        self._thread = rpc.LoopThread("router-control")
        self.address = self._thread.run(self._start(host, port), timeout=30)
        return self.address

    async def _start(self, host: str, port: int) -> str:
        self._server = rpc.server(self.token)
        self._server.add_generic_rpc_handlers((rpc.handler({"Register": self._register}, {}, messages.ROUTER),))
        port = rpc.listen(self._server, f"{host}:{port}", self.tls)
        await self._server.start()
        return f"{host}:{port}"

    async def _register(self, req: messages.Register, ctx):
        try:
            w = self.registry.register(req.model_dump())
        except RegistrationError as e:
            log.warning("registration refused: %s", e)
            await ctx.abort(rpc.Code.INVALID_ARGUMENT, str(e))
        ans = {"name": w.name, "heartbeat_s": self.heartbeat_s, "peers": self.registry.peers()}
        if self.index is not None:
            self.index.request_state = self.index.request_state or req.request_state
            batch = req.kv.model_dump(by_alias=True, exclude_none=True) if req.kv else None
            ans["kv_want"] = self.index.apply(w.name, batch, req.kv_epoch)
        if self.on_join is not None:
            self.on_join()
        return ans

    def stop(self) -> None:
        if self._thread is None:
            return
        if self._server is not None:
            self._thread.run(self._server.stop(0.5), timeout=30)
        self._thread.stop()
        self._thread = None
