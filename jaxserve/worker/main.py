"""A worker: one instance of a cluster serving the worker protocol over gRPC (the process around it, its
pinning and lifetime, is process.py; what it does before JAX starts, setup.py).

The protocol (every method, its messages and who may call it: JSON over gRPC, rpc.py; every request checked
against its schema in messages.py) is docs/08-worker-protocol.md.

When ready it prints one line `JAXSERVE_WORKER_READY {json}` with its addresses. Concurrency: one asyncio loop
(gRPC server and handlers), the heartbeat thread's loop, the engine thread (engine/async_engine.py), the
transfer threads, and a thread compiling the copies out of each store pool on the host (`_prepare_loads`).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import time

from ..config import Config, InstanceSection

from .setup import READY, Refused, build_engine

log = logging.getLogger("jaxserve.worker")
MIGRATE_CALL_S = 30.0  # a helper that does not answer a migration's call within this fails the step's move


class Worker:
    def __init__(self, cfg: Config, inst: InstanceSection, progress: bool = False, advertise: str | None = None,
                 group=None):
        """advertise: the host other processes dial for this worker's gRPC and KV servers (a pod's IP), where
        it listens on a wildcard address (default: instance.host). group: the leader's channel to the other
        processes of a multi-host instance (worker/group.py), whose runners then follow this one's."""
        from ..engine.async_engine import AsyncEngine
        self.cfg, self.inst = cfg, inst
        self.role = inst.role  # SetRole changes it in place
        self.cluster = cfg.cluster_of(inst.name)
        self.address = None  # host:port once serving
        self.advertise = advertise or inst.host
        t0 = time.monotonic()
        self.llm = build_engine(cfg, inst, progress)
        from jaxserve.transfer.plan import layer_groups
        # the layer groups KV is exported and imported in: the transfer programs are warmed with them (_warm)
        self.layer_groups = layer_groups(self.llm.layout.num_layers, cfg.transfer.layers_per_group)
        self.group = group
        if group is not None:
            from .group import Lockstep
            print(f"{inst.name}: waiting for the group's {group.group.size - 1} other processes", flush=True)
            group.accept()
            self.llm.runner = Lockstep(self.llm.runner, group)
        self._stream(inst.role)
        # the global KV store keeps its pool in shared memory, where prefill instances on its host read it in
        # place (cache/shared_pool.py); a prefill instance on one CPU device reads such pools (an accelerator's
        # pool would copy them over its host link: it takes them over the transfer layer)
        from ..cache.shared_pool import readable_here
        single = group is None and _one_cpu_device(self.llm.runner.pool)
        self.reads_pool = single and cfg.transfer.shared_memory and readable_here()
        self.shared_pool = self.llm.runner.share_pool() if inst.role == "store" and self.reads_pool else None
        self._pools: dict = {}  # a store instance's name -> its SharedPool, mapped here
        self._copies: set[str] = set()  # store pools (segment names) whose one-pass copy is compiled or compiling
        self._loads: dict[str, asyncio.Future] = {}  # Load calls under way here by request_id -> their error or None
        if cfg.engine.warmup:
            print(f"{inst.name}: compiling the step programs (engine.warmup)", flush=True)
            print(f"{inst.name}: {self._warm(inst.role, progress)} programs compiled", flush=True)
        print(f"{inst.name}: engine ready after {time.monotonic() - t0:.1f}s", flush=True)
        self.engine = AsyncEngine(self.llm)
        t = cfg.transfer
        self.tls = t.tls.build() if t.tls else None  # transfer/tls.py: gRPC and KV links over TLS
        self._client_tls = self.tls.client_context() if self.tls else None
        self.intake = self.feeder = self.pull_server = None
        self.links: dict[tuple, tuple[object, float]] = {}  # (address, segment, pull) -> (link, last used)
        self.peers: dict[str, dict] = {}  # the router's peer table (registry.py `peers`), from each heartbeat
        self._names = {i.name for i in cfg.instances()}
        self._beats = self._router = None  # the heartbeat thread (rpc.LoopThread) and its router client
        self.link_bandwidth: dict[str, float] = {}  # cluster -> Gbit/s set at run time (SetLink)
        self._kv_want: int | None = None  # the cache event the router's KV index expects next (None: full)
        self._kv_full = None  # the full cache state being taken on the engine thread
        import jax
        if t.pulls(jax.default_backend()) and group is None:  # a group's KV moves through its leader's host
            from jaxserve.transfer.pull import PullServer
            try:
                self.pull_server = PullServer(inst.host, t.connections)
            except Exception as e:  # noqa: BLE001 - PJRT without a transfer server for this platform
                if t.device_transfer == "on":
                    from ..config import ConfigFileError
                    raise ConfigFileError(f"transfer.device_transfer: on, but JAX's transfer server did not start "
                                          f"on {jax.default_backend()}: {e}") from e
                log.warning("%s: no device transfer (%s); KV goes over TCP / shared memory", inst.name, e)
        # every instance receives KV: a decode instance its requests', any instance a cached prefix moved to it
        from ..disagg.decode_side import KVIntake
        self.intake = KVIntake(self.llm, t.token, self.engine.post, inst.host, inst.kv_port,
                               t.recv_pool_mb << 20, t.deadline_s, shared=t.shared_memory,
                               puller=self.pull_server, timeouts=t.timeouts(), pull_from=self._pull_source,
                               tls=self.tls.server_context() if self.tls else None)
        self.engine.hooks.append(self.intake.retry_waiting)  # prefixes waiting for room, once some may be free
        if inst.role in ("prefill", "both", "store"):  # a store exports prefixes as a prefill instance does
            from ..disagg.prefill_side import Feeder
            self.feeder = Feeder()
        self._active = 0  # Decode, Prefill, Generate, Import and Export calls in progress (asyncio loop only)
        self._idle: asyncio.Event | None = None  # set while _active is 0 (made on the loop, in start())
        self._flipping = False
        self._helpers: dict = {}  # address -> rpc.SyncClient: helpers of this instance's migrations
        import concurrent.futures
        self._migrations = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="migration")  # as a helper

    def _stream(self, role: str) -> None:
        """Where `role` sends KV layer group by layer group, every prefill step runs its long shapes as the
        groups (LLMEngine.stream_layers): warm-up then compiles each shape one way."""
        sends = role in ("prefill", "both") and len(self.layer_groups) > 1
        self.llm.stream_layers(self.layer_groups if sends else None, self.cfg.transfer.stream_min_tokens)

    def _warm(self, role: str, progress: bool = False) -> int:
        """Compile what `role` runs (engine thread, or before the engine thread starts) -> programs compiled.
        Every whole-model prefill shape where requests are prefilled, and on a layer-wise prefill instance the
        layer-group programs of the shapes a streamed prompt's last chunk can take; a role's fallbacks (a
        prefill instance decoding when no decode instance is up, a decode instance prefilling when no prefill
        instance is) compile when first needed."""
        cfg = self.cfg
        groups = self.layer_groups
        if role == "store":  # no model step runs here: only the programs that move KV in and out
            return self.llm.runner.warmup_transfer(self.llm.dtype_name, groups, export=True, receive=True,
                                                   progress=progress)
        sends, layerwise = role in ("prefill", "both"), len(groups) > 1
        receives = role in ("decode", "both")
        store = any(i.role == "store" for i in cfg.instances())  # prefills may run over prefixes it loads
        moves = store or any(c.kind == "prfaas" for c in cfg.clusters)  # prefixes moved between clusters
        n = self.llm.runner.warmup(progress, groups if sends and layerwise else None, tails=receives,
                                   decode=receives, whole=sends, stage_cached=sends and store)
        # a prefill instance receives cached prefixes too where there are any to receive (moved between clusters,
        # or loaded from the global KV store layer group by layer group while its prefill runs)
        return n + self.llm.runner.warmup_transfer(self.llm.dtype_name, groups, export=sends,
                                                   receive=receives or (sends and moves), progress=progress,
                                                   by_group=sends and store)

    def _pull_source(self, address: str) -> bool:
        """Whether a PULL frame's transfer-server address belongs to a registered prefill instance."""
        return any(p.get("pull_address") == address for p in list(self.peers.values()))

    # ---- the peer table (from the router) and the links to decode instances
    def _link(self, peer: dict, dst_cluster: str, shm_base: int | None):
        """The link to a decode instance's KV server (`peer`: its entry in the router's peer table): device
        pulls when both ends take them (transfer.device_transfer), else shared memory when it runs on this host
        (transfer.shared_memory), else TCP; a configured link between the two clusters sets its emulated
        bandwidth, latency, loss and connection count (and always means TCP). Links idle for
        transfer.link_idle_s are closed (their threads end); a later transfer builds a fresh one.
        -> (link, shm region base)"""
        from jaxserve.transfer.link import LinkEmulation
        from jaxserve.transfer.pull import PullLink
        from jaxserve.transfer.shm import ShmLink, same_host
        from jaxserve.transfer.tcp import TcpLink
        t = self.cfg.transfer
        address = peer["kv_address"]
        lk = self.cfg.link(self.cluster, dst_cluster)
        pull = lk is None and self.pull_server is not None and bool(peer.get("pull"))
        shm = peer.get("shm") if t.shared_memory and lk is None and not pull and shm_base is not None else None
        if shm is not None and not same_host(shm.get("boot")):
            shm = None
        key = (address[0], int(address[1]), shm["name"] if shm else None, pull)
        now = time.monotonic()
        for k, (link, used) in list(self.links.items()):
            if k != key and now - used > t.link_idle_s:
                del self.links[k]
                link.close()
        if key not in self.links:
            kw = dict(name=f"{self.inst.name}->{key[0]}:{key[1]}" + (" (shm)" if shm else " (device)" if pull else ""),
                      chunk_bytes=int(t.chunk_mb * (1 << 20)), timeouts=t.timeouts(), tls=self._client_tls)
            if pull:
                link = PullLink(key[:2], t.token, self.pull_server, t.deadline_s, connections=t.connections, **kw)
            elif shm is not None:
                link = ShmLink(key[:2], t.token, shm["name"], connections=t.connections, **kw)
            else:
                gbps = self.link_bandwidth.get(dst_cluster, lk.bandwidth_gbps) if lk else None
                emu = LinkEmulation(gbps, lk.latency_ms, lk.loss) if lk else None
                link = TcpLink(key[:2], t.token, lk.connections if lk else t.connections, emulation=emu, **kw)
            link.metrics.labels = {"src": self.cluster, "dst": dst_cluster}  # the router sums per cluster pair
            self.links[key] = (link, now)
        link = self.links[key][0]
        self.links[key] = (link, now)
        return link, (shm_base if shm else None)

    async def _peer(self, name: str, decode: bool = False) -> dict | None:
        """Instance `name` from the router's peer table; asks the router once more on a miss (an instance that
        registered since this worker's last heartbeat) and, with `decode`, when the table says it does not
        decode (it changed its role since)."""
        peer = self.peers.get(name)
        stale = peer is None or (decode and peer.get("role") not in ("decode", "both"))
        if stale and self._beats is not None:
            try:
                await asyncio.wrap_future(self._beats.submit(self._register()))
            except Exception as e:  # noqa: BLE001 - the router unreachable: the table stays as it was
                log.warning("peer table refresh failed: %s", e)
        return self.peers.get(name)

    # ---- methods
    async def health(self, req=None, ctx=None):
        """The Health call: stats taken on the engine thread, so they follow every earlier command."""
        return self._describe(await self.engine.call(self._stats))

    async def set_link(self, req, ctx=None):
        """SetLink: the emulated bandwidth of the links from this instance to cluster req.dst, now and for links
        built later. -> {"links": how many open links changed}"""
        self.link_bandwidth[req.dst] = req.bandwidth_gbps
        changed = 0
        for link, _ in list(self.links.values()):
            if link.metrics.labels.get("dst") == req.dst and link.shaper.bucket is not None:
                link.set_bandwidth(req.bandwidth_gbps)
                changed += 1
        log.info("links to %s: %.3f Gbit/s (%d open)", req.dst, req.bandwidth_gbps, changed)
        return {"links": changed}

    async def set_role(self, req, ctx=None):
        """SetRole (docs/08-worker-protocol.md): drain, compile what the new role lacks, switch."""
        import grpc
        role, old = req.role, self.role
        if role == old:
            return {"role": role, "previous": old, "drained_s": 0.0, "programs_compiled": 0}
        if self._flipping:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name}: a role change is under way")
        self._flipping = True
        t0 = time.monotonic()
        try:
            await self._idle.wait()  # every call in flight has ended: its requests and transfers are done
            drained = time.monotonic() - t0
            log.info("%s: drained in %.2fs; %s -> %s", self.inst.name, drained, old, role)
            n = await self.engine.call(lambda eng: self._become(role))
        finally:
            self._flipping = False
        log.info("%s: now %s (%d programs compiled)", self.inst.name, role, n)
        return {"role": role, "previous": old, "drained_s": drained, "programs_compiled": n}

    def _become(self, role: str) -> int:
        """Engine thread: compile what `role` runs (engine.warmup), then take it -> programs compiled. The
        warm-up's programs write block 0, which the prefix cache may hold by now: it leaves the cache first (with
        a request holding it, which the drain rules out, the new role's programs compile when first needed)."""
        self._stream(role)
        n = self._warm(role) if self.cfg.engine.warmup and self.llm.blocks.uncache(0) else 0
        if role in ("prefill", "both") and self.feeder is None:
            from ..disagg.prefill_side import Feeder
            self.feeder = Feeder()
        self.role = role
        return n

    def _counted(self, fn, stream: bool):
        """A call handler that counts itself in flight (SetRole's drain waits for the count to reach 0). While a
        role change is under way it refuses new calls as busy (RESOURCE_EXHAUSTED: the router tries another
        instance); the router stops placing work here before it asks for the change, so only a call it had
        already placed meets this."""
        async def enter(ctx):
            if self._flipping:
                import grpc
                await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.inst.name} is changing its role")
            self._active += 1
            self._idle.clear()

        def leave():
            self._active -= 1
            if not self._active:
                self._idle.set()
        if stream:
            async def streamed(req, ctx):
                await enter(ctx)
                try:
                    async for msg in fn(req, ctx):
                        yield msg
                finally:
                    leave()
            return streamed

        async def unary(req, ctx):
            await enter(ctx)
            try:
                return await fn(req, ctx)
            finally:
                leave()
        return unary

    def _stats(self, eng) -> dict:
        """Engine thread: the engine's stats and its KV intake's (reservations, receive pool)."""
        return {**eng.stats(), **self.intake.stats()}

    def _kv_address(self) -> list | None:
        """[host, port] senders dial for this instance's KV server (instance.kv_advertise, else the advertised
        host and the bound port)."""
        if self.inst.kv_advertise:
            host, _, port = self.inst.kv_advertise.rpartition(":")
            return [host, int(port)]
        return [self.advertise, self.intake.address[1]]

    def _describe(self, stats: dict) -> dict:
        from jaxserve.transfer.shm import boot_id
        links = {v.metrics.name: v.metrics.snapshot() for v, _ in list(self.links.values())}
        pool = self.intake.pool
        shm = {"name": pool.shm_name, "boot": boot_id(), "bytes": pool.capacity} if pool.shm_name else None
        copies = self.llm.runner.copies  # compiled on their own thread: the engine's stats may predate them
        stats = {**stats, "store_copies": len(copies) if copies is not None else 0}
        return {"name": self.inst.name, "role": self.role, "address": self.address, "pid": os.getpid(),
                "kv_address": self._kv_address(),
                "max_model_len": self.llm.max_model_len, "stats": stats, "links": links, "shm": shm,
                "pull": self.intake.server.puller is not None,
                "pull_address": self.pull_server.address if self.pull_server and self.role != "decode" else None,
                "request_state": self.llm.scheduler.cfg.has_request_state,
                "pool": {**self.shared_pool.describe(), "boot": boot_id()} if self.shared_pool else None,
                "reads_pool": self.reads_pool}

    async def _updates(self, q, rid):
        """The request's Updates as stream messages until it finishes; leaving early aborts it."""
        try:
            while True:
                u = await q.get()
                yield {"update": dataclasses.asdict(u)}
                if u.finished:
                    return
        finally:
            self.engine.abort(rid)

    async def decode(self, req, ctx):
        import grpc
        from jaxserve.transfer.bufpool import PoolFull
        from jaxserve.transfer.segments import OutOfBlocks
        from ..engine.client import RequestError
        if self.role in ("prefill", "store"):
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is a {self.role} instance")
        rid = req.request_id
        try:
            params = req.params.sampling()
            q, (blocks, skip, base) = await self.engine.attach(rid, lambda eng: self._reserve(req, params))
        except (RequestError, ValueError) as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (OutOfBlocks, PoolFull) as e:  # no room right now
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{type(e).__name__}: {e}")
        try:
            yield {"reserved": {"blocks": blocks, "skip": skip, "shm_base": base,
                                "pull": self.intake.server.puller is not None}}
            async for msg in self._updates(q, rid):
                yield msg
        finally:
            self.intake.cancel(rid)
            self.engine.abort(rid)

    async def generate(self, req, ctx):
        import grpc
        from ..engine.client import QueueFull, RequestError
        if self.role == "store":
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is a store instance")
        try:
            params = req.params.sampling()
            if params.n != 1:
                raise ValueError("Generate takes n = 1 (the router fans out n > 1)")
            q = await self.engine.add(req.request_id, list(req.prompt), params, **req.resume())
        except (RequestError, ValueError) as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"QueueFull: {e}")
        async for msg in self._updates(q, req.request_id):
            yield msg

    def _reserve(self, req, params):
        seq, blocks, skip = self.intake.reserve(req.request_id, list(req.prompt), params, req.kv_tokens,
                                                req.deadline_s, **req.resume())
        return [seq], (blocks, skip, self.intake.shm_base(req.request_id))

    def _check_dst(self, peer: dict | None, dst, kv: int, decode: bool = True) -> str | None:
        """Why a reservation cannot be sent to (None: it can): the instance must be a registered instance (a
        decode instance, for a request's KV), its blocks must cover the KV, and a shared-memory region must lie
        page aligned inside the instance's segment, with exactly the room the transfer's staging takes."""
        from jaxserve.transfer.bufpool import PAGE
        from jaxserve.transfer.receiver import region_bytes
        if peer is None:
            return (f"dst.instance: {dst.instance!r} is not an instance registered with the router"
                    + ("" if self._beats is not None else " (this worker has no router: start it with --router)"))
        if decode and peer.get("role") not in ("decode", "both"):
            return f"dst.instance: {dst.instance!r} is a {peer.get('role')} instance, not a decode instance"
        if not peer.get("kv_address"):
            return f"dst.instance: {dst.instance!r} has no KV server"
        n = -(-kv // self.llm.layout.block_size)
        if len(dst.blocks) < n or dst.skip > n:
            return f"dst.blocks: {len(dst.blocks)} blocks (skipping {dst.skip}) do not hold {kv} tokens ({n} blocks)"
        if dst.shm_base is not None and not peer.get("shm"):
            return f"dst.shm_base: {dst.instance!r} has no shared-memory receive pool"
        if dst.shm_base is not None:
            need = region_bytes(self.llm.layout, self.llm.dtype_name, kv, dst.skip)
            if dst.shm_base % PAGE or dst.shm_base + need > int(peer["shm"]["bytes"]):
                return (f"dst.shm_base: a region of {need} bytes at {dst.shm_base} is not a page-aligned region "
                        f"of {dst.instance!r}'s receive pool ({peer['shm']['bytes']} bytes)")
        return None

    async def prefill(self, req, ctx):
        import grpc
        from jaxserve.transfer.segments import OutOfBlocks
        from ..disagg.prefill_side import Handoff
        from ..engine.client import RequestError
        if self.role in ("decode", "store"):
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is a {self.role} instance")
        rid, kv, dst = req.request_id, req.kv_tokens, req.dst
        t = self.cfg.transfer
        peer = await self._peer(dst.instance, decode=True)
        why = self._check_dst(peer, dst, kv)
        pf = req.prefix_from
        if why is None and pf is not None:
            why = self._check_prefix_from(pf, kv)
        sc, store_peer = req.store, None
        if why is None and sc is not None:
            store_peer = await self._peer(sc.dst.instance)
            why = self._check_store_copy(store_peer, sc, kv)
        if why is not None:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        prompt = list(req.prompt)[:kv]
        over = []  # the IncomingPrefix the prefill runs over (none when that Import has ended)
        # or a Load here from the store's shared pool, under way: its copy is queued on the engine thread already
        # (Load queues it before it first awaits), so the prefill, queued after it, finds the prefix cached
        loading = self._loads.get(pf.import_id) if pf is not None else None
        try:
            params = req.params.sampling()
            link, shm_base = self._link_to(peer, dst)
            copies, per_group = [], t.groups_of(kv)
            # the store's copy leaves group by group beside decode's; a model with request-level state would
            # need the state at the copy's end, a snapshot the step does not export: the router puts it after
            if sc is not None and not self.llm.layout.has_request_state:
                store_link, store_base = self._link_to(store_peer, sc.dst)
                copies.append(Handoff(store_link, self.feeder, list(sc.dst.blocks), sc.dst.skip, sc.tokens, False,
                                      per_group, request_id=sc.import_id, shm_base=store_base))
            handoff = Handoff(link, self.feeder, list(dst.blocks), dst.skip, kv, req.sample, per_group,
                              request_id=rid, shm_base=shm_base, copies=copies)

            def add(eng):
                inc = self.intake.prefixes.get(pf.import_id) if pf is not None else None
                if inc is not None and inc.tokens != prompt[:pf.tokens]:
                    raise RequestError(f"prefix_from.import_id: {pf.import_id!r} carries another prefix than the "
                                       f"prompt's first {pf.tokens} tokens")
                seqs = eng.add_request(rid, prompt, params)
                seqs[0].handoff = handoff
                if inc is not None and inc.pending:
                    seqs[0].incoming = inc
                    over.append(inc)
                return seqs, None
            q, _ = await self.engine.attach(rid, add)
        except (RequestError, ValueError) as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        try:
            while True:
                u = await q.get()
                if u.finished:
                    break
        finally:
            self.engine.abort(rid)
        if u.error or u.finish_reason != "handoff":
            await ctx.abort(grpc.StatusCode.ABORTED, f"prefill failed: {u.error or u.finish_reason}")
        sender = handoff.sender
        if handoff.sample and not handoff.ends:  # the client may see the first token while its KV travels
            yield {"first": dataclasses.asdict(dataclasses.replace(u, finished=False, finish_reason=None))}
        sent = await self._sent(sender, ctx)
        prefix = None
        if loading is not None:
            prefix = {"tokens": pf.tokens, "streamed_groups": 0, "error": await asyncio.shield(loading),
                      "via": "shared"}
        elif pf is not None:  # what arrived while the prefill ran (none: the Import had ended before it began)
            prefix = {"tokens": pf.tokens, "streamed_groups": len(over[0].imported) if over else 0,
                      "error": over[0].error if over else None, "via": "transfer"}
        store = None if sc is None else {"streamed": bool(copies)}  # False: the router puts it after the prefill
        yield {**sent, "token": u.token_ids[0] if u.token_ids and handoff.sample else None, "ttft_s": u.ttft_s,
               **({"prefix": prefix} if prefix is not None else {}), **({"store": store} if store else {})}

    def _check_store_copy(self, peer: dict | None, sc, kv: int) -> str | None:
        """Why the prompt's KV cannot also go to the store's reservation `sc` (None: it can)."""
        bs = self.llm.layout.block_size
        if sc.tokens % bs or sc.tokens > kv:
            return f"store.tokens: {sc.tokens} is not whole blocks of {bs} tokens within the {kv} tokens prefilled"
        if peer is not None and peer.get("role") != "store":
            return f"store.dst.instance: {sc.dst.instance!r} is a {peer.get('role')} instance, not the store"
        why = self._check_dst(peer, sc.dst, sc.tokens, decode=False)
        return None if why is None else "store." + why

    def _check_prefix_from(self, pf, kv: int) -> str | None:
        """Why the prompt cannot run over the prefix pf names (None: it can)."""
        bs = self.llm.layout.block_size
        if pf.tokens % bs or pf.tokens >= kv:
            return (f"prefix_from.tokens: {pf.tokens} is not whole blocks of {bs} tokens shorter than the "
                    f"{kv} tokens prefilled")
        return None

    def _link_to(self, peer: dict, dst):
        """(link, shm region base) for a reservation on instance dst.instance (`peer`: its peer-table entry)."""
        return self._link(peer, self.cfg.cluster_of(dst.instance) if dst.instance in self._names else self.cluster,
                          dst.shm_base)

    async def _sent(self, sender, ctx) -> dict:
        """Wait until the receiver acknowledged every byte (ABORTED when the transfer failed or outlived
        transfer.deadline_s) -> the transfer's numbers."""
        import grpc
        from jaxserve.transfer.pull import PullLink
        from jaxserve.transfer.state import KVPoll
        try:
            state = await sender.state.wait_async(self.cfg.transfer.deadline_s)
        except asyncio.CancelledError:
            sender.abort("the caller went away")
            raise
        if state is not KVPoll.DONE:
            sender.abort("deadline passed" if not sender.state.final else sender.state.reason)
            await ctx.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {sender.state.reason}")
        return {"kv_bytes": sender.bytes_acked, "frames": sender.frames, "sends": sender.sends,
                "resends": sender.resends, "backend": "device" if isinstance(sender.link, PullLink)
                else "shm" if sender.shm_base is not None else "tcp"}

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
        groups = layer_groups(self.llm.layout.num_layers, self.cfg.transfer.groups_of(len(tokens)))
        wait_s = req.deadline_s or self.cfg.transfer.deadline_s
        reserved = loop.create_future()

        def on_reserved(result):  # engine thread: (blocks, skip), or why not
            loop.call_soon_threadsafe(lambda: reserved.done() or reserved.set_result(result))
        self.engine.post(lambda: self.intake.reserve_prefix_when_room(
            rid, tokens, on_done, on_reserved, wait_s, groups if len(groups) > 1 else None) or [])

        def withdraw():  # no longer waiting (released, if it was reserved meanwhile)
            self.engine.post(lambda: self.intake.withdraw(rid) or [])
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
        recv = self.intake.receivers.get(rid)  # (its bytes, once arrived; nothing is sent before the answer below)
        try:
            yield {"reserved": {"blocks": blocks, "skip": skip, "shm_base": self.intake.shm_base(rid),
                                "pull": self.intake.server.puller is not None}}
            error = await asyncio.shield(done)  # the caller closing the stream cancels this wait, not `done`
        finally:
            if not done.done():
                self.intake.cancel(rid)  # its arrival (failed) releases the blocks on the engine thread
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
        if self.role == "decode":
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is a {self.role} instance")
        dst, tokens = req.dst, list(req.prompt)
        peer = await self._peer(dst.instance)
        why = self._check_dst(peer, dst, len(tokens), decode=False)
        if why is not None:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, why)
        link, shm_base = self._link_to(peer, dst)
        # by layer group whatever its length: the receiver may be computing over it as it lands
        handoff = Handoff(link, self.feeder, list(dst.blocks), dst.skip, len(tokens), False,
                          self.cfg.transfer.layers_per_group, request_id=req.request_id, shm_base=shm_base)

        def send(eng) -> bool:
            found = eng.cached_prefix(tokens)
            if found is not None:
                handoff.send_cached(eng, *found)
            return found is not None
        try:
            sent = await self.engine.call(send)
        except (RequestError, ValueError) as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        if not sent:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION,
                            f"{self.inst.name} no longer holds the {len(tokens)}-token prefix")
        return await self._sent(handoff.sender, ctx)

    async def load_prefix(self, req, ctx):
        """Load: copy the prefix `prompt` (whole blocks) from the shared pool of store `store` on this host into
        this instance's prefix cache, with no call to the store (cache/shared_pool.py) -> {"kv_bytes",
        "seconds"}. FAILED_PRECONDITION when `store` is no store with a shared pool on this host, or its pool
        does not hold the prefix (any more, or a write of the store raced the read); RESOURCE_EXHAUSTED when
        there is no room for it here. While it runs it is in `_loads` (its outcome to come: None, or why it
        failed): a Prefill whose prefix_from names it is queued on the engine thread after its copy."""
        done = asyncio.get_running_loop().create_future()
        self._loads[req.request_id] = done
        outcome = "the Load call was cancelled"  # what the engine thread took of it runs to its end first
        try:
            code, answer = await self._load(req)
            outcome = None if code is None else answer
        finally:
            self._loads.pop(req.request_id, None)
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
        if self.role != "prefill":
            return grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is a {self.role} instance"
        pool, why = self._pool_of(req.store)
        if pool is None:
            return grpc.StatusCode.FAILED_PRECONDITION, why
        tokens, t0 = list(req.prompt), time.monotonic()

        def load(eng):  # -> (bytes, whether copied in one pass); staged (until the one-pass copy is compiled) in
            before = eng.prefix_loads["one_pass"]  # the layer groups the import programs were warmed with
            return eng.load_prefix(tokens, pool, self.layer_groups), eng.prefix_loads["one_pass"] > before
        try:
            kv_bytes, one_pass = await self.engine.call(load)
        except (RequestError, ValueError) as e:
            return grpc.StatusCode.INVALID_ARGUMENT, str(e)
        except Missed as e:
            return grpc.StatusCode.FAILED_PRECONDITION, str(e)
        except OutOfBlocks as e:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, f"no room for the prefix: {e}"
        return None, {"kv_bytes": kv_bytes, "seconds": round(time.monotonic() - t0, 6), "one_pass": one_pass}

    def _prepare_loads(self) -> None:
        """For each store pool on this host that the peer table newly shows, compile the one-pass copy out of it
        (cache/pool_copy.py) on a thread of its own: the engine thread is not held up, and until they are
        compiled a Load stages the prefix (nothing compiles on a request's path)."""
        import threading

        from jaxserve.transfer.shm import same_host
        from ..cache.shared_pool import SharedPool
        if self.role != "prefill" or not self.reads_pool or self.llm.runner.copies is None:
            return
        for name, peer in list(self.peers.items()):
            desc = peer.get("pool")
            if peer.get("role") != "store" or not desc or desc.get("name") in self._copies \
                    or not same_host(desc.get("boot")):
                continue
            self._copies.add(desc["name"])

            def compile_(name=name, desc=desc):
                try:
                    shapes = SharedPool.shapes(desc, self.llm.layout, self.llm.dtype_name)
                    t0 = time.monotonic()
                    made = self.llm.prepare_loads(shapes)
                    log.info("%s: the one-pass copy out of %s's pool compiled in %.1fs (%d programs)",
                             self.inst.name, name, time.monotonic() - t0, made)
                except Exception as e:  # noqa: BLE001 - the loads from this store stage instead
                    log.warning("%s: no one-pass copy out of %s's pool (%s: %s); its prefixes are staged",
                                self.inst.name, name, type(e).__name__, e)
            threading.Thread(target=compile_, name="jaxserve-copies", daemon=True).start()

    def _pool_of(self, instance: str):
        """Store `instance`'s shared pool, mapped here on first use -> (SharedPool, None), or (None, why not) when
        the peer table has no such pool on this host or it does not fit this instance's pool."""
        from jaxserve.transfer.shm import same_host
        from ..cache.shared_pool import SharedPool
        peer = self.peers.get(instance)
        desc = (peer or {}).get("pool")
        if not self.reads_pool or peer is None or peer.get("role") != "store" or not desc:
            return None, f"store: {instance!r} is not a store with a shared pool"
        if not same_host(desc.get("boot")):
            return None, f"store: {instance!r} runs on another host"
        got = self._pools.get(instance)
        if got is None or got.name != desc["name"]:  # first use, or the store restarted with a new segment
            if got is not None:
                got.close()
            try:
                got = SharedPool.attach(desc, self.llm.layout, self.llm.dtype_name)
            except (OSError, ValueError) as e:
                self._pools.pop(instance, None)
                return None, f"store: {instance!r}: {e}"
            self._pools[instance] = got
        return got, None

    # ---- migration (engine/migration.py)
    async def migrate(self, req, ctx):
        import grpc
        from ..engine.migration import MigrationError
        if self.role in ("prefill", "store"):
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"[src] {self.inst.name} is a {self.role} "
                                                                 "instance: nothing decodes here")
        peer = await self._peer(req.dst)
        if peer is None or req.dst == self.inst.name:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"[dst] no helper instance {req.dst!r} registered")
        link = self._helper_link(peer["address"])
        try:
            return await self.engine.call(lambda eng: eng.migrate(req.kind, req.heads, req.layers, self.inst.name,
                                                                  req.dst, link))
        except MigrationError as e:  # the field it names first, for the router's answer
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, f"[{e.param or 'kind'}] {e}")

    def _helper_link(self, address: str):
        """The blocking call that carries a migration's messages to the helper at `address` (one channel each)."""
        from . import rpc
        if address not in self._helpers:
            self._helpers[address] = rpc.SyncClient(address, self.cfg.transfer.token, self.tls)
        client = self._helpers[address]
        return lambda payload: client.call_raw("MigrateCall", payload, timeout=MIGRATE_CALL_S)

    async def migrate_call(self, payload: bytes, ctx) -> bytes:
        import grpc
        if self.role == "store":
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is the KV store: it runs no model")
        if self.group is not None:  # a helper's programs run on this process alone; the weights span the group
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is a multi-host instance: it "
                            "helps no migration")
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._migrations, self.llm.guests.handle, payload)

    # ---- heartbeats (on the thread of self._beats)
    async def _register(self) -> None:
        """One registration with the router, carrying the prefix-cache events it asked for last time (the
        global KV index, router/kv_index.py); its answer replaces the peer table."""
        # the engine thread's last snapshot: a long step or compile must not look like a dead worker
        msg = {**self._describe(self.engine.stats()), "kv_epoch": self.llm.cache_events.epoch}
        batch = self._cache_batch()
        if batch is not None:
            msg["kv"] = batch
        ans = await self._router.call("Register", msg, timeout=max(self.cfg.router.heartbeat_s, 1.0))
        if not isinstance(ans, dict):
            return
        if isinstance(ans.get("peers"), dict):
            self.peers = ans["peers"]
            self._prepare_loads()
        want = ans.get("kv_want")
        self._kv_want = want if isinstance(want, int) else None

    def _cache_batch(self) -> dict | None:
        """The events from the number the router wants; when it wants the full state (or the events are no
        longer held), the full state, taken on the engine thread: asked for now and sent by a later heartbeat,
        so a long step never delays a heartbeat."""
        batch = self.llm.cache_events.since(self._kv_want)
        if batch is not None:
            return batch
        if self._kv_full is None:
            self._kv_full = asyncio.ensure_future(self.engine.call(lambda eng: eng.blocks.full_state()))
            return None
        if not self._kv_full.done():
            return None
        fut, self._kv_full = self._kv_full, None
        return None if fut.cancelled() or fut.exception() is not None else fut.result()

    async def _heartbeat(self, router: str) -> None:
        """Register with the router, then again every heartbeat_s with fresh stats, until cancelled. Raises
        Refused when the router refuses this worker."""
        import grpc
        from . import rpc
        self._router = rpc.Client(router, self.cfg.transfer.token, self.tls)
        every = self.cfg.router.heartbeat_s
        failing = False
        try:
            while True:
                try:
                    await self._register()
                    if failing:
                        log.warning("router %s reachable again", router)
                    failing = False
                except grpc.aio.AioRpcError as e:
                    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
                        raise Refused(f"the router {router} refused this worker: wrong cluster token "
                                      f"(transfer.token)") from None
                    if e.code() == grpc.StatusCode.INVALID_ARGUMENT:
                        raise Refused(f"the router {router} refused this worker: {e.details()}") from None
                    if not failing:
                        log.warning("router %s unreachable (%s); retrying every %.1fs", router, e.code().name, every)
                    failing = True
                await asyncio.sleep(every)
        finally:
            await self._router.close()

    async def profile(self, req, ctx) -> dict:
        """Profile: a JAX trace of this process over the window asked for (the router's POST /debug/profile
        asks every worker for the same one) -> its folder, on this worker's host."""
        import grpc
        from .. import trace
        out = trace.folder(self.cfg.server.profile_dir, req.stamp, self.inst.name)
        try:
            await trace.capture(out, req.seconds)
        except trace.Busy as e:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name}: {e}")
        return {"instance": self.inst.name, "trace_dir": out}

    async def start(self):
        """Serve the worker methods on instance.host:port (with the cluster token, TLS when configured);
        -> the started grpc.aio server. self.address is where it listens."""
        from . import messages, rpc
        server = rpc.server(self.cfg.transfer.token)
        self._idle = asyncio.Event()
        self._idle.set()
        unary = {"Health": self.health, "SetLink": self.set_link, "SetRole": self.set_role,
                 "Export": self._counted(self.export_prefix, False), "Migrate": self.migrate,
                 "Load": self._counted(self.load_prefix, False), "Profile": self.profile}
        streams = {name: self._counted(fn, True) for name, fn in (
            ("Decode", self.decode), ("Generate", self.generate), ("Prefill", self.prefill),
            ("Import", self.import_prefix))}
        server.add_generic_rpc_handlers((rpc.handler(unary, streams, messages.WORKER,
                                                     {"MigrateCall": self.migrate_call}),))
        port = rpc.listen(server, f"{self.inst.host}:{self.inst.port}", self.tls)
        await server.start()
        self.address = f"{self.advertise}:{port}"
        return server

    async def serve(self, router: str | None = None) -> None:
        from . import rpc
        server = await self.start()
        info = {"name": self.inst.name, "role": self.role, "address": self.address,
                "kv_address": self._kv_address(), "pid": os.getpid(),
                "cpus": sorted(os.sched_getaffinity(0))}
        print(f"{READY} {json.dumps(info)}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        beat = None
        if router:
            self._beats = rpc.LoopThread(f"{self.inst.name}-heartbeat")
            beat = self._beats.submit(self._heartbeat(router))
            def ended(_):  # refused by the router: the worker stops
                try:
                    loop.call_soon_threadsafe(stop.set)
                except RuntimeError:  # this loop is already gone (shutting down)
                    pass
            beat.add_done_callback(ended)
        try:
            await stop.wait()
        finally:
            if beat is not None:
                self._beats.stop()  # cancels the heartbeat, which closes its channel to the router, then the loop
            await server.stop(1.0)
            self.close()
        if beat is not None and beat.done() and not beat.cancelled() and beat.exception() is not None:
            raise beat.exception()

    def close(self) -> None:
        for link, _ in self.links.values():
            link.close()
        for client in self._helpers.values():
            client.close()
        self._migrations.shutdown(wait=False)
        if self.feeder:
            self.feeder.close()
        self.intake.close()
        self.engine.shutdown()
        for pool in self._pools.values():
            pool.close()
        if self.shared_pool is not None:
            self.shared_pool.close()


def _one_cpu_device(pool) -> bool:
    import jax
    devices = jax.tree.leaves(pool)[0].sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"
