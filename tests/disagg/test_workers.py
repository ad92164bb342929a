"""Prefill and decode as two real worker processes (`jaxserve worker`), driven over gRPC, KV over TCP (and,
in one test, pulled through JAX's transfer servers: the device backend).

Every process speaks mutual TLS (transfer.tls: gRPC and the KV links), with certificates the module makes.
The test plays the router's part: open a Decode stream on the decode worker (it reserves first), pass the
reservation to the prefill worker's Prefill call, read the tokens from the stream. The workers register with a
real router control port in this process (router/control_port.py), which hands them the peer table their KV
addresses come from. Calls without the cluster token are refused, and so is a reservation naming an instance
the router does not know. Tokens must equal the
colocated engine's; a worker that is told the wrong role refuses; killing the prefill worker mid-request
fails the decode side's reservation after its deadline with its blocks freed."""

from __future__ import annotations

import asyncio
import functools
import json
import os
import subprocess
import sys
import time

import grpc
import pytest
import yaml

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import EngineConfig
from jaxserve.models.config import load_config
from jaxserve.worker.setup import READY
from jaxserve.config import parse
from jaxserve.worker import rpc
from jaxserve.router.control_port import ControlPort
from jaxserve.router.registry import Registry
from jaxserve.transfer.plan import layer_groups
from jaxserve.transfer.tls import Tls, make_certs

pytestmark = pytest.mark.slow

BASE = [5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 15, 6, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [BASE[:13], BASE[:3], [30, 31] + BASE[:11]]
ENGINE = dict(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
              max_num_seqs=4, num_snapshots=8, warmup=False)
GREEDY = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
TOKEN = "test-token"


TLS: dict = {}  # the cluster's transfer.tls section, made by run_cluster


def Client(address: str, token: str = TOKEN, tls: bool = True) -> rpc.Client:
    return rpc.Client(address, token, Tls(**TLS) if tls else None)


def start_worker(cfg_path: str, name: str, router: str) -> tuple[subprocess.Popen, dict]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    p = subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "worker", "--config", cfg_path, "--instance", name,
                          "--router", router], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines = []
    for line in p.stdout:
        lines.append(line)
        if line.startswith(READY):
            return p, json.loads(line[len(READY):])
    raise RuntimeError(f"worker {name} exited before ready:\n{''.join(lines)}")


def run_cluster(checkpoint_dir, tmp_path_factory, **transfer):
    """Start p0 (prefill, core 0) and d0 (decode, core 1) of a 1P1D config; yields (model path, {name: (process,
    ready info)}, config path) and stops both."""
    path = checkpoint_dir("kimi_linear")
    if not TLS:  # one CA for the module: both clusters' processes may be up at once
        certs = make_certs(str(tmp_path_factory.mktemp("certs")), ["127.0.0.1"], ["node"])
        TLS.update(ca_file=certs["ca"][0], cert_file=certs["node"][0], key_file=certs["node"][1], mutual=True)
    cfg = {"model": {"path": path}, "engine": ENGINE, "router": {"heartbeat_s": 0.5, "down_after_s": 5.0},
           "transfer": {"token": TOKEN, "connections": 2, "chunk_mb": 0.01, "deadline_s": 120.0,
                        "layers_per_group": 2, "stream_min_tokens": 0, "tls": dict(TLS), **transfer},
           "clusters": [{"name": "pd", "instances": [{"name": "p0", "role": "prefill", "cpus": [0]},
                                                     {"name": "d0", "role": "decode", "cpus": [1]}]}]}
    cfg_path = str(tmp_path_factory.mktemp("cfg") / "disagg.yaml")
    with open(cfg_path, "w") as f:
        yaml.safe_dump(cfg, f)
    conf = parse(cfg)
    registry = Registry({i.name: i.role for i in conf.instances()}, conf.router.down_after_s)
    control = ControlPort(registry, TOKEN, conf.router.heartbeat_s, tls=conf.transfer.tls.build())
    router = control.start("127.0.0.1", 0)
    procs = {}
    try:
        for name in ("p0", "d0"):
            procs[name] = start_worker(cfg_path, name, router)
        deadline = time.monotonic() + 120  # the prefill worker's peer table names d0 from its next heartbeat on
        while {"p0", "d0"} - set(registry.workers):
            assert time.monotonic() < deadline, "workers did not register"
            time.sleep(0.05)
        yield path, procs, (cfg_path, router)
    finally:
        for p, _ in procs.values():
            p.terminate()
            p.wait(30)
        control.stop()


