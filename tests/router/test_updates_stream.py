"""A step's running updates in one message per worker (worker/fanout.py, router/updates.py): the worker side alone
(one message a step whatever the number of requests, the finished update on the request's own call, steps the
reader fell behind on sent together), and the router against fake decode workers that serve the Updates stream
with the worker's own StepStreams (running updates on the stream, every token once; a stream that breaks sends its
requests elsewhere, resumed)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from jaxserve.engine.client import Grown, Update, update_message, update_of
from jaxserve.worker import messages, rpc
from jaxserve.worker.fanout import READY, StepStreams

from .test_dispatch import GREEDY, TOKEN, Fake, cluster, updates


def running(tokens: list[int], n: int, text: str = "") -> Update:
    return Update(0, Grown(tokens, n), text, False, None, [], 0, 3)


def test_a_steps_updates_of_every_request_go_in_one_message_and_the_finished_one_on_its_own():
    async def go():
        steps = StepStreams()
        stream = steps.serve("s1")
        assert await stream.__anext__() == READY and len(steps) == 1
        own = {r: asyncio.Queue() for r in ("a", "b", "c")}
        sinks = {r: steps.queue_for("s1", r, own[r]) for r in own}
        assert steps.queue_for("elsewhere", "d", own["a"]) is own["a"]  # no such stream: its own call
        assert steps.queue_for(None, "d", own["a"]) is own["a"]
        out = {r: [] for r in own}

        def step(k: int, finished=()):  # what AsyncEngine._deliver does with a step: one callback
            for r, sink in sinks.items():
                out[r].append(10 * k + ord(r))
                sink.put_nowait(Update(0, list(out[r]), "x" * len(out[r]), True, "stop", [], 0, 3) if r in finished
                                else running(out[r], len(out[r]), "x" * len(out[r])))
        asyncio.get_running_loop().call_soon(step, 1)
        m = await asyncio.wait_for(stream.__anext__(), 5)
        assert [rid for rid, _ in m["updates"]] == ["a", "b", "c"]  # one message for the step's three requests
        held = {rid: update_of(msg, None) for rid, msg in m["updates"]}
        assert held["b"].token_ids == [10 + ord("b")] and held["b"].text == "x"
        # the reader falls behind two steps: they come in one message, in order; c finishes in the second
        asyncio.get_running_loop().call_soon(step, 2)
        await asyncio.sleep(0)
        asyncio.get_running_loop().call_soon(step, 3, ("c",))
        await asyncio.sleep(0.01)
        m = await asyncio.wait_for(stream.__anext__(), 5)
        assert [rid for rid, _ in m["updates"]] == ["a", "b", "c", "a", "b"]
        for rid, msg in m["updates"]:
            assert msg["offset"] == len(held[rid].token_ids)  # each carries only what its last one did not
            held[rid] = update_of(msg, held[rid])
        assert held["a"].token_ids == out["a"] and held["a"].text == "xxx"
        assert held["c"].token_ids == out["c"][:2]
        fin = own["c"].get_nowait()  # the finished update went to c's own call, whole
        assert fin.finished and fin.token_ids == out["c"] and own["a"].empty()
        assert update_message(fin, (2, "xx"))[0]["offset"] == 0
        with pytest.raises(ValueError, match="open already"):
            await steps.serve("s1").__anext__()
        await stream.aclose()
        assert len(steps) == 0
    asyncio.run(go())


class Fanout(Fake):
    """A decode worker that serves the Updates stream with the worker's StepStreams: each running update (one per
    token) through the stream the request names, the finished one whole on its own call. cut: the stream breaks
    after a step message carrying a request's first placement (ids ending in .1)."""

    def __init__(self, *a, cut=False, **k):
        super().__init__(*a, **k)
        self.steps, self.cut, self.own_messages, self.stream_messages = StepStreams(), cut, [], []

    async def start(self):
        self.server = rpc.server(TOKEN)
        self.server.add_generic_rpc_handlers((rpc.handler(
            {}, {"Prefill": self.prefill, "Decode": self.decode, "Updates": self.serve_updates}, messages.WORKER),))
        self.address = f"127.0.0.1:{self.server.add_insecure_port('127.0.0.1:0')}"
        await self.server.start()

    async def serve_updates(self, req, ctx):
        async for m in self.steps.serve(req.stream):
            if "updates" in m:
                self.stream_messages.append(m)
            yield m
            if self.cut and any(rid.endswith(".1") for rid, _ in m.get("updates", [])):
                await ctx.abort(grpc.StatusCode.UNAVAILABLE, "injected: connection reset")

    async def decode(self, req, ctx):
        req = req.model_dump()
        xid = req["request_id"]
        self.opened.append(xid)
        self.requests.append(req)
        own: asyncio.Queue = asyncio.Queue()
        sink = self.steps.queue_for(req["updates"], xid, own)
        arrived = self.board.setdefault(xid, asyncio.Event())
        yield {"reserved": {"blocks": [0], "skip": 0, "shm_base": None, "pull": False}}
        await arrived.wait()
        tokens = [len(req["prompt"]), 0, 7, 8]  # Fake.output's two first (prefill's first token), then 7, 8
        # a fresh request's first update adds the token after prefill's, a resumed one's the token after its output
        for n in range(len(req["output"]) + 1 if req["output"] else 2, len(tokens)):
            sink.put_nowait(running(tokens, n))
            await asyncio.sleep(0.02)  # a step
        sink.put_nowait(Update(0, list(tokens), "", True, "length", [], 0, 3))
        while True:
            u = await own.get()
            self.own_messages.append(u)
            yield {"update": update_message(u, (0, ""))[0]}
            if u.finished:
                return


