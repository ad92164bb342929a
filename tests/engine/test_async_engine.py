"""AsyncEngine's command path when callers go away (a client disconnecting while its Prefill or Decode call
waits on the engine thread): the engine thread survives, a command cancelled before it ran never runs, and a
request attached for a caller that was cancelled meanwhile is aborted, not left running for nobody. The
engine-thread side is a stand-in here: these are properties of the thread and its queue, not of a model."""

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