@pytest.fixture(scope="module")
def cluster(checkpoint_dir, tmp_path_factory):
    yield from run_cluster(checkpoint_dir, tmp_path_factory, shared_memory=False)  # TCP between processes


@pytest.fixture(scope="module")
def device_cluster(checkpoint_dir, tmp_path_factory):
    yield from run_cluster(checkpoint_dir, tmp_path_factory, device_transfer="on")


async def disagg_request(p_addr, d_addr, rid, prompt, params, output=()):
    """Reserve on decode, prefill into it, read decode's stream. output: resume a request that already has these
    tokens (decode computes the last of them; prefill sends the KV before it and samples nothing).
    -> (reservation, Prefill's answer, decode's last update, Prefill's early first token or None)"""
    d, p = Client(d_addr), Client(p_addr)
    kv = len(prompt) + len(output) - (1 if output else 0)
    try:
        stream = d.stream("Decode", {"request_id": rid, "prompt": prompt, "params": params, "kv_tokens": kv,
                                     "output": list(output)})
        it = stream.__aiter__()
        first = await it.__anext__()
        msgs = [m async for m in p.stream("Prefill", {
            "request_id": rid, "prompt": prompt + list(output), "params": {**params, "max_tokens": params[
                "max_tokens"] - len(output)}, "kv_tokens": kv, "sample": not output,
            "dst": {"instance": "d0", **first["reserved"]}},
            timeout=300)]  # a hang guard: the first calls compile (warmup off), slowly on a busy machine
        last = None
        async for msg in it:
            last = msg["update"]
        early = msgs[0]["first"] if len(msgs) == 2 else None
        return first["reserved"], msgs[-1], last, early
    finally:
        await d.close()
        await p.close()


@functools.lru_cache(maxsize=None)
def _colocated(path) -> LLM:
    return LLM(path, progress=False, engine=EngineConfig(**{k: v for k, v in ENGINE.items() if k != "warmup"}))


def colocated_tokens(path, params=GREEDY) -> list[list[int]]:
    return [o.token_ids for o in _colocated(path).generate(PROMPTS, SamplingParams(**params))]


def run_prompts(pinfo, dinfo) -> list:
    async def run():
        return await asyncio.gather(*(disagg_request(pinfo["address"], dinfo["address"], f"r{i}", p, GREEDY)
                                      for i, p in enumerate(PROMPTS)))
    return asyncio.run(run())


def health(*addresses) -> list[dict]:
    async def run():
        out = []
        for a in addresses:
            c = Client(a)
            out.append(await c.call("Health", {}))
            await c.close()
        return out
    return asyncio.run(run())


def test_worker_processes_match_colocated(cluster):
    path, procs, _ = cluster
    pinfo, dinfo = procs["p0"][1], procs["d0"][1]
    assert pinfo["cpus"] == [0] and dinfo["cpus"] == [1]  # pinned before JAX started
    assert dinfo["kv_address"] and pinfo["kv_address"]  # every instance receives KV (a moved prefix, too)
    want = colocated_tokens(path)
    for (reserved, res, last, early), p, w in zip(run_prompts(pinfo, dinfo), PROMPTS, want):
        assert last["token_ids"] == w and last["finished"] and not last["error"]
        assert res["token"] == w[0] and res["kv_bytes"] > 0 and res["sends"] >= 1 and res["backend"] == "tcp"
        # the first token came back from prefill before its KV finished arriving, as decode reports it
        assert early["token_ids"] == w[:1] and not early["finished"] and early["text"] == last["text"][:len(
            early["text"])]
    # no block held on either side once the requests are done
    ph, dh = health(pinfo["address"], dinfo["address"])
    assert ph["stats"]["blocks_used"] == 0 and dh["stats"]["blocks_used"] == 0
    assert ph["stats"]["running"] == 0 and dh["stats"]["running"] == 0