def fakes(name, role, board, **kw):
    return (Fanout if role == "decode" else Fake)(name, role, board, **kw)


def test_running_updates_come_on_the_workers_updates_stream():
    async def go():
        async with cluster({"p0": ("prefill", {}), "d0": ("decode", {})}, make=fakes) as (ce, w):
            got = await asyncio.gather(*[updates(await ce.add(r, [1, 2, 3], GREEDY)) for r in ("r", "s")])
            for ups in got:
                assert ups[-1].token_ids == [3, 0, 7, 8] and ups[-1].error is None
                tokens = [u.token_ids for u in ups]
                # prefill's first token, then decode's; under load decode's [3, 0] can reach the router before
                # prefill's [3], which is then not passed on (it adds nothing)
                assert tokens[0] in ([3], [3, 0]) and all(len(a) < len(b) for a, b in zip(tokens, tokens[1:])), \
                    tokens
            d0 = w["d0"]
            names = {r["updates"] for r in d0.requests}
            assert len(names) == 1 and None not in names  # one stream for both requests
            assert all(u.finished for u in d0.own_messages)  # their own calls carried the finished update only
            carried = [rid for m in d0.stream_messages for rid, _ in m["updates"]]
            assert sorted(carried) == ["r.1", "r.1", "s.1", "s.1"]  # [3, 0] and [3, 0, 7] each
    asyncio.run(go())


def test_a_worker_without_the_updates_method_streams_each_request_on_its_own_call(caplog):
    async def go():
        async with cluster({"p0": ("prefill", {}), "d0": ("decode", {})}) as (ce, w):  # Fake: no Updates method
            for r in ("r", "s"):
                ups = await updates(await ce.add(r, [1, 2, 3], GREEDY))
                assert ups[-1].token_ids == [3, 0] and ups[-1].error is None
            assert [q["updates"] for q in w["d0"].requests] == [None, None]
    asyncio.run(go())
    said = [r.message for r in caplog.records if "no Updates stream" in r.message]
    assert len(said) == 1 and "UNIMPLEMENTED" in said[0], said  # asked once, not per request


def test_an_updates_stream_that_breaks_sends_its_requests_elsewhere_resumed():
    async def go():
        cut = ("decode", {"cut": True})
        async with cluster({"p0": ("prefill", {}), "d0": cut, "d1": cut}, make=fakes) as (ce, w):
            ups = await updates(await ce.add("r", [1, 2, 3], GREEDY))
            assert ups[-1].token_ids == [3, 0, 7, 8] and ups[-1].error is None, ups[-1]
            tokens = [u.token_ids for u in ups]
            assert all(len(a) < len(b) for a, b in zip(tokens, tokens[1:])), tokens  # every token once
            first = next(n for n in ("d0", "d1") if w[n].opened == ["r.1"])  # its stream broke
            second = "d1" if first == "d0" else "d0"
            assert w[second].opened == ["r.2"] and w[second].requests[0]["output"][:1] == [3]  # resumed
            assert ups[-1].route["decode_instance"] == second and ups[-1].route["attempts"] == 2
            assert ce.retries == 1
    asyncio.run(go())


def test_a_request_that_does_not_stream_gets_its_final_update_alone_and_still_resumes():
    """final_only through the router: the client's queue gets the finished update alone, while the router still
    follows the running ones, so a placement whose stream breaks is resumed after the tokens decoded so far."""
    async def go():
        cut = ("decode", {"cut": True})
        async with cluster({"p0": ("prefill", {}), "d0": cut, "d1": cut}, make=fakes) as (ce, w):
            q = await ce.add("r", [1, 2, 3], GREEDY, final_only=True)
            u = await asyncio.wait_for(q.get(), 30)
            assert u.finished and u.token_ids == [3, 0, 7, 8] and u.error is None, u
            await asyncio.sleep(0.1)
            assert q.empty()
            second = next(n for n in ("d0", "d1") if w[n].opened == ["r.2"])
            assert w[second].requests[0]["output"][:1] == [3] and ce.retries == 1  # resumed, not restarted
    asyncio.run(go())
