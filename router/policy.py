"""Dispatch within a PD cluster: which prefill and which decode instance serve a request (plain Python).

`least_loaded` is the load-aware rule (BanaServe's dispatch with no prefix affinity): the instance with the
fewest requests the router has in flight there, then the fewest waiting and running requests it last
reported, then the most free cache blocks; the name breaks exact ties, so the choice is deterministic.
"""

from __future__ import annotations

from .registry import WorkerInfo


def load_key(w: WorkerInfo) -> tuple:
    s = w.stats
    return (w.inflight, s.get("waiting", 0) + s.get("running", 0), -s.get("blocks_free", 0), w.name)


def least_loaded(candidates: list[WorkerInfo]) -> WorkerInfo | None:
    return min(candidates, key=load_key, default=None)
