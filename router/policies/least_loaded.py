"""`least_loaded` (BanaServe's dispatch with no prefix affinity): decode on the least loaded decode instance,
prefill on the least loaded prefill instance of any cluster.
"""

from __future__ import annotations

from .base import Placement, Snapshot, least_loaded, _route


class LeastLoaded:
    name = "least_loaded"

    def state(self) -> dict[str, float]:
        return {}

    def place(self, snap: Snapshot) -> Placement:
        d = least_loaded(snap.of("decode"))
        if d is None:
            return Placement(None, None, "colocated", "no decode instance is up")
        p = least_loaded([i for i in snap.of("prefill") if i.name != d.name])
        if p is None:
            return Placement(d.name, None, "colocated", "no prefill instance is up: decode prefills")
        return Placement(d.name, p.name, _route(p, d), "least loaded prefill and decode instances",
                         uncached_tokens=snap.request.prompt_tokens - p.cached_tokens)


def from_config(s) -> LeastLoaded:
    """The policy of a config's `policy` section (jaxserve/config.py PolicySection)."""
    return LeastLoaded()
