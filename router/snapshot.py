"""The router's view of its cluster, frozen into a policy `Snapshot` (policies/base.py) for one request.

Instances come from the registry (registry.py: those up and not excluded for the request), with their
cluster and its kind from the config, the router's own counts (requests in flight, uncached prefill tokens
queued) and measured prefill rate, and the last heartbeat's stats; the prefix index's answer for the request
fills `cached_tokens`. Links are the configured inter-cluster links, each with the live traffic its prefill
instances last reported (transfer/link.py snapshots, labelled with the clusters they join), summed over the
instances sending on it. Plain Python.
"""

from __future__ import annotations

from jaxserve.config import Config

from .policies.base import InstanceState, LinkState, RequestInfo, Snapshot
from .registry import WorkerInfo


def instance_state(w: WorkerInfo, cluster: str, kind: str, cached: int = 0) -> InstanceState:
    s = w.stats
    sending = sum(int(v.get("queue_depth") or 0) for v in w.links.values())
    return InstanceState(w.name, w.role, cluster, kind, w.inflight, int(s.get("waiting", 0)),
                         int(s.get("running", 0)), int(s.get("blocks_free", 0)), int(s.get("blocks_total", 0)),
                         cached, w.prefill.queued_tokens, w.prefill.tokens_s, float(s.get("busy", 0.0)),
                         int(s.get("swapped", 0)), sending)


def link_states(cfg: Config, workers: list[WorkerInfo], bandwidth: dict | None = None) -> tuple[LinkState, ...]:
    """Every configured link between two clusters, with the traffic its senders reported; bandwidth: (src, dst)
    -> Gbit/s set at run time, over the config's."""
    out = []
    for lk in cfg.links:
        if lk.src == lk.dst:
            continue
        snaps = [v for w in workers for v in w.links.values() if v.get("src") == lk.src and v.get("dst") == lk.dst]
        gbps = (bandwidth or {}).get((lk.src, lk.dst), lk.bandwidth_gbps)
        out.append(LinkState(lk.src, lk.dst, gbps * 1e9 / 8,
                             sum(float(v.get("throughput_bytes_s") or 0) for v in snaps),
                             sum(int(v.get("in_flight_bytes") or 0) for v in snaps),
                             sum(int(v.get("queue_depth") or 0) for v in snaps),
                             sum(int(v.get("queued_bytes") or 0) for v in snaps),
                             sum(int(v.get("tcp_retransmits") or 0) for v in snaps)))
    return tuple(out)


class Topology:
    """Instance -> (cluster, kind), from the config; links' bandwidth as configured or as set at run time."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.where = {i.name: (c.name, c.kind) for c in cfg.clusters for i in c.instances}
        self.bandwidth: dict[tuple[str, str], float] = {}  # (src, dst) -> Gbit/s set at run time (admin)

    def cluster(self, name: str) -> str:
        return self.where[name][0]

    def kind(self, name: str) -> str:
        return self.where[name][1]

    def snapshot(self, workers: list[WorkerInfo], every: list[WorkerInfo], prompt_tokens: int, kv_tokens: int,
                 cached: dict[str, int] | None = None, now: float = 0.0,
                 kv_bytes_per_token: float | None = None, store: str | None = None,
                 store_tokens: int = 0) -> Snapshot:
        """workers: the instances the request may use; every: all registered (their link reports);
        cached: instance -> prompt tokens whose KV it holds (the prefix index's answer); store: the global KV
        store instance up (None: none) and the prompt tokens it holds."""
        cached = cached or {}
        insts = tuple(instance_state(w, *self.where[w.name], cached.get(w.name, 0)) for w in workers)
        return Snapshot(RequestInfo(prompt_tokens, kv_tokens), insts, link_states(self.cfg, every, self.bandwidth),
                        now, kv_bytes_per_token, store_tokens, store)
