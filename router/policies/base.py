"""What every placement policy sees and answers (plain Python, no I/O): the `Snapshot` of the instances and
links a request may use, the `Placement` a policy returns, the `Policy` protocol, and the load order and routes
they all share (router/policies/__init__.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol



ROUTES = ("colocated", "pd", "prfaas")


@dataclass(frozen=True)
class InstanceState:
    name: str
    role: str  # prefill / decode / both
    cluster: str
    kind: str  # the cluster's kind: pd / prfaas
    inflight: int = 0  # requests the router has on it now
    waiting: int = 0  # its last reported queue
    running: int = 0
    blocks_free: int = 0
    blocks_total: int = 0
    cached_tokens: int = 0  # the prefix index's answer: prompt tokens whose KV this instance holds
    queued_tokens: int = 0  # uncached tokens of the prefills the router has on it, not yet computed
    prefill_tokens_s: float | None = None  # its measured prefill rate (None: not measured yet)
    busy: float = 0.0  # fraction of recent time its engine spent computing (heartbeat)
    swapped: int = 0  # requests preempted and waiting to run again
    sending: int = 0  # KV transfers queued on it, not yet on the wire

    def prefill_wait(self, tokens: int) -> float | None:
        """Seconds until a prefill of `tokens` more would be computed here: its queue and them at its measured
        rate (None before a rate is measured)."""
        return None if not self.prefill_tokens_s else (self.queued_tokens + tokens) / self.prefill_tokens_s

    def serves(self, role: str) -> bool:
        return self.role == role or self.role == "both"

    @property
    def load(self) -> tuple:
        return (self.inflight, self.waiting + self.running, -self.blocks_free, self.name)


@dataclass(frozen=True)
class LinkState:
    """KV traffic from cluster `src`'s prefill instances to cluster `dst`'s decode instances."""
    src: str
    dst: str
    capacity_bytes_s: float | None  # None: not shaped (no configured bandwidth)
    egress_bytes_s: float = 0.0  # recent throughput, summed over the instances sending on it
    pending_bytes: int = 0  # sent and not yet acknowledged
    queued_frames: int = 0
    queued_bytes: int = 0  # waiting in the senders' queues, not yet on the wire
    retransmits: int = 0  # TCP retransmits so far (TCP_INFO)

    @property
    def utilisation(self) -> float:
        if not self.capacity_bytes_s:
            return 0.0
        return self.egress_bytes_s / self.capacity_bytes_s


@dataclass(frozen=True)
class RequestInfo:
    prompt_tokens: int
    kv_tokens: int  # tokens whose KV prefill hands over


@dataclass(frozen=True)
class Snapshot:
    request: RequestInfo
    instances: tuple[InstanceState, ...]  # up, and not excluded for this request
    links: tuple[LinkState, ...] = ()
    now: float = 0.0  # seconds (monotonic), for policies that follow the links over time
    kv_bytes_per_token: float | None = None  # KV bytes a transfer sends per token, as measured (None: not yet)
    store_tokens: int = 0  # prompt tokens whose KV the global KV store holds (router/policies/banaserve.py)
    store: str | None = None  # the store instance (a prefix it holds moves from there: PrefixMove)

    def of(self, role: str, kind: str | None = None, cluster: str | None = None) -> list[InstanceState]:
        return [i for i in self.instances if i.serves(role) and (kind is None or i.kind == kind)
                and (cluster is None or i.cluster == cluster)]

    def link(self, src: str, dst: str) -> LinkState | None:
        return next((lk for lk in self.links if lk.src == src and lk.dst == dst), None)


@dataclass(frozen=True)
class PrefixMove:
    """Cached prefix KV to copy from `src` (an instance of another cluster, or the global KV store) into the
    prefill instance. overlap: the prefill runs over the prefix as it lands, layer group by layer group
    (BanaServe's pipelined load: for a source whose fetch keeps up with compute; the prefill instance's engine
    waits on it meanwhile); else it is loaded first and the prefill starts once it is cached."""
    src: str
    tokens: int
    overlap: bool = False


@dataclass(frozen=True)
class Placement:
    decode: str | None  # None: no decode instance can take it
    prefill: str | None  # None: the decode instance prefills itself
    route: str  # colocated / pd / prfaas
    reason: str
    move_prefix: PrefixMove | None = None
    uncached_tokens: int | None = None  # prompt tokens the prefill computes
    prefix_source: str | None = None  # the instance whose cached prefix the prefill uses
    details: dict = field(default_factory=dict, compare=False)  # numbers behind the choice (logs, metrics)


class Policy(Protocol):
    name: str

    def place(self, snap: Snapshot) -> Placement: ...

    def state(self) -> dict[str, float]:
        """Numbers the policy keeps between placements (/metrics publishes them as jaxserve_policy_<key>)."""


def least_loaded(candidates: list[InstanceState]) -> InstanceState | None:
    return min(candidates, key=lambda i: i.load, default=None)


def affine(candidates: list[InstanceState], slack: int) -> InstanceState | None:
    """The instance holding the longest prefix of the request, unless it has more than `slack` requests in
    flight beyond the least loaded candidate (a hot cache must not draw every request): then the least loaded."""
    if not candidates:
        return None
    low = least_loaded(candidates)
    best = min(candidates, key=lambda i: (-i.cached_tokens,) + i.load)
    if best.cached_tokens > low.cached_tokens and best.inflight - low.inflight <= slack:
        return best
    return low


def route_of(prefill_kind: str, prefill_cluster: str, decode_cluster: str) -> str:
    """The route of a prefill and a decode on different instances: `prfaas` when the prefill ran in a PrfaaS
    cluster and the KV crossed to another cluster, else `pd` (one instance doing both is `colocated`)."""
    return "prfaas" if prefill_kind == "prfaas" and prefill_cluster != decode_cluster else "pd"


def _route(prefill: InstanceState, decode: InstanceState) -> str:
    return route_of(prefill.kind, prefill.cluster, decode.cluster)
