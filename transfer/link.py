"""Link emulation (bandwidth, latency, loss) and the congestion signals a link publishes.

`LinkEmulation` models a slower or lossier link than loopback so that a "cross-datacenter" path can be
exercised on one machine: a token bucket shared by the link's connections caps its bandwidth, each frame is
held back `latency_ms` after it is queued (a delay line: frames stay pipelined), and with probability `loss`
a frame goes out with a wrong checksum, so the receiver refuses it and it is sent again (what loss costs an
application above TCP: a resend and its time).

`LinkMetrics` counts what the router's bandwidth-aware policy and `/metrics` read: bytes and frames sent,
throughput over a sliding window, utilisation of the configured bandwidth, send-queue depth, bytes in flight,
application resends, and the kernel's own TCP retransmits and RTT read with getsockopt(TCP_INFO).
Thread-safe (locks); used by the TCP backend's writer threads.
"""

from __future__ import annotations

import collections
import random
import socket
import struct
import threading
import time
from dataclasses import dataclass


@dataclass(frozen=True)
class LinkEmulation:
    bandwidth_gbps: float | None = None  # None: unlimited
    latency_ms: float = 0.0
    loss: float = 0.0
    seed: int = 0

    def __post_init__(self):
        if self.bandwidth_gbps is not None and self.bandwidth_gbps <= 0:
            raise ValueError(f"bandwidth_gbps must be > 0, got {self.bandwidth_gbps}")
        if self.latency_ms < 0 or not 0 <= self.loss < 1:
            raise ValueError(f"latency_ms must be >= 0 and loss in [0, 1): {self.latency_ms}, {self.loss}")

    @property
    def bytes_per_s(self) -> float | None:
        return None if self.bandwidth_gbps is None else self.bandwidth_gbps * 1e9 / 8


class TokenBucket:
    """Bytes may leave at `rate` per second with bursts of up to `burst` bytes."""

    def __init__(self, rate: float, burst: float):
        self.rate, self.burst = rate, burst
        self.tokens = burst
        self.t = time.monotonic()
        self._lock = threading.Lock()

    def set_rate(self, rate: float, burst: float) -> None:
        with self._lock:
            now = time.monotonic()
            self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
            self.t, self.rate, self.burst = now, rate, burst
            self.tokens = min(self.tokens, burst)

    def consume(self, n: int) -> None:
        """Take n bytes' worth of tokens, waiting for the bucket to refill when it is short."""
        while True:
            with self._lock:
                now = time.monotonic()
                self.tokens = min(self.burst, self.tokens + (now - self.t) * self.rate)
                self.t = now
                if self.tokens >= min(n, self.burst):
                    self.tokens -= n  # may go negative for n > burst: later senders wait it off
                    return
                wait = (min(n, self.burst) - self.tokens) / self.rate
            time.sleep(wait)


class Shaper:
    """A link's emulation state: its bucket, its loss draw."""

    PIECE = 1 << 20  # bytes per token-bucket draw, so several connections interleave fairly

    def __init__(self, emu: LinkEmulation | None):
        self.emu = emu or LinkEmulation()
        rate = self.emu.bytes_per_s
        self.bucket = TokenBucket(rate, max(self.PIECE, rate * 0.005)) if rate else None
        self._rng = random.Random(self.emu.seed)
        self._lock = threading.Lock()

    def set_bandwidth(self, gbps: float | None) -> None:
        """Change the emulated bandwidth at run time (None: unshaped); frames already drawn keep their pace."""
        self.emu = LinkEmulation(gbps, self.emu.latency_ms, self.emu.loss, self.emu.seed)
        rate = self.emu.bytes_per_s
        if rate is None:
            self.bucket = None
        elif self.bucket is None:
            self.bucket = TokenBucket(rate, max(self.PIECE, rate * 0.005))
        else:
            self.bucket.set_rate(rate, max(self.PIECE, rate * 0.005))

    def lose(self) -> bool:
        if not self.emu.loss:
            return False
        with self._lock:
            return self._rng.random() < self.emu.loss

    def send(self, sock: socket.socket, data) -> None:
        if self.bucket is None:
            sock.sendall(data)
            return
        view = memoryview(data).cast("B")
        for i in range(0, len(view), self.PIECE):
            piece = view[i:i + self.PIECE]
            self.bucket.consume(len(piece))
            sock.sendall(piece)


