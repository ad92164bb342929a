"""Simulate a PrfaaS-PD deployment with the live router's policy objects (router/policies/).

A `Deployment` names its clusters' instances (role, profile), the PrfaaS -> PD link and the policy; `Traffic`
gives arrivals (Poisson, or bursty: the rate multiplied by `burst_factor` for `burst_s` out of every
`burst_every_s`), first-turn uncached lengths (a truncated log-normal), output lengths, and conversations
(another turn with probability `turn_p` after `think_s`, its prompt the whole conversation so far plus
`followup_tokens` new ones, so its prefix sits in the caches of the instances that served it). `trace` replays
a recorded workload instead: each conversation's arrival, first-turn length and whether one more turn follows
(after exactly `think_s`), so a live run and its simulation serve the very same requests. Per request:

  arrival -> policy.place(Snapshot) -> prefill queue (only the uncached tokens) -> first token (TTFT) ->
  KV: inside a cluster at once; across clusters over the link, streamed layer by layer from the prefill's
  start (it arrives when both the link has carried it and the prefill has ended) -> a decode slot ->
  output_tokens decode steps -> done (the conversation's KV is then cached on its decode instance).

The snapshot the policy sees is built as the live one is (snapshot.py): per instance its role, cluster, the
requests placed on it and not finished, its queue and running counts, free decode slots as free blocks, the
prefix it holds for this conversation, its queued prefill tokens and measured prefill rate; per link its
capacity, recent throughput, bytes in flight and queued. `Traffic.phases` change the
length distribution and output length at given times; `replan` runs the long-term loop (router/replan.py)
in every cell as the live router does: its threshold becomes the policy's base, and a flip drains the
instance (no new work placed there), waits `warmup_s` (its compilation), then switches its role.
Shared prefixes: with `prefix_groups` a new conversation's prompt starts with one of that many common
prefixes of `prefix_tokens` (chosen Zipf-like, `prefix_skew`: a few hot ones), cached per instance like the
conversations. With a global KV store (`Deployment.store_tokens` > 0) every prefill's prefix and prompt is
also written to the store, the snapshot reports what it holds (`store_tokens`), and a prefill instance that
lacks a prefix the store holds loads it at `store_bytes_s`, overlapped with its compute. A policy with a
`control` method (flowkv) is called every `control_s`: its role flips are carried out as the re-plan's are,
its scaling actions counted. A prefill a decode instance runs itself queues there and stalls its decoding.
`cells` > 1 runs that many independent copies of
the deployment (each its own policy object, link and caches), arrivals spread over them at random: the way a
large deployment is cut into router-sized cells, and what keeps a 10,000-accelerator hour to minutes.
"""

from __future__ import annotations

import dataclasses
import time

import numpy as np

from ..planner import LogNormal, Profile
from ..policies.base import InstanceState, LinkState, RequestInfo, Snapshot
from ..replan import Replanner
from .models import Clock, Decode, Link, Prefill, PrefixCache


@dataclasses.dataclass(frozen=True)
class InstanceSpec:
    name: str
    cluster: str
    kind: str  # pd / prfaas
    role: str  # prefill / decode
    profile: Profile


@dataclasses.dataclass
class Deployment:
    instances: list[InstanceSpec]
    make_policy: object  # () -> a policy object (router/policies/)
    link_gbps: float = 100.0  # PrfaaS -> PD
    link_latency_s: float = 0.005
    link_fluctuation: float = 0.0  # relative standard deviation of each transfer's rate
    link_schedule: tuple = ()  # ((time_s, gbps), ...): the link's bandwidth changes at these times
    chunk_tokens: int = 8192  # prefill tokens per step
    chunk_size: int | None = None  # prefill tokens per request per step (None: whole prompts; models.Prefill)
    max_prefill_seqs: int | None = None  # requests per chunked prefill step (None: no limit)
    cache_tokens: int = 1 << 22  # prefix cache per instance
    kv_bytes: object = None  # Profile whose S_kv gives the KV bytes (default: the first instance's)
    dispatch_s: float = 0.0  # the serving path's fixed cost per request (router, RPCs), added to every TTFT
    # the serving path's cost per request by route, measured: {route: ((prompt tokens, ...), (seconds, ...))},
    # interpolated (held at the ends) and added to that route's TTFTs in place of dispatch_s
    path_s: dict = dataclasses.field(default_factory=dict)
    store_tokens: int = 0  # the global KV store's capacity (0: no store)
    store_bytes_s: float = 20e9  # its read bandwidth into a prefill instance
    shared_cores: tuple = ()  # groups of instance names that share one core (profiles measured alone)


