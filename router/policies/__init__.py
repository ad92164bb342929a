"""Placement policies: where a request's prefill and decode run (plain Python, no I/O), one module per policy.

A policy sees an immutable `Snapshot` (the request's length, every instance it may use with its role,
cluster, load, free blocks and the prefix index's answer for this request, the inter-cluster links with
capacity and live utilisation, the time) and returns a `Placement` (the decode instance, the prefill
instance or none, a cached prefix to move between clusters, the route, and why). It reads nothing else and
does no I/O, so the live router (cluster.py, snapshots from snapshot.py) and a simulator (router/sim) run the
same objects. A policy may keep state that the snapshots drive (the prfaas threshold controller, flowkv's
windows); given the same sequence of snapshots it places the same way. `make(cfg.policy)` builds the one
`policy.name` selects, from `REGISTRY` (each module's `from_config`).

- `least_loaded.py`: decode and prefill on the least loaded instances (the default);
- `prfaas.py`: selective offload of long uncached prefills to a PrfaaS cluster over the inter-cluster link;
- `round_robin.py`: instances in turn;
- `cache_aware.py`: SGLang's and Dynamo's cache-affine rules, as published;
- `banaserve.py`: BanaServe's load-aware dispatch with a global KV store;
- `flowkv.py`: FlowKV's load scores, scenarios and role changes.
`base.py` holds what they all see and answer, `shared.py` what the load-balancing ones share. Modules import
base and shared only, never one another nor this package.

Load, everywhere: requests the router has in flight on the instance, then its reported waiting + running,
then the most free blocks; the name breaks exact ties, so placements are deterministic.
"""

from __future__ import annotations

from . import banaserve, cache_aware, flowkv, least_loaded, prfaas, round_robin
from .base import (ROUTES, InstanceState, LinkState, Placement, Policy, PrefixMove, RequestInfo, Snapshot, affine,
                   route_of)

# policy.name -> its module's from_config(policy section)
REGISTRY = {"least_loaded": least_loaded.from_config, "prfaas": prfaas.from_config,
            "round_robin": round_robin.from_config, "cache_aware": cache_aware.from_config,
            "banaserve": banaserve.from_config, "flowkv": flowkv.from_config}
POLICIES = tuple(REGISTRY)

__all__ = ["ROUTES", "InstanceState", "LinkState", "Placement", "Policy", "PrefixMove", "RequestInfo", "Snapshot",
           "affine", "route_of", "REGISTRY", "POLICIES", "make"]


def make(section) -> Policy:
    """The policy a config's `policy` section names (jaxserve/config.py PolicySection)."""
    if section.name not in REGISTRY:
        raise ValueError(f"policy.name: unknown policy {section.name!r} (one of {sorted(POLICIES)})")
    return REGISTRY[section.name](section)