def test_resumed_request_continues_as_if_uninterrupted(cluster):
    """A request whose first tokens reached the client before its instance failed is placed again with that
    output (what the router does): decode computes the last of those tokens, prefill sends the KV before it. With
    seeded sampling the tokens equal the uninterrupted run's (the sampler's key follows the output position)."""
    path, procs, _ = cluster
    pinfo, dinfo = procs["p0"][1], procs["d0"][1]
    seeded = dict(max_tokens=6, temperature=0.9, top_k=20, seed=11, ignore_eos=True)
    want = colocated_tokens(path, seeded)
    assert want != colocated_tokens(path)  # the sampling is not greedy in disguise

    async def run():
        return await asyncio.gather(*(disagg_request(pinfo["address"], dinfo["address"], f"resume{i}", p, seeded,
                                                     output=w[:i + 1]) for i, (p, w) in enumerate(zip(PROMPTS, want))))
    for i, ((reserved, res, last, early), w) in enumerate(zip(asyncio.run(run()), want)):
        assert last["token_ids"] == w and last["finished"] and not last["error"]
        assert early is None and res["token"] is None and res["kv_bytes"] > 0  # prefill sampled nothing
    ph, dh = health(pinfo["address"], dinfo["address"])
    assert ph["stats"]["blocks_used"] == 0 and dh["stats"]["blocks_used"] == 0


def test_device_backend_between_worker_processes(device_cluster):
    """transfer.device_transfer on both ends: decode pulls each layer group's KV from the prefill process's
    JAX transfer server; the same tokens as colocated, no block held afterwards."""
    path, procs, _ = device_cluster
    pinfo, dinfo = procs["p0"][1], procs["d0"][1]
    want = colocated_tokens(path)
    groups = len(layer_groups(load_config(path).num_layers, 2))  # transfer.layers_per_group, stream_min_tokens 0
    assert groups > 1
    for (reserved, res, last, _), p, w in zip(run_prompts(pinfo, dinfo), PROMPTS, want):
        assert reserved["pull"] is True
        assert last["token_ids"] == w and last["finished"] and not last["error"]
        assert res["backend"] == "device" and res["token"] == w[0] and res["kv_bytes"] > 0
        # one PULL per layer group (streamed), and after the first chunk one per group with attention blocks (13
        # tokens in chunks of 8, blocks of 4: the first 2 rows leave then); plus the plan and the record
        assert (res["sends"] > groups if len(p) > 8 else res["sends"] == groups), (res, p)
        assert res["frames"] == res["sends"] + 2
    ph, dh = health(pinfo["address"], dinfo["address"])
    assert ph["stats"]["blocks_used"] == 0 and dh["stats"]["blocks_used"] == 0


async def early_request(p_addr, d_addr, rid, prompt, params, late: bool):
    """The router's early prefill: the Prefill call first (pending_dst, no reservation yet), then decode reserves
    (max_skip 0) and a Bind call gives the prefill the reservation; late: the Bind only after the prefill sampled
    its first token (its KV exported and waiting in the hand-off). -> as disagg_request."""
    d, p = Client(d_addr), Client(p_addr)
    try:
        pre = p.stream("Prefill", {"request_id": rid, "prompt": prompt, "params": params, "kv_tokens": len(prompt),
                                   "pending_dst": "d0"}, timeout=300)
        pit = pre.__aiter__()
        msgs = [await pit.__anext__()] if late else []
        stream = d.stream("Decode", {"request_id": rid, "prompt": prompt, "params": params,
                                     "kv_tokens": len(prompt), "max_skip": 0})
        it = stream.__aiter__()
        first = await it.__anext__()
        assert await p.call("Bind", {"request_id": rid, "dst": {"instance": "d0", **first["reserved"]}}) == {
            "bound": True}
        msgs += [m async for m in pit]
        last = None
        async for msg in it:
            last = msg["update"]
        return first["reserved"], msgs[-1], last, msgs[0]["first"] if len(msgs) == 2 else None
    finally:
        await d.close()
        await p.close()


