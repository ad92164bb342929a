"""Which workers the router knows, whether they are up, and how loaded they are (plain Python, no JAX).

Workers register themselves (the `Register` call, which doubles as their heartbeat, every `heartbeat_s`),
carrying their role, addresses and engine stats. A worker is *up* while it has been heard from within
`down_after_s`; a call to it that fails at the transport level marks it down at once (`mark_down`), and its
next heartbeat brings it back. The router's own count of requests in flight on each instance is the load
signal for dispatch (policies/), the heartbeat's stats break ties. The registry is also the one source of
the instances' data addresses: `peers()` is the table every worker gets back from Register, and a prefill
worker sends KV only to an address in it (worker/messages.py).

Concurrency: registrations arrive on the control port's thread (router/control_port.py), everything else runs on
the router's asyncio loop; the worker table is changed and iterated under one lock, and single attribute
updates of a WorkerInfo are atomic. `now` is injectable for tests.
"""

from __future__ import annotations

import collections
import threading
import time
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "both", "store")
MAX_EVENTS = 1024


class RegistrationError(ValueError):
    """A registration the router refuses (unknown instance, wrong role or token)."""


@dataclass
class PrefillMeter:
    """An instance's prefill queue and rate as the router sees them: uncached tokens dispatched and not yet
    computed, and tokens computed per second busy. A prefill's busy time is the gap from the later of its
    start and the previous prefill's end to its own end: over a busy period the gaps add up to the period, so
    prefills batched together are not counted twice. Both sums decay by DECAY per prefill (the recent ones)."""
    DECAY = 0.9
    queued_tokens: int = 0
    tokens: float = 0.0
    busy_s: float = 0.0
    last_end: float = 0.0

    def start(self, n: int) -> None:
        self.queued_tokens += n

    def end(self, n: int, started: float, now: float, computed: bool) -> None:
        """A prefill of n tokens begun at `started` ended at `now`; computed: its first token came (a failed or
        cancelled one only leaves the queue)."""
        self.queued_tokens -= n
        if computed:
            gap = max(0.0, now - max(started, self.last_end))
            self.tokens = self.DECAY * self.tokens + n
            self.busy_s = self.DECAY * self.busy_s + gap
            self.last_end = now

    @property
    def tokens_s(self) -> float | None:
        return self.tokens / self.busy_s if self.busy_s > 0 else None


@dataclass
class WorkerInfo:
    name: str
    role: str
    address: str  # gRPC control address host:port
    kv_address: tuple[str, int] | None  # its KV data server
    max_model_len: int
    pid: int | None = None
    stats: dict = field(default_factory=dict)
    steps: dict = field(default_factory=dict)  # its engine's step time by kind (StepTimer.totals)
    links: dict = field(default_factory=dict)
    shm: dict | None = None  # decode: its shared-memory receive pool {"name", "boot", "bytes"}
    pull: bool = False  # decode: takes device pulls
    pull_address: str | None = None  # prefill: its JAX transfer server
    ipc: str | None = None  # the GPU it takes and makes CUDA IPC pulls on (transfer/ipc.py)
    pool: dict | None = None  # store: its shared KV pool (cache/shared_pool.py; "boot": its host)
    reads_pool: bool = False  # prefill: copies prefixes out of a store's shared pool on its host
    last_seen: float = 0.0
    down_reason: str | None = None  # set while marked down by a failed call
    draining: bool = False  # a role change is under way: no new work is placed here
    inflight: int = 0  # requests the router has on this instance now
    prefill: PrefillMeter = field(default_factory=PrefillMeter)  # its prefill queue and rate
    served: int = 0
    failures: int = 0

    def serves(self, role: str) -> bool:
        return self.role == role or self.role == "both"

    def peer(self) -> dict:
        """This instance's entry in the peer table."""
        return {"role": self.role, "pid": self.pid, "address": self.address, "kv_address": list(self.kv_address) if self.kv_address else None,
                "shm": self.shm, "pull": self.pull, "pull_address": self.pull_address, "ipc": self.ipc,
                "pool": self.pool}

    def shares_host_pool(self, store: "WorkerInfo") -> bool:
        """Whether this instance can read `store`'s shared KV pool in place: it reads such pools, and its receive
        pool's host is the store's."""
        return (self.reads_pool and store.pool is not None and self.shm is not None
                and store.pool.get("boot") == self.shm.get("boot"))


