"""One request as the scheduler sees it: tokens, cache blocks, decode slot, progress, outcome; and its KV crossing
instances (`Transfer`: the engine's side of disaggregation, engine/connector.py)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..structured import Guide
    from .detokenizer import Detokenizer
    from .migration import Outbound
    from .rows import Prefix


class Outgoing(Protocol):
    """Where a request's KV goes instead of decoding here (disagg.prefill_side.Handoff); `connector`: the engine's
    KVConnector (engine/connector.py), all of the engine it is given."""
    ends: bool  # the first token ends the request (set by KVConnector.hand_off)

    @property
    def begun(self) -> bool: ...
    def groups(self, connector) -> list[tuple[int, int]] | None: ...
    def begin(self, connector, seq: Sequence) -> None: ...
    def export(self, k: int) -> None: ...
    def finish(self, prefix: Prefix) -> None: ...
    def abort(self, reason: str) -> None: ...


class Incoming(Protocol):
    """A cached prefix arriving for a request, which its prefill computes over as it lands
    (disagg.decode_side.IncomingPrefix); `connector` as Outgoing's."""
    tokens: list[int]
    blocks: list[int]
    skip: int
    groups: list[tuple[int, int]] | None
    error: str | None

    @property
    def pending(self) -> bool: ...
    @property
    def started(self) -> bool: ...
    @property
    def landed(self) -> bool: ...
    def take(self, connector, hi: int, row: int) -> bool: ...


@dataclass(eq=False)
class Transfer:
    """A request's KV crossing instances (`Sequence.transfer`; engine/connector.py runs it)."""
    out: Outgoing | None = None  # prefill side: where its KV goes instead of decoding here
    into: Incoming | None = None  # its cached prefix, still arriving from another instance


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt: list[int]
    params: SamplingParams
    arrival: float = field(default_factory=time.monotonic)
    output: list[int] = field(default_factory=list)
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose KV / state is in the cache
    num_cached: int = 0  # prompt tokens reused from the prefix cache at the last admission
    prefill_target: int = 0  # tokens to prefill at this admission (prompt, or prompt + output after preemption)
    block_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    state_src: int | None = None  # snapshot row to restore request-level state from on the first chunk
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    error: str | None = None
    logprobs: list = field(default_factory=list)  # per output token: (logprob, [(token, logprob), ...])
    first_token_time: float | None = None
    finish_time: float | None = None
    num_preemptions: int = 0
    detok: Detokenizer | None = None
    awaiting_kv: bool = False  # decode side of a disaggregated request: blocks reserved, KV not yet arrived
    transfer: Transfer = field(default_factory=Transfer)  # its KV crossing instances
    decode_snapshot: int | None = None  # this decode step also saves its request-level state in this row
    snapshot_hash: bytes | None = None  # the chain hash the row it saved during decode is keyed by
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full blocks computed so far
    migration: Outbound | None = None  # while part of its decode runs on a helper instance
    kv_partial: bool = False  # layers of its KV in the pool miss the tokens decoded while they ran on a helper
    migrations: list[dict] = field(default_factory=list)  # the migrations it went through: kind, src, dst
    guide: Guide | None = None  # the grammar its output follows (structured outputs)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    @property
    def is_prefilling(self) -> bool:
        return self.num_computed < self.prefill_target

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED
