"""The router: the engine-client protocol (jaxserve/engine/client.py) the HTTP app uses, over worker processes.

Per request (the KV Messenger flow): the placement policy (policies/, `policy.name`) picks the decode and the
prefill instance from a snapshot of the cluster (snapshot.py); open the decode instance's `Decode` stream,
which reserves cache space and validates the request (a bad one is refused before any prefill work), then the
prefill instance's `Prefill` call with the reservation, and relay both to the request's queue: the
prefill call sends the first token the moment it is sampled (the client has it while the KV travels), then
answers once decode has acknowledged every KV byte; the decode stream's Updates follow (its report of that
first token is dropped). n > 1 fans out into n requests with seeds seed, seed + 1, ... (as the colocated
engine does). A placement without a prefill instance runs the request whole on the decode instance
(`Generate`: it holds most of the prompt already, or no prefill instance is up). A placement that names a
cached prefix to move (`move_prefix`) copies it into the prefill instance (`Import` there, `Export` on its
holder): before the Prefill call, or, for a pipelined load (BanaServe's global KV store), from the placement
on, beside the decode reservation, with the Prefill call running over the prefix as it lands (`_Load`); a
failed move only means the prefill computes those tokens. With a store up, the prompt's whole blocks go to it as
the prefill computes them (`_Put`: an Import on the store, opened beside the decode reservation, that the
Prefill call names), or after the prefill (`_store_put`) when that could not be.

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

Concurrency: requests run on the router's asyncio loop (uvicorn's), one task per (sub-)request; gRPC channels are
`grpc.aio`, one per worker address, each call presenting the cluster token. Registrations (heartbeats) arrive on
the control port's own thread (control.py), so a busy request path cannot starve them; the registry they update
is thread-safe (registry.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import math
import random
import re
import time
from dataclasses import dataclass, field

import grpc

from jaxserve.config import Config, ConfigFileError
from jaxserve.engine.client import EngineUnavailable as Unavailable
from jaxserve.engine.client import QueueFull, RequestError, Update, encode
from jaxserve.sampling import SamplingParams
from jaxserve.worker import rpc

from . import policies
from .control import ControlServer
from .kv_index import KVIndex
from .migration import MigrationParams, MigrationPlanner, Unit
from .policies.base import Placement, least_loaded
from .registry import Registry, WorkerInfo
from .snapshot import Topology

log = logging.getLogger("jaxserve.router")
Code = grpc.StatusCode
# the only status that says the worker is gone (the call never reached it, or its connection broke): a bad
# message is INVALID_ARGUMENT, a handler's bug INTERNAL (worker/rpc.py); those fail the placement, not the worker
DEAD = (Code.UNAVAILABLE,)
PROFILE_WRITE_S = 120.0  # a worker's Profile answers within its window plus this (writing its trace files)


def _why(e: BaseException) -> str:
    return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else f"{e!r}"


class _Retry(Exception):
    """This placement failed in a way another placement may not (the reason is the message)."""


class _Silent(Exception):
    """The worker a call waits on stopped heartbeating (hung or partitioned): the call is abandoned."""


@dataclass(eq=False)
class _Load:
    """A cached prefix the router loads from its holder (the global KV store) into a placement's prefill
    instance, started with the placement so that the fetch overlaps the decode reservation (BanaServe's pipelined
    load). Over the transfer layer: the Import stream on the prefill instance reserves the blocks (`reserved`:
    its reservation, None when none was made), the holder's Export sends into them, and the Prefill call names
    the Import (`import_id`), so that the prefill computes over the prefix as it lands; `task` ends once the
    prefix is cached there. From the store's shared pool on the prefill instance's host (`shared`): a Load call
    on the prefill instance, which finds the prefix's blocks in the store's segment and copies them into its
    prefix cache (cache/shared_pool.py) without a call to the store, beside the decode reservation; `task` ends
    once they are cached there (`reserved` is set at once). The Prefill names the Load (`import_id`) and is sent
    without waiting for its answer: p runs it after the copy (its engine thread takes calls in order)."""
    src: str
    dst: str
    tokens: int
    import_id: str  # the Import's id
    reserved: asyncio.Future
    shared: bool = False
    task: asyncio.Future | None = None
    sent: dict | None = None  # Export's transfer numbers (shared: Load's {"kv_bytes", "seconds"})
    seconds: float = 0.0  # from the start to the prefix cached (or the failure)
    error: str | None = None


@dataclass(eq=False)
class _Put:
    """The prompt's whole blocks going to the global KV store as the prefill computes them (BanaServe 4.2's
    write-back, layer group by layer group beside decode's KV): an Import on the store, opened with the placement
    beside the decode reservation (`reserved`: its reservation, None when none was made). The Prefill call names
    it when it is reserved by then; else the prompt is put after the prefill (an Export from the prefill
    instance), as it is for a model with request-level state. `task` ends once the store has cached it."""
    store: str
    tokens: int
    import_id: str
    reserved: asyncio.Future
    task: asyncio.Future | None = None


@dataclass
class _Sub:
    """One sequence of a request, and where it runs now."""
    rid: str
    index: int
    prompt: list[int]
    params: dict  # SamplingParams fields (JSON)
    kv_tokens: int
    attempts: int = 0  # placements opened
    serial: int = 0  # numbers the placement ids
    xid: str = ""  # the id of the current placement on the workers
    method: str = ""  # "Decode" (disaggregated) or "Generate" (whole request on one instance)
    worker: WorkerInfo | None = None
    call: object = None  # the open stream
    it: object = None
    reserved: dict | None = None
    prefill: str | None = None
    prefilling: str | None = None  # the prefill instance whose Prefill call for it is running now
    kv_bytes: int = 0
    kv_backend: str | None = None
    avoid: set = field(default_factory=set)  # instances that failed this request
    avoid_prefill: set = field(default_factory=set)
    placement: Placement | None = None  # the policy's latest answer
    moved: dict | None = None  # the cached prefix moved to its prefill instance: {"src", "tokens", "kv_bytes", ...}
    load: _Load | None = None  # the placement's pipelined load of a cached prefix
    put: _Put | None = None  # the placement's write-back of the prompt to the store, until the Prefill names it
    ttft_s: float | None = None
    arrival: float = 0.0  # time.monotonic() when the request came
    placed_s: float | None = None  # from the arrival to the placement's stream opened (Decode: its reservation)
    errors: list = field(default_factory=list)
    sent: Update | None = None  # the last update the client got (updates are cumulative)

    @property
    def output(self) -> list[int]:
        """Tokens the client already has: a placement after a failure resumes from them."""
        return self.sent.token_ids if self.sent is not None else []

    def kv(self) -> int:
        """Tokens whose KV prefill sends: the prompt (but its last token with transfer.leave_last_token), or, when
        resuming, the prompt and the output but its last token (decode computes that one and samples on)."""
        return len(self.prompt) + len(self.output) - 1 if self.output else self.kv_tokens

    def resume(self) -> dict:
        """The placement message's fields that resume the request (worker/main.py: "output", "logprobs")."""
        return {"output": self.output, "logprobs": self.sent.logprobs} if self.output else {}

    def route(self, topo: Topology) -> dict:
        """Where it ran: `colocated` (whole on one instance), `pd` (prefill and decode in one cluster, or a
        PD cluster's own prefill) or `prfaas` (prefill in a PrfaaS cluster, KV over the inter-cluster link)."""
        name = self.worker.name if self.worker else None
        pre = self.prefill or name
        route = "colocated"
        if self.prefill is not None and name is not None:
            route = policies.route_of(topo.kind(pre), topo.cluster(pre), topo.cluster(name))
        pl = self.placement
        return {"route": route, "prefill_instance": pre, "decode_instance": name,
                "prefill_cluster": topo.cluster(pre) if pre else None,
                "decode_cluster": topo.cluster(name) if name else None,
                # a prefix move that failed leaves the prefill with its own cache only
                "prefix_source": None if pl is None else self.moved["src"] if self.moved
                else pl.prefix_source if pl.move_prefix is None else None,
                "prefix_move": self.moved,
                "kv_bytes_transferred": self.kv_bytes, "kv_backend": self.kv_backend, "attempts": self.attempts,
                "placed_s": None if self.placed_s is None else round(self.placed_s, 6)}


