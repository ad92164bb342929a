"""Socket settings every KV connection gets: timeouts, TCP keepalive, and the limits on what a peer that has
not yet authenticated may cost (plain Python).

A KV connection must never wait forever: on a silent partition (no reset: a blackholed route, a peer that is
stopped) reads and writes fail after `io_s`, the kernel gives up on unacknowledged data after `io_s`
(TCP_USER_TIMEOUT) and probes an idle connection after `keepalive_s` (SO_KEEPALIVE), and a connection that has
carried nothing for `idle_s` is closed by the receiver (the sender reconnects when it next sends). An accepted
connection must present the cluster token within `hello_s`, in a HELLO of at most `hello_max_bytes`; at most
`max_unauthenticated` connections may be waiting to do so and at most `max_connections` be open at all, more
are closed at once.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass


@dataclass(frozen=True)
class Timeouts:
    io_s: float = 10.0  # one read or write of a frame's piece; also TCP_USER_TIMEOUT
    ack_s: float = 30.0  # a sent frame not acknowledged within this: its connection is presumed dead
    idle_s: float = 300.0  # the receiver closes a connection with no frame for this long
    hello_s: float = 5.0  # an accepted connection must authenticate within this
    keepalive_s: float = 10.0  # idle time before the kernel's first keepalive probe
    connect_s: float = 5.0  # a sender gives up reaching a receiver after this
    hello_max_bytes: int = 4096
    max_unauthenticated: int = 32
    max_connections: int = 512

    def __post_init__(self):
        for name in ("io_s", "ack_s", "idle_s", "hello_s", "keepalive_s", "connect_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"Timeouts.{name} must be > 0, got {getattr(self, name)}")
        for name in ("hello_max_bytes", "max_unauthenticated", "max_connections"):
            if getattr(self, name) < 1:
                raise ValueError(f"Timeouts.{name} must be >= 1, got {getattr(self, name)}")


def tune(sock: socket.socket, t: Timeouts) -> None:
    """No delay for the small control frames; keepalive probes; the kernel's bound on unacknowledged data; a
    timeout on every blocking call. Socket buffer sizes are left to the kernel's autotuning: fixed 4 MiB
    buffers measured about 10% slower on loopback (bench/transfer.py (a))."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for opt, value in (("TCP_KEEPIDLE", max(int(t.keepalive_s), 1)), ("TCP_KEEPINTVL", max(int(t.keepalive_s / 3), 1)),
                       ("TCP_KEEPCNT", 3), ("TCP_USER_TIMEOUT", int(t.io_s * 1000))):
        if hasattr(socket, opt):  # Linux; elsewhere the socket timeout alone bounds each call
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, opt), value)
    sock.settimeout(t.io_s)
