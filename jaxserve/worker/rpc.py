"""gRPC plumbing for the control plane: JSON messages over generic method handlers (no generated stubs).

Control messages are small (ids, token lists, block ids); requests' KV never travels here (transfer/). The
one exception is a migration's (engine/migration.py): the raw `MigrateCall` method carries its moved KV once and
each decode step's queries, partial attention results or hidden states, as bytes with their own header.

- **Authentication.** Every call carries the cluster token (`transfer.token`) in its metadata
  (`x-jaxserve-token`). The server's interceptor compares it in constant time before the request message is
  parsed and answers UNAUTHENTICATED otherwise, for every method: the workers' and the router's control port.
- **Validation.** Each method names a pydantic schema (worker/messages.py). A request that is not JSON or does
  not fit its schema is answered INVALID_ARGUMENT naming the field, before the handler runs; an exception a
  handler lets escape becomes INTERNAL, never UNKNOWN. So a caller tells a bad message or a handler's bug from
  a worker that is gone (UNAVAILABLE), and only the last counts against a worker's health (router/cluster.py).
- **Limits.** Messages are capped at `MAX_MESSAGE` on both ends (a prompt of MAX_TOKENS token ids fits);
  requests larger than `PARSE_INLINE` bytes are parsed on a small thread pool, not on the serving loop.
- **TLS.** With `transfer.tls` (transfer/tls.py) servers listen with TLS and clients dial with it, verifying the
  server's certificate against the cluster CA; with `mutual`, servers require a client certificate too.
- **Liveness.** HTTP/2 keepalive pings on both ends, so a peer that vanishes without a reset (a silent
  partition) fails its calls within `KEEPALIVE_S` plus `KEEPALIVE_TIMEOUT_S` instead of leaving them open.

Servers and clients are `grpc.aio`. `LoopThread` runs an asyncio loop on a thread of its own, for control
work that a busy request loop must not starve (the router's control port, a worker's heartbeats).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import logging
import threading

import grpc
from pydantic import BaseModel, ValidationError

log = logging.getLogger("jaxserve.rpc")

SERVICE = "jaxserve.Worker"
TOKEN_KEY = "x-jaxserve-token"
MAX_MESSAGE = 64 << 20
PARSE_INLINE = 256 << 10
KEEPALIVE_S = 10.0
KEEPALIVE_TIMEOUT_S = 5.0
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE),
           ("grpc.keepalive_time_ms", int(KEEPALIVE_S * 1000)),
           ("grpc.keepalive_timeout_ms", int(KEEPALIVE_TIMEOUT_S * 1000)),
           ("grpc.keepalive_permit_without_calls", 1), ("grpc.http2.max_pings_without_data", 0),
           ("grpc.http2.min_ping_interval_without_data_ms", int(KEEPALIVE_S * 500))]
Code = grpc.StatusCode
_parser = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="rpc-parse")


def _enc(obj) -> bytes:
    """A message as JSON: a dict, or a message model (messages.py) with the fields it was given."""
    import json
    if isinstance(obj, BaseModel):
        obj = obj.model_dump(mode="json", by_alias=True, exclude_unset=True)
    return json.dumps(obj, separators=(",", ":")).encode()


def _dec(data: bytes):
    import json
    return json.loads(data) if data else {}


def describe(e: ValidationError) -> str:
    """A pydantic error as one line naming the field: `prompt.3: Input should be a valid integer`."""
    err = e.errors()[0] if e.errors() else {"loc": (), "msg": str(e)}
    loc = ".".join(str(x) for x in err.get("loc", ()))
    return f"{loc}: {err['msg']}" if loc else str(err["msg"])


def token_matches(presented: str | bytes | None, token: str) -> bool:
    """Constant-time comparison of a presented cluster token."""
    if presented is None:
        return False
    got = presented if isinstance(presented, bytes) else str(presented).encode()
    return hmac.compare_digest(got, token.encode())


class _Auth(grpc.aio.ServerInterceptor):
    """Refuses (UNAUTHENTICATED) every call that does not present the cluster token, before it is parsed."""

    def __init__(self, token: str):
        self.token = token
        self.refused = 0

        async def deny(request, ctx):
            await ctx.abort(Code.UNAUTHENTICATED, f"missing or wrong cluster token ({TOKEN_KEY} metadata)")
        self._deny = grpc.unary_unary_rpc_method_handler(deny)

    async def intercept_service(self, continuation, details):
        presented = next((v for k, v in details.invocation_metadata or () if k == TOKEN_KEY), None)
        if token_matches(presented, self.token):
            return await continuation(details)
        self.refused += 1
        return self._deny


async def _parse(schema: type[BaseModel], raw: bytes, ctx) -> BaseModel:
    try:
        if len(raw) > PARSE_INLINE:
            loop = asyncio.get_running_loop()
            return await loop.run_in_executor(_parser, schema.model_validate_json, raw or b"{}")
        return schema.model_validate_json(raw or b"{}")
    except ValidationError as e:
        await ctx.abort(Code.INVALID_ARGUMENT, describe(e))


def _internal(name: str, e: Exception) -> str:
    log.exception("%s handler failed", name)
    return f"{name}: internal error: {type(e).__name__}: {e}"


def handler(unary: dict, streams: dict, schemas: dict[str, type[BaseModel]],
            raw: dict | None = None) -> grpc.GenericRpcHandler:
    """Generic handler: unary `async fn(request, context) -> dict`, streams async generators of dicts; each
    method's request is parsed into `schemas[name]` first (INVALID_ARGUMENT when it does not fit). raw: unary
    methods of bytes to bytes, `async fn(payload, context) -> bytes`, that parse their own messages (a
    ValueError or KeyError they raise is INVALID_ARGUMENT)."""
    def unary_method(name, fn):
        async def call(raw, ctx):
            req = await _parse(schemas[name], raw, ctx)
            try:
                return await fn(req, ctx)
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001 - a handler's bug is INTERNAL, never UNKNOWN
                await ctx.abort(Code.INTERNAL, _internal(name, e))
        return grpc.unary_unary_rpc_method_handler(call, response_serializer=_enc)

    def stream_method(name, fn):
        async def call(raw, ctx):
            req = await _parse(schemas[name], raw, ctx)
            try:
                async for msg in fn(req, ctx):
                    yield msg
            except grpc.aio.AbortError:
                raise
            except Exception as e:  # noqa: BLE001
                await ctx.abort(Code.INTERNAL, _internal(name, e))
        return grpc.unary_stream_rpc_method_handler(call, response_serializer=_enc)

    def raw_method(name, fn):
        async def call(payload, ctx):
            try:
                return await fn(payload, ctx)
            except grpc.aio.AbortError:
                raise
            except (ValueError, KeyError) as e:
                await ctx.abort(Code.INVALID_ARGUMENT, f"{name}: {type(e).__name__}: {e}")
            except Exception as e:  # noqa: BLE001
                await ctx.abort(Code.INTERNAL, _internal(name, e))
        return grpc.unary_unary_rpc_method_handler(call)

    missing = (set(unary) | set(streams)) - set(schemas)
    if missing:
        raise ValueError(f"methods without a request schema: {sorted(missing)}")
    methods = {name: unary_method(name, fn) for name, fn in unary.items()}
    methods.update({name: stream_method(name, fn) for name, fn in streams.items()})
    methods.update({name: raw_method(name, fn) for name, fn in (raw or {}).items()})
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def server(token: str) -> grpc.aio.Server:
    """An aio server whose every method requires `token`."""
    return grpc.aio.server(options=OPTIONS, interceptors=[_Auth(token)])


def listen(srv: grpc.aio.Server, address: str, tls=None) -> int:
    """Bind `srv` to host:port (port 0: any free one), with TLS when `tls` (transfer.tls.Tls); the bound port."""
    if tls is None:
        return srv.add_insecure_port(address)
    return srv.add_secure_port(address, tls.grpc_server_credentials())


class Client:
    """Calls one worker's (or the router's) methods with the cluster token: `await client.call(name, msg)`,
    `client.stream(name, msg)` (an async iterator); msg: the method's message model (messages.py), or a dict."""

    def __init__(self, address: str, token: str, tls=None):
        """tls: a transfer.tls.Tls; the channel is then TLS, the server's certificate checked against its CA."""
        self.address = address
        self.metadata = ((TOKEN_KEY, token),)
        self.channel = (grpc.aio.insecure_channel(address, options=OPTIONS) if tls is None else
                        grpc.aio.secure_channel(address, tls.grpc_channel_credentials(), options=OPTIONS))

    async def call(self, name: str, msg: dict | BaseModel, timeout: float | None = None) -> dict:
        fn = self.channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=_enc, response_deserializer=_dec)
        return await fn(msg, timeout=timeout, metadata=self.metadata)

    def stream(self, name: str, msg: dict | BaseModel, timeout: float | None = None):
        fn = self.channel.unary_stream(f"/{SERVICE}/{name}", request_serializer=_enc, response_deserializer=_dec)
        return fn(msg, timeout=timeout, metadata=self.metadata)

    async def close(self) -> None:
        await self.channel.close()