class Router:
    def __init__(self, cfg: Config, tokenizer, on_finish=None):
        self.cfg = cfg
        self.tokenizer = tokenizer
        self.registry = Registry({i.name: i.role for i in cfg.instances()}, cfg.router.down_after_s)
        self.topology = Topology(cfg)
        self.index = KVIndex(cfg.engine.block_size)  # the global KV index, fed by heartbeats (control.py)
        self.policy = policies.make(cfg.policy)
        self.routes: dict[str, int] = {}  # route -> requests finished on it
        self.on_finish = on_finish  # (final Update, seconds since arrival)
        self.tasks: dict[str, list[asyncio.Task]] = {}
        self.sequences: dict[str, list[_Sub]] = {}  # request id -> its sequences, while it runs (read-only view)
        self.kv_bytes_transferred = 0
        self.retries = 0
        self.migrations: dict[str, int] = {}  # moves done by kind (POST /admin/migrate, the planner)
        pol = cfg.policy
        self.mover = (MigrationPlanner(MigrationParams(pol.migrate_delta_up, pol.migrate_delta_down,
                                                       budget_s=pol.migrate_budget_s)) if pol.migrate else None)
        self.prefix_moves = {"done": 0, "failed": 0, "bytes": 0}  # cached prefixes moved between instances
        # prompts written to the global KV store (streamed: those of done written as the prefill computed them)
        self.store_puts = {"done": 0, "failed": 0, "bytes": 0, "streamed": 0}
        self._store_tasks: set[asyncio.Task] = set()
        # whether the prefill instances write the store's copy as they compute (router.store_write; False once one
        # said it does not: a model with request-level state; the router then puts prompts after their prefill)
        self.puts_stream = cfg.router.store_write == "streamed"
        # a prefix the store holds is read from its shared pool where the prefill instance runs on its host
        # (cache/shared_pool.py), else sent over the transfer layer; False: always sent (bench/store compares them)
        self.shared_loads = cfg.transfer.shared_memory
        self.kv_bytes_per_token: float | None = None  # measured on the transfers so far
        self._clients: dict[str, rpc.Client] = {}
        self._control: ControlServer | None = None
        self._joined: asyncio.Event | None = None
        self.address: str | None = None
        self.launcher = None  # router/launcher.py, when serve started the workers
        self._tls = self.cfg.transfer.tls.build() if self.cfg.transfer.tls else None
        self.replanner = _replanner(cfg.policy)  # the long-term loop (router/replan.py), None when off
        self.replan_state: dict = {}  # the last decision, for /metrics
        self._replan_task: asyncio.Task | None = None
        self.control_actions: list[dict] = []  # the policy's controller (flowkv): the last 64, newest last
        self.control_count = 0

    async def profile(self, seconds: float, base: str) -> dict:
        """POST /debug/profile on a cluster: this process and every worker up traced over the same window, each
        into `<base>/<stamp>/<instance>` on its own host (the worker's Profile call) -> {"trace_dir" (the
        router's), "seconds", "instances": {name: {"role", "trace_dir"} or {"role", "error"}}}. A worker that
        fails its capture is named with its error; the others' traces stand."""
        from jaxserve import trace
        name = trace.stamp()
        mine = trace.folder(base, name, "router")

        async def one(w: WorkerInfo) -> dict:
            try:
                ans = await self._client(w).call("Profile", {"seconds": seconds, "stamp": name},
                                                 timeout=seconds + PROFILE_WRITE_S)
                return {"role": w.role, "trace_dir": ans["trace_dir"]}
            except grpc.aio.AioRpcError as e:
                return {"role": w.role, "error": f"{e.code().name}: {e.details()}"}
        workers = self.registry.up()
        trace.start(mine)  # raises Busy before any worker is asked
        try:
            *theirs, _ = await asyncio.gather(*(one(w) for w in workers), asyncio.sleep(seconds))
        finally:
            await trace.stop()
        return {"trace_dir": mine, "seconds": seconds, "instances": {w.name: t for w, t in zip(workers, theirs)}}

    # ---- control port (worker registration, on a thread of its own: control.py)
    async def start(self) -> str:
        """Serve `Register` on router.host:router.port; returns host:port."""
        self._joined = asyncio.Event()
        loop = asyncio.get_running_loop()
        r = self.cfg.router
        self._control = ControlServer(self.registry, self.cfg.transfer.token, r.heartbeat_s,
                                      on_join=lambda: loop.call_soon_threadsafe(self._joined.set), tls=self._tls,
                                      index=self.index)
        self.address = await asyncio.to_thread(self._control.start, r.host, r.port)
        if self.replanner is not None:
            self._replan_task = asyncio.create_task(self._replan_loop())
        elif self.cfg.policy.control_s is not None:
            self._replan_task = asyncio.create_task(self._control_loop())
        return self.address

    async def joined(self) -> None:
        """Wait for the next registration or heartbeat."""
        await self._joined.wait()
        self._joined.clear()

    async def close(self) -> None:
        if self._replan_task is not None:
            self._replan_task.cancel()
            self._replan_task = None
        for t in list(self._store_tasks):
            t.cancel()
        for tasks in list(self.tasks.values()):
            for t in tasks:
                t.cancel()
        for c in self._clients.values():
            await c.close()
        self._clients.clear()
        if self._control is not None:
            await asyncio.to_thread(self._control.stop)
            self._control = None

    def metrics_state(self) -> dict:
        """What server/metrics.py publishes for a cluster (instances, links, KV bytes, retries, requests per
        route, the policy's state)."""
        links = {snap.get("link", f"{w.name}:{addr}"): snap for w in self.registry.all()
                 for addr, snap in w.links.items()}
        return {"instances": self.registry.state(), "links": links,
                "kv_bytes_transferred": self.kv_bytes_transferred, "retries": self.retries,
                "routes": dict(self.routes), "policy": {**self.policy.state(), **self.replan_state,
                                                        **({"control_actions": self.control_count}
                                                           if self.cfg.policy.control_s else {}),
                                                        "migrations": sum(self.migrations.values())},
                "index": self.index.stats(),
                "prefix_moves": dict(self.prefix_moves), "store_puts": dict(self.store_puts)}

    def health(self) -> dict:
        up = self.registry.up("decode") or (self.cfg.router.local_fallback and self.registry.up())
        return {"status": "ok" if up else "degraded", "instances": self.registry.state(),
                **({} if up else {"error": "no instance can decode"})}

    # ---- admin
    async def set_link(self, src: str, dst: str, gbps: float) -> dict:
        """Change the emulated bandwidth of the link from cluster src to cluster dst now: every prefill instance
        of src reshapes its open links to dst (SetLink) and builds later ones at this rate; the policies see
        the new capacity at once. Raises RequestError for a link the config does not have."""
        if src == dst or self.cfg.link(src, dst) is None:
            have = [f"{lk.src}->{lk.dst}" for lk in self.cfg.links if lk.src != lk.dst]
            raise RequestError(f"no link from cluster {src!r} to cluster {dst!r} in the config (links: {have})",
                               "src")
        self.topology.bandwidth[(src, dst)] = gbps
        out = {}
        for w in self.registry.up("prefill"):
            if self.topology.cluster(w.name) == src:
                try:
                    ans = await self._client(w).call("SetLink", {"dst": dst, "bandwidth_gbps": gbps}, timeout=10)
                    out[w.name] = {"links": ans["links"]}
                except grpc.aio.AioRpcError as e:
                    out[w.name] = {"error": f"{e.code().name}: {e.details()}"}
        log.info("link %s -> %s: %.3f Gbit/s (%s)", src, dst, gbps, out)
        return {"src": src, "dst": dst, "bandwidth_gbps": gbps, "instances": out}

    async def set_role(self, name: str, role: str) -> dict:
        """Change instance `name`'s role in place (prefill, decode, both): no new work is placed there, the
        worker drains what it has in flight, compiles what the new role runs and switches (SetRole); then work
        of the new role is placed there. Refused (RequestError) for an unknown or down instance, one of a PrfaaS
        cluster, one already changing, and a change that would leave no other instance up for its old role.
        Raises Unavailable when the worker fails or times out (the instance takes work again as it reports)."""
        w = self.registry.get(name)
        if w is None or name not in self.topology.where:
            raise RequestError(f"no instance {name!r} (instances: {sorted(self.topology.where)})", "instance")
        if not self.registry.is_up(w):
            raise RequestError(f"{name} is down", "instance")
        if w.role == "store":
            raise RequestError(f"{name} is the global KV store: it takes no other role", "instance")
        if self.topology.kind(name) == "prfaas":
            raise RequestError(f"{name} is in PrfaaS cluster {self.topology.cluster(name)!r}: only PD-cluster "
                               "instances change roles", "instance")
        if w.draining:
            raise RequestError(f"{name} is already changing its role", "instance")
        old = w.role
        if role == old:
            return {"instance": name, "role": role, "previous": old, "drained_s": 0.0, "programs_compiled": 0}
        others = [x for x in self.registry.up() if x.name != name and not x.draining]
        for lost in {"prefill", "decode"} - ({"prefill", "decode"} if role == "both" else {role}):
            if w.serves(lost) and not any(x.serves(lost) for x in others):
                raise RequestError(f"{name} is the only instance up that can {lost}", "role")
        self.registry.begin_flip(name, role)
        ok = False
        try:
            ans = await self._client(w).call("SetRole", {"role": role}, timeout=self.cfg.router.role_change_timeout_s)
            ok = True
        except grpc.aio.AioRpcError as e:
            raise Unavailable(f"{name} did not change its role: {e.code().name}: {e.details()}") from None
        finally:
            self.registry.end_flip(name, role, ok)
        log.info("%s: %s -> %s (drained in %.2fs, %d programs compiled)", name, old, role, ans["drained_s"],
                 ans["programs_compiled"])
        return {"instance": name, **ans}

    async def migrate(self, kind: str, src: str, dst: str, heads: list[int] | None = None,
                      layers: list[int] | None = None) -> dict:
        """Move part of the decode work of the requests decoding on `src` to `dst` (BanaServe 4.1; the worker's
        Migrate, engine/migration.py): the KV of some heads (`heads`) or the layers lo..hi-1 (`layers`). Answers
        once the move is done. RequestError for an impossible move (unknown or down instances, the store, heads
        or layers out of range, nothing decoding on src); Unavailable when src fails or times out."""
        for param, name in (("src", src), ("dst", dst)):
            w = self.registry.get(name)
            if w is None:
                raise RequestError(f"no instance {name!r} (instances: {sorted(self.topology.where)})", param)
            if not self.registry.is_up(w):
                raise RequestError(f"{name} is down", param)
            if w.role == "store":
                raise RequestError(f"{name} is the global KV store: it runs no model", param)
        if src == dst:
            raise RequestError("src and dst are the same instance", "dst")
        w = self.registry.get(src)
        if not w.serves("decode"):
            raise RequestError(f"{src} is a {w.role} instance: nothing decodes there", "src")
        msg = {"kind": kind, "dst": dst, "heads": heads, "layers": layers}
        try:
            ans = await self._client(w).call("Migrate", msg, timeout=self.cfg.router.role_change_timeout_s)
        except grpc.aio.AioRpcError as e:
            if e.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION):
                m = re.match(r"\[(\w+)\] (.*)", e.details() or "", re.S)
                raise RequestError(m.group(2) if m else e.details(), m.group(1) if m else "src") from None
            raise Unavailable(f"{src} did not move its work: {e.code().name}: {e.details()}") from None
        self.migrations[kind] = self.migrations.get(kind, 0) + 1
        log.info("moved %s of %d requests from %s to %s (%d bytes, %.3fs)", kind, len(ans["requests"]), src, dst,
                 ans["bytes"], ans["seconds"])
        return {"kind": kind, "src": src, "dst": dst, **ans}

    # ---- the long-term loop (PrfaaS 3.4.3): re-plan from the observed traffic, apply threshold and flips
    async def _replan_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.policy.replan_s)  # the planning period
            try:
                await self.replan()
            except Exception:  # noqa: BLE001 - a failed round leaves the deployment as it is; the next one retries
                log.exception("re-planning failed")

    async def _control_loop(self) -> None:
        while True:
            await asyncio.sleep(self.cfg.policy.control_s)
            try:
                await self.control()
                if self.mover is not None:
                    await self.rebalance()
            except Exception:  # noqa: BLE001 - a failed cycle changes nothing; the next one retries
                log.exception("policy control failed")

    async def rebalance(self) -> list:
        """One cycle of BanaServe's migration planner (router/migration.py, Algorithm 1) over the decode
        instances' heartbeat loads (busy fraction + KV use): the moves it decides are carried out as
        POST /admin/migrate's (`migrate`); a move that cannot be made now (nothing decoding) is skipped."""
        units = []
        for w in self.registry.up():
            st = w.stats
            if w.draining or not w.serves("decode") or "move_layers" not in st:
                continue
            load = st.get("busy", 0.0) + st.get("blocks_used", 0) / max(1, st.get("blocks_total", 1))
            units.append(Unit(w.name, load, (0, int(st["move_layers"])), int(st.get("move_heads", 0)),
                              int(st.get("running", 0)), float(st.get("layer_weight_bytes", 0)),
                              float(st.get("layer_kv_bytes", 0))))
        done = []
        for m in self.mover.plan(units):
            heads = layers = None
            if m.kind == "heads":
                n = next(u.heads for u in units if u.name == m.src)
                heads = list(range(n - m.heads, n))
            else:
                layers = list(m.layers)
            try:
                done.append(await self.migrate(m.kind, m.src, m.dst, heads, layers))
            except (RequestError, Unavailable) as e:
                log.info("migration planner: %s %s -> %s not made: %s", m.kind, m.src, m.dst, e)
        return done

    async def control(self) -> list:
        """One cycle of the policy's global controller (flowkv `control`): role flips are carried out as the
        re-plan's; a scale-out starts a standby instance of the role (config `standby`) through the launcher, a
        scale-in drains a running standby instance of the role and stops it. Without a launcher or a standby
        instance to use, a scaling action is logged and counted only."""
        if not hasattr(self.policy, "control"):  # the policy in effect has no controller (swapped at run time)
            return []
        workers = [w for w in self.registry.up() if not w.draining and self.topology.kind(w.name) != "prfaas"
                   and w.role != "store"]
        snap = self.topology.snapshot(workers, self.registry.all(), 0, 0, None, time.monotonic(),
                                      self.kv_bytes_per_token)
        acts = self.policy.control(snap)
        for a in acts:
            self.control_count += 1
            self.control_actions = (self.control_actions + [{"kind": a.kind, "role": a.role, "instance": a.instance,
                                                             "why": a.why}])[-64:]
            log.info("policy control: %s %s %s: %s", a.kind, a.instance or "", a.role, a.why)
            if a.kind == "flip" and not any(w.draining for w in self.registry.all()):
                try:
                    await self.set_role(a.instance, a.role)
                except (RequestError, Unavailable) as e:
                    log.warning("policy control: %s did not change to %s: %s", a.instance, a.role, e)
            elif a.kind in ("scale_out", "scale_in"):
                await (self._scale_out(a.role) if a.kind == "scale_out" else self._scale_in(a.role, a.instance))
        return acts

    def _standby(self, role: str) -> list[str]:
        return [i.name for i in self.cfg.instances() if i.standby and i.role in (role, "both")]

    async def _scale_out(self, role: str) -> str | None:
        """Start a standby instance of `role` that is not running (it joins when ready) -> its name."""
        running = {n for n, c in (self.launcher.children.items() if self.launcher else ()) if c.exited() is None}
        name = next((n for n in self._standby(role) if n not in running), None)
        if self.launcher is None or name is None:
            log.warning("policy control: no standby %s instance to start%s", role,
                        "" if self.launcher else " (the workers were not started by this router)")
            return None
        log.info("policy control: starting standby instance %s (%s)", name, role)
        self.launcher.start_one(name)
        return name

    async def _scale_in(self, role: str, name: str | None) -> str | None:
        """Drain a running standby instance of `role` (`name` when it is one) and stop it -> its name."""
        up = {w.name: w for w in self.registry.up() if not w.draining}
        cands = [n for n in self._standby(role) if n in up]
        if name not in cands:
            name = cands[0] if cands else None
        if self.launcher is None or name is None or len([w for w in up.values() if w.serves(role)]) < 2:
            log.info("policy control: no standby %s instance to stop", role)
            return None
        w = self.registry.retire(name)
        deadline = time.monotonic() + self.cfg.router.role_change_timeout_s
        while w.inflight and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        await asyncio.to_thread(self.launcher.stop_one, name)
        self.registry.mark_down(name, "stopped (scale-in)")
        log.info("policy control: stopped standby instance %s", name)
        return name

    def _egress_gbps(self) -> float:
        """The PrfaaS -> PD bandwidth now (the narrowest shaped link; unshaped: unbounded)."""
        kinds = {c.name: c.kind for c in self.cfg.clusters}
        out = []
        for lk in self.cfg.links:
            if kinds.get(lk.src) == "prfaas" and kinds.get(lk.dst) != "prfaas":
                out.append(self.topology.bandwidth.get((lk.src, lk.dst), lk.bandwidth_gbps))
        return min((b for b in out if b), default=math.inf)

    async def replan(self):
        """One round of the long-term loop -> the replanner's Decision (applied: the policy's base threshold,
        and the role flip it asks for)."""
        now = time.monotonic()
        up = self.registry.up()
        n_prfaas = sum(1 for w in up if self.topology.kind(w.name) == "prfaas" and w.serves("prefill"))
        pd = {w.name: (w.role, w.inflight) for w in up if self.topology.kind(w.name) != "prfaas"}
        flipping = any(w.draining for w in self.registry.all())
        d = self.replanner.decide(now, n_prfaas, pd, self._egress_gbps(), flipping)
        if d.threshold_tokens is not None and hasattr(self.policy, "threshold"):
            self.policy.threshold.rebase(d.threshold_tokens)
        self.replan_state = {"replan_decisions": self.replanner.decisions, "replan_flips": self.replanner.flips}
        if d.current is not None:
            self.replan_state.update(planned_lambda_max=d.current["lambda_max"],
                                     optimal_lambda_max=d.best["lambda_max"], planned_threshold_tokens=d.threshold_tokens)
        log.info("re-plan: %s%s", d.why, f"; flipping {d.flip[0]} to {d.flip[1]}" if d.flip else "")
        if d.flip is not None:
            try:
                await self.set_role(*d.flip)
            except (RequestError, Unavailable) as e:
                log.warning("re-plan: %s did not change to %s: %s", d.flip[0], d.flip[1], e)
        return d

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

    async def add(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> asyncio.Queue:
        """Place the request (raises RequestError / QueueFull / Unavailable) and stream its Updates to a queue."""
        arrival = time.monotonic()
        seed = params.seed
        if params.n > 1 and seed is None:
            seed = random.randrange(2**31)
        kv = len(prompt_ids) - 1 if self.cfg.transfer.leave_last_token and len(prompt_ids) > 1 else len(prompt_ids)
        subs = [_Sub(request_id if params.n == 1 else f"{request_id}-{i}", i, list(prompt_ids),
                     dataclasses.asdict(dataclasses.replace(params, n=1, seed=None if seed is None else seed + i)), kv,
                     arrival=arrival)
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
        """The client went away: cancel its tasks, which close their streams (the workers abort and free)."""
        self.sequences.pop(request_id, None)
        for t in self.tasks.pop(request_id, []):
            t.cancel()

    # ---- placement
    def _client(self, w: WorkerInfo) -> rpc.Client:
        if w.address not in self._clients:
            # channels to addresses no worker registers at any more (restarted workers) are closed
            live = self.registry.addresses()
            for addr in [a for a in self._clients if a not in live]:
                asyncio.ensure_future(self._clients.pop(addr).close())
            self._clients[w.address] = rpc.Client(w.address, self.cfg.transfer.token, self._tls)
        return self._clients[w.address]

    def _down(self, w: WorkerInfo, e: grpc.aio.AioRpcError) -> None:
        if e.code() in DEAD:
            log.warning("%s failed (%s: %s); not used until it answers again", w.name, e.code().name, e.details())
            self.registry.mark_down(w.name, f"{e.code().name}: {e.details()}")
            self.index.drop(w.name)  # its cache may be gone: nothing of it counts until it resyncs

    def _snapshot(self, s: _Sub, exclude: set):
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

    async def _place(self, s: _Sub) -> None:
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
            if self.replanner is not None and not s.errors and pl.uncached_tokens is not None:
                self.replanner.observe(pl.uncached_tokens, time.monotonic())
            log.debug("%s: %s", s.rid, pl)
            self._start_load(s, pl)
            self._start_put(s, pl)
            try:
                await self._open(s, w, method)
                return
            except grpc.aio.AioRpcError as e:
                if e.code() == Code.INVALID_ARGUMENT:
                    raise RequestError(e.details()) from None
                if e.code() == Code.RESOURCE_EXHAUSTED:
                    busy.add(w.name)
                    continue
                self._down(w, e)
                s.avoid.add(w.name)
                s.errors.append(f"{method} on {w.name}: {e.code().name}: {e.details()}")
            except _Retry as e:
                s.avoid.add(w.name)
                s.errors.append(str(e))

    async def _open(self, s: _Sub, w: WorkerInfo, method: str) -> None:
        s.serial += 1
        s.xid = f"{s.rid}.{s.serial}"
        msg = {"request_id": s.xid, "prompt": s.prompt, "params": s.params, **s.resume()}
        if method == "Decode":
            msg.update(kv_tokens=s.kv(), deadline_s=self.cfg.transfer.deadline_s)
        call = self._client(w).stream(method, msg)
        it = call.__aiter__()
        first = None
        if method == "Decode":
            try:
                # a stopped process accepts the call and never answers: give up when its heartbeats stop
                first = await self._watch(w, it.__anext__())
            except StopAsyncIteration:
                call.cancel()
                raise _Retry(f"{w.name} closed its Decode stream without a reservation") from None
            except _Silent as e:
                call.cancel()
                raise _Retry(f"Decode on {e}") from None
            except BaseException:
                call.cancel()
                raise
            if not isinstance(first, dict) or not isinstance(first.get("reserved"), dict):
                call.cancel()
                raise _Retry(f"{w.name} answered Decode without a reservation: {str(first)[:200]}")
        s.call, s.it, s.worker, s.method, s.prefill, s.kv_bytes, s.kv_backend = call, it, w, method, None, 0, None
        # where prefill sends the KV: the decode instance by name (the worker looks its addresses up in the
        # registry's peer table) and the reservation's blocks, skip and region offset
        s.reserved = {"instance": w.name, **first["reserved"]} if first else None
        s.placed_s = time.monotonic() - s.arrival
        s.attempts += 1
        w.inflight += 1

    def _close(self, s: _Sub) -> None:
        self._drop_load(s)
        self._drop_put(s)
        if s.call is not None:
            s.call.cancel()  # the worker's stream ends: it aborts the request and frees its blocks
            s.worker.inflight -= 1
            s.call = None

    def _start_load(self, s: _Sub, pl: Placement) -> None:
        """Start the pipelined load the placement names (`move_prefix` with `overlap`), beside the decode
        reservation that follows (`s.load`); an earlier placement's load is dropped."""
        self._drop_load(s)
        mv = pl.move_prefix
        if pl.prefill is None or mv is None or not mv.overlap:
            return
        src, dst = self.registry.get(mv.src), self.registry.get(pl.prefill)
        if src is None or dst is None or not self.registry.is_up(src):
            return  # _move_prefix counts the move failed
        tokens = (s.prompt + s.output)[:mv.tokens]
        ld = _Load(src.name, dst.name, len(tokens), f"{s.rid}.{s.serial + 1}.prefix",
                   asyncio.get_running_loop().create_future(),
                   shared=self.shared_loads and dst.shares_host_pool(src)
                   and self.cfg.link(self.topology.cluster(src.name), self.topology.cluster(dst.name)) is None)

        async def run():
            t0 = time.monotonic()
            try:
                if ld.shared:
                    ld.reserved.set_result({})
                    ld.sent = await self._watch(dst, self._client(dst).call(
                        "Load", {"request_id": ld.import_id, "prompt": tokens, "store": src.name},
                        timeout=self.cfg.transfer.deadline_s))
                else:
                    ld.sent = await self._copy_prefix(src, dst, tokens, ld.import_id, ld.reserved)
            except (grpc.aio.AioRpcError, _Silent, StopAsyncIteration, KeyError, TypeError, ValueError) as e:
                ld.error = _why(e)
            finally:
                ld.seconds = time.monotonic() - t0
                if not ld.reserved.done():
                    ld.reserved.set_result(None)
        ld.task = asyncio.ensure_future(run())
        s.load = ld

    def _drop_load(self, s: _Sub) -> None:
        """Stop the sequence's pipelined load, if still running (its Import stream closes: the prefill instance
        releases the blocks)."""
        ld, s.load = s.load, None
        if ld is None:
            return
        ld.task.cancel()
        if not ld.reserved.done():  # a task cancelled before it ran sets nothing
            ld.reserved.set_result(None)

    def _start_put(self, s: _Sub, pl: Placement) -> None:
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
        self._drop_put(s)
        if not self.puts_stream or target is None:
            return
        store, n = target
        put = _Put(store.name, n, f"{s.rid}.{s.serial + 1}.put", asyncio.get_running_loop().create_future())

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

    def _put_task(self, s: _Sub, store: WorkerInfo, n: int, write, streamed: bool) -> asyncio.Task:
        """Run write() (-> KV bytes written) in the background, counted in `store_puts` (a failure is logged)."""
        async def run():
            try:
                written = await write()
                self.store_puts["done"] += 1
                self.store_puts["streamed"] += int(streamed)
                self.store_puts["bytes"] += written
            except (grpc.aio.AioRpcError, _Silent, StopAsyncIteration, KeyError, TypeError, ValueError) as e:
                self.store_puts["failed"] += 1
                log.info("%s: writing %d tokens to the store %s %sfailed (%s)", s.rid, n, store.name,
                         "as they were computed " if streamed else "", _why(e))
            finally:
                self._store_tasks.discard(task)
        task = asyncio.ensure_future(run())
        self._store_tasks.add(task)
        return task

    def _drop_put(self, s: _Sub) -> None:
        """Stop the sequence's write-back to the store, if the Prefill has not named it (its Import closes: the
        store releases the blocks)."""
        put, s.put = s.put, None
        if put is None:
            return
        put.task.cancel()
        if not put.reserved.done():
            put.reserved.set_result(None)

    def _name_put(self, s: _Sub) -> dict | None:
        """The Prefill's `store`: the write-back's reservation, when the store has made it by now (the Prefill
        does not wait for it: without it the prompt is put after the prefill)."""
        put = s.put
        if put is None or not put.reserved.done() or put.reserved.result() is None:
            self._drop_put(s)
            return None
        return {"import_id": put.import_id, "tokens": put.tokens,
                "dst": {"instance": put.store, **put.reserved.result()}}

    async def _move_prefix(self, s: _Sub, p: WorkerInfo) -> dict | None:
        """Copy the cached prefix the placement names (`move_prefix`: PrfaaS 3.4.3's longer prefix held in the
        other cluster, or BanaServe's global KV store) from its holder into prefill instance p's prefix cache: an
        Import stream on p reserves the blocks, an Export call on the holder sends the KV into them, and p's
        answer says they are cached. With `overlap`, that load started with the placement (`_start_load`) and
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
        except (grpc.aio.AioRpcError, _Silent, StopAsyncIteration, KeyError, TypeError, ValueError) as e:
            self.prefix_moves["failed"] += 1
            log.warning("%s: moving the %d-token prefix %s -> %s failed (%s); %s prefills without it",
                        s.rid, len(tokens), src.name, p.name, _why(e), p.name)
            return None
        self._moved(s, src.name, p.name, len(tokens), int(sent["kv_bytes"]), time.monotonic() - t0, via="transfer")
        return None

    def _moved(self, s: _Sub, src: str, dst: str, tokens: int, kv_bytes: int, seconds: float, **more) -> None:
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
            return await self._watch(src, self._client(src).call(
                "Export", {"request_id": rid, "prompt": tokens, "dst": {"instance": dst.name, **reservation}},
                timeout=self.cfg.transfer.deadline_s))
        sent, _ = await self._import(dst, tokens, rid, reserved, export)
        return sent

    async def _import(self, dst: WorkerInfo, tokens: list[int], rid: str, reserved: asyncio.Future | None = None,
                      fill=None) -> tuple[dict, dict]:
        """An Import stream on dst for a prefix (whole blocks): `reserved` gets its reservation, `fill(it)` (an
        Export on the holder) or a Prefill naming it sends the KV into it -> (fill's answer, dst's "imported"
        once the prefix is cached there). Raises what the calls raise."""
        deadline = self.cfg.transfer.deadline_s
        imp = self._client(dst).stream("Import", {"request_id": rid, "prompt": tokens, "deadline_s": deadline})
        try:
            it = imp.__aiter__()
            first = await self._watch(dst, it.__anext__())
            if reserved is not None:
                reserved.set_result(first["reserved"])
            sent = await fill(first["reserved"]) if fill is not None else {}
            done = await self._watch(dst, it.__anext__())
            if "imported" not in done:
                raise ValueError(f"Import answered {str(done)[:200]}")
            return sent, done["imported"]
        finally:
            imp.cancel()

    def _store_put(self, s: _Sub, p: WorkerInfo, tokens: list[int], force: bool = False) -> None:
        """After a prefill on p that did not stream them there (`_Put`): its prompt's whole blocks go to the
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

    async def _prefill(self, s: _Sub, p: WorkerInfo, on_first) -> None:
        """Run the prompt on prefill instance p into the reservation (after moving a cached prefix to p when
        the placement says so); on_first(Update) gets the first token as soon as it is sampled; returns once
        decode acknowledged every KV byte. Raises _Retry."""
        load = await self._move_prefix(s, p) if s.placement.move_prefix is not None else None
        missed = False  # a read of the store's shared pool that missed: the prompt goes back to the store after
        tokens = s.prompt + s.output  # resuming: the output so far is prompt to this prefill
        params = {**s.params, "max_tokens": s.params["max_tokens"] - len(s.output)}
        p.inflight += 1
        s.prefilling = p.name
        n, t0, computed = max(1, s.placement.uncached_tokens or len(tokens)), time.monotonic(), False
        p.prefill.start(n)
        store = self._name_put(s)
        call = self._client(p).stream("Prefill", {
            "request_id": s.xid, "prompt": tokens, "params": params, "kv_tokens": s.kv(),
            "sample": s.kv() == len(tokens), "dst": s.reserved, **({"prefix_from": load} if load else {}),
            **({"store": store} if store else {})}, timeout=self.cfg.server.request_timeout_s)
        try:
            it = call.__aiter__()
            while True:
                try:
                    res = await self._watch(p, it.__anext__())
                except StopAsyncIteration:
                    raise _Retry(f"{p.name} ended its Prefill call without an answer") from None
                if "first" not in res:
                    break
                if not computed:  # the prompt is computed: its tokens leave p's queue and time its rate
                    computed = True
                    p.prefill.end(n, t0, time.monotonic(), True)
                on_first(Update(**res["first"]))
        except grpc.aio.AioRpcError as e:
            self._down(p, e)
            s.avoid_prefill.add(p.name)
            raise _Retry(f"prefill on {p.name} failed: {e.code().name}: {e.details()}") from None
        except _Silent as e:
            s.avoid_prefill.add(p.name)
            raise _Retry(f"prefill on {e}") from None
        finally:
            call.cancel()  # nothing once it has ended
            p.inflight -= 1
            s.prefilling = None
            if not computed:
                p.prefill.end(n, t0, time.monotonic(), False)
        if load:  # the prefix arrived while p's prefill ran over it, or before it (the prefill waited for it)
            ld, got = s.load, res.get("prefix") or {}
            await ld.task
            error = ld.error or got.get("error")
            if error or not ld.sent:
                self.prefix_moves["failed"] += 1
                missed = ld.shared
                log.warning("%s: %s did not load the %d-token prefix from %s (%s); it computed it", s.rid, p.name,
                            ld.tokens, ld.src, error)
            else:
                more = ({"via": "shared", "one_pass": bool(ld.sent.get("one_pass"))} if ld.shared else
                        {"streamed_groups": got.get("streamed_groups"), "via": "transfer"})
                self._moved(s, ld.src, p.name, ld.tokens, int(ld.sent["kv_bytes"]), ld.seconds, overlapped=True,
                            **more)
            self._drop_load(s)
        p.served += 1
        s.prefill, s.kv_bytes, s.kv_backend = p.name, int(res["kv_bytes"]), res.get("backend")
        self.kv_bytes_transferred += s.kv_bytes
        sent = s.kv() - int(s.reserved.get("skip", 0)) * self.cfg.engine.block_size  # tokens beyond decode's own
        if sent > 0 and s.kv_bytes > 0:  # the policies' bytes per token (a moving average over transfers)
            x, old = s.kv_bytes / sent, self.kv_bytes_per_token
            self.kv_bytes_per_token = x if old is None else 0.8 * old + 0.2 * x
        if store and (res.get("store") or {}).get("streamed"):
            s.put = None  # the store is taking it as it was computed: its Import ends by itself
        else:
            if store:
                self.puts_stream = False
            self._drop_put(s)
            self._store_put(s, p, tokens, force=missed)

    async def _next(self, s: _Sub, pre: asyncio.Future | None, kv_pending: bool) -> dict:
        """The open stream's next message. While the request's prefill call (`pre`) runs and decode has not yet
        reported the KV in (kv_pending), the call is awaited alongside: its failure raises (its _Retry) at once
        rather than when decode's deadline for the KV passes. Raises StopAsyncIteration, _Silent."""
        read = asyncio.ensure_future(self._watch(s.worker, s.it.__anext__()))
        try:
            if kv_pending and pre is not None and not pre.done():
                await asyncio.wait({read, pre}, return_when=asyncio.FIRST_COMPLETED)
            if kv_pending and pre is not None and pre.done() and not read.done() and pre.exception() is not None:
                raise pre.exception()
            return await read
        except BaseException:
            read.cancel()
            raise

    async def _prefilled(self, s: _Sub, pre: asyncio.Future | None) -> None:
        """The request finished on decode: wait for its prefill call's answer (the route's KV numbers). Decode
        had every KV byte, so a prefill call failing now changes nothing for the client: it is only logged."""
        if pre is None:
            return
        try:
            await pre
        except _Retry as e:
            log.warning("%s: %s, after decode had its KV", s.rid, e)

    async def _watch(self, w: WorkerInfo, aw):
        """Await `aw` (a call to worker w); give up with _Silent once the registry no longer counts w up."""
        fut = asyncio.ensure_future(aw)
        try:
            while True:
                done, _ = await asyncio.wait({fut}, timeout=self.cfg.router.heartbeat_s)
                if done:
                    return fut.result()
                if not self.registry.is_up(w):
                    raise _Silent(f"{w.name}: no heartbeat for {self.cfg.router.down_after_s}s")
        finally:
            fut.cancel()

    # ---- one sequence, start to end
    async def _drive(self, s: _Sub, q: asyncio.Queue) -> None:
        def final(u: Update):
            if self.replanner is not None and u.finish_reason in ("length", "stop"):
                self.replanner.finished(len(u.token_ids), time.monotonic())
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
                q.put_nowait(u)

        pre = None  # the request's Prefill call, running while the decode stream is read
        try:
            while True:
                try:
                    if s.method == "Decode":
                        name = s.placement.prefill
                        p = self.registry.get(name)
                        if p is None or not self.registry.is_up(p):
                            s.avoid_prefill.add(name)
                            raise _Retry(f"prefill instance {name} went down before its Prefill call")
                        pre = asyncio.ensure_future(self._prefill(s, p, relay))
                    kv_pending = s.method == "Decode"
                    while True:
                        try:
                            msg = await self._next(s, pre, kv_pending)
                        except StopAsyncIteration:
                            break
                        except _Silent as e:
                            s.avoid.add(s.worker.name)
                            raise _Retry(f"{s.method} on {e}") from None
                        u = Update(**msg["update"])
                        if u.finished and u.error:
                            raise _Retry(f"{s.worker.name}: {u.error}")
                        kv_pending = False
                        if u.finished:
                            await self._prefilled(s, pre)
                            s.worker.served += 1
                            final(stamp(u))
                            return
                        relay(u)
                    raise _Retry(f"{s.worker.name} closed the stream before the request finished")
                except grpc.aio.AioRpcError as e:  # the open stream's worker failed
                    if e.code() == Code.INVALID_ARGUMENT:
                        raise RequestError(e.details()) from None
                    self._down(s.worker, e)
                    s.avoid.add(s.worker.name)
                    err = f"{s.method} on {s.worker.name} failed: {e.code().name}: {e.details()}"
                except _Retry as e:
                    err = str(e)
                s.errors.append(err)
                self._stop(pre)
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
            self._stop(pre)
            self._close(s)

    @staticmethod
    def _stop(pre: asyncio.Future | None) -> None:
        """Cancel a prefill call still running (its transfer has nowhere to go), or collect its outcome."""
        if pre is not None:
            if pre.done():
                pre.cancelled() or pre.exception()
            else:
                pre.cancel()


def _replanner(p):
    """The long-term loop's planner for a config's policy section (None when replan_s is unset); a profile that
    does not load is a config error naming its field."""
    if p.replan_s is None:
        return None
    from .planner import PlanError, Profile, load_json
    from .replan import ReplanParams, Replanner
    profiles = []
    for key in ("prfaas_profile", "pd_profile"):
        try:
            profiles.append(Profile.from_json(load_json(getattr(p, key), f"policy.{key}"), f"policy.{key}"))
        except PlanError as e:
            raise ConfigFileError(str(e)) from None
    return Replanner(ReplanParams(p.replan_s, p.replan_window_s, p.replan_min_samples, p.replan_min_gain,
                                  p.replan_min_interval_s), *profiles)
