"""gRPC plumbing for the control plane: JSON messages over generic method handlers (no generated stubs).

Control messages are small (ids, token lists, block ids, addresses); KV bytes never travel here (transfer/).
Both ends raise the message limits anyway, since a long prompt's token list can exceed gRPC's 4 MB default.
Servers are `grpc.aio` (asyncio, sharing the worker's event loop with its AsyncEngine); clients are
`grpc.aio` channels too.
"""

from __future__ import annotations

import json

import grpc

SERVICE = "jaxserve.Worker"
MAX_MESSAGE = 256 << 20
OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE), ("grpc.max_receive_message_length", MAX_MESSAGE)]


def _enc(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _dec(data: bytes):
    return json.loads(data) if data else {}


def handler(unary: dict, streams: dict) -> grpc.GenericRpcHandler:
    """Generic handler for async functions: unary `fn(request, context) -> dict`, streams async generators."""
    methods = {name: grpc.unary_unary_rpc_method_handler(fn, request_deserializer=_dec, response_serializer=_enc)
               for name, fn in unary.items()}
    methods.update({name: grpc.unary_stream_rpc_method_handler(fn, request_deserializer=_dec,
                                                               response_serializer=_enc)
                    for name, fn in streams.items()})
    return grpc.method_handlers_generic_handler(SERVICE, methods)


def server() -> grpc.aio.Server:
    return grpc.aio.server(options=OPTIONS)


class Client:
    """Calls one worker's methods: `await client.call(name, msg)`, `client.stream(name, msg)` (async iterator)."""

    def __init__(self, address: str):
        self.address = address
        self.channel = grpc.aio.insecure_channel(address, options=OPTIONS)

    async def call(self, name: str, msg: dict, timeout: float | None = None) -> dict:
        fn = self.channel.unary_unary(f"/{SERVICE}/{name}", request_serializer=_enc, response_deserializer=_dec)
        return await fn(msg, timeout=timeout)

    def stream(self, name: str, msg: dict, timeout: float | None = None):
        fn = self.channel.unary_stream(f"/{SERVICE}/{name}", request_serializer=_enc, response_deserializer=_dec)
        return fn(msg, timeout=timeout)

    async def close(self) -> None:
        await self.channel.close()
