"""The control plane's gRPC layer (jaxserve/worker/rpc.py) over a real server on a local port: every method
refuses a caller without the cluster token (UNAUTHENTICATED, before the handler runs), a request that does not
fit its schema is INVALID_ARGUMENT naming the field, a handler's exception is INTERNAL (never UNKNOWN), and a
Prefill reservation cannot carry an address or segment of the caller's choosing."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from jaxserve.worker import messages, rpc

TOKEN = "cluster-secret"
PREFILL = {"request_id": "r", "prompt": [1, 2, 3], "params": {"max_tokens": 2}, "kv_tokens": 3,
           "dst": {"instance": "d0", "blocks": [0], "skip": 0}}


async def serve(calls: list):
    async def health(req, ctx):
        calls.append(("Health", req))
        return {"ok": True}

    async def prefill(req, ctx):
        calls.append(("Prefill", req))
        if req.request_id == "boom":
            raise RuntimeError("a bug")
        yield {"kv_bytes": 1}

    srv = rpc.server(TOKEN)
    srv.add_generic_rpc_handlers((rpc.handler({"Health": health}, {"Prefill": prefill}, messages.WORKER),))
    addr = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
    await srv.start()
    return srv, addr


async def code_of(aw) -> grpc.StatusCode | None:
    try:
        if hasattr(aw, "__aiter__"):  # a stream call
            [m async for m in aw]
        else:
            await aw
    except grpc.aio.AioRpcError as e:
        return e.code(), e.details()
    return None, None


def test_every_method_requires_the_cluster_token():
    async def go():
        calls = []
        srv, addr = await serve(calls)
        for token in ("", "wrong", TOKEN[:-1], TOKEN + "x"):
            c = rpc.Client(addr, token)
            assert (await code_of(c.call("Health", {})))[0] == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as e:
                [m async for m in c.stream("Prefill", PREFILL)]
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            await c.close()
        # no metadata at all: a raw channel
        ch = grpc.aio.insecure_channel(addr)
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await ch.unary_unary(f"/{rpc.SERVICE}/Health")(b"{}")
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        await ch.close()
        assert calls == []  # no handler ran
        c = rpc.Client(addr, TOKEN)
        assert await c.call("Health", {}) == {"ok": True}
        assert [m async for m in c.stream("Prefill", PREFILL)] == [{"kv_bytes": 1}]
        await c.close()
        await srv.stop(0)
    asyncio.run(go())


@pytest.mark.parametrize("change, field", [
    ({"prompt": "1 2 3"}, "prompt"),
    ({"prompt": [1, "2"]}, "prompt.1"),
    ({"prompt": []}, "prompt"),
    ({"kv_tokens": 0}, "kv_tokens"),
    ({"params": {"max_tokens": 2, "temperature": "hot"}}, "params.temperature"),
    ({"params": {"bogus": 1}}, "params.bogus"),
    ({"dst": {**PREFILL["dst"], "kv_address": ["10.0.0.1", 80]}}, "dst.kv_address"),
    ({"dst": {**PREFILL["dst"], "shm": {"name": "other-segment", "base": 0}}}, "dst.shm"),
    ({"dst": {**PREFILL["dst"], "shm_base": -4096}}, "dst.shm_base"),
    ({"request_id": "x" * 300}, "request_id"),
    ({"extra": 1}, "extra"),
])
def test_a_message_that_does_not_fit_its_schema_is_invalid_argument(change, field):
    async def go():
        calls = []
        srv, addr = await serve(calls)
        c = rpc.Client(addr, TOKEN)
        code, details = await code_of(c.stream("Prefill", {**PREFILL, **change}))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and details.startswith(field + ":"), details
        # not JSON at all
        raw = c.channel.unary_unary(f"/{rpc.SERVICE}/Health")
        code, _ = await code_of(raw(b"\xff{not json", metadata=c.metadata))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and calls == []
        await c.close()
        await srv.stop(0)
    asyncio.run(go())


def test_a_handler_bug_is_internal_and_the_server_goes_on():
    async def go():
        srv, addr = await serve([])
        c = rpc.Client(addr, TOKEN)
        code, details = await code_of(c.stream("Prefill", {**PREFILL, "request_id": "boom"}))
        assert code == grpc.StatusCode.INTERNAL and "RuntimeError: a bug" in details
        assert await c.call("Health", {}) == {"ok": True}
        await c.close()
        await srv.stop(0)
    asyncio.run(go())


def test_token_comparison_is_constant_time():
    """Wrong tokens sharing a long prefix with the real one take as long to refuse as ones sharing none (the
    comparison does not stop at the first differing byte)."""
    token = "k" * 200_000
    near, far = "k" * 199_999 + "x", "x" * 200_000

    def cost(presented, n=300):
        t = time.perf_counter()
        for _ in range(n):
            rpc.token_matches(presented, token)
        return time.perf_counter() - t
    near_s, far_s = [], []
    for _ in range(15):  # interleaved, so both see the same machine noise
        near_s.append(cost(near))
        far_s.append(cost(far))
    near_s.sort(), far_s.sort()
    ratio = near_s[7] / far_s[7]
    assert 0.7 < ratio < 1.4, ratio


FIELDS = {name: list(schema.model_fields) for name, schema in messages.WORKER.items()}


def _json_values():
    from hypothesis import strategies as st
    return st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=8),
                        lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=8), c, max_size=4),
                        max_leaves=16)


def test_fuzzed_messages_to_every_method_are_answered_ok_or_invalid_argument():
    """hypothesis: JSON objects over each method's field names (and others) with values of any type; each is
    answered OK or INVALID_ARGUMENT, never UNKNOWN or INTERNAL, and the server stays up."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    thread = rpc.LoopThread("fuzz")
    calls: list = []

    async def start():
        async def health(req, ctx):
            return {}

        async def stream(req, ctx):
            calls.append(req)
            yield {}
        srv = rpc.server(TOKEN)
        srv.add_generic_rpc_handlers((rpc.handler({"Health": health}, {n: stream for n in FIELDS if n != "Health"},
                                                  messages.WORKER),))
        addr = f"127.0.0.1:{srv.add_insecure_port('127.0.0.1:0')}"
        await srv.start()
        return srv, rpc.Client(addr, TOKEN)
    srv, client = thread.run(start())
    codes: dict = {}

    @settings(max_examples=400, deadline=None, suppress_health_check=list(HealthCheck))
    @given(method=st.sampled_from(sorted(FIELDS)), data=st.data())
    def one(method, data):
        keys = st.sampled_from(FIELDS[method] + ["bogus"]) | st.text(max_size=6)
        msg = data.draw(st.dictionaries(keys, _json_values(), max_size=8))
        # the call object is made on the loop thread: a stream call needs the running loop
        code, _ = thread.run(code_of(_call(client, method, msg)), timeout=30)
        codes[code] = codes.get(code, 0) + 1
        assert code in (None, grpc.StatusCode.INVALID_ARGUMENT), (method, msg, code)
    try:
        one()
        assert thread.run(client.call("Health", {})) == {}
    finally:
        thread.run(client.close())
        thread.run(srv.stop(0))
        thread.stop()
    assert codes.get(grpc.StatusCode.INVALID_ARGUMENT, 0) > 100


