"""`cache_aware`: the anchors' cache-affine rules, as published, for comparison:
- `rule: sglang` (SGLang's cache-aware router): the instances are imbalanced when the most and least loaded
  differ by more than `balance_abs` requests AND the most loaded carries more than `balance_rel` x the least;
  then the least loaded takes the request. Otherwise the instance with the highest prefix match ratio takes
  it if that ratio exceeds `cache_threshold`, else the one with the most free cache (SGLang: the smallest
  tree).
- `rule: dynamo` (Dynamo's KV router): cost = overlap_weight x prefill blocks + decode blocks, where prefill
  blocks are the request's blocks not already cached there (the overlap credit) plus the prefill blocks
  queued there, and decode blocks the blocks in use; the lowest cost wins.
Both collapse onto one instance when many requests share a hot prefix: its hit outweighs any queue until
the imbalance passes `balance_abs` (SGLang) or the queue outgrows the prefix (Dynamo).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .base import InstanceState, Placement, Snapshot, least_loaded
from .shared import _placement, _prefills


@dataclass(frozen=True)
class CacheAwareParams:
    rule: str = "sglang"  # sglang / dynamo
    cache_threshold: float = 0.5  # sglang: a match ratio above this routes to the holder
    balance_abs: int = 32  # sglang: imbalanced when max - min load > this (requests) ...
    balance_rel: float = 1.5  # ... and max > this x min
    overlap_weight: float = 1.0  # dynamo: weight of the prefill blocks in the cost
    block_tokens: int = 16  # dynamo: tokens per block

    def __post_init__(self):
        if self.rule not in ("sglang", "dynamo"):
            raise ValueError(f"policy.rule: {self.rule!r} is not sglang or dynamo")


class CacheAware:
    name = "cache_aware"

    def __init__(self, params: CacheAwareParams = CacheAwareParams()):
        self.p = params
        self.balanced_picks = self.cache_picks = 0

    def state(self) -> dict[str, float]:
        return {"load_balanced_picks": self.balanced_picks, "cache_picks": self.cache_picks}

    def pick(self, snap: Snapshot, cands: list[InstanceState]) -> tuple[InstanceState, str]:
        p, total = self.p, max(1, snap.request.prompt_tokens)
        if p.rule == "dynamo":
            bt = p.block_tokens

            def cost(i):
                new = math.ceil(max(0, total - i.cached_tokens) / bt) + math.ceil(i.queued_tokens / bt)
                return (p.overlap_weight * new + (i.blocks_total - i.blocks_free), i.name)
            best = min(cands, key=cost)
            self.cache_picks += best.cached_tokens > 0
            return best, f"dynamo cost {cost(best)[0]:.0f} blocks (overlap {best.cached_tokens} tokens)"
        loads = [i.inflight for i in cands]
        hi, lo = max(loads), min(loads)
        if hi - lo > p.balance_abs and hi > p.balance_rel * lo:
            self.balanced_picks += 1
            return min(cands, key=lambda i: (i.inflight, i.name)), f"imbalanced ({hi} vs {lo}): shortest queue"
        best = max(cands, key=lambda i: (i.cached_tokens, -i.inflight, i.name))
        ratio = best.cached_tokens / total
        if ratio > p.cache_threshold:
            self.cache_picks += 1
            return best, f"prefix match {ratio:.0%} > {p.cache_threshold:.0%}"
        return max(cands, key=lambda i: (i.blocks_free, -i.inflight, i.name)), \
            f"best match {ratio:.0%}: the most free cache"

    def place(self, snap: Snapshot) -> Placement:
        d = least_loaded(snap.of("decode"))
        if d is None:
            return Placement(None, None, "colocated", "no decode instance is up")
        ps = _prefills(snap, d.name)
        if not ps:
            return _placement(snap, d, None, "no prefill instance is up: decode prefills")
        pre, why = self.pick(snap, ps)
        return _placement(snap, d, pre, why)


def from_config(s) -> CacheAware:
    """The policy of a config's `policy` section (jaxserve/config.py PolicySection)."""
    return CacheAware(CacheAwareParams(rule=s.rule, cache_threshold=s.cache_threshold, balance_abs=s.balance_abs,
                                       balance_rel=s.balance_rel, overlap_weight=s.overlap_weight))
