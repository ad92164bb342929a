"""Cached prefixes moved between instances for the router: a prefix a placement names (`move_prefix`: PrfaaS's
longer prefix held in the other cluster, BanaServe's global KV store) copied into its prefill instance before the
Prefill call, or loaded beside the decode reservation and computed over as it lands (`Load`); a prompt's whole
blocks written back to the global KV store as the prefill computes them (`Put`) or after it (`store_put`).
A move or a write that fails costs only its time: the prefill computes those tokens, the store misses them.
Runs on the router's asyncio loop; the counters are read by /metrics.
"""

from __future__ import annotations

import asyncio
import logging
import time

from jaxserve.config import Config

from .calls import Workers, message
from .kv_index import KVIndex
from .policies.base import Placement
from .registry import Registry, WorkerInfo
from .requests import CALL_FAILED, Load, Put, Sub, why
from .snapshot import Topology

log = logging.getLogger("jaxserve.router")


class PrefixMoves:
    def __init__(self, cfg: Config, registry: Registry, topology: Topology, index: KVIndex, workers: Workers):
        self.cfg = cfg
        self.registry = registry
        self.topology = topology
        self.index = index
        self.workers = workers
        self.prefix_moves = {"done": 0, "failed": 0, "bytes": 0}  # cached prefixes moved between instances
        # prompts written to the global KV store (streamed: those of done written as the prefill computed them)
        self.store_puts = {"done": 0, "failed": 0, "bytes": 0, "streamed": 0}
        self.store_tasks: set[asyncio.Task] = set()
        # whether the prefill instances write the store's copy as they compute (router.store_write; False once one
        # said it does not: a model with request-level state; the router then puts prompts after their prefill)
        self.puts_stream = cfg.router.store_write == "streamed"
        # a prefix the store holds is read from its shared pool where the prefill instance runs on its host
        # (cache/shared_pool.py), else sent over the transfer layer; False: always sent (bench/store compares them)
        self.shared_loads = cfg.transfer.shared_memory

    def close(self) -> None:
        for t in list(self.store_tasks):
            t.cancel()

    def start_load(self, s: Sub, pl: Placement) -> None:
        """Start the pipelined load the placement names (`move_prefix` with `overlap`), beside the decode
        reservation that follows (`s.load`); an earlier placement's load is dropped."""
        self.drop_load(s)
        mv = pl.move_prefix
        if pl.prefill is None or mv is None or not mv.overlap:
            return
        src, dst = self.registry.get(mv.src), self.registry.get(pl.prefill)
        if src is None or dst is None or not self.registry.is_up(src):
            return  # move_prefix counts the move failed
        tokens = (s.prompt + s.output)[:mv.tokens]
        ld = Load(src.name, dst.name, len(tokens), f"{s.rid}.{s.serial + 1}.prefix",
                   asyncio.get_running_loop().create_future(),
                   shared=self.shared_loads and dst.shares_host_pool(src)
                   and self.cfg.link(self.topology.cluster(src.name), self.topology.cluster(dst.name)) is None)

        async def run():
            t0 = time.monotonic()
            try:
                if ld.shared:
                    ld.reserved.set_result({})
                    ld.sent = await self.workers.watch(dst, self.workers.client(dst).call(
                        "Load", message("Load", request_id=ld.import_id, prompt=tokens, store=src.name),
                        timeout=self.cfg.transfer.deadline_s))
                else:
                    ld.sent = await self._copy_prefix(src, dst, tokens, ld.import_id, ld.reserved)
            except CALL_FAILED as e:
                ld.error = why(e)
            finally:
                ld.seconds = time.monotonic() - t0
                if not ld.reserved.done():
                    ld.reserved.set_result(None)
        ld.task = asyncio.ensure_future(run())
        s.load = ld

    def drop_load(self, s: Sub) -> None:
        """Stop the sequence's pipelined load, if still running (its Import stream closes: the prefill instance
        releases the blocks)."""
        ld, s.load = s.load, None
        if ld is None:
            return
        ld.task.cancel()
        if not ld.reserved.done():  # a task cancelled before it ran sets nothing
            ld.reserved.set_result(None)

    def start_put(self, s: Sub, pl: Placement) -> None:
        """Open the store's Import for the prompt's whole blocks beside the decode reservation (`s.put`), unless
        the store holds them already; an earlier placement's is kept (the same prompt to the same store) or
        dropped."""
        if s.put is None and (not self.puts_stream or pl.prefill is None):
            return  # nothing to keep or drop, nothing to open (no index lookup)
        tokens = s.prompt + s.output
        target = self._put_target(tokens, s.kv()) if pl.prefill is not None else None
        put = s.put
        if put is not None and target is not None and (put.store, put.tokens) == (target[0].name, target[1]) \
                and not put.task.done():
            return
        self.drop_put(s)
        if not self.puts_stream or target is None:
            return
        store, n = target
        put = Put(store.name, n, f"{s.rid}.{s.serial + 1}.put", asyncio.get_running_loop().create_future())

        async def write() -> int:
            try:
                _, got = await self._import(store, tokens[:n], put.import_id, put.reserved)
                return int(got.get("kv_bytes", 0))
            finally:
                if not put.reserved.done():
                    put.reserved.set_result(None)
        put.task = self._put_task(s, store, n, write, streamed=True)
        s.put = put

    def _put_target(self, tokens: list[int], limit: int, force: bool = False) -> tuple[WorkerInfo, int] | None:
        """(the store, the whole-block tokens of `tokens[:limit]` to write to it), or None: no store is up, no
        whole block, or the store holds them already (force: even then)."""
        store = next((w for w in self.registry.up() if w.role == "store"), None)
        bs = self.cfg.engine.block_size
        n = min(len(tokens), limit) // bs * bs
        if store is None or n == 0 or not force and self.index.match(
                tokens[:n], {store.name}, whole=True).get(store.name, 0) >= n:
            return None
        return store, n

    def _put_task(self, s: Sub, store: WorkerInfo, n: int, write, streamed: bool) -> asyncio.Task:
        """Run write() (-> KV bytes written) in the background, counted in `store_puts` (a failure is logged)."""
        async def run():
            try:
                written = await write()
                self.store_puts["done"] += 1
                self.store_puts["streamed"] += int(streamed)
                self.store_puts["bytes"] += written
            except CALL_FAILED as e:
                self.store_puts["failed"] += 1
                log.info("%s: writing %d tokens to the store %s %sfailed (%s)", s.rid, n, store.name,
                         "as they were computed " if streamed else "", why(e))
            finally:
                self.store_tasks.discard(task)
        task = asyncio.ensure_future(run())
        self.store_tasks.add(task)
        return task

    def drop_put(self, s: Sub) -> None:
        """Stop the sequence's write-back to the store, if the Prefill has not named it (its Import closes: the
        store releases the blocks)."""
        put, s.put = s.put, None
        if put is None:
            return
        put.task.cancel()
        if not put.reserved.done():
            put.reserved.set_result(None)

    def name_put(self, s: Sub) -> dict | None:
        """The Prefill's `store`: the write-back's reservation, when the store has made it by now (the Prefill
        does not wait for it: without it the prompt is put after the prefill)."""
        put = s.put
        if put is None or not put.reserved.done() or put.reserved.result() is None:
            self.drop_put(s)
            return None
        return {"import_id": put.import_id, "tokens": put.tokens,
                "dst": {"instance": put.store, **put.reserved.result()}}

    async def move_prefix(self, s: Sub, p: WorkerInfo) -> dict | None:
        """Copy the cached prefix the placement names (`move_prefix`: PrfaaS 3.4.3's longer prefix held in the
        other cluster, or BanaServe's global KV store) from its holder into prefill instance p's prefix cache: an
        Import stream on p reserves the blocks, an Export call on the holder sends the KV into them, and p's
        answer says they are cached. With `overlap`, that load started with the placement (`start_load`) and
        the prefill runs over the prefix as it lands: -> the Prefill's `prefix_from` once p has reserved the
        blocks (None: copied, or failed); from the store's shared pool on p's host, p's Load copies it beside
        the decode reservation -> the Prefill's `prefix_from` at once, naming the Load (p runs the prefill
        after the copy). A move that fails costs only its time: p computes those tokens itself."""
        mv = s.placement.move_prefix
        src = self.registry.get(mv.src)
        tokens = (s.prompt + s.output)[:mv.tokens]
        if src is None or not self.registry.is_up(src):
            self.prefix_moves["failed"] += 1
            log.warning("%s: prefix holder %s is down; %s prefills without it", s.rid, mv.src, p.name)
            return None
        if mv.overlap:
            ld = s.load
            if ld is not None and ld.dst == p.name and await ld.reserved is not None:
                return {"import_id": ld.import_id, "tokens": ld.tokens}
            self.prefix_moves["failed"] += 1
            log.warning("%s: %s could not take the %d-token prefix from %s (%s); it prefills without it", s.rid,
                        p.name, len(tokens), src.name, ld.error if ld is not None else "no load started")
            return None
        t0 = time.monotonic()
        try:
            sent = await self._copy_prefix(src, p, tokens, f"{s.xid}.prefix")
        except CALL_FAILED as e:
            self.prefix_moves["failed"] += 1
            log.warning("%s: moving the %d-token prefix %s -> %s failed (%s); %s prefills without it",
                        s.rid, len(tokens), src.name, p.name, why(e), p.name)
            return None
        self._moved(s, src.name, p.name, len(tokens), int(sent["kv_bytes"]), time.monotonic() - t0, via="transfer")
        return None

    def _moved(self, s: Sub, src: str, dst: str, tokens: int, kv_bytes: int, seconds: float, **more) -> None:
        s.moved = {"src": src, "dst": dst, "tokens": tokens, "kv_bytes": kv_bytes, "seconds": round(seconds, 6),
                   **more}
        self.prefix_moves["done"] += 1
        self.prefix_moves["bytes"] += kv_bytes

    async def _copy_prefix(self, src: WorkerInfo, dst: WorkerInfo, tokens: list[int], rid: str,
                           reserved: asyncio.Future | None = None) -> dict:
        """Copy the KV of a cached prefix (whole blocks) from src's prefix cache into dst's: an Import stream on
        dst reserves the blocks (`reserved` gets the reservation), an Export call on src sends the KV into them,
        and dst's answer says they are cached -> Export's transfer numbers. Raises what the calls raise."""
        async def export(reservation: dict) -> dict:
            return await self.workers.watch(src, self.workers.client(src).call(
                "Export", message("Export", request_id=rid, prompt=tokens, dst={"instance": dst.name, **reservation}),
                timeout=self.cfg.transfer.deadline_s))
        sent, _ = await self._import(dst, tokens, rid, reserved, export)
        return sent

    async def _import(self, dst: WorkerInfo, tokens: list[int], rid: str, reserved: asyncio.Future | None = None,
                      fill=None) -> tuple[dict, dict]:
        """An Import stream on dst for a prefix (whole blocks): `reserved` gets its reservation, `fill(it)` (an
        Export on the holder) or a Prefill naming it sends the KV into it -> (fill's answer, dst's "imported"
        once the prefix is cached there). Raises what the calls raise."""
        deadline = self.cfg.transfer.deadline_s
        imp = self.workers.client(dst).stream("Import", message("Import", request_id=rid, prompt=tokens,
                                                                deadline_s=deadline))
        try:
            it = imp.__aiter__()
            first = await self.workers.watch(dst, it.__anext__())
            if reserved is not None:
                reserved.set_result(first["reserved"])
            sent = await fill(first["reserved"]) if fill is not None else {}
            done = await self.workers.watch(dst, it.__anext__())
            if "imported" not in done:
                raise ValueError(f"Import answered {str(done)[:200]}")
            return sent, done["imported"]
        finally:
            imp.cancel()

    def store_put(self, s: Sub, p: WorkerInfo, tokens: list[int], force: bool = False) -> None:
        """After a prefill on p that did not stream them there (`Put`): its prompt's whole blocks go to the
        global KV store (BanaServe 4.2), in the background, unless the store holds them already (force: even then;
        a read of the store's shared pool missed them, so they are on its disk tier only, or were being
        rewritten). A failed write is logged and counted; nothing waits for it."""
        target = self._put_target(tokens, len(tokens), force)
        if target is None:
            return
        store, n = target

        async def write() -> int:
            sent = await self._copy_prefix(p, store, tokens[:n], f"{s.xid}.store")
            return int(sent.get("kv_bytes", 0))
        self._put_task(s, store, n, write, streamed=False)

    async def settle_load(self, s: Sub, p: WorkerInfo, res: dict) -> bool:
        """After a Prefill on p that named the placement's pipelined load (`move_prefix` with `overlap`): the
        prefix arrived while p's prefill ran over it, or before it (the prefill waited for it); count the move
        -> whether a read of the store's shared pool missed (the prompt then goes back to the store)."""
        ld, got = s.load, res.get("prefix") or {}
        await ld.task
        error, missed = ld.error or got.get("error"), False
        if error or not ld.sent:
            self.prefix_moves["failed"] += 1
            missed = ld.shared
            log.warning("%s: %s did not load the %d-token prefix from %s (%s); it computed it", s.rid, p.name,
                        ld.tokens, ld.src, error)
        else:
            more = ({"via": "shared", "one_pass": bool(ld.sent.get("one_pass"))} if ld.shared else
                    {"streamed_groups": got.get("streamed_groups"), "via": "transfer"})
            self._moved(s, ld.src, p.name, ld.tokens, int(ld.sent["kv_bytes"]), ld.seconds, overlapped=True, **more)
        self.drop_load(s)
        return missed

    def settle_put(self, s: Sub, p: WorkerInfo, tokens: list[int], store: dict | None, res: dict,
                   missed: bool) -> None:
        """After a Prefill on p that was sent `store` (name_put's answer): the store took the prompt as it was
        computed, or it gets it now (a prefill that did not stream it says the model cannot: later ones are
        not asked)."""
        if store and (res.get("store") or {}).get("streamed"):
            s.put = None  # the store is taking it as it was computed: its Import ends by itself
            return
        if store:
            self.puts_stream = False
        self.drop_put(s)
        self.store_put(s, p, tokens, force=missed)