_TCP_INFO = struct.Struct("<8B24I")


def tcp_info(sock: socket.socket) -> dict | None:
    """Kernel TCP statistics of a connected socket (Linux), or None where TCP_INFO is unavailable."""
    if not hasattr(socket, "TCP_INFO"):
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, _TCP_INFO.size)
    except OSError:
        return None
    if len(raw) < _TCP_INFO.size:
        return None
    v = _TCP_INFO.unpack(raw)
    u = v[8:]
    return {"retransmits_total": u[23], "lost": u[6], "rtt_us": u[15], "snd_cwnd": u[18], "unacked": u[4]}


class LinkMetrics:
    WINDOW_S = 2.0

    def __init__(self, name: str, bandwidth_bytes_s: float | None):
        self.name, self.bandwidth = name, bandwidth_bytes_s
        self.labels: dict = {}  # set by the owner (a worker: the clusters the link joins), copied into snapshots
        self.bytes_sent = 0
        self.frames_sent = 0
        self.resends = 0
        self.queue_depth = 0  # frames queued, not yet on the wire
        self.queued_bytes = 0  # their payload bytes
        self.in_flight = 0  # payload bytes sent, not yet acknowledged
        self._recent: collections.deque[tuple[float, int]] = collections.deque()
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._tcp_retrans_closed = 0

    def sent(self, nbytes: int) -> None:
        now = time.monotonic()
        with self._lock:
            self.bytes_sent += nbytes
            self.frames_sent += 1
            self._recent.append((now, nbytes))
            while self._recent and self._recent[0][0] < now - self.WINDOW_S:
                self._recent.popleft()

    def queued(self, frames: int, nbytes: int) -> None:
        """Frames (and their payload bytes) entering (+) or leaving (-) the send queue."""
        with self._lock:
            self.queue_depth += frames
            self.queued_bytes += nbytes

    def add(self, field: str, delta: int) -> None:
        with self._lock:
            setattr(self, field, getattr(self, field) + delta)

    def track(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.append(sock)

    def untrack(self, sock: socket.socket) -> None:
        info = tcp_info(sock)
        with self._lock:
            if sock in self._sockets:
                self._sockets.remove(sock)
                self._tcp_retrans_closed += info["retransmits_total"] if info else 0

    def throughput(self) -> float:
        """Bytes per second over the last WINDOW_S seconds."""
        now = time.monotonic()
        with self._lock:
            recent = [(t, n) for t, n in self._recent if t >= now - self.WINDOW_S]
        if not recent:
            return 0.0
        return sum(n for _, n in recent) / self.WINDOW_S

    def snapshot(self) -> dict:
        with self._lock:
            socks = list(self._sockets)
            base = {**self.labels, "link": self.name, "bytes_sent": self.bytes_sent, "frames_sent": self.frames_sent,
                    "resends": self.resends, "queue_depth": self.queue_depth, "queued_bytes": self.queued_bytes,
                    "in_flight_bytes": self.in_flight}
            retrans = self._tcp_retrans_closed
        infos = [i for i in (tcp_info(s) for s in socks) if i is not None]
        thr = self.throughput()
        base.update({
            "throughput_bytes_s": thr,
            "utilisation": (thr / self.bandwidth) if self.bandwidth else None,
            "bandwidth_bytes_s": self.bandwidth,
            "tcp_retransmits": retrans + sum(i["retransmits_total"] for i in infos),
            "rtt_us": max((i["rtt_us"] for i in infos), default=None),
            "connections": len(socks),
        })
        return base
