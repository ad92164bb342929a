"""The router's operations on its cluster as a whole, beside the request path: role changes in place (SetRole),
migration of decode work (Migrate, and BanaServe's planner over heartbeat loads), emulated link bandwidth
(SetLink), a profile of every process, and the policy's loops: PrfaaS's long-term re-planning (threshold and role
flips from observed traffic) and a controller's cycle (flowkv: flips, scaling standby instances through the
launcher). Runs on the router's asyncio loop; POST /admin/* and /debug/profile call it (server/app.py).
"""

from __future__ import annotations

import asyncio
import logging
import math
import re
import time

import grpc

from jaxserve.config import Config, ConfigFileError
from jaxserve.engine.client import EngineUnavailable as Unavailable
from jaxserve.engine.client import RequestError

from .calls import Workers, message
from .migration import MigrationParams, MigrationPlanner, Unit
from .registry import Registry, WorkerInfo
from .snapshot import Topology

log = logging.getLogger("jaxserve.router")
PROFILE_WRITE_S = 120.0  # a worker's Profile answers within its window plus this (writing its trace files)


class Admin:
    def __init__(self, cfg: Config, registry: Registry, topology: Topology, workers: Workers, policy,
                 kv_bytes_per_token):
        """policy, kv_bytes_per_token: () -> the policy in effect (it may be swapped at run time), the KV bytes
        per token measured on the transfers so far (None before any)."""
        self.cfg = cfg
        self.registry = registry
        self.topology = topology
        self.workers = workers
        self.policy = policy
        self.kv_bytes_per_token = kv_bytes_per_token
        self.launcher = None  # router/launcher.py, when serve started the workers
        self.migrations: dict[str, int] = {}  # moves done by kind (POST /admin/migrate, the planner)
        # the policy section's loops (jaxserve/policy_config.py): banaserve's migrations, prfaas's re-planning and a
        # controller's cycle (flowkv; banaserve with migrate), each where the policy's section has it
        pol = cfg.policy
        self.control_s = getattr(pol, "control_s", None)
        self.mover = (MigrationPlanner(MigrationParams(pol.migrate_delta_up, pol.migrate_delta_down,
                                                       budget_s=pol.migrate_budget_s))
                      if getattr(pol, "migrate", False) else None)
        self.replanner = _replanner(cfg.policy)  # the long-term loop (router/replan.py), None when off
        self.replan_state: dict = {}  # the last decision, for /metrics
        self.control_actions: list[dict] = []  # the policy's controller (flowkv): the last 64, newest last
        self.control_count = 0
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        """Start the policy's loop: re-planning (policy.replan_s) or its controller (policy.control_s)."""
        if self.replanner is not None:
            self._task = asyncio.create_task(self._replan_loop())
        elif self.control_s is not None:
            self._task = asyncio.create_task(self._control_loop())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            self._task = None

    def state(self) -> dict:
        """The policy's part of /metrics."""
        return {**self.policy().state(), **self.replan_state,
                **({"control_actions": self.control_count} if self.control_s else {}),
                "migrations": sum(self.migrations.values())}

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
                ans = await self.workers.client(w).call("Profile", message("Profile", seconds=seconds, stamp=name),
                                                 timeout=seconds + PROFILE_WRITE_S)
                return {"role": w.role, "trace_dir": ans["trace_dir"]}
            except grpc.aio.AioRpcError as e:
                return {"role": w.role, "error": f"{e.code().name}: {e.details()}"}
        workers = self.registry.up()
        trace.start(mine, host_only=True)  # raises Busy before any worker is asked
        try:
            *theirs, _ = await asyncio.gather(*(one(w) for w in workers), asyncio.sleep(seconds))
        finally:
            await trace.stop()
        return {"trace_dir": mine, "seconds": seconds, "instances": {w.name: t for w, t in zip(workers, theirs)}}

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
                    ans = await self.workers.client(w).call(
                        "SetLink", message("SetLink", dst=dst, bandwidth_gbps=gbps), timeout=10)
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
            ans = await self.workers.client(w).call("SetRole", message("SetRole", role=role),
                                                    timeout=self.cfg.router.role_change_timeout_s)
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
        msg = message("Migrate", kind=kind, dst=dst, heads=heads, layers=layers)
        try:
            ans = await self.workers.client(w).call("Migrate", msg, timeout=self.cfg.router.role_change_timeout_s)
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
            await asyncio.sleep(self.control_s)
            try:
                await self.control_cycle()
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

    async def control_cycle(self) -> list:
        """One cycle of the policy's global controller (flowkv `control`): role flips are carried out as the
        re-plan's; a scale-out starts a standby instance of the role (config `standby`) through the launcher, a
        scale-in drains a running standby instance of the role and stops it. Without a launcher or a standby
        instance to use, a scaling action is logged and counted only."""
        policy = self.policy()
        if not hasattr(policy, "control"):  # the policy in effect has no controller (swapped at run time)
            return []
        workers = [w for w in self.registry.up() if not w.draining and self.topology.kind(w.name) != "prfaas"
                   and w.role != "store"]
        snap = self.topology.snapshot(workers, self.registry.all(), 0, 0, None, time.monotonic(),
                                      self.kv_bytes_per_token())
        acts = policy.control(snap)
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
        policy = self.policy()
        if d.threshold_tokens is not None and hasattr(policy, "threshold"):
            policy.threshold.rebase(d.threshold_tokens)
        self.replan_state = {"replan_decisions": self.replanner.decisions, "replan_flips": self.replanner.flips}
        if d.current is not None:
            self.replan_state.update(planned_lambda_max=d.current["lambda_max"],
                                     optimal_lambda_max=d.best["lambda_max"],
                                     planned_threshold_tokens=d.threshold_tokens)
        log.info("re-plan: %s%s", d.why, f"; flipping {d.flip[0]} to {d.flip[1]}" if d.flip else "")
        if d.flip is not None:
            try:
                await self.set_role(*d.flip)
            except (RequestError, Unavailable) as e:
                log.warning("re-plan: %s did not change to %s: %s", d.flip[0], d.flip[1], e)
        return d


def _replanner(p):
    """The long-term loop's planner for a config's policy section (None when replan_s is unset); a profile that
    does not load is a config error naming its field."""
    if getattr(p, "replan_s", None) is None:
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