async def _drain(call):
    return [m async for m in call]


async def _call(client, method, msg):
    if method == "Health":
        return await client.call(method, msg)
    return await _drain(client.stream(method, msg))


@pytest.mark.parametrize("msg, field", [
    ({"seconds": 1, "stamp": "../../etc"}, "stamp"), ({"seconds": 1, "stamp": "a/b"}, "stamp"),
    ({"seconds": 1, "stamp": ""}, "stamp"), ({"seconds": 0, "stamp": "x"}, "seconds"),
    ({"seconds": 301, "stamp": "x"}, "seconds"), ({"seconds": 1}, "stamp"),
])
def test_a_profile_call_writes_only_under_the_profile_dir(msg, field):
    """A Profile call's folder is a name, never a path: the schema refuses anything else, naming the field, and
    trace.folder refuses it again."""
    from pydantic import ValidationError

    from jaxserve import trace
    with pytest.raises(ValidationError) as e:
        messages.Profile.model_validate(msg)
    assert rpc.describe(e.value).startswith(field), rpc.describe(e.value)
    if field == "stamp" and msg.get("stamp"):
        with pytest.raises(ValueError, match="name"):
            trace.folder("/tmp/profiles", msg["stamp"], "p0")
    assert trace.folder("/tmp/profiles", "20261128-120000", "p0") == "/tmp/profiles/20261128-120000/p0"


HOST_ONLY = r"""
import asyncio, json, sys
from jaxserve import trace
trace.start(sys.argv[1], host_only=True)
asyncio.run(trace.stop())
import jax
print(json.dumps({"platforms": jax.config.jax_platforms, "devices": [d.platform for d in jax.devices()]}))
"""


def test_a_routers_capture_starts_jax_on_the_host(tmp_path):
    """A router's profile (trace.start host_only, the only place its process imports JAX) starts JAX on the CPU,
    so on a GPU machine it takes none of the device's memory from the workers; the trace is written."""
    import json
    import os
    import subprocess
    import sys
    env = {k: v for k, v in os.environ.items() if k != "JAX_PLATFORMS"}
    out = subprocess.run([sys.executable, "-c", HOST_ONLY, str(tmp_path / "t")], capture_output=True, text=True,
                         timeout=300, env={**env, "PYTHONPATH": os.getcwd()}, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got == {"platforms": "cpu", "devices": ["cpu"]}, got
    assert any(name.endswith(".xplane.pb") for _, _, files in os.walk(tmp_path / "t") for name in files)
