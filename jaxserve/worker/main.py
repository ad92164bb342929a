"""`jaxserve worker --config FILE --instance NAME`: one instance of a cluster as its own process.

Start-up order matters: the process pins itself to the instance's `cpus` (os.sched_setaffinity) and sets the
number of (CPU) devices *before* JAX is imported, since JAX sizes its thread pools and devices at import;
only then does it build the engine on a mesh over its own devices, warm it up, and serve.

Methods (rpc.py; JSON over gRPC):
  Health    {} -> {"name", "role", "address", "kv_address", "max_model_len", "pid", "stats", "links"}
  Decode    (decode, stream) {"request_id", "prompt", "params", "kv_tokens", "deadline_s"?, "output"?, "logprobs"?}
            -> first {"reserved":
            {"blocks", "skip", "kv_address", "cluster", "shm" (region in this host's shared memory, or None), "pull"
            (takes device pulls)}}, then one {"update": ...} per engine step that changed the request. Closing the
            stream aborts the request (frees its slot and blocks).
  Prefill   (prefill, stream) {"request_id", "prompt", "params", "kv_tokens", "sample", "dst": (Decode's
            "reserved")} -> {"first": Update} as soon as the first token is sampled (with sample, unless that token
            ends the request: decode reports it then), while the KV travels; then {"kv_bytes", "frames", "sends",
            "resends", "token", "ttft_s", "backend" (tcp / shm / device)} once decode has acknowledged every byte;
            gRPC ABORTED (with the reason) when the transfer failed.
  Generate  (any role, stream) {"request_id", "prompt", "params", "output"?, "logprobs"?} -> one {"update": ...}
            per step: the whole request on this instance (the router's fallback when no prefill / decode pair is
            available).
"output" / "logprobs" resume a request whose first tokens were generated (and streamed to the client) before its
instance failed: it continues from there (LLMEngine.add_request); its Updates count those tokens as output.
With `--router HOST:PORT` the worker registers with the router and repeats the registration every
`router.heartbeat_s` with its Health message (its heartbeat); the router refuses names and roles its config
does not list, and workers that do not present the cluster token.
When ready it prints one line `JAXSERVE_WORKER_READY {json}` with its addresses. Concurrency: one asyncio loop
(gRPC server and handlers) plus the engine thread (engine/async_engine.py) plus the transfer threads.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import signal
import sys
import time

from ..config import Config, InstanceSection

log = logging.getLogger("jaxserve.worker")
READY = "JAXSERVE_WORKER_READY"


class Refused(RuntimeError):
    """The router does not accept this worker (not in its config, wrong role or token)."""


def pin(inst: InstanceSection) -> None:
    """CPU affinity and device count for this process; must run before `import jax`."""
    if "jax" in sys.modules:
        raise RuntimeError("pin() must run before JAX is imported")
    if inst.cpus:
        have = os.sched_getaffinity(0)
        if not set(inst.cpus) <= have:
            from ..config import ConfigFileError
            raise ConfigFileError(f"clusters.instances[{inst.name}].cpus: {inst.cpus} but this process may run "
                                  f"only on cores {sorted(have)}")
        os.sched_setaffinity(0, set(inst.cpus))
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(d) for d in inst.devices))
    n = max(len(inst.devices), inst.tp)
    if n > 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


class Worker:
    def __init__(self, cfg: Config, inst: InstanceSection, progress: bool = False):
        from ..bundled import resolve
        from ..engine.async_engine import AsyncEngine
        from ..engine.llm_engine import LLMEngine
        from ..server.serve import make_mesh
        self.cfg, self.inst = cfg, inst
        self.cluster = cfg.cluster_of(inst.name)
        self.address = None  # host:port once serving
        t0 = time.monotonic()
        path = resolve(cfg.model.path, progress)
        print(f"{inst.name}: loading {path} ({inst.role}, cores {sorted(os.sched_getaffinity(0))})", flush=True)
        self.llm = LLMEngine(path, cfg.model.dtype, cfg.engine.engine_config(cfg.server.max_waiting),
                             make_mesh(inst, local=True), progress)
        if cfg.engine.warmup:
            print(f"{inst.name}: compiling the step programs (engine.warmup)", flush=True)
            from transfer.plan import layer_groups
            groups = layer_groups(self.llm.layout.num_layers, cfg.transfer.layers_per_group)
            sends = inst.role in ("prefill", "both")
            # layer-wise prefill runs one program per layer group
            n = self.llm.engine.warmup(progress, groups if sends and len(groups) > 1 else None)
            n += self.llm.engine.warmup_transfer(self.llm.dtype_name, groups, export=sends,
                                                 receive=inst.role in ("decode", "both"), progress=progress)
            print(f"{inst.name}: {n} programs compiled", flush=True)
        print(f"{inst.name}: engine ready after {time.monotonic() - t0:.1f}s", flush=True)
        self.engine = AsyncEngine(self.llm)
        t = cfg.transfer
        self.intake = self.feeder = self.pull_server = None
        self.links: dict[tuple, object] = {}
        import jax
        if t.pulls(jax.default_backend()):
            from transfer.pull import PullServer
            try:
                self.pull_server = PullServer(inst.host, t.connections)
            except Exception as e:  # noqa: BLE001 - PJRT without a transfer server for this platform
                if t.device_transfer == "on":
                    from ..config import ConfigFileError
                    raise ConfigFileError(f"transfer.device_transfer: on, but JAX's transfer server did not start "
                                          f"on {jax.default_backend()}: {e}") from e
                log.warning("%s: no device transfer (%s); KV goes over TCP / shared memory", inst.name, e)
        if inst.role in ("decode", "both"):
            from ..disagg.decode_side import KVIntake
            self.intake = KVIntake(self.llm, t.token, self.engine.post, inst.host, inst.kv_port,
                                   t.recv_pool_mb << 20, t.deadline_s, shared=t.shared_memory,
                                   puller=self.pull_server)
        if inst.role in ("prefill", "both"):
            from ..disagg.prefill_side import Feeder
            self.feeder = Feeder()

    def _link(self, dst: dict):
        """The link to a decode instance's KV server: device pulls when both ends take them
        (transfer.device_transfer), else shared memory when it runs on this host (transfer.shared_memory), else
        TCP; a configured link between the two clusters sets its emulated bandwidth, latency, loss and
        connection count (and always means TCP). -> (link, shm region base)"""
        from transfer.link import LinkEmulation
        from transfer.pull import PullLink
        from transfer.shm import ShmLink, same_host
        from transfer.tcp import TcpLink
        t = self.cfg.transfer
        address = dst["kv_address"]
        lk = self.cfg.link(self.cluster, dst.get("cluster") or self.cluster)
        pull = lk is None and self.pull_server is not None and bool(dst.get("pull"))
        shm = dst.get("shm") if t.shared_memory and lk is None and not pull else None
        if shm is not None and not same_host(shm.get("boot")):
            shm = None
        key = (address[0], int(address[1]), shm["name"] if shm else None, pull)
        if key not in self.links:
            kw = dict(name=f"{self.inst.name}->{key[0]}:{key[1]}" + (" (shm)" if shm else " (device)" if pull else ""),
                      chunk_bytes=int(t.chunk_mb * (1 << 20)))
            if pull:
                self.links[key] = PullLink(key[:2], t.token, self.pull_server, t.deadline_s,
                                           connections=t.connections, **kw)
            elif shm is not None:
                self.links[key] = ShmLink(key[:2], t.token, shm["name"], connections=t.connections, **kw)
            else:
                emu = LinkEmulation(lk.bandwidth_gbps, lk.latency_ms, lk.loss) if lk else None
                self.links[key] = TcpLink(key[:2], t.token, lk.connections if lk else t.connections, emulation=emu,
                                          **kw)
        return self.links[key], (int(shm["base"]) if shm else None)

    # ---- methods
    async def health(self, req=None, ctx=None):
        """The Health call: stats taken on the engine thread, so they follow every earlier command."""
        return self._describe(await self.engine.call(lambda eng: eng.stats()))

    def _describe(self, stats: dict) -> dict:
        links = {v.metrics.name: v.metrics.snapshot() for v in self.links.values()}
        return {"name": self.inst.name, "role": self.inst.role, "address": self.address, "pid": os.getpid(),
                "kv_address": list(self.intake.address) if self.intake else None,
                "max_model_len": self.llm.max_model_len, "stats": stats, "links": links}

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
        from transfer.bufpool import PoolFull
        from ..cache.allocator import OutOfBlocks
        from ..engine.llm_engine import RequestError
        from ..sampling import SamplingParams
        if self.intake is None:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is a {self.inst.role} instance")
        rid = str(req["request_id"])
        try:
            params = SamplingParams(**req.get("params", {}))
            q, (blocks, skip, shm) = await self.engine.attach(rid, lambda eng: self._reserve(rid, req, params))
        except (RequestError, ValueError, TypeError) as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (OutOfBlocks, PoolFull) as e:  # no room right now
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{type(e).__name__}: {e}")
        try:
            yield {"reserved": {"blocks": blocks, "skip": skip, "kv_address": list(self.intake.address),
                                "cluster": self.cluster, "shm": shm, "pull": self.intake.server.puller is not None}}
            async for msg in self._updates(q, rid):
                yield msg
        finally:
            self.intake.cancel(rid)
            self.engine.abort(rid)

    async def generate(self, req, ctx):
        import grpc
        from ..engine.llm_engine import RequestError
        from ..engine.scheduler import QueueFull
        from ..sampling import SamplingParams
        rid = str(req["request_id"])
        try:
            params = SamplingParams(**req.get("params", {}))
            if params.n != 1:
                raise ValueError("Generate takes n = 1 (the router fans out n > 1)")
            q = await self.engine.add(rid, list(req["prompt"]), params, **self._resume(req))
        except (RequestError, ValueError, TypeError, KeyError) as e:
            await ctx.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except QueueFull as e:
            await ctx.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"QueueFull: {e}")
        async for msg in self._updates(q, rid):
            yield msg

    def _reserve(self, rid, req, params):
        deadline = req.get("deadline_s")
        seq, blocks, skip = self.intake.reserve(rid, list(req["prompt"]), params, int(req["kv_tokens"]),
                                                float(deadline) if deadline else None, **self._resume(req))
        return [seq], (blocks, skip, self.intake.shm(rid))

    @staticmethod
    def _resume(req) -> dict:
        """A resumed request's output so far (the "output" / "logprobs" fields), as LLMEngine takes them."""
        if not req.get("output"):
            return {}
        return {"output": [int(t) for t in req["output"]], "logprobs": req.get("logprobs")}

    async def prefill(self, req, ctx):
        import grpc
        from ..disagg.prefill_side import Handoff
        from transfer.pull import PullLink
        from ..engine.llm_engine import RequestError
        from ..sampling import SamplingParams
        from transfer.state import KVPoll
        if self.feeder is None:
            await ctx.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{self.inst.name} is a {self.inst.role} instance")
        rid, kv = str(req["request_id"]), int(req["kv_tokens"])
        dst = req["dst"]
        t = self.cfg.transfer
        try:
            params = SamplingParams(**req.get("params", {}))
            link, shm_base = self._link(dst)
            handoff = Handoff(link, self.feeder, list(dst["blocks"]), int(dst["skip"]), kv,
                              bool(req.get("sample", True)), t.groups_of(kv), request_id=rid, shm_base=shm_base)

            def add(eng):
                seqs = eng.add_request(rid, list(req["prompt"])[:kv], params)
                seqs[0].handoff = handoff
                return seqs, None
            q, _ = await self.engine.attach(rid, add)
        except (RequestError, ValueError, TypeError, KeyError) as e:
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
        state = await asyncio.to_thread(sender.wait, t.deadline_s)
        if state is not KVPoll.DONE:
            sender.abort("deadline passed" if not sender.state.final else sender.state.reason)
            await ctx.abort(grpc.StatusCode.ABORTED, f"KV transfer failed: {sender.state.reason}")
        yield {"kv_bytes": sender.bytes_acked, "frames": sender.frames, "sends": sender.sends,
                "resends": sender.resends, "token": u.token_ids[0] if u.token_ids and handoff.sample else None,
                "ttft_s": u.ttft_s,
                "backend": "device" if isinstance(link, PullLink) else "shm" if sender.shm_base is not None else "tcp"}

    async def heartbeat(self, router: str) -> None:
        """Register with the router, then again every heartbeat_s with fresh stats, until cancelled."""
        import grpc
        from . import rpc
        client = rpc.Client(router)
        every = self.cfg.router.heartbeat_s
        failing = False
        try:
            while True:
                # the engine thread's last snapshot: a long step or compile must not look like a dead worker
                msg = {**self._describe(self.engine.stats), "token": self.cfg.transfer.token}
                try:
                    await client.call("Register", msg, timeout=max(every, 1.0))
                    if failing:
                        log.warning("router %s reachable again", router)
                    failing = False
                except grpc.aio.AioRpcError as e:
                    if e.code() in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT):
                        raise Refused(f"the router {router} refused this worker: {e.details()}") from None
                    if not failing:
                        log.warning("router %s unreachable (%s); retrying every %.1fs", router, e.code().name, every)
                    failing = True
                await asyncio.sleep(every)
        finally:
            await client.close()

    async def serve(self, router: str | None = None) -> None:
        from . import rpc
        server = rpc.server()
        server.add_generic_rpc_handlers((rpc.handler({"Health": self.health},
                                                     {"Decode": self.decode, "Generate": self.generate,
                                                      "Prefill": self.prefill}),))
        port = server.add_insecure_port(f"{self.inst.host}:{self.inst.port}")
        await server.start()
        self.address = f"{self.inst.host}:{port}"
        info = {"name": self.inst.name, "role": self.inst.role, "address": self.address,
                "kv_address": list(self.intake.address) if self.intake else None, "pid": os.getpid(),
                "cpus": sorted(os.sched_getaffinity(0))}
        print(f"{READY} {json.dumps(info)}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        beat = asyncio.ensure_future(self.heartbeat(router)) if router else None
        waiters = [asyncio.ensure_future(stop.wait())] + ([beat] if beat else [])
        await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        for t in waiters:
            t.cancel()
        await server.stop(1.0)
        self.close()
        if beat is not None and beat.done() and not beat.cancelled() and beat.exception() is not None:
            raise beat.exception()

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        if self.feeder:
            self.feeder.close()
        if self.intake:
            self.intake.close()
        self.engine.shutdown()


def die_with_parent(parent_pid: int) -> None:
    """SIGTERM this process when `parent_pid` (the router that launched it) dies (Linux PR_SET_PDEATHSIG)."""
    import ctypes
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        log.warning("PR_SET_PDEATHSIG unavailable: this worker outlives its launcher")
    if os.getppid() != parent_pid:  # it died before the request took effect
        raise SystemExit(f"the launching process {parent_pid} is gone")


def run(cfg: Config, name: str, router: str | None = None, parent_pid: int | None = None) -> None:
    """Run instance `name` of `cfg` in this process until SIGTERM / SIGINT; router: register there."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    inst = cfg.instance(name)
    pin(inst)
    logging.basicConfig(level=logging.WARNING, format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s")
    try:
        asyncio.run(Worker(cfg, inst).serve(router))
    except Refused as e:
        log.error("%s", e)
        raise SystemExit(2) from None