class SyncClient:
    """A blocking client of one worker's raw (bytes to bytes) methods, for calls from threads that are not an
    asyncio loop (a step program's host callbacks): `client.call_raw(name, payload, timeout)`."""

    def __init__(self, address: str, token: str, tls=None):
        self.address = address
        self.metadata = ((TOKEN_KEY, token),)
        self.channel = (grpc.insecure_channel(address, options=OPTIONS) if tls is None else
                        grpc.secure_channel(address, tls.grpc_channel_credentials(), options=OPTIONS))

    def call_raw(self, name: str, payload: bytes, timeout: float | None = None) -> bytes:
        return self.channel.unary_unary(f"/{SERVICE}/{name}")(payload, timeout=timeout, metadata=self.metadata)

    def close(self) -> None:
        self.channel.close()


class LoopThread:
    """An asyncio loop running on its own (daemon) thread; `submit(coro)` schedules a coroutine on it from any
    thread and returns a concurrent.futures.Future."""

    def __init__(self, name: str):
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def submit(self, coro) -> concurrent.futures.Future:
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def run(self, coro, timeout: float | None = None):
        """Run `coro` on the thread's loop and wait for its result here (not from that loop itself)."""
        return self.submit(coro).result(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Cancel the loop's tasks and let them finish (their `finally` blocks close their gRPC channels on this
        loop), then stop and close it: a channel left open would be polled on a closed loop."""
        if self.loop.is_closed():
            return

        async def drain():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        if self._thread.is_alive():
            try:
                self.run(drain(), timeout)
            except (concurrent.futures.TimeoutError, RuntimeError):  # a task that would not end: stopped anyway
                log.warning("%s: tasks still running after %.0fs; stopping its loop", self._thread.name, timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()