@dataclasses.dataclass(frozen=True)
class Traffic:
    rate: float  # new conversations per second
    lengths: LogNormal
    output_tokens: int = 1024
    duration_s: float = 3600.0
    turn_p: float = 0.0
    think_s: float = 30.0
    followup_tokens: int = 512
    burst_factor: float = 1.0
    burst_s: float = 0.0
    burst_every_s: float = 0.0
    rate_schedule: tuple = ()  # ((time_s, rate), ...): the base rate changes at these times
    phases: tuple = ()  # ((time_s, LogNormal lengths, output_tokens), ...): the traffic mix changes then
    prefix_groups: int = 0  # shared prefixes a new conversation's prompt starts with (0: none)
    prefix_tokens: int = 0
    prefix_skew: float = 1.2  # Zipf exponent of the prefixes' popularity
    trace: tuple = ()  # ((arrival_s, first-turn tokens, a second turn follows), ...): replaces the draws above


class _Request:
    __slots__ = ("conv", "turn", "prompt", "arrival", "first", "done", "route", "prefill", "decode", "uncached",
                 "cell", "kv_ready", "prefill_end", "output", "kv_at", "group", "shared", "follow")

    def __init__(self, conv, turn, prompt, arrival, cell, group=None, shared=0):
        self.conv, self.turn, self.prompt, self.arrival, self.cell = conv, turn, prompt, arrival, cell
        self.group, self.shared = group, shared  # its shared prefix (("g", i), tokens) or none
        self.first = self.done = self.prefill_end = None
        self.route = self.prefill = self.decode = None
        self.uncached = prompt
        self.output = 0
        self.kv_at = None  # when its KV was at the decode instance (the second token follows one step later)
        self.kv_ready = 0
        self.follow = None  # a traced conversation: whether its second turn follows (None: drawn, turn_p)


