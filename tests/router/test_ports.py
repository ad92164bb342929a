"""router/launcher.free_ports: the ports every local server of the project (and every test's) is given."""

import random
import socket

from jaxserve.router import launcher
from jaxserve.router.launcher import free_ports


def test_ports_are_free_consecutive_and_below_the_ephemeral_range():
    low = launcher._ephemeral_low()
    for n in (1, 2, 3):
        p = free_ports(n=n)
        assert 10000 <= p and p + n - 1 < low, (p, n, low)  # outgoing connections never take them
        socks = [socket.socket() for _ in range(n)]
        try:
            for k, s in enumerate(socks):
                s.bind(("127.0.0.1", p + k))
        finally:
            for s in socks:
                s.close()


def test_a_taken_port_is_passed_over(monkeypatch):
    with socket.create_server(("127.0.0.1", free_ports())) as taken:
        q = taken.getsockname()[1]
        draws = iter([q, q - 1, q + 7])  # q taken; q - 1 free but q - 1 + 1 = q is taken for a pair
        monkeypatch.setattr(random.SystemRandom, "randrange", lambda self, lo, hi: next(draws))
        assert free_ports(n=2) == q + 7