class Registry:
    def __init__(self, expected: dict[str, str] | None = None, down_after_s: float = 5.0, now=time.monotonic):
        """expected: instance name -> role of every instance the config lists (None: accept any). A role change
        (begin_flip / end_flip) lets the instance report its new role."""
        self.expected = expected
        self.allowed = {n: {r} for n, r in (expected or {}).items()}  # roles a registration may carry
        self.down_after_s = down_after_s
        self.now = now
        self.workers: dict[str, WorkerInfo] = {}
        # (time, instance, what happened), for logs and tests; the newest MAX_EVENTS
        self.events: collections.deque[tuple[float, str, str]] = collections.deque(maxlen=MAX_EVENTS)
        self._lock = threading.Lock()

    def register(self, msg: dict) -> WorkerInfo:
        """A Register / heartbeat message -> the (new or refreshed) worker. Raises RegistrationError."""
        try:
            name, role, address = str(msg["name"]), str(msg["role"]), str(msg["address"])
            max_len = int(msg["max_model_len"])
        except (KeyError, TypeError, ValueError) as e:
            raise RegistrationError(f"a registration needs name, role, address and max_model_len ({e})") from None
        if role not in ROLES:
            raise RegistrationError(f"{name}: role must be one of {ROLES}, got {role!r}")
        if self.expected is not None:
            if name not in self.expected:
                raise RegistrationError(f"{name!r} is not an instance of this cluster ({sorted(self.expected)})")
            if role not in self.allowed[name]:
                now = sorted(self.allowed[name] - {self.expected[name]})
                raise RegistrationError(f"{name}: the config says role {self.expected[name]!r}"
                                        + (f" (changed to {now[0]!r})" if now else "") + f", the worker {role!r}")
        kv = msg.get("kv_address")
        kv = (str(kv[0]), int(kv[1])) if kv else None
        with self._lock:
            w = self.workers.get(name)
            if w is None or w.address != address or w.pid != msg.get("pid"):
                old = w
                w = WorkerInfo(name, role, address, kv, max_len, msg.get("pid"))
                # a restarted worker: nothing the router had in flight there survives
                self.events.append((self.now(), name, f"{'re-' if old is not None else ''}registered at {address}"))
                self.workers[name] = w
            elif w.down_reason is not None:
                self.events.append((self.now(), name, "up again"))
            w.kv_address, w.max_model_len, w.role = kv, max_len, role
            w.stats = dict(msg.get("stats") or {})
            w.steps = dict(msg.get("steps") or {})
            w.links = dict(msg.get("links") or {})
            w.shm = dict(msg["shm"]) if msg.get("shm") else None
            w.pull, w.pull_address = bool(msg.get("pull")), msg.get("pull_address")
            w.ipc = msg.get("ipc")
            w.pool, w.reads_pool = (dict(msg["pool"]) if msg.get("pool") else None), bool(msg.get("reads_pool"))
            w.last_seen = self.now()
            w.down_reason = None
        return w

    def mark_down(self, name: str, reason: str) -> None:
        with self._lock:
            w = self.workers.get(name)
            if w is not None and w.down_reason is None:
                w.down_reason = reason
                w.failures += 1
                self.events.append((self.now(), name, f"down: {reason}"))

    def begin_flip(self, name: str, role: str) -> WorkerInfo:
        """A role change of `name` starts: no new work is placed there; its heartbeats may carry `role`."""
        with self._lock:
            w = self.workers[name]
            w.draining = True
            self.allowed.setdefault(name, {w.role}).add(role)
            self.events.append((self.now(), name, f"draining: {w.role} -> {role}"))
            return w

    def retire(self, name: str) -> WorkerInfo:
        """`name` is being stopped (a scale-in): no new work is placed there."""
        with self._lock:
            w = self.workers[name]
            w.draining = True
            self.events.append((self.now(), name, "draining: scale-in"))
            return w

    def end_flip(self, name: str, role: str, ok: bool) -> None:
        """The change ended: done (`role` is the only one it may report now) or failed (the worker may have
        switched anyway: both stay allowed); work is placed there again."""
        with self._lock:
            w = self.workers.get(name)
            if ok:
                self.allowed[name] = {role}
                if w is not None:
                    w.role = role
            if w is not None:
                w.draining = False
            self.events.append((self.now(), name, f"now {role}" if ok else f"role change to {role} failed"))

    def is_up(self, w: WorkerInfo) -> bool:
        return w.down_reason is None and self.now() - w.last_seen <= self.down_after_s

    def get(self, name: str) -> WorkerInfo | None:
        with self._lock:
            return self.workers.get(name)

    def all(self) -> list[WorkerInfo]:
        """Every registered worker (a snapshot of the table)."""
        with self._lock:
            return list(self.workers.values())

    def up(self, role: str | None = None, exclude=()) -> list[WorkerInfo]:
        return [w for w in self.all() if self.is_up(w) and (role is None or w.serves(role)) and w.name not in exclude]

    def addresses(self) -> set[str]:
        return {w.address for w in self.all()}

    def peers(self) -> dict[str, dict]:
        """name -> the instance's data-plane entry (WorkerInfo.peer) for every registered instance."""
        return {w.name: w.peer() for w in self.all()}

    def state(self) -> dict:
        """name -> {"role", "up", "draining", "inflight", "served", "failures", "down_reason", "age_s", "steps"}
        (for /health; "steps": where its engine's step time went, as of its last heartbeat: StepTimer.totals)."""
        t = self.now()
        return {w.name: {"role": w.role, "up": self.is_up(w), "draining": w.draining, "inflight": w.inflight,
                         "served": w.served,
                         "failures": w.failures,
                         "down_reason": w.down_reason or (None if self.is_up(w) else "no heartbeat"),
                         "age_s": round(t - w.last_seen, 3), "steps": w.steps} for w in self.all()}
