"""A request's state on the router: a `Sub` per sequence (n > 1 fans a request out into n), where it runs now and
what the client has of it; the pipelined load of a cached prefix (`Load`) and the write-back of its prompt to the
global KV store (`Put`) a placement may start; and the ways a placement fails (`Retry`, `Silent`). Plain data,
read and written on the router's asyncio loop (cluster.py).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import grpc

from jaxserve.engine.client import Update

from . import policies
from .policies.base import Placement
from .registry import WorkerInfo
from .snapshot import Topology

# the only status that says the worker is gone (the call never reached it, or its connection broke): a bad
# message is INVALID_ARGUMENT, a handler's bug INTERNAL (worker/rpc.py); those fail the placement, not the worker
DEAD = (grpc.StatusCode.UNAVAILABLE,)


def why(e: BaseException) -> str:
    return f"{e.code().name}: {e.details()}" if isinstance(e, grpc.aio.AioRpcError) else f"{e!r}"


class Retry(Exception):
    """This placement failed in a way another placement may not (the reason is the message)."""


class Silent(Exception):
    """The worker a call waits on stopped heartbeating (hung or partitioned): the call is abandoned."""


# what a call to a worker may raise when it fails: its status, its worker's silence, its stream ending early, an
# answer of the wrong shape
CALL_FAILED = (grpc.aio.AioRpcError, Silent, StopAsyncIteration, KeyError, TypeError, ValueError)


@dataclass(eq=False)
class Load:
    """A cached prefix the router loads from its holder (the global KV store) into a placement's prefill
    instance, started with the placement so that the fetch overlaps the decode reservation (BanaServe's pipelined
    load). Over the transfer layer: the Import stream on the prefill instance reserves the blocks (`reserved`:
    its reservation, None when none was made), the holder's Export sends into them, and the Prefill call names
    the Import (`import_id`), so that the prefill computes over the prefix as it lands; `task` ends once the
    prefix is cached there. From the store's shared pool on the prefill instance's host (`shared`): a Load call
    on the prefill instance, which finds the prefix's blocks in the store's segment and copies them into its
    prefix cache (cache/shared_pool.py) without a call to the store, beside the decode reservation; `task` ends
    once they are cached there (`reserved` is set at once). The Prefill names the Load (`import_id`) and is sent
    without waiting for its answer: p runs it after the copy (its engine thread takes calls in order)."""
    src: str
    dst: str
    tokens: int
    import_id: str  # the Import's id
    reserved: asyncio.Future
    shared: bool = False
    task: asyncio.Future | None = None
    sent: dict | None = None  # Export's transfer numbers (shared: Load's {"kv_bytes", "seconds"})
    seconds: float = 0.0  # from the start to the prefix cached (or the failure)
    error: str | None = None


@dataclass(eq=False)
class Put:
    """The prompt's whole blocks going to the global KV store as the prefill computes them (BanaServe 4.2's
    write-back, layer group by layer group beside decode's KV): an Import on the store, opened with the placement
    beside the decode reservation (`reserved`: its reservation, None when none was made). The Prefill call names
    it when it is reserved by then; else the prompt is put after the prefill (an Export from the prefill
    instance), as it is for a model with request-level state. `task` ends once the store has cached it."""
    store: str
    tokens: int
    import_id: str
    reserved: asyncio.Future
    task: asyncio.Future | None = None


def settle(f: asyncio.Future | None) -> None:
    """Cancel a task still running, or collect its outcome (so none is left unretrieved)."""
    if f is not None:
        if f.done():
            f.cancelled() or f.exception()
        else:
            f.cancel()


def raise_failure(f: asyncio.Future | None) -> None:
    """Raise what the done future f raised (nothing where f is None, not done, cancelled or succeeded)."""
    if f is not None and f.done() and not f.cancelled() and f.exception() is not None:
        raise f.exception()


@dataclass
class Sub:
    """One sequence of a request, and where it runs now."""
    rid: str
    index: int
    prompt: list[int]
    params: dict  # SamplingParams fields (JSON)
    kv_tokens: int
    attempts: int = 0  # placements opened
    serial: int = 0  # numbers the placement ids
    xid: str = ""  # the id of the current placement on the workers
    method: str = ""  # "Decode" (disaggregated) or "Generate" (whole request on one instance)
    worker: WorkerInfo | None = None
    call: object = None  # the open stream
    feed: object = None  # an asyncio.Queue of what comes next: the call's messages and its running updates
    pump: object = None  # the task reading the call into the feed
    stream: object = None  # the worker's Updates stream (router/updates.py) its running updates come on, if any
    reserved: dict | None = None
    prefill: str | None = None
    prefilling: str | None = None  # the prefill instance whose Prefill call for it is running now
    kv_bytes: int = 0
    kv_backend: str | None = None
    avoid: set = field(default_factory=set)  # instances that failed this request
    avoid_prefill: set = field(default_factory=set)
    placement: Placement | None = None  # the policy's latest answer
    moved: dict | None = None  # the cached prefix moved to its prefill instance: {"src", "tokens", "kv_bytes", ...}
    load: Load | None = None  # the placement's pipelined load of a cached prefix
    put: Put | None = None  # the placement's write-back of the prompt to the store, until the Prefill names it
    ttft_s: float | None = None
    arrival: float = 0.0  # time.monotonic() when the request came
    placed_s: float | None = None  # from the arrival to the placement's stream opened (Decode: its reservation)
    prefill_ttft_s: float | None = None  # the prefill engine's own TTFT (its arrival there to its first token)
    errors: list = field(default_factory=list)
    pre: asyncio.Future | None = None  # a Prefill call started beside the Decode call (early), until _drive takes it
    bound: asyncio.Future | None = None  # that call's reservation, once decode made it
    firsts: list = field(default_factory=list)  # its first token, held until the reservation came and _drive relays
    on_first: object = None  # _drive's relay, once it runs
    sent: Update | None = None  # the last update relayed to the client (or held: final_only); cumulative
    final_only: bool = False  # the client takes only the finished update (a request that does not stream)

    def first(self, u: Update) -> None:
        """A Prefill call's first token: relayed, or held until the placement's stream is read (early prefill)."""
        if self.on_first is not None:
            self.on_first(u)
        else:
            self.firsts.append(u)

    @property
    def output(self) -> list[int]:
        """Tokens the client already has (or will, final_only): a placement after a failure resumes from them."""
        return list(self.sent.token_ids) if self.sent is not None else []

    def kv(self) -> int:
        """Tokens whose KV prefill sends: the prompt (but its last token with transfer.leave_last_token), or, when
        resuming, the prompt and the output but its last token (decode computes that one and samples on)."""
        n = len(self.sent.token_ids) if self.sent is not None else 0
        return len(self.prompt) + n - 1 if n else self.kv_tokens

    def resume(self) -> dict:
        """The placement message's fields that resume the request (worker/main.py: "output", "logprobs")."""
        return {"output": self.output, "logprobs": list(self.sent.logprobs)} if self.output else {}

    def route(self, topo: Topology) -> dict:
        """Where it ran: `colocated` (whole on one instance), `pd` (prefill and decode in one cluster, or a
        PD cluster's own prefill) or `prfaas` (prefill in a PrfaaS cluster, KV over the inter-cluster link)."""
        name = self.worker.name if self.worker else None
        pre = self.prefill or name
        route = "colocated"
        if self.prefill is not None and name is not None:
            route = policies.route_of(topo.kind(pre), topo.cluster(pre), topo.cluster(name))
        pl = self.placement
        return {"route": route, "prefill_instance": pre, "decode_instance": name,
                "prefill_cluster": topo.cluster(pre) if pre else None,
                "decode_cluster": topo.cluster(name) if name else None,
                # a prefix move that failed leaves the prefill with its own cache only
                "prefix_source": None if pl is None else self.moved["src"] if self.moved
                else pl.prefix_source if pl.move_prefix is None else None,
                "prefix_move": self.moved,
                "kv_bytes_transferred": self.kv_bytes, "kv_backend": self.kv_backend, "attempts": self.attempts,
                "placed_s": None if self.placed_s is None else round(self.placed_s, 6),
                "prefill_ttft_s": None if self.prefill_ttft_s is None else round(self.prefill_ttft_s, 6)}
