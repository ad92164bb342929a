"""The router's orchestration against scripted fake workers (real gRPC servers in this process, no model):
registration, placement, retries with a fresh reservation, the local-prefill fallback, a hung worker found
by its missing heartbeat, busy and invalid refusals, n > 1 fan-out, abort, the global KV store's pipelined load.
The fakes speak the workers'
protocol (worker/main.py); the real workers are exercised in test_cluster_http.py and test_faults.py."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from jaxserve.config import parse
from jaxserve.engine.client import EngineUnavailable, QueueFull, RequestError
from jaxserve.sampling import SamplingParams
from jaxserve.worker import messages, rpc
from jaxserve.router.cluster import Router

TOKEN = "tok"


class Fake:
    """A worker whose answers are scripted: `prefill` in ok | abort | hang | hold (the first token goes out, the KV
    waits for `release`), `decode` in ok | full | full_late (full, refused once the request's Prefill call came to a
    prefill instance) | invalid | garbage (a malformed update after the KV arrived) | die (the stream breaks after
    the first token) | hang (no reservation, no heartbeat: a stopped process) | after_import (the reservation waits
    until an Import was opened on any instance); `await_put`: the request ids whose reservation waits until the
    router holds the store's answer to their write-back's Import (an event the test sets); `export` in ok | fail (a
    store no longer holding the prefix; a prefill instance's read of the store's shared pool too); `bind` in ok |
    refuse (INVALID_ARGUMENT: a Prefill called before decode reserved then fails, ABORTED, as the worker's does). A
    Prefill named with `pending_dst` sends its KV once its Bind came; `reserve_wait`: the request ids whose Decode
    answers its reservation only once the test sets board[("reserve", id)]. Import answers its reservation, then
    `imported` once an Export filled it (or a Prefill naming it, with `streams`: a prefill instance that writes the
    store's copy as it computes). `shared`: a store advertises a shared KV pool, a prefill instance reads such pools
    (both on this host)."""

    def __init__(self, name, role, board, prefill="ok", decode="ok", export="ok", shared=False, streams=False,
                 bind="ok"):
        self.name, self.role, self.board = name, role, board
        self.streams = streams
        self.await_put: set = set()
        self.reserve_wait: set = set()
        self.prefill_mode, self.decode_mode, self.export_mode, self.bind_mode = prefill, decode, export, bind
        self.binds = []  # (request id, its reservation's instance) of each Bind
        self.shared = shared
        self.opened, self.closed, self.prefills, self.generated = [], [], [], []
        self.imports, self.imports_closed, self.exports, self.loads = [], [], [], []
        self.requests = []  # every Decode / Prefill / Generate message
        self.release = asyncio.Event()
        self.beating = True

    async def start(self):
        self.server = rpc.server(TOKEN)
        self.server.add_generic_rpc_handlers((rpc.handler(
            {"Export": self.export, "Load": self.load, "Bind": self.bind},
            {"Prefill": self.prefill, "Decode": self.decode, "Generate": self.generate,
                                      "Import": self.import_}, messages.WORKER),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()

    def health(self):
        shared = {}
        if self.shared and self.role == "store":
            shared = {"pool": {"name": "pool-s", "boot": "host-a", "bytes": 4096, "signature": "x", "leaves": [],
                               "table": {"offset": 0, "blocks": 0, "rows": 0}}}
        elif self.shared:
            shared = {"shm": {"name": f"recv-{self.name}", "boot": "host-a", "bytes": 4096}, "reads_pool": True}
        return {"name": self.name, "role": self.role, "address": self.address, "pid": 1, "max_model_len": 64,
                "kv_address": ["127.0.0.1", 1] if self.role != "prefill" else None, "stats": {}, "links": {},
                **shared}

    @staticmethod
    def output(req):
        seed = req["params"]["seed"]
        return [len(req["prompt"]), seed if seed is not None else 0]

    async def decode(self, req, ctx):
        if self.decode_mode == "full_late":  # refused once the request's early Prefill call reached its worker
            came = self.board.setdefault(("prefill came", req.request_id), asyncio.Event())
            await asyncio.wait_for(came.wait(), 5)
        if self.decode_mode in ("full", "full_late"):
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "OutOfBlocks: no room")
        if self.decode_mode == "invalid":
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "prompt too long")
        if self.decode_mode == "bug":
            raise KeyError("a handler's bug")
        if self.decode_mode == "hang":
            self.beating = False
            await asyncio.Event().wait()
        if self.decode_mode == "after_import":
            await asyncio.wait_for(self.board.setdefault("import opened", asyncio.Event()).wait(), 5)
        req = req.model_dump()
        xid = req["request_id"]
        if xid in self.await_put:  # answered once the router holds the store's answer to the write-back's Import
            await asyncio.wait_for(self.board.setdefault(("router reserved", f"{xid}.put"), asyncio.Event()).wait(), 5)
        if xid in self.reserve_wait:
            await asyncio.wait_for(self.board.setdefault(("reserve", xid), asyncio.Event()).wait(), 5)
        self.opened.append(xid)
        self.requests.append(req)
        arrived = self.board.setdefault(xid, asyncio.Event())
        try:
            yield {"reserved": {"blocks": [0], "skip": 0, "shm_base": None, "pull": False}}
            await arrived.wait()
            if self.decode_mode == "garbage":
                yield {"update": {"bogus": 1}}
            out = self.output(req)
            yield {"update": update(out[:1], False)}
            if self.decode_mode == "die":
                await ctx.abort(grpc.StatusCode.UNAVAILABLE, "injected: connection reset")
            yield {"update": update(out, True)}
        finally:
            self.closed.append(xid)

    async def prefill(self, req, ctx):
        req = req.model_dump()
        self.prefills.append(req["request_id"])
        self.requests.append(req)
        self.board.setdefault(("prefill came", req["request_id"]), asyncio.Event()).set()
        if req["prefix_from"] is not None:
            self.board.setdefault(("prefill names", req["prefix_from"]["import_id"]), asyncio.Event()).set()
        if self.prefill_mode == "abort":
            await ctx.abort(grpc.StatusCode.ABORTED, "KV transfer failed: injected")
        if self.prefill_mode == "hang":
            self.beating = False  # as a hung process: no answer, no heartbeat
            await asyncio.Event().wait()
        if req["sample"]:
            yield {"first": update(self.output(req)[:1], False)}
        if self.prefill_mode == "hold":
            await self.release.wait()
        if req["pending_dst"] is not None:  # the KV goes once the reservation is bound
            await asyncio.wait_for(self.board.setdefault(("bound", req["request_id"]), asyncio.Event()).wait(), 5)
            if self.bind_mode == "refuse":
                await ctx.abort(grpc.StatusCode.ABORTED, "KV transfer failed: destination refused: injected")
        self.board.setdefault(req["request_id"], asyncio.Event()).set()
        store = req["store"]
        if store is not None and self.streams:  # the KV went to the store's reservation too
            self.board.setdefault(("exported", store["import_id"]), asyncio.Event()).set()
        yield {"kv_bytes": 100, "frames": 1, "sends": 1, "resends": 0, "token": 0, "ttft_s": 0.0, "backend": "tcp",
               **({"store": {"streamed": self.streams}} if store is not None else {})}

    async def bind(self, req, ctx):
        self.binds.append((req.request_id, req.dst.instance))
        self.board.setdefault(("bound", req.request_id), asyncio.Event()).set()
        if self.bind_mode == "refuse":
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, "dst.blocks: injected")
        return {"bound": True}

    async def import_(self, req, ctx):
        rid = req.request_id
        self.imports.append(rid)
        self.board.setdefault("import opened", asyncio.Event()).set()
        try:
            yield {"reserved": {"blocks": [5], "skip": 0, "shm_base": None, "pull": False}}
            self.board.setdefault(("import reserved", rid), asyncio.Event()).set()
            await self.board.setdefault(("exported", rid), asyncio.Event()).wait()
            yield {"imported": {"tokens": len(req.prompt), "skip": 0, "kv_bytes": 512}}
        finally:  # also where the router cancels the call: the server runs this after the router has moved on
            self.imports_closed.append(rid)
            self.board.setdefault(("import closed", rid), asyncio.Event()).set()

    async def export(self, req, ctx):
        self.exports.append((req.request_id, req.dst.instance, list(req.dst.blocks)))
        if self.export_mode == "fail":
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.name} no longer holds the prefix")
        self.board.setdefault(("exported", req.request_id), asyncio.Event()).set()
        return {"kv_bytes": 4096, "frames": 1, "sends": 1, "resends": 0, "backend": "tcp"}

    async def load(self, req, ctx):  # from the store's shared pool: it holds the prefix, or not
        self.loads.append((req.request_id, req.store, len(req.prompt)))
        # answered only once the Prefill naming it has come: the router does not wait for the copy to send it
        await asyncio.wait_for(self.board.setdefault(("prefill names", req.request_id), asyncio.Event()).wait(), 5)
        if self.board[req.store].export_mode == "fail":
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, "the store's pool does not hold block 0 of it")
        return {"kv_bytes": 2048, "seconds": 0.002}

    async def generate(self, req, ctx):
        req = req.model_dump()
        self.generated.append(req["request_id"])
        yield {"update": update(self.output(req), True)}


def update(tokens, finished):
    return {"index": 0, "token_ids": tokens, "text": "", "finished": finished,
            "finish_reason": "length" if finished else None, "logprobs": [], "cached_tokens": 0,
            "prompt_tokens": 3, "error": None, "ttft_s": 0.01}


@contextlib.asynccontextmanager
async def cluster(fakes: dict, make=None, **router):
    """The router and fake workers {name: (role, Fake's options)}; make(name, role, board, **options): another kind
    of fake (Fake by default)."""
    cfg = parse({"clusters": [{"name": "c", "instances": [{"name": n, "role": f[0]} for n, f in fakes.items()]}],
                 "transfer": {"token": TOKEN},
                 # down after 2 s without a heartbeat (every 50 ms here): a suite on two busy cores stalls a loop
                 # for over a second now and then, which marked a beating worker down
                 "router": {"heartbeat_s": 0.1, "down_after_s": 2.0, "busy_wait_s": 0.2, **router}})
    board: dict = {}
    workers = {n: (make or Fake)(n, role, board, **kw) for n, (role, kw) in fakes.items()}
    ce = Router(cfg, tokenizer=None)
    await ce.start()
    for w in workers.values():
        await w.start()

    async def beat():
        client = rpc.Client(ce.address, TOKEN)
        while True:
            for w in workers.values():
                if w.beating:
                    await client.call("Register", w.health())
            await asyncio.sleep(0.05)
    beats = asyncio.ensure_future(beat())
    while len(ce.registry.up()) < len(workers):
        await ce.joined()
    try:
        yield ce, workers
    finally:
        beats.cancel()
        await ce.close()
        for w in workers.values():
            await w.server.stop(0)


async def result(q: asyncio.Queue, n=1):
    final = {}
    while len(final) < n:
        u = await asyncio.wait_for(q.get(), 10)
        if u.finished:
            final[u.index] = u
    return [final[i] for i in range(n)]


GREEDY = SamplingParams(max_tokens=4, temperature=0)
P, D = ("prefill", {}), ("decode", {})


def test_disaggregated_request_and_registration():
    async def go():
        async with cluster({"p0": P, "d0": D}) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.token_ids == [3, 0] and u.error is None
            placed = u.route.pop("placed_s")  # arrival to d0's reservation: before the prefill, so before TTFT
            assert 0 < placed <= u.ttft_s, (placed, u.ttft_s)
            assert u.route.pop("prefill_ttft_s") == 0.01  # p0's own, from its first-token message (update())
            assert u.route == {"route": "pd", "prefill_instance": "p0", "decode_instance": "d0",
                               "prefill_cluster": "c", "decode_cluster": "c", "prefix_source": None,
                               "prefix_move": None,
                               "kv_bytes_transferred": 100, "kv_backend": "tcp", "attempts": 1}
            assert w["d0"].opened == ["r.1"] and w["p0"].prefills == ["r.1"]
            c, intruder = rpc.Client(ce.address, TOKEN), rpc.Client(ce.address, "nope")
            try:
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await intruder.call("Register", w["p0"].health())
                assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
                for bad in [{"name": "stranger"}, {"role": "decode"}, {"max_model_len": "64"}, {"extra": 1}]:
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await c.call("Register", {**w["p0"].health(), **bad})
                    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            finally:
                await c.close()
                await intruder.close()
            assert sorted(ce.registry.workers) == ["d0", "p0"]
            await asyncio.sleep(0.05)
            assert not ce.tasks and w["d0"].closed == ["r.1"]
    asyncio.run(go())


async def updates(q: asyncio.Queue) -> list:
    out = []
    while not out or not out[-1].finished:
        out.append(await asyncio.wait_for(q.get(), 10))
    return out


def test_first_token_comes_from_prefill_while_the_kv_travels():
    async def go():
        async with cluster({"p0": ("prefill", {"prefill": "hold"}), "d0": D}) as (ce, w):
            q = await ce.add("r", [1, 2, 3], GREEDY)
            u = await asyncio.wait_for(q.get(), 10)
            assert u.token_ids == [3] and not u.finished and u.ttft_s is not None
            assert "r.1" not in w["d0"].board or not w["d0"].board["r.1"].is_set()  # decode has no KV yet
            w["p0"].release.set()
            rest = await updates(q)  # decode's report of the first token is not passed on again
            assert [x.token_ids for x in rest] == [[3, 0]] and rest[-1].error is None
            assert rest[-1].ttft_s == u.ttft_s and rest[-1].route["kv_bytes_transferred"] == 100
    asyncio.run(go())


def test_decode_failing_after_tokens_resumes_the_request_elsewhere():
    async def go():
        async with cluster({"p0": P, "d0": ("decode", {"decode": "die"}), "d1": D}) as (ce, w):
            ups = await updates(await ce.add("r", [1, 2, 3], GREEDY))
            assert [u.token_ids for u in ups] == [[3], [3, 0]] and ups[-1].error is None  # every token once
            assert ups[-1].route["decode_instance"] == "d1" and ups[-1].route["attempts"] == 2
            resumed = w["d1"].requests[0]  # the output so far; decode computes its last token
            assert resumed["output"] == [3] and resumed["kv_tokens"] == 3 and resumed["prompt"] == [1, 2, 3]
            again = w["p0"].requests[-1]  # prefill sends the KV of prompt + output but that last token
            assert again["prompt"] == [1, 2, 3, 3] and again["kv_tokens"] == 3 and not again["sample"]
            assert again["params"]["max_tokens"] == GREEDY.max_tokens - 1
            assert not ce.registry.is_up(ce.registry.workers["d0"]) and ce.retries == 1
    asyncio.run(go())


def test_prefill_failure_retries_with_a_fresh_reservation():
    async def go():
        async with cluster({"p0": ("prefill", {"prefill": "abort"}), "p1": P, "d0": D}) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.error is None and u.route["prefill_instance"] == "p1" and u.route["attempts"] == 2
            assert w["p0"].prefills == ["r.1"] and w["p1"].prefills == ["r.2"]
            assert "r.1" in w["d0"].closed  # the first reservation was given back before the second was made
            assert ce.registry.is_up(ce.registry.workers["p0"])  # a failed transfer is not a dead worker
            assert ce.retries == 1
    asyncio.run(go())


@pytest.mark.parametrize("fallback", [True, False])
def test_no_prefill_left_prefills_locally_or_fails(fallback):
    async def go():
        async with cluster({"p0": ("prefill", {"prefill": "abort"}), "d0": D}, local_fallback=fallback) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            if fallback:  # the whole request on the decode instance
                # placed again with no prefill instance left: straight to Generate, no second reservation
                assert u.error is None and u.token_ids == [3, 0] and w["d0"].generated == ["r.2"]
                assert w["d0"].opened == ["r.1"] and u.route["route"] == "colocated"
                assert u.route["prefill_instance"] == u.route["decode_instance"] == "d0"
                assert u.route["kv_bytes_transferred"] == 0
            else:
                assert u.finish_reason == "error" and "no prefill instance is up" in u.error
    asyncio.run(go())


def test_hung_prefill_is_abandoned_when_its_heartbeat_stops():
    async def go():
        async with cluster({"p0": ("prefill", {"prefill": "hang"}), "p1": P, "d0": D}) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.error is None and u.route["prefill_instance"] == "p1"
            assert not ce.registry.is_up(ce.registry.workers["p0"])
    asyncio.run(go())


def test_a_decode_instance_that_hangs_before_reserving_is_abandoned_at_its_heartbeat():
    """A stopped decode process accepts the Decode call (the kernel still answers TCP) and never sends its
    reservation: the placement is given up once the registry stops counting it up, not when HTTP/2 keepalive
    notices, and the request is placed on the other decode instance."""
    async def go():
        async with cluster({"p0": P, "d0": ("decode", {"decode": "hang"}), "d1": D}) as (ce, w):
            t = asyncio.get_running_loop().time()
            u, = await result(await asyncio.wait_for(ce.add("r", [1, 2, 3], GREEDY), 10))
            assert u.error is None and u.route["decode_instance"] == "d1"
            assert asyncio.get_running_loop().time() - t < 5  # down_after_s 2 plus a heartbeat, not keepalive
    asyncio.run(go())


def test_refusals_busy_invalid_and_attempts():
    async def go():
        async with cluster({"p0": P, "d0": ("decode", {"decode": "invalid"})}, early_prefill=False) as (ce, w):
            with pytest.raises(RequestError, match="prompt too long"):
                await ce.add("r", [1, 2, 3], GREEDY)
            assert w["p0"].prefills == []  # refused before any prefill work
        async with cluster({"p0": P, "d0": ("decode", {"decode": "invalid"})}) as (ce, w):
            with pytest.raises(RequestError, match="prompt too long"):
                await ce.add("r", [1, 2, 3], GREEDY)
            # the Prefill call began beside the reservation: cancelled with it, never bound
            for _ in range(100):
                if not ce.registry.workers["p0"].inflight:
                    break
                await asyncio.sleep(0.01)
            assert w["p0"].prefills == ["r.1"] and w["p0"].binds == [] and ce.registry.workers["p0"].inflight == 0
        async with cluster({"p0": P, "d0": ("decode", {"decode": "full"})}) as (ce, w):
            with pytest.raises(QueueFull, match="no decode instance had room"):
                await ce.add("r", [1, 2, 3], GREEDY)
        async with cluster({"p0": ("prefill", {"prefill": "abort"}), "p1": ("prefill", {"prefill": "abort"}),
                            "d0": D}, local_fallback=False, max_attempts=2) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.finish_reason == "error" and "gave up after 2 failed attempts" in u.error and "injected" in u.error
        async with cluster({"p0": P, "d0": D}) as (ce, w):
            await ce.close()
            for f in w.values():
                await f.server.stop(0)
            ce.registry.mark_down("d0", "gone")
            ce.registry.mark_down("p0", "gone")
            with pytest.raises(EngineUnavailable, match="no instance is up"):
                await ce.add("r", [1, 2, 3], GREEDY)
            assert ce.health()["status"] == "degraded"
    asyncio.run(go())


def test_n_fans_out_with_consecutive_seeds_and_abort_frees():
    async def go():
        async with cluster({"p0": ("prefill", {"prefill": "hang"}), "d0": D}, down_after_s=30.0) as (ce, w):
            q = await ce.add("r", [1, 2], SamplingParams(max_tokens=4, seed=7, n=2))
            while len(w["p0"].prefills) < 2:
                await asyncio.sleep(0.01)
            assert sorted(w["d0"].opened) == ["r-0.1", "r-1.1"]
            ce.abort("r")  # the client went away: both reservations and prefill calls are cancelled
            for _ in range(100):
                if len(w["d0"].closed) == 2:
                    break
                await asyncio.sleep(0.01)
            assert sorted(w["d0"].closed) == ["r-0.1", "r-1.1"] and ce.tasks == {} and q.empty()
        async with cluster({"p0": P, "d0": D}) as (ce, w):
            ups = await result(await ce.add("r", [1, 2], SamplingParams(max_tokens=4, seed=7, n=2)), n=2)
            assert [u.token_ids for u in ups] == [[2, 7], [2, 8]] and [u.index for u in ups] == [0, 1]
    asyncio.run(go())


def test_a_malformed_worker_message_ends_the_request_with_an_error():
    async def go():
        async with cluster({"p0": P, "d0": ("decode", {"decode": "garbage"})}) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.finished and u.finish_reason == "error" and "router error: TypeError" in u.error
            await asyncio.sleep(0.05)
            assert w["d0"].closed == ["r.1"] and ce.tasks == {}
    asyncio.run(go())


def test_a_handler_bug_fails_the_placement_not_the_worker():
    """INTERNAL (or any status but UNAVAILABLE) is the request's failure: it is placed elsewhere, and the worker
    that answered stays in rotation (only a transport failure marks a worker down)."""
    async def go():
        async with cluster({"p0": P, "d0": ("decode", {"decode": "bug"}), "d1": D}) as (ce, w):
            u, = await result(await ce.add("r", [1, 2, 3], GREEDY))
            assert u.error is None and u.route["decode_instance"] == "d1"
            assert ce.registry.is_up(ce.registry.workers["d0"]) and ce.registry.workers["d0"].failures == 0
            w["d0"].decode_mode = "ok"
            u, = await result(await ce.add("r2", [1, 2, 3], GREEDY))
            assert u.error is None and u.route["decode_instance"] == "d0"  # in rotation: first by name again
    asyncio.run(go())


class FromStore:
    """Placement: prefill on p0 over the prompt's first `tokens` loaded from the store s0 (pipelined), decode on
    d0."""
    name = "banaserve"

    def __init__(self, tokens: int, uncached: int):
        self.tokens, self.uncached = tokens, uncached

    def state(self):
        return {}

    def place(self, snap):
        from jaxserve.router.policies.base import Placement, PrefixMove
        return Placement("d0", "p0", "pd", "test: from the store", PrefixMove("s0", self.tokens, overlap=True),
                         self.uncached, "s0")


@pytest.mark.parametrize("export", ["ok", "fail"])
def test_a_pipelined_load_from_the_store_starts_beside_the_decode_reservation(export):
    """BanaServe's pipelined load: the Import on the prefill instance is opened before the decode reservation is
    answered (decode here waits for it), the store's Export fills it, and the Prefill call names that Import. A
    failed Export closes the Import (the prefill instance frees the blocks) and the prefill computes the prefix:
    the request succeeds either way, and the route says whether the prefix was moved."""

    async def go():
        async with cluster({"p0": P, "d0": ("decode", {"decode": "after_import"}),
                            "s0": ("store", {"export": export})}) as (ce, w):
            ce.policy = FromStore(4, 2)
            u, = await result(await ce.add("r", [1, 2, 3, 4, 5, 6], GREEDY))
            assert u.error is None and u.token_ids == [6, 0]
            assert w["p0"].imports == ["r.1.prefix"] and w["d0"].opened == ["r.1"]
            assert w["s0"].exports == [("r.1.prefix", "p0", [5])]
            pre = w["p0"].requests[-1]
            assert pre["prefix_from"] == {"import_id": "r.1.prefix", "tokens": 4}
            assert u.route["prefix_move"] is None or u.route["prefix_move"]["via"] == "transfer"
            # ended (imported), or closed by the router: the fake sees a closing call's cancellation in its own time
            await asyncio.wait_for(w["p0"].board.setdefault(("import closed", "r.1.prefix"), asyncio.Event()).wait(), 5)
            assert w["p0"].imports_closed == ["r.1.prefix"]
            if export == "ok":
                assert u.route["prefix_move"]["tokens"] == 4 and u.route["prefix_move"]["overlapped"]
                assert u.route["prefix_move"]["kv_bytes"] == 4096 and ce.prefixes.prefix_moves["done"] == 1
            else:
                assert u.route["prefix_move"] is None and ce.prefixes.prefix_moves["failed"] == 1
    asyncio.run(go())


@pytest.mark.parametrize("streams", [True, False])
def test_the_prompt_goes_to_the_store_as_it_is_computed(streams):
    """BanaServe's write-back: beside the decode reservation the router opens an Import on the store for the
    prompt's whole blocks, and the Prefill call names it (`store`): the prefill instance sends each layer group
    there as well as to decode, and nothing is put after the prefill. A prefill instance that did not stream it
    (a model with request-level state) says so: the router closes that Import and puts the prompt after the
    prefill (Import on the store, Export on the prefill instance). A prompt the store holds goes nowhere."""
    from jaxserve.router.kv_index import KVIndex

    async def go():
        async with cluster({"p0": ("prefill", {"streams": streams}), "d0": ("decode", {}),
                            "s0": ("store", {})}) as (ce, w):
            w["d0"].await_put = {"r.1", "z.1"} if streams else {"r.1"}
            imp = ce.prefixes._import

            async def traced_import(dst, tokens, rid, reserved=None, fill=None):
                # the router names the put in the Prefill only once it holds the store's reservation; the fake
                # decode answers after that (the store answering first does not order the router's two reads)
                if reserved is not None:
                    reserved.add_done_callback(lambda _: w["d0"].board.setdefault(("router reserved", rid),
                                                                                  asyncio.Event()).set())
                return await imp(dst, tokens, rid, reserved, fill)
            ce.prefixes._import = traced_import
            u, = await result(await ce.add("r", list(range(1, 21)), GREEDY))  # 16 tokens in whole blocks
            assert u.error is None and u.token_ids == [20, 0]
            await asyncio.gather(*list(ce.prefixes.store_tasks))
            assert w["p0"].requests[-1]["store"] == {"import_id": "r.1.put", "tokens": 16, "dst": {
                "instance": "s0", "blocks": [5], "skip": 0, "shm_base": None, "pull": False}}
            if streams:
                assert w["s0"].imports == ["r.1.put"] and w["p0"].exports == []
                assert ce.prefixes.store_puts == {"done": 1, "failed": 0, "bytes": 512, "streamed": 1}
            else:
                assert w["s0"].imports == ["r.1.put", "r.1.store"] and w["p0"].exports == [("r.1.store", "s0", [5])]
                assert ce.prefixes.store_puts == {"done": 1, "failed": 0, "bytes": 4096, "streamed": 0}
            assert "r.1.put" in w["s0"].imports_closed
            assert ce.prefixes.puts_stream is streams  # told once it does not stream, the router asks no more
            ce.index.apply("s0", {"epoch": "e", "full": {"blocks": KVIndex(16).hashes(list(range(1, 17))),
                                                         "snaps": []}, "next": 0})
            u, = await result(await ce.add("q", list(range(1, 21)), GREEDY))
            assert u.error is None and w["p0"].requests[-1]["store"] is None  # the store holds it: no put
            await asyncio.gather(*list(ce.prefixes.store_tasks))
            assert ce.prefixes.store_puts["done"] == 1 and len(w["s0"].imports) == (1 if streams else 2)
            u, = await result(await ce.add("z", list(range(31, 51)), GREEDY))  # a prompt the store does not hold
            await asyncio.gather(*list(ce.prefixes.store_tasks))
            assert u.error is None and (w["p0"].requests[-1]["store"] is None) is not streams
            assert w["s0"].imports[-1] == ("z.1.put" if streams else "z.1.store")
            assert ce.prefixes.store_puts["done"] == 2
    asyncio.run(go())


def test_store_write_after_puts_the_prompt_once_the_prefill_is_done():
    """`router.store_write: after`: no Import on the store beside the reservation, the Prefill names none, and the
    prompt is copied from the prefill instance once its prefill answered."""
    async def go():
        async with cluster({"p0": ("prefill", {"streams": True}), "d0": ("decode", {}), "s0": ("store", {})},
                           store_write="after") as (ce, w):
            u, = await result(await ce.add("r", list(range(1, 21)), GREEDY))
            await asyncio.gather(*list(ce.prefixes.store_tasks))
            assert u.error is None and w["p0"].requests[-1]["store"] is None
            assert w["s0"].imports == ["r.1.store"] and w["p0"].exports == [("r.1.store", "s0", [5])]
            assert ce.prefixes.store_puts == {"done": 1, "failed": 0, "bytes": 4096, "streamed": 0}
    asyncio.run(go())


@pytest.mark.parametrize("held", [True, False])
def test_a_load_from_the_stores_shared_pool_is_a_load_call_beside_the_reservation(held):
    """The store's shared pool on the prefill instance's host: the router calls nothing on the store (no Import,
    no Export); a Load call on the prefill instance copies the prefix beside the decode reservation, and the
    Prefill names it (prefix_from), sent without waiting for the Load's answer (the fake answers the Load only
    once that Prefill came): the instance runs the prefill after the copy. When the store's pool no longer held
    it (its disk tier may: the global index still counts it), the prefill computes it and the router writes the
    prompt back to the store although the index says the store holds it, so the next read finds it."""
    from jaxserve.router.kv_index import KVIndex

    async def go():
        async with cluster({"p0": ("prefill", {"shared": True}), "d0": ("decode", {}),
                            "s0": ("store", {"export": "ok" if held else "fail", "shared": True})}) as (ce, w):
            ce.policy = FromStore(16, 4)
            w["p0"].board["s0"] = w["s0"]
            prompt = list(range(1, 21))  # a whole block of 16 the store holds (says the index), and 4 more
            ce.index.apply("s0", {"epoch": "e", "full": {"blocks": KVIndex(16).hashes(prompt), "snaps": []},
                                  "next": 0})
            u, = await result(await ce.add("r", prompt, GREEDY))
            assert u.error is None and u.token_ids == [20, 0]
            assert w["p0"].loads == [("r.1.prefix", "s0", 16)]
            assert w["p0"].requests[-1]["prefix_from"] == {"import_id": "r.1.prefix", "tokens": 16}
            mv = u.route["prefix_move"]
            if held:
                assert mv["via"] == "shared" and mv["tokens"] == 16 and mv["kv_bytes"] == 2048, mv
                assert ce.prefixes.prefix_moves == {"done": 1, "failed": 0, "bytes": 2048}
                # nothing but the Load and the Prefill: no store call, no write-back of what the store holds
                assert w["p0"].imports == [] and w["s0"].imports == [] and w["p0"].exports == []
            else:
                assert mv is None and ce.prefixes.prefix_moves["failed"] == 1 and ce.prefixes.prefix_moves["done"] == 0
                await asyncio.gather(*list(ce.prefixes.store_tasks))  # the write-back, in the background
                assert w["s0"].imports == ["r.1.store"] and w["p0"].exports == [("r.1.store", "s0", [5])]
                assert ce.prefixes.store_puts["done"] == 1
            assert w["s0"].exports == [] and w["s0"].requests == [] and w["s0"].loads == []
    asyncio.run(go())