@pytest.mark.parametrize("backend", ["cluster", "device_cluster"])
def test_a_prefill_started_before_decode_reserved_matches_colocated(backend, request):
    """The Prefill call before the reservation (the router's early prefill): the prefill computes at once, its
    exports wait in the hand-off until the Bind call brings decode's reservation, bound while it runs or only after
    its first token; decode asked for max_skip 0 reserves every block though it holds the prompt's prefix (a
    reservation without max_skip skips it), and the tokens equal colocated's, with no block held afterwards."""
    path, procs, _ = request.getfixturevalue(backend)
    p_addr, d_addr = procs["p0"][1]["address"], procs["d0"][1]["address"]
    want = colocated_tokens(path)

    async def run():
        cached = await disagg_request(p_addr, d_addr, "cached", PROMPTS[0], GREEDY)  # decode now holds it
        again = await disagg_request(p_addr, d_addr, "again", PROMPTS[0], GREEDY)
        early = []
        for late in (False, True):  # three at a time: decode has four slots
            early += await asyncio.gather(*(early_request(p_addr, d_addr, f"early{i}{late}", p, GREEDY, late)
                                            for i, p in enumerate(PROMPTS)))
        return cached, again, early
    cached, again, early = asyncio.run(run())
    assert cached[2]["token_ids"] == want[0] and again[2]["token_ids"] == want[0] and again[0]["skip"] > 0
    for (reserved, res, last, first), w in zip(early, want + want):
        assert reserved["skip"] == 0 and res["kv_bytes"] > 0
        assert last["token_ids"] == w and last["finished"] and not last["error"]
        assert res["token"] == w[0] and first["token_ids"] == w[:1]
        assert res["backend"] == ("device" if backend == "device_cluster" else "tcp")
    for _ in range(100):  # the last acknowledgements
        ph, dh = health(p_addr, d_addr)
        if not ph["stats"]["blocks_used"] and not dh["stats"]["blocks_used"]:
            break
        time.sleep(0.05)
    assert ph["stats"]["blocks_used"] == 0 and dh["stats"]["blocks_used"] == 0


