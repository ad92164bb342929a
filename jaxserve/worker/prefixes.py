"""A worker's prefix calls: Import (reserve blocks for a cached prefix another instance sends here), Export (send
a prefix of this instance's prefix cache into such a reservation), Load (copy a prefix out of the global KV store's
shared pool on this host, with no call to the store), and the one-pass copies out of each store pool on the host,
compiled on threads of their own (`prepare_loads`).

Concurrency: the handlers run on the worker's asyncio loop and hand the engine work as commands (its engine
thread); they read the worker's role, engine, intake, feeder and peers (main.py), which a role change may replace
between calls.
"""

from __future__ import annotations

import asyncio
import logging
import time

from . import peers

log = logging.getLogger("jaxserve.worker")


class PrefixCalls:
    def __init__(self, worker):
        """worker: the Worker (main.py) whose calls these are."""
        self.w = worker
        self.cfg = worker.cfg
        self.pools: dict = {}  # a store instance's name -> its SharedPool, mapped here
        self._copies: set[str] = set()  # store pools (segment names) whose one-pass copy is compiled or compiling
        self.loads: dict[str, asyncio.Future] = {}  # Load calls under way here by request_id -> their error or None

    async def import_prefix(self, req, ctx):
        """Import (stream): reserve blocks for a cached prefix another instance exports to this one (the router's
        prefix move), answer the reservation, then {"imported": {"tokens", "skip", "kv_bytes"}} once its KV is
        cached here; ABORTED when the transfer failed. Closing the stream early releases the reservation. With no
        room now, the reservation waits for it, ahead of the requests queued here (KVIntake.
        reserve_prefix_when_room): RESOURCE_EXHAUSTED when none came within the deadline, whose remainder the
        transfer then has."""
        import grpc
        from jaxserve.transfer.bufpool import PoolFull
        from jaxserve.transfer.plan import layer_groups
        from jaxserve.transfer.segments import OutOfBlocks
        from ..engine.client import RequestError
        rid, tokens = req.request_id, list(req.prompt)
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def on_done(error):  # engine thread
            loop.call_soon_threadsafe(lambda: done.done() or done.set_result(error))
        # as the layer groups a prefill over it runs (a Prefill naming this Import computes over it as it lands);
        # a prefix shorter than transfer.stream_min_tokens lands whole before that prefill runs, unstaged: its
        # per-group programs and imports would cost more than the fetch they hide
        groups = layer_groups(self.w.llm.layout.num_layers, self.cfg.transfer.groups_of(len(tokens)))
        wait_s = req.deadline_s or self.cfg.transfer.deadline_s
        reserved = loop.create_future()

        def on_reserved(result):  # engine thread: (blocks, skip), or why not
            loop.call_soon_threadsafe(lambda: reserved.done() or reserved.set_result(result))
        self.w.engine.post(lambda: self.w.intake.reserve_prefix_when_room(
            rid, tokens, on_done, on_reserved, wait_s, groups if len(groups) > 1 else None) or [])

        def withdraw():  # no longer waiting (released, if it was reserved meanwhile)
            self.w.engine.post(lambda: self.w.intake.withdraw(rid) or [])
        try:
            result = await asyncio.wait_for(asyncio.shield(reserved), wait_s)
        except TimeoutError:
            withdraw()
            result = OutOfBlocks(f"no room for the {len(tokens)}-token prefix within {wait_s:g}s")
        except BaseException:  # the caller went away
            withdraw()
            raise
        if isinstance(result, (RequestError, ValueError)):
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(result))
        if isinstance(result, (OutOfBlocks, PoolFull)):
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{type(result).__name__}: {result}")
        if isinstance(result, Exception):
            await ctx.abort(grpc.StatusCode.INTERNAL, f"reserving the prefix failed: {type(result).__name__}: {result}")
        blocks, skip = result
        recv = self.w.intake.receivers.get(rid)  # (its bytes, once arrived; nothing is sent before the answer below)
        try:
            yield {"reserved": {"blocks": blocks, "skip": skip, "shm_base": self.w.intake.shm_base(rid),
                                "pull": self.w.intake.server.puller is not None}}
            error = await asyncio.shield(done)  # the caller closing the stream cancels this wait, not `done`
        finally:
            if not done.done():
                self.w.intake.cancel(rid)  # its arrival (failed) releases the blocks on the engine thread
        if error is not None:
            await ctx.abort(grpc.StatusCode.ABORTED, f"prefix import failed: {error}")
        yield {"imported": {"tokens": len(tokens), "skip": skip, "kv_bytes": recv.received if recv else 0}}

    async def export_prefix(self, req, ctx):
        """Export: send the KV of a prefix this instance holds in its prefix cache (whole blocks; with
        request-level state, a snapshot at its end) into a reservation that Import made on another instance ->
        the transfer's numbers once acknowledged. FAILED_PRECONDITION when the prefix is no longer cached."""
        import grpc
        from ..disagg.prefill_side import Handoff
        from ..engine.client import RequestError
        if self.w.role == "decode":
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.w.inst.name} is a {self.w.role} instance")
        dst, tokens = req.dst, list(req.prompt)
        peer = await self.w.peers.get(dst.instance)
        why = self.w.peers.check_dst(peer, dst, len(tokens), self.w.llm.layout, self.w.llm.dtype_name,
                                      decode=False)
        if why is not None:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        link, shm_base = self.w.peers.link_to(peer, dst)
        # by layer group whatever its length: the receiver may be computing over it as it lands
        handoff = Handoff(link, self.w.feeder, list(dst.blocks), dst.skip, len(tokens), False,
                          self.cfg.transfer.layers_per_group, request_id=req.request_id, shm_base=shm_base)

        def send(eng) -> bool:
            found = eng.connector.cached_prefix(tokens)
            if found is not None:
                handoff.send_cached(eng.connector, *found)
            return found is not None
        try:
            sent = await self.w.engine.call(send)
        except (RequestError, ValueError) as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not sent:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{self.w.inst.name} no longer holds the {len(tokens)}-token prefix")
        return await peers.sent(handoff.sender, ctx, self.cfg.transfer.deadline_s)

    async def load_prefix(self, req, ctx):
        """Load: copy the prefix `prompt` (whole blocks) from the shared pool of store `store` on this host into
        this instance's prefix cache, with no call to the store (cache/shared_pool.py) -> {"kv_bytes",
        "seconds"}. FAILED_PRECONDITION when `store` is no store with a shared pool on this host, or its pool
        does not hold the prefix (any more, or a write of the store raced the read); RESOURCE_EXHAUSTED when
        there is no room for it here. While it runs it is in `loads` (its outcome to come: None, or why it
        failed): a Prefill whose prefix_from names it is queued on the engine thread after its copy."""
        done = asyncio.get_running_loop().create_future()
        self.loads[req.request_id] = done
        outcome = "the Load call was cancelled"  # what the engine thread took of it runs to its end first
        try:
            code, answer = await self._load(req)
            outcome = None if code is None else answer
        finally:
            self.loads.pop(req.request_id, None)
            done.set_result(outcome)
        if code is not None:
            await ctx.abort(code, answer)
        return answer

    async def _load(self, req) -> tuple:
        """-> (None, Load's answer), or (a gRPC status code, why)"""
        import grpc
        from jaxserve.transfer.segments import OutOfBlocks
        from ..cache.shared_pool import Missed
        from ..engine.client import RequestError
        if self.w.role != "prefill":
            return grpc.StatusCode.FAILED_PRECONDITION, f"{self.w.inst.name} is a {self.w.role} instance"
        pool, why = self.pool_of(req.store)
        if pool is None:
            return grpc.StatusCode.FAILED_PRECONDITION, why
        tokens, t0 = list(req.prompt), time.monotonic()

        def load(eng):  # -> (bytes, whether copied in one pass); staged (until the one-pass copy is compiled) in
            kv = eng.connector  # the layer groups the import programs were warmed with
            before = kv.prefix_loads["one_pass"]
            return kv.load_prefix(tokens, pool, self.w.layer_groups), kv.prefix_loads["one_pass"] > before
        try:
            kv_bytes, one_pass = await self.w.engine.call(load)
        except (RequestError, ValueError) as e:
            return grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except Missed as e:
            return grpc.StatusCode.FAILED_PRECONDITION, str(e)
        except OutOfBlocks as e:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room for the prefix: {e}"
        return None, {"kv_bytes": kv_bytes, "seconds": round(time.monotonic() - t0, 6), "one_pass": one_pass}

    def prepare_loads(self) -> None:
        """For each store pool on this host that the peer table newly shows, compile the one-pass copy out of it
        (cache/pool_copy.py) on a thread of its own: the engine thread is not held up, and until they are
        compiled a Load stages the prefix (nothing compiles on a request's path)."""
        import threading

        from jaxserve.transfer.shm import same_host
        from ..cache.shared_pool import SharedPool
        if self.w.role != "prefill" or not self.w.reads_pool or self.w.llm.runner.copies is None:
            return
        for name, peer in list(self.w.peers.table.items()):
            desc = peer.get("pool")
            if peer.get("role") != "store" or not desc or desc.get("name") in self._copies \
                    or not same_host(desc.get("boot")):
                continue
            self._copies.add(desc["name"])

            def compile_(name=name, desc=desc):
                try:
                    shapes = SharedPool.shapes(desc, self.w.llm.layout, self.w.llm.dtype_name)
                    t0 = time.monotonic()
                    made = self.w.llm.prepare_loads(shapes)
                    log.info("%s: the one-pass copy out of %s's pool compiled in %.1fs (%d programs)",
                             self.w.inst.name, name, time.monotonic() - t0, made)
                except Exception as e:  # noqa: BLE001 - the loads from this store stage instead
                    log.warning("%s: no one-pass copy out of %s's pool (%s: %s); its prefixes are staged",
                                self.w.inst.name, name, type(e).__name__, e)
            threading.Thread(target=compile_, name="jaxserve-copies", daemon=True).start()

    def pool_of(self, instance: str):
        """Store `instance`'s shared pool, mapped here on first use -> (SharedPool, None), or (None, why not) when
        the peer table has no such pool on this host or it does not fit this instance's pool."""
        from jaxserve.transfer.shm import same_host
        from ..cache.shared_pool import SharedPool
        peer = self.w.peers.table.get(instance)
        desc = (peer or {}).get("pool")
        if not self.w.reads_pool or peer is None or peer.get("role") != "store" or not desc:
            return None, f"store: {instance!r} is not a store with a shared pool"
        if not same_host(desc.get("boot")):
            return None, f"store: {instance!r} runs on another host"
        got = self.pools.get(instance)
        if got is None or got.name != desc["name"]:  # first use, or the store restarted with a new segment
            if got is not None:
                got.close()
            try:
                got = SharedPool.attach(desc, self.w.llm.layout, self.w.llm.dtype_name)
            except (OSError, ValueError) as e:
                self.pools.pop(instance, None)
                return None, f"store: {instance!r}: {e}"
            self.pools[instance] = got
        return got, None

    def close(self) -> None:
        for pool in self.pools.values():
            pool.close()
