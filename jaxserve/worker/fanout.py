"""A step's running updates in one message per router connection (the `Updates` stream).

A request streamed on its own Decode or Generate call costs the worker one gRPC message per engine step, and the
router one more read: about 10 ms of this process's CPU a step at 256 requests on a CPU core (bench.update_streams),
time the engine thread's host work shares a GIL with. So the router opens one `Updates` stream per worker and names it
(`updates`) in each Decode and Generate call: that request's running updates then leave in one message per step
with every other request named to the same stream, `{"updates": [[request_id, message], ...]}` (each message as
`engine/client.py update_message` makes it, from what that request's earlier ones carried), and its own call
carries its reservation (Decode) and its finished update, whole, which ends it. Closing its own call still aborts
the request. A stream that the consumer has fallen behind on sends the steps it holds in one message.

Concurrency: the worker's asyncio loop only. AsyncEngine delivers a step's updates in one loop callback
(`_deliver`), and each stream's step goes out from a callback queued after it (`loop.call_soon`), so a step is
one message.
"""

from __future__ import annotations

import asyncio

from ..engine.client import Update, update_message

READY = {"ready": True}  # the stream's first message: requests may name it from now on


class _Stream:
    def __init__(self):
        self.queue: asyncio.Queue = asyncio.Queue()  # lists of [request_id, message], one a step
        self.step: list = []  # this step's, until the callback queued after the step's delivery sends it
        self.flush_queued = False

    def add(self, rid: str, msg: dict) -> None:
        self.step.append([rid, msg])
        if not self.flush_queued:
            self.flush_queued = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        self.flush_queued = False
        if self.step:
            self.queue.put_nowait(self.step)
            self.step = []


class Sink:
    """What AsyncEngine puts one request's Updates on (its `put_nowait`): running ones into the named stream's step,
    each as the message from what the request's earlier ones carried; the finished one (whole) into `own`, the
    request's own call."""
    __slots__ = ("rid", "stream", "own", "sent")

    def __init__(self, rid: str, stream: _Stream, own: asyncio.Queue):
        self.rid, self.stream, self.own, self.sent = rid, stream, own, (0, "")

    def put_nowait(self, u: Update) -> None:
        if u.finished:
            self.own.put_nowait(u)
            return
        msg, self.sent = update_message(u, self.sent)
        self.stream.add(self.rid, msg)


async def own_messages(q: asyncio.Queue):
    """A request's own call: its Updates from q as stream messages until it finishes, each with what the one before
    did not carry (`update_message`); a request that named an Updates stream finds only its finished one in q."""
    sent = (0, "")
    while True:
        u = await q.get()
        msg, sent = update_message(u, sent)
        yield {"update": msg}
        if u.finished:
            return


class StepStreams:
    def __init__(self):
        self._streams: dict[str, _Stream] = {}
        self.carried = 0  # running updates sent in step messages

    def __len__(self) -> int:
        return len(self._streams)

    async def serve(self, name: str):
        """The Updates call of stream `name`: READY, then each step's running updates of the requests named to it,
        until the caller closes it. A name already open is refused (ValueError)."""
        if name in self._streams:
            raise ValueError(f"stream: {name!r} is open already")
        s = self._streams[name] = _Stream()
        try:
            yield READY
            while True:
                batch = await s.queue.get()
                while not s.queue.empty():  # steps the caller has not read yet go as one
                    batch += s.queue.get_nowait()
                self.carried += len(batch)
                yield {"updates": batch}
        finally:
            del self._streams[name]

    def queue_for(self, name: str | None, rid: str, own: asyncio.Queue):
        """Where AsyncEngine puts request rid's Updates: a Sink into stream `name` when it is open here, else the
        request's own queue (every update on its own call, as without a stream)."""
        s = self._streams.get(name) if name else None
        return own if s is None else Sink(rid, s, own)
