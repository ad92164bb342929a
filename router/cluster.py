"""The router: the engine-client protocol (jaxserve/engine/client.py) the HTTP app uses, over worker processes.

Per request (the KV Messenger flow): the placement policy (policies/, `policy.name`) picks the decode and the
prefill instance from a snapshot of the cluster (snapshot.py); open the decode instance's `Decode` stream, which
reserves cache space and validates the request, and the prefill instance's `Prefill` call beside it
(`router.early_prefill`, as SGLang's router sends a request to both servers at once: the prefill starts while decode
reserves, and a `Bind` call gives it the reservation when it comes; the first token is held until then), or after
it where decode holds a cached prefix of the prompt (the Prefill call then carries the reservation, whose skipped
blocks do not travel) or a store load or write-back is planned; both are relayed to the request's queue: the prefill
call sends the first token the moment it is sampled (the client has it while the KV travels), then answers once
decode has acknowledged every KV byte; the decode instance's Updates follow (its report of that first token is dropped):
running ones in one message a step for all of that worker's requests, on its Updates stream (updates.py), the
finished one on the request's own stream. n > 1 fans out into n requests with seeds seed, seed + 1, ... (as the
colocated engine does). A placement without a prefill instance runs the request whole on the decode instance
(`Generate`: it holds most of the prompt already, or no prefill instance is up). A placement that names a cached
prefix to move (`move_prefix`) copies it into the prefill instance (`Import` there, `Export` on its holder): before
the Prefill call, or, for a pipelined load (BanaServe's global KV store), from the placement on, beside the decode
reservation, with the Prefill call running over the prefix as it lands (prefix.py); a failed move only means the
prefill computes those tokens. With a store up, the prompt's whole blocks go to it as the prefill computes them
(`Put`: an Import on the store, opened beside the decode reservation, that the Prefill call names), or after the
prefill (`store_put`) when that could not be.

Faults: a prefill that fails (its worker died, or the transfer failed) before decode has the KV closes the
reservation (decode frees its blocks at once) and the request is placed again, on another prefill instance,
or, when none is left, whole on the decode instance (`Generate`: prefill locally). A decode instance that fails
is avoided and the request placed again elsewhere. A request whose tokens already reached the client is
resumed, not restarted: the new placement gets its output so far (worker/main.py: "output", "logprobs"),
decode computes the last of those tokens after the KV of the ones before it, and the stream goes on where it
stopped (the tokens equal an uninterrupted run's: the sampler's key follows the output position). A worker
whose call fails at the transport level is marked down (registry.py) until its next heartbeat. Every request
ends with a final Update (tokens or an error): nothing hangs; at most `router.max_attempts` placements per
request.

Concurrency: requests run on the router's asyncio loop (uvicorn's), one task per (sub-)request, which reads one
queue (its feed: a task reads the placement's call into it, a worker's Updates stream its running updates, so a
message costs the request one wake-up); gRPC channels are `grpc.aio`, one per worker address, each call presenting
the cluster token. Registrations (heartbeats) arrive on
the control port's own thread (control_port.py), so a busy request path cannot starve them; the registry they update
is thread-safe (registry.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import random
import time

import grpc

from jaxserve.config import Config
from jaxserve.engine.client import EngineUnavailable as Unavailable
from jaxserve.engine.client import QueueFull, RequestError, Update, encode, update_of
from jaxserve.sampling import SamplingParams

from . import policies
from .admin import Admin
from .calls import Workers, message
from .control_port import ControlPort
from .kv_index import KVIndex
from .policies.base import Placement, least_loaded
from .prefill_call import Prefills
from .prefix import PrefixMoves
from .registry import Registry, WorkerInfo
from .requests import Retry, Silent, Sub, raise_failure, settle
from .snapshot import Topology
from .updates import END, Ended, Failed, UpdateStreams

log = logging.getLogger("jaxserve.router")
Code = grpc.StatusCode


class Router:
    """The engine-client protocol over a cluster of workers, composed of: the worker calls (calls.py), the prefix
    moves and store write-backs (prefix.py), the admin operations and policy loops (admin.py); the request path
    (placement, prefill, the decode stream, retries) is here."""

    def __init__(self, cfg: Config, tokenizer, on_finish=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.registry = Registry({i.name: i.role for i in cfg.instances()}, cfg.router.down_after_s)
        self.topology = Topology(cfg)
        self.index = KVIndex(cfg.engine.block_size)  # the global KV index, fed by heartbeats (control_port.py)
        self.policy = policies.make(cfg.policy)
        self.routes: dict[str, int] = {}  # route -> requests finished on it
        self.on_finish = on_finish  # (final Update, seconds since arrival)
        self.tasks: dict[str, list[asyncio.Task]] = {}
        self.sequences: dict[str, list[Sub]] = {}  # request id -> its sequences, while it runs (read-only view)
        self.kv_bytes_transferred = 0
        self.retries = 0
        self.kv_bytes_per_token: float | None = None  # measured on the transfers so far
        self.workers = Workers(cfg, self.registry, self.index)
        self.updates = UpdateStreams(self.workers)  # the workers' Updates streams: a step's updates in one message
        self.prefixes = PrefixMoves(cfg, self.registry, self.topology, self.index, self.workers)
        self.prefills = Prefills(self)  # each request's Prefill call
        self.admin = Admin(cfg, self.registry, self.topology, self.workers, lambda: self.policy,
                           lambda: self.kv_bytes_per_token)
        # the admin operations of the engine-client protocol (server/app.py's /admin and /debug routes)
        self.profile, self.set_link, self.set_role = self.admin.profile, self.admin.set_link, self.admin.set_role
        self.migrate, self.rebalance, self.control_cycle, self.replan = (
            self.admin.migrate, self.admin.rebalance, self.admin.control_cycle, self.admin.replan)
        self._port: ControlPort | None = None
        self._joined: asyncio.Event | None = None
        self.address: str | None = None

    @property
    def launcher(self):
        """router/launcher.py (or ray_launcher.py), when serve started the workers; the admin scales through it."""
        return self.admin.launcher

    @launcher.setter
    def launcher(self, launcher) -> None:
        self.admin.launcher = launcher

    # ---- control port (worker registration, on a thread of its own: control_port.py)
    async def start(self) -> str:
        """Serve `Register` on router.host:router.port; returns host:port."""
        self._joined = asyncio.Event()
        loop = asyncio.get_running_loop()
        r = self.cfg.router
        self._port = ControlPort(self.registry, self.cfg.transfer.token, r.heartbeat_s,
                                      on_join=lambda: loop.call_soon_threadsafe(self._joined.set), tls=self.workers.tls,
                                      index=self.index)
        self.address = await asyncio.to_thread(self._port.start, r.host, r.port)
        self.admin.start()
        return self.address

    async def joined(self) -> None:
        """Wait for the next registration or heartbeat."""
        await self._joined.wait()
        self._joined.clear()

    async def close(self) -> None:
        self.admin.stop()
        self.prefixes.close()
        for tasks in list(self.tasks.values()):
            for t in tasks:
                t.cancel()
        self.updates.close()
        await self.workers.close()
        if self._port is not None:
            await asyncio.to_thread(self._port.stop)
            self._port = None

    def metrics_state(self) -> dict:
        """What server/metrics.py publishes for a cluster (instances, links, KV bytes, retries, requests per
        route, the policy's state)."""
        links = {snap.get("link", f"{w.name}:{addr}"): snap for w in self.registry.all()
                 for addr, snap in w.links.items()}
        return {"instances": self.registry.state(), "links": links,
                "kv_bytes_transferred": self.kv_bytes_transferred, "retries": self.retries,
                "routes": dict(self.routes), "policy": self.admin.state(), "index": self.index.stats(),
                "prefix_moves": dict(self.prefixes.prefix_moves), "store_puts": dict(self.prefixes.store_puts)}

    def health(self) -> dict:
        up = self.registry.up("decode") or (self.cfg.router.local_fallback and self.registry.up())
        return {"status": "ok" if up else "degraded", "instances": self.registry.state(),
                **({} if up else {"error": "no instance can decode"})}

    # ---- the EngineClient protocol
    def encode(self, prompt) -> list[int]:
        return encode(self.tokenizer, prompt)

    @property
    def max_model_len(self) -> int | None:
        """The smallest of the registered instances' (None before any registered)."""
        lens = [w.max_model_len for w in self.registry.all()]
        return min(lens) if lens else None

    def stats(self) -> dict:
        """Sums over the instances' last heartbeats (the hit rate: their mean)."""
        out: dict = {}
        workers = self.registry.up()
        for w in workers:
            for k, v in w.stats.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[k] = out.get(k, 0) + v
        if workers and "prefix_hit_rate" in out:
            out["prefix_hit_rate"] /= len(workers)
        return out

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                  final_only: bool = False) -> asyncio.Queue:
        """Place the request (raises RequestError / QueueFull / Unavailable) and stream its Updates to a queue
        (final_only: each sequence's finished one alone; the running ones are still followed, to resume it)."""
        arrival = time.monotonic()
        seed = params.seed
        if params.n > 1 and seed is None:
            seed = random.randrange(2**31)
        kv = len(prompt_ids) - 1 if self.cfg.transfer.leave_last_token and len(prompt_ids) > 1 else len(prompt_ids)
        subs = [Sub(request_id if params.n == 1 else f"{request_id}-{i}", i, list(prompt_ids),
                     dataclasses.asdict(dataclasses.replace(params, n=1, seed=None if seed is None else seed + i)), kv,
                     arrival=arrival, final_only=final_only)
                for i in range(params.n)]
        try:
            for s in subs:
                await self._place(s)
        except BaseException:
            for s in subs:
                self._close(s)
            raise
        q: asyncio.Queue = asyncio.Queue()
        tasks = [asyncio.ensure_future(self._drive(s, q)) for s in subs]
        self.tasks[request_id], self.sequences[request_id] = tasks, subs

        def done(_):
            if all(t.done() for t in tasks):
                self.tasks.pop(request_id, None)
                self.sequences.pop(request_id, None)
        for t in tasks:
            t.add_done_callback(done)
        return q

    def abort(self, request_id: str) -> None:
        """The client went away: cancel its tasks and close their streams (the workers abort and free): a task
        cancelled before it ran never closes them itself."""
        subs = self.sequences.pop(request_id, [])
        for t in self.tasks.pop(request_id, []):
            t.cancel()
        for s in subs:
            self._close(s)

    # ---- placement
    def _snapshot(self, s: Sub, exclude: set):
        """The policy's view for this sequence: instances up and not excluded, each with the prefix of the
        prompt (and any output so far) that the global KV index says it holds; the global KV store (an instance
        of role store, when one is up) with the prefix it holds."""
        up = [w for w in self.registry.up(exclude=exclude) if not w.draining]
        workers = [w for w in up if w.role != "store"]
        store = next((w.name for w in up if w.role == "store"), None)
        tokens = s.prompt + s.output
        cached = self.index.match(tokens, {w.name for w in up})
        return self.topology.snapshot(workers, self.registry.all(), len(tokens), s.kv(), cached, time.monotonic(),
                                      self.kv_bytes_per_token, store, cached.get(store, 0) if store else 0)

    async def _place(self, s: Sub) -> None:
        """Ask the policy and open the sequence's stream: a reservation on its decode instance (the prefill
        follows in _drive), or the whole request on one instance (a placement without prefill instance; or no
        decode instance up, local fallback on). Raises RequestError, QueueFull, Unavailable."""
        r = self.cfg.router
        deadline, delay, busy = time.monotonic() + r.busy_wait_s, 0.01, set()
        while True:
            if len(s.errors) >= r.max_attempts:
                raise Unavailable(f"gave up after {len(s.errors)} failed attempts: {'; '.join(s.errors[-3:])}")
            snap = self._snapshot(s, s.avoid | s.avoid_prefill | busy)
            pl = self.policy.place(snap)
            if pl.decode is not None:
                if pl.prefill is None and not r.local_fallback and not snap.of("prefill"):
                    raise Unavailable("no prefill instance is up")
                w, method = self.registry.get(pl.decode), "Decode" if pl.prefill is not None else "Generate"
            elif not self.registry.up("decode", exclude=s.avoid) and r.local_fallback and snap.instances:
                w = self.registry.get(least_loaded(list(snap.instances)).name)
                method = "Generate"
                pl = Placement(w.name, None, "colocated", "no decode instance is up: local fallback")
            elif busy and time.monotonic() < deadline:
                await asyncio.sleep(delay)
                delay, busy = min(2 * delay, 0.5), set()
                continue
            elif busy:
                raise QueueFull(f"no decode instance had room for {r.busy_wait_s}s")
            else:
                raise Unavailable("no instance is up to serve the request"
                                  + (f" ({'; '.join(s.errors[-3:])})" if s.errors else ""))
            s.placement, s.moved = pl, None
            if self.admin.replanner is not None and not s.errors and pl.uncached_tokens is not None:
                self.admin.replanner.observe(pl.uncached_tokens, time.monotonic())
            log.debug("%s: %s", s.rid, pl)
            self.prefixes.start_load(s, pl)
            self.prefixes.start_put(s, pl)
            try:
                await self._open(s, w, method, self._early(s, snap, pl) if method == "Decode" else None)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == Code.INVALID_ARGUMENT:
                    raise RequestError(e.details()) from None
                if e.code() == Code.RESOURCE_EXHAUSTED:
                    busy.add(w.name)
                    continue
                self.workers.down(w, e)
                s.avoid.add(w.name)
                s.errors.append(f"{method} on {w.name}: {e.code().name}: {e.details()}")
            except Retry as e:
                s.avoid.add(w.name)
                s.errors.append(str(e))

    def _early(self, s: Sub, snap, pl: Placement) -> WorkerInfo | None:
        """The prefill instance to call beside decode's reservation (router.early_prefill), or None: the Prefill
        call follows the reservation where decode holds a cached prefix of the prompt (a prefill bound later sends
        every block, so that prefix would travel again) or a store load or write-back is planned."""
        if not self.cfg.router.early_prefill or pl.move_prefix is not None or s.load is not None or s.put is not None:
            return None
        held = next((i.cached_tokens for i in snap.instances if i.name == pl.decode), 0)
        p = self.registry.get(pl.prefill)
        return p if held < self.cfg.engine.block_size and p is not None and self.registry.is_up(p) else None

    def _drop_early(self, s: Sub) -> None:
        """An early Prefill call not taken by _drive (its reservation failed, or the request ended): cancelled."""
        settle(s.pre)
        if s.bound is not None and not s.bound.done():
            s.bound.cancel()
        s.pre, s.bound, s.firsts = None, None, []

    async def _open(self, s: Sub, w: WorkerInfo, method: str, early: WorkerInfo | None = None) -> None:
        """Open the placement's stream on w; early: a prefill instance whose Prefill call starts now, beside the
        Decode call, and is bound to the reservation when it comes (prefill_call.py)."""
        s.serial += 1
        s.xid = f"{s.rid}.{s.serial}"
        s.prefill_ttft_s = None  # (an early prefill may report its own before the reservation comes)
        more = dict(kv_tokens=s.kv(), deadline_s=self.cfg.transfer.deadline_s) if method == "Decode" else {}
        if early is not None:  # the prefill, bound later, sends every block
            more["max_skip"] = 0
        try:
            stream = await self.updates.stream(w)
        except Silent as e:
            raise Retry(f"Updates on {e}") from None
        if stream is not None:
            more["updates"] = stream.name
        msg = message(method, request_id=s.xid, prompt=s.prompt, params=s.params, **s.resume(), **more)
        call = self.workers.client(w).stream(method, msg)
        it = call.__aiter__()
        first = None
        if early is not None:
            s.bound, s.firsts, s.on_first = asyncio.get_running_loop().create_future(), [], None
            s.pre = asyncio.ensure_future(self.prefills.run(s, early, s.first, s.bound, w.name))
        if method == "Decode":
            try:
                first = await self._reservation(w, call, it)
            except BaseException:
                self._drop_early(s)
                raise
        s.call, s.worker, s.method, s.prefill, s.kv_bytes, s.kv_backend = call, w, method, None, 0, None
        # one feed of what comes next: the call's messages (a task reads them) and, on the worker's Updates stream,
        # its running updates (from here on: a Decode's come only once its KV is in, after its reservation)
        s.feed, s.stream = asyncio.Queue(), stream
        if stream is not None:
            stream.subscribe(s.xid, s.feed)
        s.pump = asyncio.ensure_future(self._pump(w, it, s.feed))
        # where prefill sends the KV: the decode instance by name (the worker looks its addresses up in the
        # registry's peer table) and the reservation's blocks, skip and region offset
        s.reserved = {"instance": w.name, **first["reserved"]} if first else None
        if s.bound is not None and not s.bound.done():
            s.bound.set_result(s.reserved)
        s.placed_s = time.monotonic() - s.arrival
        s.attempts += 1
        w.inflight += 1

    async def _reservation(self, w: WorkerInfo, call, it) -> dict:
        """A Decode call's first message, its reservation (the call is cancelled when it does not come)."""
        try:
            # a stopped process accepts the call and never answers: give up when its heartbeats stop
            first = await self.workers.watch(w, it.__anext__())
        except StopAsyncIteration:
            call.cancel()
            raise Retry(f"{w.name} closed its Decode stream without a reservation") from None
        except Silent as e:
            call.cancel()
            raise Retry(f"Decode on {e}") from None
        except BaseException:
            call.cancel()
            raise
        if not isinstance(first, dict) or not isinstance(first.get("reserved"), dict):
            call.cancel()
            raise Retry(f"{w.name} answered Decode without a reservation: {str(first)[:200]}")
        return first

    def _close(self, s: Sub) -> None:
        self._drop_early(s)
        self.prefixes.drop_load(s)
        self.prefixes.drop_put(s)
        if s.pump is not None:
            s.pump.cancel()
            s.pump = None
        if s.stream is not None:
            s.stream.unsubscribe(s.xid)
            s.stream = None
        if s.call is not None:
            s.call.cancel()  # the worker's stream ends: it aborts the request and frees its blocks
            s.worker.inflight -= 1
            s.call = None

    async def _pump(self, w: WorkerInfo, it, feed: asyncio.Queue) -> None:
        """A placement's call to w, read into its feed: each message, then END when the call ends, or what it
        raised (grpc.aio.AioRpcError, or Silent once w stops heartbeating)."""
        try:
            while True:
                feed.put_nowait(await self.workers.watch(w, it.__anext__()))
        except StopAsyncIteration:
            feed.put_nowait(END)
        except Exception as e:  # noqa: BLE001 - handed to the request's task (_drive), which never waits in vain
            feed.put_nowait(Failed(e))

    async def _next(self, s: Sub, pre: asyncio.Future | None, kv_pending: bool) -> dict:
        """The placement's next message from its feed (its call's, and its running updates from the worker's
        Updates stream where it has one). While the request's prefill call (`pre`) runs and decode has not yet
        reported the KV in (kv_pending), the call is awaited alongside: its failure raises (its Retry) at once
        rather than when decode's deadline for the KV passes. Raises StopAsyncIteration (the call ended), the
        call's failure (grpc.aio.AioRpcError, Silent), and Retry when the Updates stream ended."""
        if kv_pending and pre is not None and pre.done():  # (an early prefill may have ended before this read)
            raise_failure(pre)
        elif kv_pending and pre is not None:
            get = asyncio.ensure_future(s.feed.get())
            try:
                await asyncio.wait({get, pre}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                get.cancel()  # (a get cancelled leaves its item in the queue)
            if get.done() and not get.cancelled():
                return self._message(s, get.result())
            if pre.exception() is not None:
                raise pre.exception()
        return self._message(s, await s.feed.get())

    @staticmethod
    def _message(s: Sub, got) -> dict:
        if got is END:
            raise StopAsyncIteration
        if isinstance(got, Failed):
            raise got.error
        if isinstance(got, Ended):
            s.avoid.add(s.worker.name)
            raise Retry(f"{s.worker.name}'s Updates stream {got.why}")
        return got

    async def _prefilled(self, s: Sub, pre: asyncio.Future | None) -> None:
        """The request finished on decode: wait for its prefill call's answer (the route's KV numbers). Decode
        had every KV byte, so a prefill call failing now changes nothing for the client: it is only logged."""
        if pre is None:
            return
        try:
            await pre
        except Retry as e:
            log.warning("%s: %s, after decode had its KV", s.rid, e)

    # ---- one sequence, start to end
    async def _drive(self, s: Sub, q: asyncio.Queue) -> None:
        def final(u: Update):
            if self.admin.replanner is not None and u.finish_reason in ("length", "stop"):
                self.admin.replanner.finished(len(u.token_ids), time.monotonic())
            u.route = s.route(self.topology)
            self.routes[u.route["route"]] = self.routes.get(u.route["route"], 0) + 1
            q.put_nowait(u)
            if self.on_finish is not None:
                self.on_finish(u, time.monotonic() - s.arrival)

        def stamp(u: Update) -> Update:
            u.index = s.index
            if s.ttft_s is None and u.token_ids:
                s.ttft_s = time.monotonic() - s.arrival
            u.ttft_s = s.ttft_s
            return u

        def relay(u: Update) -> None:
            """Pass a (cumulative) update on; one that adds no token (decode reporting the first token that
            prefill already delivered) is dropped."""
            if s.sent is None or len(u.token_ids) > len(s.sent.token_ids):
                s.sent = stamp(u)
                if not s.final_only:
                    q.put_nowait(u)

        pre = None  # the request's Prefill call, running while the decode stream is read
        try:
            while True:
                try:
                    if s.method == "Decode" and s.pre is not None:  # called beside the reservation: relayed now
                        pre, s.pre, s.on_first = s.pre, None, relay
                        for u in s.firsts:
                            relay(u)
                        s.firsts = []
                    elif s.method == "Decode":
                        name = s.placement.prefill
                        p = self.registry.get(name)
                        if p is None or not self.registry.is_up(p):
                            s.avoid_prefill.add(name)
                            raise Retry(f"prefill instance {name} went down before its Prefill call")
                        pre = asyncio.ensure_future(self.prefills.run(s, p, relay))
                    kv_pending, held = s.method == "Decode", None  # held: the open stream's last update
                    while True:
                        try:
                            msg = await self._next(s, pre, kv_pending)
                        except StopAsyncIteration:
                            break
                        except Silent as e:
                            s.avoid.add(s.worker.name)
                            raise Retry(f"{s.method} on {e}") from None
                        # a malformed or out-of-order update raises: the request ends with a router error
                        u = held = update_of(msg["update"], held)
                        if u.finished and u.error:
                            raise Retry(f"{s.worker.name}: {u.error}")
                        kv_pending = False
                        if u.finished:
                            await self._prefilled(s, pre)
                            s.worker.served += 1
                            final(stamp(u))
                            return
                        relay(u)
                    raise Retry(f"{s.worker.name} closed the stream before the request finished")
                except grpc.aio.AioRpcError as e:  # the open stream's worker failed
                    if e.code() == Code.INVALID_ARGUMENT:
                        raise RequestError(e.details()) from None
                    self.workers.down(s.worker, e)
                    s.avoid.add(s.worker.name)
                    err = f"{s.method} on {s.worker.name} failed: {e.code().name}: {e.details()}"
                except Retry as e:
                    err = str(e)
                s.errors.append(err)
                settle(pre)
                pre = None
                self._close(s)
                self.retries += 1
                if s.output:
                    log.warning("%s: %s; resuming it after the %d tokens streamed", s.rid, err, len(s.output))
                else:
                    log.warning("%s: %s; placing it again", s.rid, err)
                await self._place(s)
        except (RequestError, QueueFull, Unavailable) as e:
            final(Update(s.index, [], "", True, "error", [], 0, len(s.prompt), error=str(e), ttft_s=s.ttft_s))
        except Exception as e:  # noqa: BLE001 - a bug must still end the request, never leave it waiting
            log.exception("%s: router error", s.rid)
            final(Update(s.index, [], "", True, "error", [], 0, len(s.prompt),
                         error=f"router error: {type(e).__name__}: {e}", ttft_s=s.ttft_s))
        finally:
            settle(pre)
            self._close(s)