class _Cell:
    def __init__(self, clock: Clock, dep: Deployment, rng, replan=None):
        self.clock, self.dep = clock, dep
        self.policy = dep.make_policy()
        self.replanner = replan() if replan is not None else None
        self.draining: set[str] = set()
        self.flips: list[dict] = []
        self.prefills = {s.name: self._prefill(s.name, s.cluster, s.kind, s.profile)
                         for s in dep.instances if s.role == "prefill"}
        self.decodes = {s.name: self._decode(s.name, s.cluster, s.kind, s.profile)
                        for s in dep.instances if s.role == "decode"}
        self.store = PrefixCache(dep.store_tokens) if dep.store_tokens else None
        self._wire()
        self.actions: list[dict] = []  # a policy's control actions (flowkv)
        clusters = {s.cluster: s.kind for s in dep.instances}
        self.links = {}
        for src, k in clusters.items():
            for dst, k2 in clusters.items():
                if k == "prfaas" and k2 != "prfaas":
                    self.links[(src, dst)] = Link(clock, src, dst, dep.link_gbps, dep.link_latency_s,
                                                  dep.link_fluctuation, rng)
        self.kv_profile = dep.kv_bytes or dep.instances[0].profile
        self.kv_per_token = self.kv_profile.kv_bytes_at(8192) / 8192  # what the live router measures per token

    def _prefill(self, name, cluster, kind, profile) -> Prefill:
        d = self.dep
        return Prefill(self.clock, name, cluster, kind, profile, d.chunk_tokens, d.cache_tokens, d.chunk_size,
                       d.max_prefill_seqs)

    def _decode(self, name, cluster, kind, profile) -> Decode:
        d = self.dep
        return Decode(self.clock, name, cluster, kind, profile, d.cache_tokens, d.chunk_tokens, d.chunk_size,
                      d.max_prefill_seqs)

    def _wire(self) -> None:
        """Processor sharing: each prefill instance's peers on its core (Deployment.shared_cores)."""
        insts = {**self.prefills, **self.decodes}
        for group in self.dep.shared_cores:
            for name in group:
                peers = [insts[n] for n in group if n != name and n in insts]
                if name in self.prefills:
                    self.prefills[name].peers = peers
                elif name in self.decodes:  # its own prefills share the core too
                    self.decodes[name].local.peers = [x for x in peers if isinstance(x, Prefill)]

    @staticmethod
    def held(cache, r: _Request | None, get: bool = False) -> int:
        """Prompt tokens of r that `cache` holds: its conversation, or its shared prefix (get: counts as a use)."""
        if r is None or cache is None:
            return 0
        look = cache.get if get else cache.held
        n = max(look(r.conv), look(r.group) if r.group is not None else 0)
        return min(n, r.prompt - 1)

    def remember(self, cache, r: _Request, tokens: int) -> None:
        cache.put(r.conv, tokens)
        if r.group is not None:
            cache.put(r.group, r.shared)

    def snapshot(self, r: _Request | None) -> Snapshot:
        """The policy's view (r: the request placed; None: the controller's view, no request)."""
        out = []
        for p in self.prefills.values():
            if p.name in self.draining:
                continue
            out.append(InstanceState(p.name, "prefill", p.cluster, p.kind, p.inflight, len(p.queue), int(p.busy),
                                     0, 0, self.held(p.cache, r), p.queued_tokens, p.rate, float(p.busy)))
        for d in self.decodes.values():
            if d.name in self.draining:
                continue
            out.append(InstanceState(d.name, "decode", d.cluster, d.kind, d.inflight, len(d.queue), d.active,
                                     d.slots - d.active, d.slots, self.held(d.cache, r), d.local.queued_tokens,
                                     None, 1.0 if d.active or d.local.busy else 0.0))
        links = tuple(LinkState(lk.src, lk.dst, lk.capacity_bytes_s, lk.egress_bytes_s(), lk.pending_bytes, 0,
                                lk.queued_bytes) for lk in self.links.values())
        prompt = r.prompt if r is not None else 0
        return Snapshot(RequestInfo(prompt, prompt), tuple(out), links, self.clock.now, self.kv_per_token,
                        self.held(self.store, r))

    # ---- a policy's global controller (flowkv), as the live router runs it
    def control(self, warmup_s: float) -> None:
        for a in self.policy.control(self.snapshot(None)):
            self.actions.append({"t_s": self.clock.now, "kind": a.kind, "role": a.role, "instance": a.instance,
                                 "why": a.why})
            if a.kind == "flip" and not self.draining:
                self._flip(a.instance, a.role, a.why, warmup_s)

    # ---- the long-term loop (router/replan.py), as the live router runs it
    def replan(self, warmup_s: float) -> None:
        c = self.replanner
        pd = {n: ("prefill", i.inflight) for n, i in self.prefills.items() if i.kind != "prfaas"}
        pd.update({n: ("decode", i.inflight) for n, i in self.decodes.items()})
        pd = {n: v for n, v in pd.items() if n not in self.draining}
        n_prfaas = sum(1 for i in self.prefills.values() if i.kind == "prfaas")
        gbps = min((lk.gbps for lk in self.links.values()), default=float("inf"))
        d = c.decide(self.clock.now, n_prfaas, pd, gbps, bool(self.draining))
        if d.threshold_tokens is not None and hasattr(self.policy, "threshold"):
            self.policy.threshold.rebase(d.threshold_tokens)
        if d.flip is not None:
            self._flip(*d.flip, d.why, warmup_s)

    def _flip(self, name: str, role: str, why: str, warmup_s: float) -> None:
        """Drain `name` (no new work placed there), then switch it to `role` after the warm-up."""
        self.draining.add(name)
        self.flips.append({"t_s": self.clock.now, "instance": name, "role": role, "why": why})
        self._drained(name, role, warmup_s)

    def _drained(self, name: str, role: str, warmup_s: float) -> None:
        """Poll (in simulated time) until `name` holds nothing, then switch it after the warm-up."""
        inst = self.prefills.get(name) or self.decodes.get(name)
        idle = inst.inflight == 0 and not inst.queue and not getattr(inst, "busy", False) \
            and not getattr(inst, "active", 0) and not (hasattr(inst, "local") and inst.local.busy)
        if not idle:
            self.clock.after(0.5, self._drained, name, role, warmup_s)
            return
        self.clock.after(warmup_s, self._switch, name, role)

    def _switch(self, name: str, role: str) -> None:
        old = self.prefills.pop(name, None) or self.decodes.pop(name)
        if role == "decode":
            self.decodes[name] = self._decode(name, old.cluster, old.kind, old.profile)
        else:
            self.prefills[name] = self._prefill(name, old.cluster, old.kind, old.profile)
        self.draining.discard(name)
        self._wire()


