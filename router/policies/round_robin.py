"""`round_robin`: prefill and decode instances in turn (the baseline with no information at all).
"""

from __future__ import annotations

from .base import Placement, Snapshot
from .shared import _placement, _prefills


class RoundRobin:
    name = "round_robin"

    def __init__(self):
        self._p = self._d = 0

    def state(self) -> dict[str, float]:
        return {}

    def place(self, snap: Snapshot) -> Placement:
        ds = sorted(snap.of("decode"), key=lambda i: i.name)
        if not ds:
            return Placement(None, None, "colocated", "no decode instance is up")
        d = ds[self._d % len(ds)]
        self._d += 1
        ps = sorted(_prefills(snap, d.name), key=lambda i: i.name)
        if not ps:
            return _placement(snap, d, None, "no prefill instance is up: decode prefills")
        p = ps[self._p % len(ps)]
        self._p += 1
        return _placement(snap, d, p, "in turn")


def from_config(s) -> RoundRobin:
    """The policy of a config's `policy` section (jaxserve/config.py PolicySection)."""
    return RoundRobin()
