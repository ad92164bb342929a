"""Runs an `LLMEngine` on its own thread for an asyncio server: the colocated `EngineClient` (client.py).

Concurrency model: one engine thread owns the LLMEngine (scheduler, block manager, device programs) and is
the only code that touches it. Callers on the asyncio loop send commands (add, abort, call) through a
thread-safe queue and get results back as concurrent futures; per-request updates are pushed onto the
request's asyncio.Queue, a step's updates with one `loop.call_soon_threadsafe` per loop (one each had cost the
engine thread 2-3 ms a step at 256 requests on this CPU: a wake-up of the loop per request). The thread blocks
on the command queue when there is no work, so an idle server uses no CPU. If a step raises, every in-flight
request fails with the error (and its blocks are released) rather than hanging.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from dataclasses import dataclass, field

from ..sampling import SamplingParams
from .client import Grown, RequestError, Update, encode
from .llm_engine import LLMEngine
from .sequence import Sequence

log = logging.getLogger("jaxserve.engine")


@dataclass
class _Request:
    seqs: list[Sequence]
    queue: asyncio.Queue  # or anything with its put_nowait (a worker's worker/fanout.py Sink)
    loop: asyncio.AbstractEventLoop
    final_only: bool = False  # only each sequence's finished Update is made and delivered
    done: set = field(default_factory=set)


def _deliver(items: list) -> None:
    """On a loop: put each (queue, update) of a step on its queue."""
    for q, u in items:
        q.put_nowait(u)


class AsyncEngine:
    def __init__(self, engine: LLMEngine, on_finish=None):
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self.on_finish = on_finish  # called on the engine thread with each finished Sequence
        self._cmds: queue.Queue = queue.Queue()
        self._requests: dict[str, _Request] = {}  # engine thread only
        self._owner: dict[str, str] = {}  # sequence id -> request id (n > 1 gives several sequences)
        self._stop = False
        # run on the engine thread after each step and each batch of commands (what may free blocks); cheap
        self.hooks: list = []
        self.error: str | None = None
        self._stats: dict = engine.stats()  # refreshed by the engine thread each iteration (readable anywhere)
        self._thread = threading.Thread(target=self._run, name="jaxserve-engine", daemon=True)
        self._thread.start()

    # ---- loop side (the EngineClient protocol, and what the disaggregated sides use)
    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    def encode(self, prompt) -> list[int]:
        return encode(self.tokenizer, prompt)

    def stats(self) -> dict:
        """The engine's stats as of its last iteration (no call into the engine thread), and "steps": where its step
        time went so far (StepTimer.totals, read from here: no per-step work for it)."""
        return {**self._stats, "steps": self.engine.timer.totals()}

    def metrics_state(self) -> None:
        return None

    async def set_link(self, src: str, dst: str, gbps: float) -> dict:
        raise RequestError("a colocated deployment has no links between clusters", "src")

    async def set_role(self, instance: str, role: str) -> dict:
        raise RequestError("a colocated deployment has no instance roles to change", "instance")

    async def migrate(self, kind: str, src: str, dst: str, heads=None, layers=None) -> dict:
        raise RequestError("a colocated deployment has one instance: there is nowhere to move work to", "dst")

    async def profile(self, seconds: float, base: str) -> dict:
        """This process runs the model: its trace alone."""
        from .. import trace
        return {"trace_dir": await trace.capture(trace.folder(base, trace.stamp()), seconds), "seconds": seconds}

    async def call(self, fn, *args):
        """Run fn(engine, *args) on the engine thread and await its result. Cancelled before the engine thread
        takes it, fn never runs; once it runs, it runs to the end (its result is dropped)."""
        fut: concurrent.futures.Future = concurrent.futures.Future()
        self._cmds.put((fn, args, fut))
        return await asyncio.wrap_future(fut)

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams, queue=None,
                  final_only: bool = False, **resume) -> asyncio.Queue:
        """Queue a request; returns the asyncio.Queue its Updates arrive on. Raises RequestError / QueueFull.
        resume: output= and logprobs= of a request resumed (LLMEngine.add_request); queue, final_only: as
        attach's."""
        if self.error is not None and not self.engine.has_work:
            self.error = None  # the failed step's requests are gone; try again
        q, _ = await self.attach(request_id,
                                 lambda eng: (eng.add_request(request_id, prompt_ids, params, **resume), None), queue,
                                 final_only)
        return q

    async def attach(self, request_id: str, make, queue=None, final_only: bool = False) -> tuple[asyncio.Queue, object]:
        """Run make(engine) -> (sequences, result) on the engine thread and stream the sequences' Updates to the
        returned queue (how the disaggregated sides queue their requests). Returns (queue, result). queue: where
        the Updates go instead of a new asyncio.Queue (anything with its put_nowait, called on this loop);
        final_only: only each sequence's finished Update (a request that does not stream: the engine thread
        makes no Update of it while it runs, and the loop wakes for it once)."""
        q = asyncio.Queue() if queue is None else queue
        loop = asyncio.get_running_loop()

        def attach(eng: LLMEngine):
            seqs, result = make(eng)
            self._requests[request_id] = _Request(list(seqs), q, loop, final_only)
            self._owner.update((s.request_id, request_id) for s in seqs)
            return result
        try:
            return q, await self.call(attach)
        except asyncio.CancelledError:
            # the caller went away (its client disconnected): if `attach` ran, nobody reads the request's
            # updates, so it is aborted (the abort runs after it on the engine thread; if it did not, a no-op)
            self.abort(request_id)
            raise

    def post(self, fn) -> None:
        """From any thread: run fn() on the engine thread; the sequences it returns are published."""
        self._cmds.put((lambda eng: self._publish(fn()), (), None))

    def abort(self, request_id: str) -> None:
        """Abort (e.g. the client went away): releases its slot and blocks. Fire and forget."""
        def abort(eng: LLMEngine):
            req = self._requests.pop(request_id, None)
            if req is not None:
                for s in req.seqs:
                    eng.abort(s.request_id)
                    self._owner.pop(s.request_id, None)
        self._cmds.put((abort, (), None))

    def health(self) -> dict:
        """{"status": "ok"} or {"status": "degraded", "error": ...} after a failed step, and "steps": where the
        engine's step time went so far (StepTimer.totals) (/health)."""
        state = {"status": "ok"} if self.error is None else {"status": "degraded", "error": self.error}
        return {**state, "steps": self.engine.timer.totals()}

    def shutdown(self) -> None:
        self._stop = True
        self._cmds.put((lambda eng: None, (), None))
        self._thread.join(timeout=30)

    # ---- engine thread
    def _run(self) -> None:
        eng = self.engine
        while not self._stop:
            block = not eng.has_work
            try:
                while True:
                    fn, args, fut = self._cmds.get(block=block)
                    block = False
                    if fut is not None and not fut.set_running_or_notify_cancel():
                        continue  # its caller was cancelled before it ran: it does not run at all
                    try:
                        res = fn(eng, *args)
                        if fut is not None:
                            fut.set_result(res)
                    except Exception as e:  # noqa: BLE001 - handed to the caller
                        if fut is not None:
                            fut.set_exception(e)
            except queue.Empty:
                pass
            if self._stop or not eng.has_work:
                self._run_hooks()
                self._stats = eng.stats()
                continue
            try:
                changed = eng.step()
            except Exception as e:  # noqa: BLE001 - fail every request cleanly, keep serving
                log.exception("engine step failed")
                self.error = f"{type(e).__name__}: {e}"
                self._fail_all(self.error)
                continue
            self._publish(changed)
            self._run_hooks()
            self._stats = eng.stats()

    def _run_hooks(self) -> None:
        for hook in self.hooks:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a hook's failure is its own, never the engine's
                log.exception("engine hook %s failed", getattr(hook, "__name__", hook))

    def _publish(self, changed: list[Sequence]) -> None:
        posts: dict[asyncio.AbstractEventLoop, list] = {}  # loop -> the step's (queue, update) for it
        by_req: dict[str, list[Sequence]] = {}
        for s in changed:
            by_req.setdefault(self._owner.get(s.request_id, ""), []).append(s)
        try:
            self._updates(by_req, posts)
        finally:  # what was made goes out, whatever an on_finish callback raised
            for loop, items in posts.items():
                try:
                    loop.call_soon_threadsafe(_deliver, items)
                except RuntimeError:  # the loop is closed: no one is listening there
                    pass

    def _updates(self, by_req: dict[str, list[Sequence]], posts: dict) -> None:
        """The step's Update of each changed sequence, into posts[its request's loop]; finished ones released."""
        for rid, seqs in by_req.items():
            req = self._requests.get(rid)
            if req is None:
                continue
            for s in seqs:
                if req.final_only and not s.finished:
                    continue
                idx = req.seqs.index(s)
                ttft = None if s.first_token_time is None else s.first_token_time - s.arrival
                # a running request's output and logprobs as views (they only grow): no copy of its whole
                # output each step; the finished one's as lists
                ids, lps = (list(s.output), list(s.logprobs)) if s.finished else (Grown(s.output), Grown(s.logprobs))
                u = Update(idx, ids, s.detok.text, s.finished, s.finish_reason,
                           lps, s.num_cached, len(s.prompt), error=s.error, ttft_s=ttft,
                           migrations=list(s.migrations) if s.finished and s.migrations else None)
                posts.setdefault(req.loop, []).append((req.queue, u))
                if s.finished:
                    req.done.add(idx)
                    self._owner.pop(s.request_id, None)
                    self.engine.release(s)
                    if self.on_finish is not None:
                        self.on_finish(s)
            if len(req.done) == len(req.seqs):
                del self._requests[rid]

    def _fail_all(self, error: str) -> None:
        for rid, req in list(self._requests.items()):
            for i, s in enumerate(req.seqs):
                self.engine.abort(s.request_id)
                u = Update(i, list(s.output), "", True, "error", [], 0, len(s.prompt), error)
                req.loop.call_soon_threadsafe(req.queue.put_nowait, u)
        self._requests.clear()
        self._owner.clear()
        self.engine.scheduler.waiting.clear()
