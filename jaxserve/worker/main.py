"""A worker: one instance of a cluster serving the worker protocol over gRPC. Around it: the process, its
pinning and lifetime (process.py); what it does before JAX starts (setup.py); its peer table and KV links
(peers.py); its registration with the router (heartbeat.py); the prefix calls Import, Export and Load
(prefixes.py); Prefill and Bind (prefill_calls.py). Here: the engine and its warm-up, role changes, Decode,
Generate, Migrate and the server.

The protocol (every method, its messages and who may call it: JSON over gRPC, rpc.py; every request checked
against its schema in messages.py) is docs/08-worker-protocol.md.

When ready it prints one line `JAXSERVE_WORKER_READY {json}` with its addresses. Concurrency: one asyncio loop
(gRPC server and handlers), the heartbeat thread's loop, the engine thread (engine/async_engine.py), the
transfer threads, and a thread compiling the copies out of each store pool on the host (prefixes.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time

from ..config import Config, InstanceSection

from .fanout import StepStreams, own_messages
from .heartbeat import Heartbeat
from .peers import Peers
from .prefill_calls import PrefillCalls
from .prefixes import PrefixCalls
from .setup import READY, build_engine

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
        if cfg.engine.warmup:
            print(f"{inst.name}: compiling the step programs (engine.warmup)", flush=True)
            print(f"{inst.name}: {self._warm(inst.role, progress)} programs compiled", flush=True)
        print(f"{inst.name}: engine ready after {time.monotonic() - t0:.1f}s", flush=True)
        self.engine = AsyncEngine(self.llm)
        t = cfg.transfer
        self.tls = t.tls.build() if t.tls else None  # transfer/tls.py: gRPC and KV links over TLS
        self.intake = self.feeder = self.pull_server = None
        self.heartbeat = None  # heartbeat.py, when serving with a router
        import jax
        if t.pulls(jax.default_backend()) and group is None:  # a group's KV moves through its leader's host
            from jaxserve.transfer.pull import PullServer
            try:
                self.pull_server = PullServer(inst.host, t.connections, ipc=self._ipc(t))
            except Exception as e:  # noqa: BLE001 - PJRT without a transfer server for this platform
                if t.device_transfer == "on":
                    from ..config import ConfigFileError
                    raise ConfigFileError(f"transfer.device_transfer: on, but JAX's transfer server did not start "
                                          f"on {jax.default_backend()}: {e}") from e
                log.warning("%s: no device transfer (%s); KV goes over TCP / shared memory", inst.name, e)
        self.peers = Peers(cfg, inst, self.pull_server, self.tls.client_context() if self.tls else None)
        # every instance receives KV: a decode instance its requests', any instance a cached prefix moved to it
        from ..disagg.decode_side import KVIntake
        self.intake = KVIntake(self.llm.connector, t.token, self.engine.post, inst.host, inst.kv_port,
                               t.recv_pool_mb << 20, t.deadline_s, shared=t.shared_memory,
                               puller=self.pull_server, timeouts=t.timeouts(), pull_from=self.peers.pull_source,
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
        self.prefixes = PrefixCalls(self)  # Import, Export, Load
        self.prefills = PrefillCalls(self)  # Prefill, Bind
        self.steps = StepStreams()  # the Updates streams: running requests' updates, one message a step

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
        # every second instance of a role warms up from the other end: where they share a host (and XLA's
        # persistent cache) each finds what the other compiled in the cache (warmup.compile_steps)
        same = [i.name for i in cfg.instances() if i.role == self.inst.role]
        reverse = self.inst.name in same and same.index(self.inst.name) % 2 == 1
        if role == "store":  # no model step runs here: only the programs that move KV in and out
            return self.llm.runner.warmup_transfer(self.llm.dtype_name, groups, export=True, receive=True,
                                                   progress=progress, reverse=reverse)
        sends, layerwise = role in ("prefill", "both"), len(groups) > 1
        receives = role in ("decode", "both")
        store = any(i.role == "store" for i in cfg.instances())  # prefills may run over prefixes it loads
        moves = store or any(c.kind == "prfaas" for c in cfg.clusters)  # prefixes moved between clusters
        n = self.llm.runner.warmup(progress, groups if sends and layerwise else None, tails=receives,
                                   decode=receives, whole=sends, stage_cached=sends and store, reverse=reverse)
        # a prefill instance receives cached prefixes too where there are any to receive (moved between clusters,
        # or loaded from the global KV store layer group by layer group while its prefill runs)
        return n + self.llm.runner.warmup_transfer(self.llm.dtype_name, groups, export=sends,
                                                   receive=receives or (sends and moves), progress=progress,
                                                   by_group=sends and store, reverse=reverse)

    # ---- methods
    async def health(self, req=None, ctx=None):
        """The Health call: stats taken on the engine thread, so they follow every earlier command."""
        return self._describe(await self.engine.call(self._stats))

    async def set_link(self, req, ctx=None):
        """SetLink: the emulated bandwidth of the links from this instance to cluster req.dst, now and for links
        built later. -> {"links": how many open links changed}"""
        changed = self.peers.set_bandwidth(req.dst, req.bandwidth_gbps)
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
        """Engine thread: the engine's stats, its step times and its KV intake's (reservations, receive pool)."""
        return {**eng.stats(), "steps": eng.timer.totals(), **self.intake.stats()}

    def _kv_address(self) -> list | None:
        """[host, port] senders dial for this instance's KV server (instance.kv_advertise, else the advertised
        host and the bound port)."""
        if self.inst.kv_advertise:
            host, _, port = self.inst.kv_advertise.rpartition(":")
            return [host, int(port)]
        return [self.advertise, self.intake.address[1]]

    def _ipc(self, t):
        """This process's CUDA IPC share (transfer/ipc.py) when it runs on a GPU and transfer.cuda_ipc is on, else
        None (stated in the log when the GPU cannot share its memory)."""
        import jax
        if not t.cuda_ipc or jax.default_backend() != "gpu":
            return None
        from jaxserve.transfer.cuda import CudaError
        from jaxserve.transfer.ipc import cuda_share
        from jaxserve.transfer.pull import listening
        try:
            return cuda_share(jax.local_devices()[0], alive=listening)
        except CudaError as e:
            log.warning("%s: no CUDA IPC (%s); device pulls go over the transfer server", self.inst.name, e)
            return None

    def _describe(self, stats: dict) -> dict:
        from jaxserve.transfer.shm import boot_id
        links = self.peers.snapshots()
        pool = self.intake.pool
        shm = {"name": pool.shm_name, "boot": boot_id(), "bytes": pool.capacity} if pool.shm_name else None
        copies = self.llm.runner.copies  # compiled on their own thread: the engine's stats may predate them
        stats = {**stats, "store_copies": len(copies) if copies is not None else 0,
                 "updates_streamed": self.steps.carried}  # running updates sent in Updates streams' step messages
        steps = stats.pop("steps", {})  # nested: a field of its own
        return {"name": self.inst.name, "role": self.role, "address": self.address, "pid": os.getpid(),
                "kv_address": self._kv_address(),
                "max_model_len": self.llm.max_model_len, "stats": stats, "steps": steps, "links": links, "shm": shm,
                "pull": self.intake.server.puller is not None,
                "ipc": self.pull_server.ipc.advertised if self.pull_server and self.pull_server.ipc else None,
                "pull_address": self.pull_server.address if self.pull_server and self.role != "decode" else None,
                "request_state": self.llm.scheduler.cfg.has_request_state,
                "pool": {**self.shared_pool.describe(), "boot": boot_id()} if self.shared_pool else None,
                "reads_pool": self.reads_pool}

    async def _updates(self, q, rid):
        """The request's own call's messages (fanout.py `own_messages`); leaving early aborts it."""
        try:
            async for msg in own_messages(q):
                yield msg
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
            q = asyncio.Queue()
            _, (blocks, skip, base) = await self.engine.attach(rid, lambda eng: self._reserve(req, params),
                                                               self.steps.queue_for(req.updates, rid, q))
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
            q = asyncio.Queue()
            await self.engine.add(req.request_id, list(req.prompt), params,
                                  self.steps.queue_for(req.updates, req.request_id, q), **req.resume())
        except (RequestError, ValueError) as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"QueueFull: {e}")
        async for msg in self._updates(q, req.request_id):
            yield msg

    def _reserve(self, req, params):
        seq, blocks, skip = self.intake.reserve(req.request_id, list(req.prompt), params, req.kv_tokens,
                                                req.deadline_s, req.max_skip, **req.resume())
        return [seq], (blocks, skip, self.intake.shm_base(req.request_id))

    # ---- migration (engine/migration.py)
    async def migrate(self, req, ctx):
        import grpc
        from ..engine.migration import MigrationError
        if self.role in ("prefill", "store"):
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"[src] {self.inst.name} is a {self.role} "
                                                                 "instance: nothing decodes here")
        peer = await self.peers.get(req.dst)
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

    async def updates(self, req, ctx):
        """Updates (fanout.py): each step's running updates of the requests that name this stream. Not counted
        in flight: it lasts as long as the router's connection (a role change waits for its requests)."""
        import grpc
        try:
            async for msg in self.steps.serve(req.stream):
                yield msg
        except ValueError as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))

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
                 "Export": self._counted(self.prefixes.export_prefix, False), "Migrate": self.migrate,
                 "Load": self._counted(self.prefixes.load_prefix, False), "Profile": self.profile,
                 "Bind": self.prefills.bind}
        streams = {name: self._counted(fn, True) for name, fn in (
            ("Decode", self.decode), ("Generate", self.generate), ("Prefill", self.prefills.prefill),
            ("Import", self.prefixes.import_prefix))}
        streams["Updates"] = self.updates
        server.add_generic_rpc_handlers((rpc.handler(unary, streams, messages.WORKER,
                                                     {"MigrateCall": self.migrate_call}),))
        port = rpc.listen(server, f"{self.inst.host}:{self.inst.port}", self.tls)
        await server.start()
        self.address = f"{self.advertise}:{port}"
        return server

    async def serve(self, router: str | None = None) -> None:
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
            self.heartbeat = Heartbeat(self.cfg, self.inst.name, self.engine, self.llm, self._describe,
                                       self._on_peers, self.tls)
            self.peers.refresh = self.heartbeat.refresh
            beat = self.heartbeat.start(router)
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
                self.heartbeat.stop()  # cancels the heartbeat, which closes its channel to the router, then the loop
            await server.stop(1.0)
            self.close()
        if beat is not None and beat.done() and not beat.cancelled() and beat.exception() is not None:
            raise beat.exception()

    def _on_peers(self, table: dict) -> None:
        """Heartbeat thread: the router's new peer table; a store pool it newly shows on this host gets its copy."""
        self.peers.table = table
        self.prefixes.prepare_loads()

    def close(self) -> None:
        self.peers.close()
        for client in self._helpers.values():
            client.close()
        self._migrations.shutdown(wait=False)
        if self.feeder:
            self.feeder.close()
        self.intake.close()
        self.engine.shutdown()
        self.prefixes.close()
        if self.shared_pool is not None:
            self.shared_pool.close()


def _one_cpu_device(pool) -> bool:
    import jax
    devices = jax.tree.leaves(pool)[0].sharding.device_set
    return len(devices) == 1 and next(iter(devices)).platform == "cpu"
