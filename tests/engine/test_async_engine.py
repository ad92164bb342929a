"""AsyncEngine's command path when callers go away (a client disconnecting while its Prefill or Decode call
waits on the engine thread): the engine thread survives, a command cancelled before it ran never runs, and a
request attached for a caller that was cancelled meanwhile is aborted, not left running for nobody. The
engine-thread side is a stand-in here: these are properties of the thread and its queue, not of a model. And
the Updates a real engine's thread publishes: a running request's are views of its output, not copies."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from types import SimpleNamespace

from jaxserve.engine.async_engine import AsyncEngine


class Idle:
    """What AsyncEngine's thread asks of an engine with nothing scheduled."""
    has_work = False
    tokenizer = None

    def __init__(self):
        self.aborted: list[str] = []

    def stats(self) -> dict:
        return {}

    def abort(self, request_id: str) -> None:
        self.aborted.append(request_id)


def held(ae: AsyncEngine):
    """A call that holds the engine thread until released: (its task, started, release)."""
    started, release = threading.Event(), threading.Event()

    def hold(eng):
        started.set()
        release.wait(30)
        return "held"
    return asyncio.ensure_future(ae.call(hold)), started, release


async def cancelled(task) -> None:
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


def test_cancelled_calls_neither_run_late_nor_kill_the_engine_thread():
    ae = AsyncEngine(Idle())

    async def go():
        # cancelled while queued behind another command: it never runs
        blocker, started, release = held(ae)
        assert await asyncio.to_thread(started.wait, 30)
        ran: list = []
        queued = asyncio.ensure_future(ae.call(lambda eng: ran.append(1)))
        await asyncio.sleep(0)  # the command is on the queue
        await cancelled(queued)
        release.set()
        assert await blocker == "held"
        # cancelled while running: it runs to its end; its result goes nowhere, the thread goes on
        running, started, release = held(ae)
        assert await asyncio.to_thread(started.wait, 30)
        await cancelled(running)
        release.set()
        assert await asyncio.wait_for(ae.call(lambda eng: 42), 30) == 42  # a dead engine thread: a timeout
        assert ran == []
    try:
        asyncio.run(go())
        assert ae._thread.is_alive()
    finally:
        ae.shutdown()


def test_a_request_attached_for_a_cancelled_caller_is_aborted():
    eng = Idle()
    ae = AsyncEngine(eng)

    async def go():
        started, release = threading.Event(), threading.Event()

        def make(e):
            started.set()
            release.wait(30)
            return [SimpleNamespace(request_id="r1.1")], None
        attach = asyncio.ensure_future(ae.attach("r1", make))
        assert await asyncio.to_thread(started.wait, 30)
        await cancelled(attach)  # the caller went away while the engine thread was attaching
        release.set()
        await asyncio.wait_for(ae.call(lambda e: None), 30)  # every command queued before this one has run
        assert eng.aborted == ["r1.1"]
        assert "r1" not in ae._requests
    try:
        asyncio.run(go())
    finally:
        ae.shutdown()


def test_a_running_requests_updates_view_its_output_and_the_finished_one_holds_lists(checkpoint_dir):
    """Each step's Update of a running request reads the request's output and logprobs in place (engine/client.py
    Grown: publishing a step does not copy a whole output per request), yet stays the snapshot of its step after
    later steps append; the finished Update holds lists of the whole answer."""
    from jaxserve.engine.client import Grown
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams
    ae = AsyncEngine(LLM(checkpoint_dir("llama"), progress=False).engine)

    async def go():
        q = await ae.add("r", [5, 9, 13, 2], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                                             logprobs=1))
        got = [await asyncio.wait_for(q.get(), 60)]
        while not got[-1].finished:
            got.append(await asyncio.wait_for(q.get(), 60))
        return got
    try:
        ups = asyncio.run(go())
    finally:
        ae.shutdown()
    final, running = ups[-1], ups[:-1]
    assert type(final.token_ids) is list and type(final.logprobs) is list and len(final.token_ids) == 6
    assert running and all(isinstance(u.token_ids, Grown) and isinstance(u.logprobs, Grown) for u in running)
    assert len({id(u.token_ids._items) for u in running}) == 1  # one list, the sequence's own: no copies
    for u in running:
        n = len(u.token_ids)
        assert 0 < n < 6 and u.token_ids == final.token_ids[:n] and u.logprobs == final.logprobs[:n]


def test_a_steps_updates_reach_their_loop_in_one_call(checkpoint_dir):
    """Four requests decoding together: each step's four Updates go to the loop in one call_soon_threadsafe (one
    per request had cost the engine thread 2-3 ms a step at 256 requests), in order per request."""
    from jaxserve.engine import async_engine
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams
    ae = AsyncEngine(LLM(checkpoint_dir("llama"), progress=False).engine)
    calls: list[int] = []

    async def go():
        loop = asyncio.get_running_loop()
        post = loop.call_soon_threadsafe

        def counted(fn, *args):
            if fn is async_engine._deliver:
                calls.append(len(args[0]))
            return post(fn, *args)
        loop.call_soon_threadsafe = counted
        params = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
        qs = [await ae.add(f"r{i}", [5 + i, 9, 13], params) for i in range(4)]
        out = []
        for q in qs:
            ups = [await asyncio.wait_for(q.get(), 60)]
            while not ups[-1].finished:
                ups.append(await asyncio.wait_for(q.get(), 60))
            out.append(ups)
        return out
    try:
        got = asyncio.run(go())
    finally:
        ae.shutdown()
    for ups in got:  # every step's update of each request, in order
        assert [len(u.token_ids) for u in ups] == list(range(1, 6)) and ups[-1].finished
    assert max(calls) == 4 and sum(calls) == 4 * 5 and len(calls) < 4 * 5


def test_a_request_that_does_not_stream_gets_its_final_update_alone(checkpoint_dir):
    """final_only (the HTTP app's non-streamed requests): the engine thread makes no Update of the request while
    it runs (vLLM's FINAL_ONLY), its queue gets the finished one alone, equal to a streamed twin's last; n > 1:
    one final Update per sequence."""
    from jaxserve.engine.client import Update
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams
    ae = AsyncEngine(LLM(checkpoint_dir("llama"), progress=False).engine)
    made: list[int] = []
    real = Update.__init__

    def count(self, index, *a, **kw):
        made.append(index)
        real(self, index, *a, **kw)

    async def drain(q, n=1):
        got = [await asyncio.wait_for(q.get(), 60)]
        while sum(u.finished for u in got) < n:
            got.append(await asyncio.wait_for(q.get(), 60))
        await asyncio.sleep(0.1)
        assert q.empty()  # nothing after the finished ones
        return got

    async def go():
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=1)
        streamed = await drain(await ae.add("s", [5, 9, 13, 2], params))
        Update.__init__ = count
        try:
            final = await drain(await ae.add("f", [5, 9, 13, 2], params, final_only=True))
            two = await drain(await ae.add("t", [5, 9, 13, 2], SamplingParams(
                n=2, max_tokens=4, temperature=0.8, seed=3, ignore_eos=True), final_only=True), 2)
        finally:
            Update.__init__ = real
        return streamed, final, two
    try:
        streamed, final, two = asyncio.run(go())
    finally:
        ae.shutdown()
    assert len(streamed) == 6 and len(final) == 1 and final[0].finished
    assert final[0].token_ids == streamed[-1].token_ids and final[0].logprobs == streamed[-1].logprobs
    assert sorted(u.index for u in two) == [0, 1] and all(u.finished and len(u.token_ids) == 4 for u in two)
    assert sorted(made) == [0, 0, 1]  # the three finished Updates, none while running