class Simulation:
    def __init__(self, dep: Deployment, traffic: Traffic, cells: int = 1, seed: int = 0, replan=None,
                 warmup_s: float = 30.0, control_s: float | None = None):
        """replan: (ReplanParams, PrfaaS profile, PD profile) to run the long-term loop in every cell (a flip
        drains the instance, then takes warmup_s to compile before it serves its new role); control_s: call the
        policy's global controller (flowkv `control`) this often."""
        self.control_s = control_s
        self.dep, self.traffic, self.seed = dep, traffic, seed
        self.rng = np.random.default_rng(seed)
        self.clock = Clock()
        self.replan_params, self.warmup_s = (replan[0] if replan else None), warmup_s
        make = (lambda: Replanner(*replan)) if replan else None
        self.cells = [_Cell(self.clock, dep, self.rng, make) for _ in range(cells)]
        for p in self.cells[0].prefills.values():  # utilisation over time: the first cell's prefill instances
            p.busy_by = {}
        self.finished: list[_Request] = []
        self.failed = 0
        self._convs = 0
        self._zipf = None

    # ---- traffic
    def _rate(self, t: float) -> float:
        tr = self.traffic
        base = tr.rate
        for when, rate in tr.rate_schedule:
            if t >= when:
                base = rate
        if tr.burst_every_s and (t % tr.burst_every_s) < tr.burst_s:
            base *= tr.burst_factor
        return base * len(self.cells)

    def _peak(self) -> float:
        tr = self.traffic
        rates = [tr.rate] + [r for _, r in tr.rate_schedule]
        return max(rates) * max(1.0, tr.burst_factor) * len(self.cells)

    def _next_arrival(self) -> None:
        # a non-homogeneous Poisson process by thinning against the peak rate
        peak = self._peak()
        t = self.clock.now
        while True:
            t += self.rng.exponential(1.0 / peak)
            if t > self.traffic.duration_s:
                return
            if self.rng.random() * peak <= self._rate(t):
                break
        self.clock.at(t, self._arrive_new)

    def _mix(self) -> tuple:
        """(lengths, output tokens) of the traffic now."""
        tr = self.traffic
        lengths, out = tr.lengths, tr.output_tokens
        for when, ln, o in tr.phases:
            if self.clock.now >= when:
                lengths, out = ln, o
        return lengths, out

    def _length(self) -> int:
        L = self._mix()[0]
        while True:
            x = float(np.exp(self.rng.normal(L.mu, L.sigma)))
            if L.lo <= x <= L.hi:
                return int(x)

    def _group(self) -> int:
        tr = self.traffic
        if self._zipf is None:
            w = 1.0 / np.arange(1, tr.prefix_groups + 1) ** tr.prefix_skew
            self._zipf = np.cumsum(w / w.sum())
        return int(np.searchsorted(self._zipf, self.rng.random()))

    def _arrive_traced(self, tokens: int, follow: bool) -> None:
        self._convs += 1
        r = _Request(self._convs, 0, tokens, self.clock.now, self.cells[int(self.rng.integers(len(self.cells)))])
        r.output, r.follow = self.traffic.output_tokens, follow
        self._start(r)

    def _arrive_new(self) -> None:
        self._convs += 1
        cell = self.cells[int(self.rng.integers(len(self.cells)))]
        tr = self.traffic
        if tr.prefix_groups:
            r = _Request(self._convs, 0, tr.prefix_tokens + self._length(), self.clock.now, cell,
                         ("g", self._group()), tr.prefix_tokens)
        else:
            r = _Request(self._convs, 0, self._length(), self.clock.now, cell)
        r.output = self._mix()[1]
        self._start(r)
        self._next_arrival()

    # ---- one request
    def _start(self, r: _Request) -> None:
        cell = r.cell
        pl = cell.policy.place(cell.snapshot(r))
        if pl.decode is None:
            self.failed += 1
            return
        d = cell.decodes.get(pl.decode)
        p = cell.prefills.get(pl.prefill) if pl.prefill else None
        r.route, r.decode, r.prefill = pl.route, d, p
        d.inflight += 1
        if cell.replanner is not None and r.turn == 0 and pl.uncached_tokens is not None:
            cell.replanner.observe(pl.uncached_tokens, self.clock.now)
        if p is None:  # the decode instance prefills the uncached rest itself (colocated), then decodes
            r.uncached = r.prompt - cell.held(d.cache, r, get=True)

            def local_done():
                r.prefill_end = self.clock.now
                r.first = r.prefill_end + self._path(r)
                self._to_decode(r)
            d.local.submit(r.uncached, lambda dt: None, local_done, cached=r.prompt - r.uncached)
            return
        p.inflight += 1
        held = cell.held(p.cache, r, get=True)
        if pl.move_prefix is not None:
            held = max(held, pl.move_prefix.tokens)
        fetch_s = 0.0
        stored = cell.held(cell.store, r, get=True)
        if stored > held:  # the rest of the prefix comes from the global store, pipelined with the compute
            fetch_s = (cell.kv_profile.kv_bytes_at(stored) - cell.kv_profile.kv_bytes_at(held)) / self.dep.store_bytes_s
            held = stored
        r.uncached = max(1, r.prompt - min(held, r.prompt - 1))
        link = cell.links.get((p.cluster, d.cluster))
        if link is None:
            r.kv_ready = 1  # inside a cluster: no wait beyond the prefill

        def started(dt):
            if link is not None:  # streamed layer by layer from the prefill's start
                link.send(int(cell.kv_profile.kv_bytes_at(r.prompt)), lambda: self._kv(r))

        def done():
            r.prefill_end = self.clock.now
            r.first = r.prefill_end + self._path(r)
            p.inflight -= 1
            cell.remember(p.cache, r, r.prompt)
            if cell.store is not None:
                cell.remember(cell.store, r, r.prompt)
            self._kv(r)
        p.submit(r.uncached, started, done, fetch_s, cached=r.prompt - r.uncached)

    def _path(self, r: _Request) -> float:
        """The serving path's cost for r beyond its prefill (Deployment.path_s, else dispatch_s)."""
        pts = self.dep.path_s.get(r.route)
        return float(np.interp(r.prompt, *pts)) if pts else self.dep.dispatch_s

    def _kv(self, r: _Request) -> None:
        r.kv_ready += 1
        if r.kv_ready == 2:  # the prefill has ended and the KV has arrived
            self._to_decode(r)

    def _to_decode(self, r: _Request) -> None:
        r.kv_at = self.clock.now
        out = r.output
        r.decode.admit(out, lambda: self._done(r, out))

    def _done(self, r: _Request, out: int) -> None:
        r.done = self.clock.now
        r.decode.inflight -= 1
        r.cell.remember(r.decode.cache, r, r.prompt + out)
        self.finished.append(r)
        if r.cell.replanner is not None:
            r.cell.replanner.finished(out, self.clock.now)
        tr = self.traffic
        traced = r.follow is not None
        if (r.follow and r.turn == 0) if traced else (tr.turn_p and self.rng.random() < tr.turn_p):
            nxt = _Request(r.conv, r.turn + 1, r.prompt + out + tr.followup_tokens, 0.0, r.cell, r.group, r.shared)
            nxt.output, nxt.follow = r.output, (False if traced else None)
            t = self.clock.now + (tr.think_s if traced else self.rng.exponential(tr.think_s))
            if t <= tr.duration_s:
                def arrive():
                    nxt.arrival = self.clock.now
                    self._start(nxt)
                self.clock.at(t, arrive)

    # ---- run
    def run(self, drain_s: float | None = None, timeline_s: float = 60.0) -> dict:
        """Traffic for duration_s, then up to drain_s more for what is in flight -> results."""
        t0 = time.perf_counter()
        for cell in self.cells:
            for lk in cell.links.values():
                for when, gbps in self.dep.link_schedule:
                    self.clock.at(when, lk.set_gbps, gbps)
        dur = self.traffic.duration_s
        for t, tokens, follow in self.traffic.trace:
            if t <= dur:
                self.clock.at(t, self._arrive_traced, int(tokens), bool(follow))
        if not self.traffic.trace:
            self._next_arrival()
        if self.replan_params is not None:
            self.clock.after(self.replan_params.replan_s, self._replan)
        if self.control_s:
            self.clock.after(self.control_s, self._control)
        self.clock.run(dur + (dur if drain_s is None else drain_s))
        return self.results(dur, time.perf_counter() - t0, timeline_s)

    def _replan(self) -> None:
        for cell in self.cells:
            cell.replan(self.warmup_s)
        if self.clock.now + self.replan_params.replan_s <= self.traffic.duration_s:
            self.clock.after(self.replan_params.replan_s, self._replan)

    def _control(self) -> None:
        for cell in self.cells:
            cell.control(self.warmup_s)
        if self.clock.now + self.control_s <= self.traffic.duration_s:
            self.clock.after(self.control_s, self._control)

    def results(self, duration_s: float, wall_s: float, timeline_s: float) -> dict:
        done = [r for r in self.finished if r.arrival <= duration_s]
        in_window = [r for r in done if r.done <= duration_s]
        ttft = np.array([r.first - r.arrival for r in done]) if done else np.zeros(1)
        second = np.array([r.kv_at - r.arrival for r in done]) if done else np.zeros(1)
        routes, by_route = {}, {}
        for r in done:
            routes[r.route] = routes.get(r.route, 0) + 1
            by_route.setdefault(r.route, []).append(r.first - r.arrival)
        buckets, served, seconds = {}, {}, {}
        for r in done:
            buckets.setdefault(int(r.arrival // timeline_s), []).append(r.first - r.arrival)
            seconds.setdefault(int(r.arrival // timeline_s), []).append(r.kv_at - r.arrival)
        for r in in_window:
            served[int(r.done // timeline_s)] = served.get(int(r.done // timeline_s), 0) + 1
        link_bytes = sum(lk.bytes_sent for c in self.cells for lk in c.links.values())
        util = {}
        for p in self.cells[0].prefills.values():
            if p.busy_by is not None:
                per = {}
                for k, v in p.busy_by.items():
                    per[int(k * p.BUCKET_S // timeline_s)] = per.get(int(k * p.BUCKET_S // timeline_s), 0.0) + v
                util[p.name] = [round(per.get(k, 0.0) / timeline_s, 4)
                                for k in range(int(max(duration_s, 1) // timeline_s) + 1)]
        return {"requests": len(done), "throughput_rps": len(in_window) / duration_s,
                "ttft_s": {"mean": float(ttft.mean()), "p50": float(np.percentile(ttft, 50)),
                           "p90": float(np.percentile(ttft, 90)), "p99": float(np.percentile(ttft, 99))},
                # until the KV is at the decode instance (the second token is one decode step later)
                "kv_ready_s": {"p50": float(np.percentile(second, 50)), "p90": float(np.percentile(second, 90))},
                "routes": routes, "ttft_by_route": {k: {"n": len(v), "p50_s": float(np.percentile(v, 50)),
                                                        "p90_s": float(np.percentile(v, 90))}
                                                    for k, v in sorted(by_route.items())},
                "egress_gbps": link_bytes * 8 / 1e9 / duration_s,
                "timeline": [{"t_s": k * timeline_s, "requests": len(v), "ttft_p90_s": float(np.percentile(v, 90)),
                              "kv_ready_p90_s": float(np.percentile(seconds[k], 90)),
                              "finished_rps": served.get(k, 0) / timeline_s} for k, v in sorted(buckets.items())],
                "flips": [f for c in self.cells for f in c.flips],
                "actions": [a for c in self.cells for a in c.actions],
                "prefill_utilisation": util,  # per prefill instance (first cell): busy fraction per timeline bucket
                "prefill_busy_s": {p.name: p.busy_s for p in self.cells[0].prefills.values()},
                "failed": self.failed, "events": self.clock.events, "wall_s": wall_s,
                "cells": len(self.cells), "instances": sum(len(c.prefills) + len(c.decodes) for c in self.cells)}


def case_study(prfaas: Profile, pd: Profile, which: str, make_policy, n_prfaas: int = 4, n_p: int = 3, n_d: int = 5,
               **kw) -> Deployment:
    """The PrfaaS document's deployments: "prfaas_pd" (n_prfaas PrfaaS + n_p / n_d PD), "homogeneous"
    (n_p / n_d PD only), "naive" (n_prfaas PrfaaS prefill, n_d PD decode)."""
    inst = []
    if which in ("prfaas_pd", "naive"):
        inst += [InstanceSpec(f"x{i}", "prfaas", "prfaas", "prefill", prfaas) for i in range(n_prfaas)]
    if which in ("prfaas_pd", "homogeneous"):
        inst += [InstanceSpec(f"p{i}", "pd", "pd", "prefill", pd) for i in range(n_p)]
    inst += [InstanceSpec(f"d{i}", "pd", "pd", "decode", pd) for i in range(n_d)]
    return Deployment(inst, make_policy, kv_bytes=pd, **kw)
