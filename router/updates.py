"""The router's end of the workers' Updates streams (worker/fanout.py): one stream per worker address, opened when a
request is first placed there, whose step messages go to each request's feed by its id on that worker. A request
whose worker has no such stream (it could not be opened; a worker without the method is not asked again) gets
every update on its own call, as before. A request's feed also gets what its own call brings (router/cluster.py
`_pump`): its messages, then END, or `Failed`.

When a stream ends (its worker died, or the router's channel to it closed), every feed on it gets an `Ended`: its
request is placed again (router/cluster.py `_drive`), and the next request placed on the worker opens a new stream.

Concurrency: the router's asyncio loop; one reader task per open stream.
"""

from __future__ import annotations

import asyncio
import logging
import uuid

import grpc

from .calls import message

log = logging.getLogger("jaxserve.router")


class Ended:
    """What a feed gets when its stream ends: why."""
    __slots__ = ("why",)

    def __init__(self, why: str):
        self.why = why

    def __repr__(self) -> str:
        return f"Ended({self.why!r})"


class Failed:
    """What a feed gets when the request's own call fails: the error (grpc.aio.AioRpcError, or calls' Silent)."""
    __slots__ = ("error",)

    def __init__(self, error: BaseException):
        self.error = error


END = object()  # what a feed gets when the request's own call ends


class Stream:
    """One worker's Updates stream: `name` (what requests name in their `updates` field), the feeds by request id."""

    def __init__(self, client, worker: str, failed=None):
        """failed(grpc.aio.AioRpcError): told when the stream fails (calls.Workers.down: a worker gone)."""
        self.name = uuid.uuid4().hex
        self.worker, self.failed = worker, failed
        self.feeds: dict[str, asyncio.Queue] = {}
        self.ready: asyncio.Future = asyncio.get_running_loop().create_future()  # True once open, False: failed
        self.closed = False
        self.code = None  # the status it failed with
        self.call = client.stream("Updates", message("Updates", stream=self.name))
        self.task = asyncio.ensure_future(self._read())

    def subscribe(self, rid: str, feed: asyncio.Queue) -> None:
        """Put request rid's running updates on feed as `{"update": message}` (an `Ended` if the stream ends)."""
        self.feeds[rid] = feed
        if self.closed:
            feed.put_nowait(Ended("had ended"))

    def unsubscribe(self, rid: str) -> None:
        self.feeds.pop(rid, None)

    async def _read(self) -> None:
        why = "ended"
        try:
            async for m in self.call:
                if m.get("ready"):
                    if not self.ready.done():
                        self.ready.set_result(True)
                    continue
                for rid, msg in m["updates"]:
                    q = self.feeds.get(rid)
                    if q is not None:  # (a request that has ended or moved on: its late updates are dropped)
                        q.put_nowait({"update": msg})
        except grpc.aio.AioRpcError as e:
            why, self.code = f"failed: {e.code().name}: {e.details()}", e.code()
            if self.failed is not None:
                self.failed(e)
        except asyncio.CancelledError:
            why = "was closed"
            raise
        except Exception as e:  # noqa: BLE001 - a malformed message ends the stream; its requests go again
            why = f"sent a malformed message ({type(e).__name__}: {e})"
            log.warning("%s's Updates stream %s", self.worker, why)
        finally:
            self.closed = True
            self.call.cancel()
            if not self.ready.done():
                self.ready.set_result(False)
            for q in self.feeds.values():
                q.put_nowait(Ended(why))

    def close(self) -> None:
        self.task.cancel()


class UpdateStreams:
    """The open Updates streams, by worker address."""

    def __init__(self, workers):
        self.workers = workers  # calls.Workers: the channels, and `watch` for a worker that goes silent
        self._open: dict[str, Stream] = {}
        self._without: set[str] = set()  # addresses of workers without the method (UNIMPLEMENTED)

    async def stream(self, w) -> Stream | None:
        """Worker w's open stream, opened now if it has none; None where it cannot be (the request's updates
        then all come on its own call). Raises calls' Silent when w stops heartbeating meanwhile."""
        if w.address in self._without:
            return None
        s = self._open.get(w.address)
        if s is None or s.closed:
            for address in [a for a, x in self._open.items() if x.closed]:  # (workers gone or restarted)
                del self._open[address]
            s = self._open[w.address] = Stream(self.workers.client(w), w.name, lambda e: self.workers.down(w, e))
        if not await self.workers.watch(w, asyncio.shield(s.ready)):
            if s.code == grpc.StatusCode.UNIMPLEMENTED:
                self._without.add(w.address)
            log.warning("%s: no Updates stream (%s); each request's updates come on its own call", w.name,
                        s.code.name if s.code else "it ended")
            return None
        return s

    def close(self) -> None:
        for s in self._open.values():
            s.close()
        self._open.clear()
