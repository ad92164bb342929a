"""Which workers the router knows, whether they are up, and how loaded they are (plain Python, no JAX).

Workers register themselves (the `Register` call, which doubles as their heartbeat, every `heartbeat_s`),
carrying their role, addresses and engine stats. A worker is *up* while it has been heard from within
`down_after_s`; a call to it that fails at the transport level marks it down at once (`mark_down`), and its
next heartbeat brings it back. The router's own count of requests in flight on each instance is the load
signal for dispatch (policy.py), the heartbeat's stats break ties. Concurrency: used from the router's
asyncio loop only (no locks); `now` is injectable for tests.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

ROLES = ("prefill", "decode", "both")


class RegistrationError(ValueError):
    """A registration the router refuses (unknown instance, wrong role or token)."""


@dataclass
class WorkerInfo:
    name: str
    role: str
    address: str  # gRPC control address host:port
    kv_address: tuple[str, int] | None  # KV data server (decode / both)
    max_model_len: int
    pid: int | None = None
    stats: dict = field(default_factory=dict)
    links: dict = field(default_factory=dict)
    last_seen: float = 0.0
    down_reason: str | None = None  # set while marked down by a failed call
    inflight: int = 0  # requests the router has on this instance now
    served: int = 0
    failures: int = 0

    def serves(self, role: str) -> bool:
        return self.role == role or self.role == "both"


class Registry:
    def __init__(self, expected: dict[str, str] | None = None, down_after_s: float = 5.0, now=time.monotonic):
        """expected: instance name -> role of every instance the config lists (None: accept any)."""
        self.expected = expected
        self.down_after_s = down_after_s
        self.now = now
        self.workers: dict[str, WorkerInfo] = {}
        self.events: list[tuple[float, str, str]] = []  # (time, instance, what happened), for logs and tests

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
            if self.expected[name] != role:
                raise RegistrationError(f"{name}: the config says role {self.expected[name]!r}, the worker {role!r}")
        kv = msg.get("kv_address")
        kv = (str(kv[0]), int(kv[1])) if kv else None
        w = self.workers.get(name)
        if w is None or w.address != address or w.pid != msg.get("pid"):
            old = w
            w = WorkerInfo(name, role, address, kv, max_len, msg.get("pid"))
            if old is not None:  # a restarted worker: nothing the router had in flight there survives
                self.events.append((self.now(), name, f"re-registered at {address}"))
            else:
                self.events.append((self.now(), name, f"registered at {address}"))
            self.workers[name] = w
        elif w.down_reason is not None:
            self.events.append((self.now(), name, "up again"))
        w.kv_address, w.max_model_len = kv, max_len
        w.stats = dict(msg.get("stats") or {})
        w.links = dict(msg.get("links") or {})
        w.last_seen = self.now()
        w.down_reason = None
        return w

    def mark_down(self, name: str, reason: str) -> None:
        w = self.workers.get(name)
        if w is not None and w.down_reason is None:
            w.down_reason = reason
            w.failures += 1
            self.events.append((self.now(), name, f"down: {reason}"))

    def is_up(self, w: WorkerInfo) -> bool:
        return w.down_reason is None and self.now() - w.last_seen <= self.down_after_s

    def up(self, role: str | None = None, exclude=()) -> list[WorkerInfo]:
        return [w for w in self.workers.values()
                if self.is_up(w) and (role is None or w.serves(role)) and w.name not in exclude]

    def state(self) -> dict:
        """name -> {"role", "up", "inflight", "served", "failures", "down_reason", "age_s"} (for /health)."""
        t = self.now()
        return {w.name: {"role": w.role, "up": self.is_up(w), "inflight": w.inflight, "served": w.served,
                         "failures": w.failures,
                         "down_reason": w.down_reason or (None if self.is_up(w) else "no heartbeat"),
                         "age_s": round(t - w.last_seen, 3)} for w in self.workers.values()}
