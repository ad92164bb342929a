"""One request as the scheduler sees it: tokens, cache blocks, decode slot, progress, outcome."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from ..sampling import SamplingParams


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
    detok: object = None  # engine/detokenizer.py Detokenizer
    awaiting_kv: bool = False  # decode side of a disaggregated request: blocks reserved, KV not yet arrived
    handoff: object = None  # prefill side: disagg.prefill_side.Handoff, sends the KV instead of decoding here
    decode_snapshot: int | None = None  # this decode step also saves its request-level state in this row
    snapshot_hash: bytes | None = None  # the chain hash the row it saved during decode is keyed by
    hashes: list[bytes] = field(default_factory=list)  # chain hashes of its full blocks computed so far
    migration: object = None  # engine.migration.Outbound while part of its decode runs on a helper instance
    kv_partial: bool = False  # layers of its KV in the pool miss the tokens decoded while they ran on a helper
    migrations: list[dict] = field(default_factory=list)  # the migrations it went through: kind, src, dst
    incoming: object = None  # disagg.decode_side.IncomingPrefix: its cached prefix, still arriving
    guide: object = None  # structured.Guide: the grammar its output follows (structured outputs)

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