def test_a_bind_that_does_not_fit_fails_the_prefill(cluster):
    """A Bind for no waiting prefill is NOT_FOUND; one whose reservation cannot take the KV (skipping blocks, on
    another instance) is refused and the Prefill call it was for fails (ABORTED), decode's reservation given back
    when its stream closes; a Prefill naming both or neither destination, or a prefill instance as pending_dst, is
    refused before any work."""
    _, procs, _ = cluster
    p_addr, d_addr = procs["p0"][1]["address"], procs["d0"][1]["address"]
    prompt = BASE[:13]
    pre = {"request_id": "b", "prompt": prompt, "params": GREEDY, "kv_tokens": len(prompt)}

    async def run():
        out = {}
        d, p = Client(d_addr), Client(p_addr)
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.call("Bind", {"request_id": "nobody", "dst": {"instance": "d0", "blocks": [0], "skip": 0}})
            out["unknown"] = e.value.code(), e.value.details()
            for name, extra in (("both", {"pending_dst": "d0", "dst": {"instance": "d0", "blocks": [0], "skip": 0}}),
                                ("neither", {}), ("prefill", {"pending_dst": "p0"})):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await p.stream("Prefill", {**pre, "request_id": name, **extra}).read()
                out[name] = e.value.code(), e.value.details()
            for name, bad in (("skip", {"skip": 1}), ("instance", {"instance": "p0"})):
                stream = d.stream("Decode", {**pre, "request_id": name, "max_skip": 0})
                reserved = (await stream.read())["reserved"]
                call = p.stream("Prefill", {**pre, "request_id": name, "pending_dst": "d0"})
                first = await call.read()  # computed; its KV waits for the reservation
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await p.call("Bind", {"request_id": name, "dst": {"instance": "d0", **reserved, **bad}})
                out["bind", name] = e.value.code(), e.value.details()
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await call.read()
                out["prefill", name] = e.value.code(), e.value.details(), "first" in first
                stream.cancel()
            for _ in range(100):
                hp, hd = await p.call("Health", {}), await d.call("Health", {})
                if not hp["stats"]["blocks_used"] and not hd["stats"]["blocks_used"]:
                    break
                await asyncio.sleep(0.05)
            return out, hp, hd
        finally:
            await d.close()
            await p.close()
    out, hp, hd = asyncio.run(run())
    assert out["unknown"][0] == grpc.StatusCode.NOT_FOUND and "no prefill of 'nobody'" in out["unknown"][1]
    assert out["both"][0] == out["neither"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "names its destination once" in out["both"][1] and "names its destination once" in out["neither"][1]
    assert out["prefill"] == (grpc.StatusCode.INVALID_ARGUMENT,
                              "pending_dst: 'p0' is a prefill instance, not a decode instance")
    assert out["bind", "skip"][0] == grpc.StatusCode.INVALID_ARGUMENT and "dst.skip: 1" in out["bind", "skip"][1]
    assert out["bind", "instance"][0] == grpc.StatusCode.INVALID_ARGUMENT
    assert "dst.instance: 'p0', the Prefill named 'd0'" in out["bind", "instance"][1]
    for name in ("skip", "instance"):
        code, why, sampled = out["prefill", name]
        assert code == grpc.StatusCode.ABORTED and "destination refused" in why and sampled
    assert hp["stats"]["blocks_used"] == 0 and hd["stats"]["blocks_used"] == 0 and hd["stats"]["running"] == 0


def test_wrong_role_is_refused(cluster):
    _, procs, _ = cluster

    async def run():
        c = Client(procs["d0"][1]["address"])
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await c.call("Prefill", {"request_id": "x", "prompt": [1], "kv_tokens": 1,
                                         "dst": {"instance": "d0", "blocks": [0], "skip": 0}})
            return e.value
        finally:
            await c.close()
    err = asyncio.run(run())
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION and "decode instance" in err.details()


def test_reservation_without_prefill_fails_after_deadline_and_frees(cluster):
    """Prefill never comes (as when its worker is killed before sending): decode fails the request cleanly."""
    _, procs, _ = cluster
    d_addr = procs["d0"][1]["address"]

    async def run():
        d = Client(d_addr)
        try:
            msgs = [m async for m in d.stream("Decode", {"request_id": "orphan", "prompt": BASE[:9],
                                                          "params": GREEDY, "kv_tokens": 9,
                                                          "deadline_s": 1.0}, timeout=30)]
            h = await d.call("Health", {})
            return msgs, h
        finally:
            await d.close()
    msgs, h = asyncio.run(run())
    assert "reserved" in msgs[0]
    last = msgs[-1]["update"]
    assert last["finished"] and last["finish_reason"] == "error" and "deadline" in last["error"]
    assert h["stats"]["blocks_used"] == 0


def test_an_import_without_room_waits_for_it_or_is_refused_at_its_deadline(cluster):
    """Two Imports take all but 2 of p0's 64 blocks: a third (3 blocks) is not refused at once but waits; with a
    short deadline it is refused when that passes (RESOURCE_EXHAUSTED, nothing held); with a long one it is
    reserved as soon as one of the two is released; one whose caller goes away while it waits is withdrawn."""
    _, procs, _ = cluster
    p_addr = procs["p0"][1]["address"]

    async def run():
        p = Client(p_addr)
        try:
            big = [p.stream("Import", {"request_id": f"big{i}", "prompt": [40 + i] * 124, "deadline_s": 60})
                   for i in range(2)]
            for s in big:
                assert "reserved" in await s.read()
            t0 = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await p.stream("Import", {"request_id": "short", "prompt": [50] * 12, "deadline_s": 0.5}).read()
            short = (e.value.code(), e.value.details(), time.monotonic() - t0)
            gone = p.stream("Import", {"request_id": "gone", "prompt": [51] * 12, "deadline_s": 60})
            gone_read = asyncio.ensure_future(gone.read())  # (it would be reserved too, and held, if not withdrawn)
            waiting = p.stream("Import", {"request_id": "wait", "prompt": [52] * 12, "deadline_s": 60})
            first = asyncio.ensure_future(waiting.read())
            for _ in range(200):  # both are waiting on p0 (its Health says so)
                if (await p.call("Health", {}))["stats"]["prefixes_waiting"] == 2:
                    break
                await asyncio.sleep(0.02)
            waited = (await p.call("Health", {}))["stats"]["prefixes_waiting"]
            gone.cancel()  # its caller goes away: withdrawn
            gone_read.cancel()
            big[0].cancel()  # 31 blocks free again: "wait" is reserved
            reserved = await asyncio.wait_for(first, 30)
            for s in (waiting, big[1]):
                s.cancel()
            for _ in range(200):
                h = (await p.call("Health", {}))["stats"]
                if not h["blocks_used"] and not h["prefixes_waiting"] and not h["reservations"]:
                    break
                await asyncio.sleep(0.05)
            return short, waited, reserved, h
        finally:
            await p.close()
    short, waited, reserved, h = asyncio.run(run())
    assert short[0] == grpc.StatusCode.RESOURCE_EXHAUSTED and "no room" in short[1] and short[2] >= 0.5, short
    assert waited == 2 and "reserved" in reserved
    assert h["blocks_used"] == 0 and h["prefixes_waiting"] == 0 and h["reservations"] == 0, h


def test_prefill_worker_killed_mid_request_frees_decode_blocks(cluster):
    """A second prefill worker is killed (SIGKILL) while it serves Prefill: the decode side's request fails
    with a clear error at its deadline, nothing hangs, and no block stays held on the decode worker."""
    _, procs, (cfg_path, router) = cluster
    victim, info = start_worker(cfg_path, "p0", router)
    d_addr = procs["d0"][1]["address"]
    prompt = BASE[:17]

    async def run():
        d, p = Client(d_addr), Client(info["address"])
        try:
            stream = d.stream("Decode", {"request_id": "killed", "prompt": prompt, "params": GREEDY,
                                         "kv_tokens": len(prompt), "deadline_s": 5.0}, timeout=60)
            it = stream.__aiter__()
            first = await it.__anext__()
            call = asyncio.ensure_future(p.call("Prefill", {"request_id": "killed", "prompt": prompt,
                                                            "params": GREEDY, "kv_tokens": len(prompt),
                                                            "dst": {"instance": "d0", **first["reserved"]}},
                                                 timeout=60))
            await asyncio.sleep(0)  # the call is on its way
            victim.kill()
            with pytest.raises(grpc.aio.AioRpcError):
                await call
            msgs = [m async for m in it]
            return msgs, await d.call("Health", {})
        finally:
            await d.close()
            await p.close()
    msgs, h = asyncio.run(run())
    victim.wait(30)
    last = msgs[-1]["update"]
    assert last["finished"] and last["finish_reason"] == "error" and "KV transfer failed" in last["error"]
    assert h["stats"]["blocks_used"] == 0 and h["stats"]["running"] == 0


def test_worker_methods_refuse_callers_without_the_token_and_forged_destinations(cluster):
    """Health and Generate answer no caller without the cluster token, nor one without TLS; a Prefill call may not choose where the
    KV goes: an instance the router has not registered, or a prefill instance, is refused before any work."""
    _, procs, _ = cluster
    p_addr, d_addr = procs["p0"][1]["address"], procs["d0"][1]["address"]

    async def run():
        out = {}
        for token in ("", "wrong"):
            c = Client(d_addr, token)
            try:
                for name, call in (("Health", lambda: c.call("Health", {})),
                                   ("Generate", lambda: c.stream("Generate", {"request_id": "g", "prompt": [1, 2],
                                                                              "params": GREEDY}).read())):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await call()
                    out[(token, name)] = e.value.code()
            finally:
                await c.close()
        plain = Client(d_addr, tls=False)  # the right token without TLS: no connection at all
        try:
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await plain.call("Health", {}, timeout=5)
            out["plaintext"] = e.value.code()
        finally:
            await plain.close()
        p = Client(p_addr)
        try:
            for dst in ({"instance": "elsewhere", "blocks": [0, 1, 2], "skip": 0},
                        {"instance": "p0", "blocks": [0, 1, 2], "skip": 0},
                        {"instance": "d0", "blocks": [0], "skip": 0}):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await p.stream("Prefill", {"request_id": "forged", "prompt": BASE[:9], "params": GREEDY,
                                               "kv_tokens": 9, "dst": dst}).read()
                out[dst["instance"], len(dst["blocks"])] = (e.value.code(), e.value.details())
            for sc in ({"import_id": "put", "tokens": 8, "dst": {"instance": "d0", "blocks": [0, 1], "skip": 0}},
                       {"import_id": "put", "tokens": 6, "dst": {"instance": "d0", "blocks": [0, 1], "skip": 0}}):
                with pytest.raises(grpc.aio.AioRpcError) as e:  # the store's copy: only into the store, whole blocks
                    await p.stream("Prefill", {"request_id": "forged", "prompt": BASE[:9], "params": GREEDY,
                                               "kv_tokens": 9, "dst": {"instance": "d0", "blocks": [0, 1, 2],
                                                                       "skip": 0}, "store": sc}).read()
                out["store", sc["tokens"]] = (e.value.code(), e.value.details())
            imp = p.stream("Import", {"request_id": "imp", "prompt": [7] * 4})  # a prefix arriving, not BASE's
            assert "reserved" in await imp.read()
            for pf in ({"import_id": "imp", "tokens": 4}, {"import_id": "imp", "tokens": 6},
                       {"import_id": "imp", "tokens": 12},
                       {"import_id": "imp", "shared": {"instance": "s0"}, "tokens": 8}):  # no such source (any more)
                with pytest.raises(grpc.aio.AioRpcError) as e:  # the prefix it runs over: which, how much
                    await p.stream("Prefill", {"request_id": "forged", "prompt": BASE[:9], "params": GREEDY,
                                               "kv_tokens": 9, "dst": {"instance": "d0", "blocks": [0, 1, 2],
                                                                       "skip": 0}, "prefix_from": pf}).read()
                out["from", pf["tokens"], *pf] = (e.value.code(), e.value.details())
            imp.cancel()  # the reservation is released
            for store in ("d0", "nowhere"):  # a Load from a store's shared pool: only a registered store's
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await p.call("Load", {"request_id": "l", "prompt": BASE[:8], "store": store})
                out["load", store] = (e.value.code(), e.value.details())
            for _ in range(100):
                health = await p.call("Health", {})
                if not health["stats"]["blocks_used"]:
                    break
                await asyncio.sleep(0.05)
        finally:
            await p.close()
        return out, health
    out, health = asyncio.run(run())
    assert all(out[(t, n)] == grpc.StatusCode.UNAUTHENTICATED for t in ("", "wrong") for n in ("Health", "Generate"))
    assert out["plaintext"] in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    code, why = out["elsewhere", 3]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not an instance registered with the router" in why
    code, why = out["p0", 3]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "not a decode instance" in why
    code, why = out["d0", 1]
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "dst.blocks" in why
    for key, why in ((("from", 4, "import_id", "tokens"),
                      "prefix_from.import_id: 'imp' carries another prefix than the prompt's first 4"),
                     (("from", 6, "import_id", "tokens"), "prefix_from.tokens: 6 is not whole blocks"),
                     (("from", 12, "import_id", "tokens"),
                      "prefix_from.tokens: 12 is not whole blocks of 4 tokens shorter than"),
                     (("from", 8, "import_id", "shared", "tokens"),
                      "prefix_from.shared: Extra inputs are not permitted")):
        assert out[key][0] == grpc.StatusCode.INVALID_ARGUMENT and why in out[key][1], (key, out[key])
    assert out["store", 8][0] == grpc.StatusCode.INVALID_ARGUMENT and "not the store" in out["store", 8][1]
    assert out["store", 6][0] == grpc.StatusCode.INVALID_ARGUMENT and "store.tokens: 6" in out["store", 6][1]
    for store in ("d0", "nowhere"):
        assert out["load", store] == (grpc.StatusCode.FAILED_PRECONDITION,
                                      f"store: {store!r} is not a store with a shared pool"), out["load", store]
    assert health["stats"]["blocks_used"] == 0 and health["stats"]["running"] == 0
