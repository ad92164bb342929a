"""Fault matrix: prefill and decode instances killed, stopped, partitioned and fed corrupted KV while real
requests run, and what the clients saw.

Topology (real processes, real gRPC and TCP): the router (router/cluster.py) in this process; two prefill
workers (p0, p1, core 0) and two decode workers (d0, d1, core 1), each a `jaxserve worker` process. The victims
are p0 and d0. With root, each victim runs in a network namespace of its own (bench/netns.py), so a partition
is its veth link taken down: no reset, no FIN, packets vanish. Every decode instance's KV port sits behind a
fault proxy (bench/faultproxy.py; the instance advertises the proxy through `kv_advertise`), which flips a bit
in every chunk to corrupt a link: for a prefill victim only the chunks it sends, for a decode victim all it
receives. KV goes over TCP (shared memory off) through a link shaped to `--bandwidth-gbps`, so a transfer
takes long enough to be caught in the middle.

A cell is (victim role, fault, phase). Its requests (`--requests`, `--concurrency` at a time, prompts cycled
from a fixed set, greedy) run; after `--warm` have finished the fault lands at the first moment a request
sharing the victim is in the phase:
  first_token: the victim holds the request (its Prefill call, or its Decode reservation) before any token;
  transfer:    the first token is out and the Prefill call is still sending the KV;
  stream:      decode has streamed 2+ tokens (prefill victim: that request's prefill was on p0).
Faults: sigkill; sigstop_10s (SIGCONT after `--stop-s`); sigstop (stopped for the rest of the cell); partition
(for the rest of the cell); corrupt (for `--stop-s`). Afterwards the victim is repaired (restarted, continued,
healed) and, once every instance is idle, each is asked for what it still holds.

Per cell: requests token-exact against the colocated engine, parted from it only at a near tie (the first
token that differs was within `--tie` in logprob of the reference's own choice there: float32 sums that run in
another batch round differently, a cluster's batches are not the reference's, and greedy decoding then follows
the other branch; vLLM's tests accept the same), failed with an error (and the distinct errors), wrong tokens
(where and what, for the first few), hung (no answer within `--hang-s`: must be 0), time from the fault to the
end of each request in flight at that moment (p50/p99), time until a request submitted after the fault
finished, and blocks, reservations and receive-pool bytes still held after quiesce (must be 0). Also per cell:
the programs the surviving instances compiled during it, named (the workers run with JAX's compile log on, and
each line "Compiling <program> with global shapes ..." they print during the cell is kept, shortened), and how
many requests ended up served whole on a decode instance (a decode instance's prefill is a role fallback that
its warm-up does not compile: jaxserve/worker/main.py). Writes JSON (`--json`).

    python -m bench.faults --json bench/results/faults.json

Size: over 600 lines as one benchmark: the scenarios side by side (each its kill, stop, partition or corruption
and what it checks), the harness they share above them.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import platform
import secrets
import signal
import sys
import tempfile
import time

import numpy as np

from jaxserve.router.launcher import free_ports

ROLES = ("prefill", "decode")
FAULTS = ("sigkill", "sigstop_10s", "sigstop", "partition", "corrupt")
PHASES = ("first_token", "transfer", "stream")
VICTIM = {"prefill": "p0", "decode": "d0"}
HELD = ("blocks_used", "running", "waiting", "reservations", "pool_used_bytes")  # all 0 on an idle instance
ENGINE = dict(block_size=16, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=256, chunk_size=256,
              max_prefill_seqs=2, max_model_len=512, num_snapshots=16, prefix_caching=False, warmup=True)


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


class CompileLog:
    """The "Compiling ..." lines the workers print (JAX's compile log), with when they arrived: the Launcher's
    echo, called from its reader threads (a lock guards the lists)."""

    def __init__(self, keep: int = 20000):
        import threading
        self.lines: collections.deque = collections.deque(maxlen=keep)
        self.lock = threading.Lock()

    def echo(self, line: str) -> None:  # "[name] text", from router/launcher.py
        import re
        if "Compiling " not in line or not line.startswith("["):
            return
        name, _, text = line[1:].partition("] ")
        program, _, shapes = text[text.index("Compiling ") + len("Compiling "):].partition(" with global shapes "
                                                                                          "and types ")
        # the arguments' shapes, the last ones kept (a step program's first are the weights; its batch is last)
        shapes = re.sub(r"ShapedArray\(([^()]*)\)", r"\1", shapes.split(". Argument mapping")[0])
        shapes = shapes if len(shapes) <= 160 else "..." + shapes[-160:]
        with self.lock:
            self.lines.append((time.monotonic(), name, f"{program} {shapes}"))

    def counts(self) -> dict[str, int]:
        """worker -> the compile lines kept from it."""
        with self.lock:
            return dict(collections.Counter(name for _, name, _ in self.lines))

    def since(self, t: float, exclude: str) -> dict[str, list[str]]:
        """worker -> what it compiled after monotonic time t (all but `exclude`)."""
        out: dict[str, list[str]] = {}
        with self.lock:
            for at, name, what in self.lines:
                if at >= t and name != exclude:
                    out.setdefault(name, []).append(what)
        return out


def wait_ready(proc, ready, what: str, log: str, timeout: float, every: float = 0.5) -> float:
    """Poll ready() (a server's readiness over HTTP; an HTTP error or bad JSON counts as not yet) until it holds;
    -> the seconds it took. Raises if `proc` exits first or `timeout` passes (`what` and `log` name them)."""
    import httpx
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}; see {log}")
        try:
            if ready():
                return time.monotonic() - t0
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(every)
    raise RuntimeError(f"{what} not ready after {timeout}s; see {log}")


def stop_process(proc, timeout: float = 60.0) -> None:
    """SIGTERM a subprocess.Popen, SIGKILL it if it has not exited after `timeout` seconds, and reap it."""
    import subprocess
    proc.terminate()
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


class Reference:
    """The colocated engine's greedy answer to each prompt: its tokens and, per position, the logprobs of its
    top tokens there."""

    def __init__(self, outputs):
        self.tokens = [list(o.token_ids) for o in outputs]
        self.top = [[dict(top) | {t: lp} for t, (lp, top) in zip(o.token_ids, o.logprobs)] for o in outputs]

    def __len__(self) -> int:
        return len(self.tokens)

    def __getitem__(self, i: int) -> list[int]:
        return self.tokens[i]

    def parting(self, i: int, got: list[int]) -> tuple[int, float | None] | None:
        """Where `got` first differs from prompt i's answer, and by how much the reference preferred its own token
        there (logprob; None: `got`'s token was not among its top ones); None when they are the same."""
        want = self.tokens[i]
        if got == want:
            return None
        k = next((j for j, (x, y) in enumerate(zip(got, want)) if x != y), min(len(got), len(want)))
        if k >= min(len(got), len(want)) or got[k] not in self.top[i][k]:
            return k, None
        return k, self.top[i][k][want[k]] - self.top[i][k][got[k]]

    def near_tie(self, i: int, got: list[int], tie: float) -> bool:
        """got differs from prompt i's answer first where the reference's top two were within `tie`."""
        p = self.parting(i, got)
        return p is not None and p[1] is not None and p[1] <= tie


def wrong_tokens(rec: dict, ref: Reference, i: int) -> dict:
    """What a request answered with other tokens than prompt i's got, against the reference: where they part,
    by how much the reference preferred its own token there, and the tokens around it."""
    got, want = rec["tokens"], ref[i]
    k, gap = ref.parting(i, got)
    return {"request": rec["rid"], "attempts": rec.get("attempts"), "prefill_decode": rec.get("where"),
            "tokens": len(got), "want_tokens": len(want), "first_difference": k, "logprob_gap": gap,
            "got": got[max(0, k - 2):k + 3], "want": want[max(0, k - 2):k + 3]}


class Topology:
    """The config, the namespaces and proxies, and the worker processes (started, restarted, stopped here)."""

    def __init__(self, model: str, args, tmp: str):
        from bench import clusters, netns
        from bench.faultproxy import FaultProxy
        self.ns, self.why_no_ns = {}, netns.available()
        if self.why_no_ns is None:  # KV from p0 to d0 goes through d0's proxy on the host: no forwarding needed
            self.ns = {"p0": netns.Netns(1), "d0": netns.Netns(2)}
            host = self.ns["p0"].host_ip  # the router and the host's workers: reachable from both namespaces
        else:
            host = "127.0.0.1"
        addr = {n: (self.ns[n].ns_ip if n in self.ns else host) for n in ("p0", "p1", "d0", "d1")}
        self.victim_ip = {n: addr[n] for n in self.ns}
        first = free_ports(host, n=2)  # two ports in one draw: two separate draws could give the same port
        kv_ports = {d: first + k if d not in self.ns else 7300 for k, d in enumerate(("d0", "d1"))}
        self.proxies = {d: FaultProxy((addr[d], kv_ports[d]), host=host) for d in ("d0", "d1")}
        inst = lambda name, role, cpu, **kw: {"name": name, "role": role, "cpus": [cpu], "host": addr[name],  # noqa
                                              "launch": False, **kw}
        self.config = {
            "model": {"path": model, "name": "m"}, "engine": {**ENGINE, "warmup": not args.no_warmup},
            "clusters": [{"name": "c", "instances": [
                inst("p0", "prefill", 0), inst("p1", "prefill", 0),
                *[inst(d, "decode", 1, kv_port=kv_ports[d],
                       kv_advertise="%s:%d" % self.proxies[d].address) for d in ("d0", "d1")]]}],
            "links": [{"src": "c", "dst": "c", "bandwidth_gbps": args.bandwidth_gbps, "connections": 2}],
            "transfer": {"token": secrets.token_hex(16), "connections": 2, "shared_memory": False,
                         "deadline_s": args.deadline_s, "io_timeout_s": 5.0, "stream_min_tokens": 4096},
            "router": {"host": host, "port": 0, "heartbeat_s": 0.5, "down_after_s": 3.0, "max_attempts": 4},
            "server": {"request_timeout_s": args.hang_s},
        }
        if args.unpinned:
            self.config = clusters.unpinned(self.config)
        import yaml
        self.path = os.path.join(tmp, "faults.yaml")
        with open(self.path, "w") as f:
            yaml.safe_dump(self.config, f)
        self.launcher = None  # router/launcher.py, once the router's address is known (`launch`)
        self.compiles = CompileLog()

    def launch(self, router_address: str):
        """Start every worker (the victims inside their namespaces); returns the Launcher."""
        from jaxserve.router.launcher import Launcher
        def wrap(name: str, argv: list[str]) -> list[str]:
            argv = ["env", "JAX_LOG_COMPILES=1", *argv]  # `env` execs the worker: the pid stays the worker's
            return self.ns[name].argv(argv) if name in self.ns else argv
        self.launcher = Launcher(self.path, ["p0", "p1", "d0", "d1"], router_address, wrap=wrap,
                                 echo=self.compiles.echo)
        self.launcher.start()
        return self.launcher

    def signal(self, name: str, sig) -> None:
        os.kill(self.launcher.children[name].pid, sig)

    def close(self) -> None:
        if self.launcher is not None:
            for c in self.launcher.children.values():
                if c.exited() is None:
                    os.kill(c.pid, signal.SIGCONT)  # a stopped worker cannot act on SIGTERM
            self.launcher.stop()
        for p in self.proxies.values():
            p.close()
        for n in self.ns.values():
            n.close()


class Matrix:
    def __init__(self, topo: Topology, cluster, prompts, want, args):
        self.topo, self.cluster, self.prompts, self.want, self.args = topo, cluster, prompts, want, args

    async def wait_up(self, timeout: float) -> None:
        """Until every worker is registered and up (raises WorkerExited with its output if one died)."""
        from jaxserve.router.launcher import wait_ready
        await wait_ready(self.cluster, self.topo.launcher, self.topo.launcher.names, timeout, progress=False)

    async def quiesce(self, limit_s: float) -> dict:
        """Ask every instance what it holds until all hold nothing or `limit_s` passes; returns the last answers."""
        t0 = time.monotonic()
        while True:
            held = await self.holdings()
            if all(all(v == 0 for v in h.values()) for h in held.values()) or time.monotonic() - t0 > limit_s:
                return held
            await asyncio.sleep(0.25)

    async def warm(self) -> None:
        """Every prompt twice, four at a time (least-loaded placement spreads them over both prefill and both
        decode instances), so no cell waits on a first compile; every answer must be token-exact."""
        from jaxserve import SamplingParams
        todo = iter(list(enumerate(self.prompts)) * 2)

        async def client():
            for i, prompt in todo:
                q = await self.cluster.add(f"warm-{i}-{time.monotonic_ns()}", prompt, SamplingParams(
                    max_tokens=self.args.max_tokens, temperature=0, ignore_eos=True))
                while not (u := await q.get()).finished:
                    pass
                got = list(u.token_ids)
                if u.error or (got != self.want[i] and not self.want.near_tie(i, got, self.args.tie)):
                    raise RuntimeError(f"untimed pass: {u.error or 'tokens differ from the colocated engine'}")
        await asyncio.gather(*[client() for _ in range(4)])

    async def holdings(self, keys=None) -> dict:
        """name -> what each worker still holds (its Health stats: `keys`, default HELD)."""
        from jaxserve.worker import rpc
        out = {}
        for w in self.cluster.registry.all():
            c = rpc.Client(w.address, self.topo.config["transfer"]["token"])
            try:
                st = (await c.call("Health", {}, timeout=10))["stats"]
                out[w.name] = {k: st.get(k, 0) for k in keys or HELD}
            except Exception as e:  # noqa: BLE001 - reported, the cell goes on
                out[w.name] = {"error": f"{type(e).__name__}: {e}"}
            finally:
                await c.close()
        return out

    def in_phase(self, role: str, phase: str) -> bool:
        v = VICTIM[role]
        for subs in list(self.cluster.sequences.values()):
            for s in subs:
                n = len(s.output)
                holds = s.prefilling == v if role == "prefill" else (
                    s.worker is not None and s.worker.name == v and s.method == "Decode")
                if phase == "first_token" and holds and n == 0:
                    return True
                if phase == "transfer" and n >= 1 and s.prefilling is not None and (
                        holds if role == "prefill" else s.worker is not None and s.worker.name == v):
                    return True
                if phase == "stream" and n >= 2 and s.prefilling is None and (
                        s.prefill == v if role == "prefill" else holds):
                    return True
        return False

    async def inject(self, role: str, fault: str) -> callable:
        """Apply the fault; returns the repair (async), which also undoes a timed fault if still on."""
        t, v = self.topo, VICTIM[role]
        if fault == "sigkill":
            t.launcher.kill(v)
            return lambda: self._restart(v)
        if fault in ("sigstop", "sigstop_10s"):
            t.signal(v, signal.SIGSTOP)
            if fault == "sigstop":
                return lambda: self._restart(v)
            cont = asyncio.get_running_loop().call_later(self.args.stop_s, t.signal, v, signal.SIGCONT)

            async def resume():
                cont.cancel()
                t.signal(v, signal.SIGCONT)
            return resume
        if fault == "partition":
            t.ns[v].partition()

            async def heal():
                t.ns[v].heal()
            return heal
        if fault == "corrupt":
            if role == "prefill":
                for p in t.proxies.values():
                    p.set("corrupt", only_from=[t.victim_ip[v]])
            else:
                t.proxies[v].set("corrupt")
            undo = asyncio.get_running_loop().call_later(self.args.stop_s, self._pass_all)

            async def clean():
                undo.cancel()
                self._pass_all()
            return clean
        raise ValueError(fault)

    def _pass_all(self) -> None:
        for p in self.topo.proxies.values():
            p.set("pass")

    async def _restart(self, name: str) -> None:
        self.topo.launcher.kill(name)
        self.topo.launcher.start_one(name)

    def skip_reason(self, role: str, fault: str) -> str | None:
        if fault == "partition" and not self.topo.ns:
            return f"no network namespaces: {self.topo.why_no_ns}"
        if fault == "corrupt" and role == "prefill" and not self.topo.ns:
            return "corrupting only the prefill victim's traffic needs its own address (a network namespace): " \
                   f"{self.topo.why_no_ns}"
        return None

    async def cell(self, role: str, fault: str, phase: str) -> dict:
        from jaxserve import SamplingParams
        a = self.args
        out = {"role": role, "fault": fault, "phase": phase, "victim": VICTIM[role]}
        why = self.skip_reason(role, fault)
        if why:
            return {**out, "skipped": why}
        n = a.requests
        recs: list[dict] = [{} for _ in range(n)]
        fault_at: list[float] = []
        nxt = iter(range(n))
        done_count = [0]

        async def one(i: int) -> None:
            r = recs[i]
            prompt = self.prompts[i % len(self.prompts)]
            r["start"] = time.monotonic()
            rid = r["rid"] = f"{role}-{fault}-{phase}-{i}"
            try:
                q = await self.cluster.add(rid, prompt, SamplingParams(max_tokens=a.max_tokens, temperature=0,
                                                                       ignore_eos=True))

                async def final():
                    while True:
                        u = await q.get()
                        if u.finished:
                            return u
                u = await asyncio.wait_for(final(), a.hang_s)
                r["error"] = u.error
                r["tokens"] = list(u.token_ids)
                r["attempts"] = (u.route or {}).get("attempts")
                r["where"] = [(u.route or {}).get(k) for k in ("prefill_instance", "decode_instance")]
                r["whole_on_decode"] = (u.route or {}).get("route") == "colocated" and r["where"][1] in ("d0", "d1")
            except asyncio.TimeoutError:
                r["hung"] = True
                self.cluster.abort(rid)
            except Exception as e:  # noqa: BLE001 - placement refused: a clean failure
                r["error"] = f"{type(e).__name__}: {e}"
            r["end"] = time.monotonic()
            done_count[0] += 1

        async def client():
            for i in nxt:
                await one(i)

        missed: list[str] = []

        async def injector():
            while done_count[0] < a.warm:
                await asyncio.sleep(0.005)
            t0 = time.monotonic()
            while not self.in_phase(role, phase):
                if done_count[0] >= n:
                    missed.append("every request of the cell finished before the phase was seen")
                    return None
                if time.monotonic() - t0 > a.phase_wait_s:
                    missed.append(f"phase not reached within {a.phase_wait_s}s")
                    return None
                await asyncio.sleep(0.001)
            fault_at.append(time.monotonic())
            return await self.inject(role, fault)

        programs = await self.holdings(("compiled_programs",))
        t0 = time.monotonic()
        inj = asyncio.ensure_future(injector())
        await asyncio.gather(*[client() for _ in range(a.concurrency)])
        repair = await inj
        run_s = time.monotonic() - t0
        # programs the surviving instances compiled during the cell (a first compile lengthens recovery)
        after = await self.holdings(("compiled_programs",))
        compiled = {n: after[n]["compiled_programs"] - programs[n]["compiled_programs"] for n in after
                    if n != VICTIM[role] and "error" not in after[n] and "error" not in programs.get(n, {"error": 1})}
        compiled_names = self.topo.compiles.since(t0, exclude=VICTIM[role])
        if repair is not None:
            await repair()
        # quiesce: every instance up and idle, then ask what each still holds
        q0 = time.monotonic()
        await self.wait_up(a.restart_timeout_s)
        held = await self.quiesce(a.deadline_s + 10)
        if fault_at:
            t_f = fault_at[0]
            inflight = [r for r in recs if r["start"] <= t_f < r.get("end", float("inf"))]
            after = [r for r in recs if r["start"] > t_f and not r.get("error") and not r.get("hung")]
            rec = [r["end"] - t_f for r in inflight if "end" in r and not r.get("hung")]
            out.update(fault_injected=True, affected=len(inflight),
                       recover_p50_s=pct(rec, 50), recover_p99_s=pct(rec, 99),
                       service_restored_s=min((r["end"] - t_f for r in after), default=None))
        else:
            out.update(fault_injected=False, note=missed[0] if missed else "no fault injected")
        errors = collections.Counter((r.get("error") or "")[:160] for r in recs if r.get("error"))
        ok = [i for i, r in enumerate(recs) if not r.get("error") and not r.get("hung")]
        ref, m = self.want, len(self.want)
        exact = sum(recs[i]["tokens"] == ref[i % m] for i in ok)
        parted = [i for i in ok if recs[i]["tokens"] != ref[i % m]]
        ties = [wrong_tokens(recs[i], ref, i % m) for i in parted if ref.near_tie(i % m, recs[i]["tokens"], a.tie)]
        wrong = [wrong_tokens(recs[i], ref, i % m) for i in parted
                 if not ref.near_tie(i % m, recs[i]["tokens"], a.tie)]
        leaked = total(held)
        out.update(requests=n, token_exact=exact, near_ties=len(ties), wrong_tokens=len(wrong),
                   failed=sum(bool(r.get("error")) for r in recs), hung=sum(bool(r.get("hung")) for r in recs),
                   retried=sum((r.get("attempts") or 1) > 1 for r in recs), errors=dict(errors.most_common(4)),
                   leaked_blocks=leaked["blocks_used"], leaked_reservations=leaked["reservations"],
                   leaked_pool_bytes=leaked["pool_used_bytes"], leaked_requests=leaked["running"] + leaked["waiting"],
                   unreachable_after=[k for k, h in held.items() if "error" in h],
                   compiled_during_cell=compiled, compiled_during_cell_names=compiled_names,
                   served_whole_on_decode=sum(bool(r.get("whole_on_decode")) for r in recs),
                   run_s=round(run_s, 2), quiesce_s=round(time.monotonic() - q0, 2))
        if wrong:
            out["wrong"] = wrong[:5]
        if ties:
            out["ties"] = ties[:5]
        return out


async def storm(m: Matrix, n: int, concurrency: int, seed: int = 0) -> dict:
    """Cancellation storm: `n` requests, each abandoned by its client (the router's abort, as the HTTP app does
    on a disconnect) at a random moment within the time a request takes: before placement, while prefill runs,
    mid-transfer, mid-stream. While it runs the decode instances are asked for their oldest reservation; after
    it, every instance must hold nothing."""
    from jaxserve import SamplingParams
    rng = np.random.default_rng(seed)
    # how long one request takes here, to spread the aborts over its whole life
    t = time.monotonic()
    q = await m.cluster.add("storm-probe", m.prompts[0], SamplingParams(max_tokens=m.args.max_tokens, temperature=0,
                                                                          ignore_eos=True))
    while not (await q.get()).finished:
        pass
    life = time.monotonic() - t
    todo = iter(range(n))
    oldest = [0.0]
    running = [True]
    phases = collections.Counter()

    async def client():
        for i in todo:
            rid = f"storm-{i}"
            await m.cluster.add(rid, m.prompts[i % len(m.prompts)], SamplingParams(
                max_tokens=m.args.max_tokens, temperature=0, ignore_eos=True))
            await asyncio.sleep(float(rng.uniform(0, 1.2 * life)))
            subs = m.cluster.sequences.get(rid, [])
            phases[("finished" if not subs else "before placement" if subs[0].worker is None else
                    "prefill" if subs[0].prefilling and not subs[0].output else
                    "transfer" if subs[0].prefilling else "stream")] += 1
            m.cluster.abort(rid)

    async def watch():
        while running[0]:
            for name, h in (await m.holdings(("oldest_reservation_s",))).items():
                oldest[0] = max(oldest[0], h.get("oldest_reservation_s", 0.0))
            await asyncio.sleep(0.2)
    w = asyncio.ensure_future(watch())
    t0 = time.monotonic()
    await asyncio.gather(*[client() for _ in range(concurrency)])
    running[0] = False
    await w
    q0 = time.monotonic()
    held = await m.quiesce(m.args.deadline_s + 10)
    return {"requests": n, "concurrency": concurrency, "request_life_s": round(life, 3),
            "aborted_in": dict(phases), "run_s": round(q0 - t0, 2),
            "longest_reservation_s": round(oldest[0], 3), "deadline_s": m.args.deadline_s,
            "quiesce_s": round(time.monotonic() - q0, 2),
            "leaked": total(held),
            "unreachable": [k for k, h in held.items() if "error" in h]}


def total(held: dict) -> dict:
    """What the instances that answered hold, summed over them (HELD keys)."""
    return {k: sum(h.get(k, 0) for h in held.values() if "error" not in h) for k in HELD}


def prompts_for(vocab: int, count: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [rng.integers(3, vocab, size=int(n)).tolist() for n in rng.integers(lo, hi + 1, size=count)]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--model", default="llama", help="a checkpoint directory, 'bundled', or a bench family "
                    "(bench/families.py: built under models/bench on first use)")
    ap.add_argument("--roles", default=",".join(ROLES))
    ap.add_argument("--faults", default=",".join(FAULTS))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--cells", default=None, help="role:fault:phase,... instead of every roles x faults x phases")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--warm", type=int, default=8, help="requests finished before the fault is armed")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-len", default="48,160", help="min,max prompt tokens")
    ap.add_argument("--bandwidth-gbps", type=float, default=0.05, help="the shaped prefill->decode KV link")
    ap.add_argument("--stop-s", type=float, default=10.0, help="length of sigstop_10s and corrupt")
    ap.add_argument("--deadline-s", type=float, default=30.0, help="transfer.deadline_s")
    ap.add_argument("--hang-s", type=float, default=120.0, help="a request unanswered this long is hung")
    ap.add_argument("--tie", type=float, default=1e-4, help="a reference logprob gap this small is a near tie")
    ap.add_argument("--phase-wait-s", type=float, default=60.0)
    ap.add_argument("--restart-timeout-s", type=float, default=300.0)
    ap.add_argument("--no-warmup", action="store_true", help="workers compile on first use, not at start (a "
                    "compile then adds to recovery times)")
    ap.add_argument("--storm", type=int, default=200, help="requests in the cancellation storm (0: none)")
    ap.add_argument("--unpinned", action="store_true", help="the workers on any core (default: the prefill "
                    "instances pinned to core 0, the decode instances to core 1)")
    args = ap.parse_args(argv)
    roles, faults, phases = (args.roles.split(","), args.faults.split(","), args.phases.split(","))
    for got, allowed, what in ((roles, ROLES, "roles"), (faults, FAULTS, "faults"), (phases, PHASES, "phases")):
        bad = sorted(set(got) - set(allowed))
        if bad:
            ap.error(f"--{what}: unknown {bad}; choose from {list(allowed)}")
    lo, hi = (int(x) for x in args.prompt_len.split(","))

    from tqdm import tqdm

    from jaxserve import LLM, SamplingParams
    from jaxserve.bundled import resolve
    from jaxserve.config import parse
    from jaxserve.engine.llm_engine import EngineConfig
    from jaxserve.router.cluster import Router
    from bench import families
    model = families.checkpoint(args.model, "models/bench") if args.model in families.NAMES else resolve(args.model)
    print("reference: the colocated engine's greedy tokens ...", flush=True)
    llm = LLM(model, progress=False, engine=EngineConfig(**{k: v for k, v in ENGINE.items() if k != "warmup"}))
    prompts = prompts_for(llm.config.vocab_size, 16, lo, hi, 0)
    want = Reference(llm.generate(prompts, SamplingParams(max_tokens=args.max_tokens, temperature=0,
                                                          ignore_eos=True, logprobs=2)))
    del llm
    cells = [(r, f, p) for r in roles for f in faults for p in phases]
    if args.cells:
        cells = [tuple(c.split(":")) for c in args.cells.split(",")]
        bad = [c for c in cells if len(c) != 3 or c[0] not in ROLES or c[1] not in FAULTS or c[2] not in PHASES]
        if bad:
            ap.error(f"--cells: {bad} are not role:fault:phase of {list(ROLES)}, {list(FAULTS)}, {list(PHASES)}")
    results: list[dict] = []
    storm_out: dict = {}
    with tempfile.TemporaryDirectory(prefix="jaxserve-faults-") as tmp:
        topo = Topology(model, args, tmp)
        try:
            cfg = parse(topo.config)

            async def go():
                cluster = Router(cfg, None)
                topo.launch(await cluster.start())
                try:
                    m = Matrix(topo, cluster, prompts, want, args)
                    print("starting 4 workers (compiling their programs) ...", flush=True)
                    await m.wait_up(args.restart_timeout_s)
                    print("untimed pass: every prompt through every prefill and decode instance ...", flush=True)
                    await m.warm()
                    if args.storm:
                        print(f"cancellation storm: {args.storm} requests, each abandoned at a random moment ...",
                              flush=True)
                        storm_out.update(await storm(m, args.storm, args.concurrency))
                        print(json.dumps(storm_out), flush=True)
                    for r, f, p in tqdm(cells, desc="fault matrix", unit="cell", file=sys.stdout):
                        res = await m.cell(r, f, p)
                        results.append(res)
                        tqdm.write(summary(res))
                finally:
                    await cluster.close()
            asyncio.run(go())
        finally:
            topo.close()
    compiles_logged = topo.compiles.counts()  # worker -> compile lines seen from it (kept: the last 20,000)
    ran = [c for c in results if "skipped" not in c]
    out = {"benchmark": "faults", "device": f"cpu ({platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} cores)", "model": model,
           "what": "per cell: a fault on the victim instance while --requests requests run at --concurrency; "
                   "token_exact vs the colocated engine, failed (clean error), hung (no answer within hang_s), "
                   "time from the fault to the end of each request then in flight, what instances hold after",
           "partition": "veth link down in a network namespace" if topo.ns else f"not run: {topo.why_no_ns}",
           "settings": {k: v for k, v in vars(args).items() if k != "json"},
           "config": {k: topo.config[k] for k in ("engine", "transfer", "router", "links")},
           "totals": {"cells": len(results), "run": len(ran),
                      "requests": sum(c["requests"] for c in ran),
                      "token_exact": sum(c["token_exact"] for c in ran),
                      "near_ties": sum(c["near_ties"] for c in ran),
                      "failed": sum(c["failed"] for c in ran), "wrong_tokens": sum(c["wrong_tokens"] for c in ran),
                      "hung": sum(c["hung"] for c in ran),
                      "leaked_blocks": sum(c["leaked_blocks"] for c in ran),
                      "leaked_pool_bytes": sum(c["leaked_pool_bytes"] for c in ran),
                      "recover_p99_s_max": max((c.get("recover_p99_s") or 0 for c in ran), default=None),
                      "compiled_during_cells": sum(sum(c["compiled_during_cell"].values()) for c in ran),
                      "served_whole_on_decode": sum(c["served_whole_on_decode"] for c in ran)},
           "cancellation_storm": storm_out or None, "compiles_logged": compiles_logged, "cells": results}
    out["config"]["transfer"] = {k: v for k, v in out["config"]["transfer"].items() if k != "token"}
    from bench.stamp import write
    write(args.json, out, indent=1)
    print(json.dumps(out["totals"]))
    return out


def summary(c: dict) -> str:
    head = f"{c['role']:7s} {c['fault']:11s} {c['phase']:11s}"
    if "skipped" in c:
        return f"{head} skipped: {c['skipped']}"
    rec = "-" if c.get("recover_p50_s") is None else f"{c['recover_p50_s']:.1f}/{c['recover_p99_s']:.1f}s"
    ties = f" near ties {c['near_ties']}" if c["near_ties"] else ""
    wrong = f" WRONG {c['wrong_tokens']}" if c["wrong_tokens"] else ""
    built = "; ".join(f"{n}: " + ", ".join(p + (f" x{k}" if k > 1 else "") for p, k in collections.Counter(
        w.split(" ")[0] for w in ws).items()) for n, ws in c["compiled_during_cell_names"].items())
    return (f"{head} exact {c['token_exact']}/{c['requests']}{ties}{wrong} failed {c['failed']} hung {c['hung']} "
            f"recover p50/p99 {rec} leaked blocks {c['leaked_blocks']} bytes {c['leaked_pool_bytes']}"
            + (f" whole on decode {c['served_whole_on_decode']}" if c["served_whole_on_decode"] else "")
            + (f" compiled {built}" if built else "")
            + ("" if c.get("fault_injected") else f" ({c.get('note')})"))


if __name__ == "__main__":
    main()
