"""Continuous-batching scheduler: admission, chunked prefill, decode slots, preemption by recompute.

Each engine step runs one prefill program (chunks of several requests, padded to a bucket) and one
decode program (every running request that finished its prefill, one token each). `schedule()` plans a
step; `complete_prefill()` / `complete_decode()` apply its results.

- Decode first: every decoding request needs room for one more token. When the pool is out of blocks the
  most recently admitted request is preempted: its blocks and slot are released and it goes back to the
  front of the queue to be recomputed (prompt + tokens generated so far) later, instead of crashing.
- Prefill under a token budget (`max_num_batched_tokens`; `mixed_batched_tokens` in a step that also
  decodes, so a long prompt's prefill delays the running requests' next tokens by at most that much work) and
  at most `chunk_size` tokens per request per step: partially prefilled requests continue first, then waiting
  requests are admitted in arrival order while a decode slot and blocks for the whole prompt are available.
  A request's prefix cache hit is taken at admission.
- Disaggregated decode: `reserve()` admits a request whose KV another instance computes (decode reserves
  cache first). It holds its slot and blocks but is skipped by planning and never preempted until
  `kv_arrived()`; the transfer writes into those blocks meanwhile.
- A prefix still arriving from another instance (`Sequence.transfer.into`, the global KV store's pipelined load)
  is taken as cached at admission, in the blocks its transfer fills, unless this instance's own cache holds as
  much. Its request is admitted once the prefix's first layer group has landed (requests behind it go first
  meanwhile); the engine waits for the later groups as the first chunk runs.
- Chunk ends fall on block boundaries (except a prompt's final chunk), and for models with request-level
  state the prompt is cut at its last block boundary, so the state can be snapshotted where a later
  request can reuse it (block_manager.SnapshotPool).

Plain Python, no JAX; single-threaded (the engine thread owns it).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from jaxserve.transfer.segments import OutOfBlocks
from ..cache.block_manager import BlockManager, block_hashes
from .client import QueueFull
from .sequence import Sequence, Status


def _gated(seq: Sequence) -> bool:
    """A waiting request whose cached prefix is arriving but whose first layer group has not landed yet: not
    admitted until it has (its step would only wait for it), or until the load ends either way."""
    inc = seq.transfer.into
    return inc is not None and inc.pending and not inc.started


@dataclass(frozen=True, kw_only=True)
class SchedulerConfig:
    """The scheduler's settings, built by keyword from the engine's (engine/settings.py holds the defaults)."""
    max_num_seqs: int  # decode slots
    max_num_batched_tokens: int  # prefill tokens per step
    chunk_size: int  # prefill tokens per request per step (a multiple of block_size)
    max_prefill_seqs: int  # requests per prefill step
    max_waiting: int  # requests queued beyond the free decode slots before new ones are refused
    block_size: int
    mixed_batched_tokens: int | None  # prefill tokens in a step that also decodes (None: the step budget)
    has_request_state: bool  # linear / sliding layers: snapshots needed for prefix reuse
    # the runner's packed-token buckets (ascending; empty: steps are not packed), see `_fit_bucket`
    token_buckets: tuple[int, ...]
    # the most requests a decode step snapshots at a block boundary (None: all; sliding rings: cache/layout.py
    # RING_SNAPSHOTS); a request past them keeps its last snapshot and takes one at a later boundary
    decode_snapshots: int | None = None

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "chunk_size", "max_prefill_seqs", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"SchedulerConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.chunk_size % self.block_size:
            raise ValueError(f"SchedulerConfig.chunk_size ({self.chunk_size}) must be a multiple of block_size "
                             f"({self.block_size})")
        if self.mixed_batched_tokens is not None and self.mixed_batched_tokens < 1:
            raise ValueError(f"SchedulerConfig.mixed_batched_tokens must be >= 1, got {self.mixed_batched_tokens}")


@dataclass
class PrefillChunk:
    seq: Sequence
    start: int
    length: int
    snapshot_row: int | None = None  # save request-level state here after the chunk

    @property
    def end(self) -> int:
        return self.start + self.length

    @property
    def last(self) -> bool:
        return self.end == self.seq.prefill_target


@dataclass
class StepPlan:
    prefills: list[PrefillChunk] = field(default_factory=list)
    decodes: list[Sequence] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)

    @property
    def empty(self) -> bool:
        return not self.prefills and not self.decodes


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, blocks: BlockManager):
        self.cfg, self.blocks = cfg, blocks
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.free_slots = list(range(cfg.max_num_seqs - 1, -1, -1))
        self.num_preemptions = 0

    def num_preempted_waiting(self) -> int:
        """Requests preempted and waiting to run again (FlowKV's swapped queue)."""
        return sum(1 for s in self.waiting if s.num_preemptions)

    # ---- requests
    def add(self, seq: Sequence) -> None:
        queued = len(self.waiting) - len(self.free_slots)  # beyond the slots about to be taken
        if queued >= self.cfg.max_waiting:
            raise QueueFull(f"{queued} requests already queued beyond the {self.cfg.max_num_seqs} decode slots "
                            f"(limit {self.cfg.max_waiting})")
        need = self.blocks.blocks_for(len(seq.prompt) + seq.params.max_tokens)
        if need > self.blocks.num_blocks:
            raise ValueError(f"prompt + max_tokens needs {need} cache blocks; the pool has {self.blocks.num_blocks}")
        self.waiting.append(seq)

    def abort(self, seq: Sequence, reason: str = "abort") -> None:
        if seq.finished:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def finish(self, seq: Sequence, reason: str) -> None:
        self._release(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason

    def _release(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
            seq.block_ids = []
        if seq.slot is not None:
            self.free_slots.append(seq.slot)
            seq.slot = None

    @property
    def has_work(self) -> bool:
        """Something a step can do (requests waiting for their KV, or for their prefix to start arriving, are
        not)."""
        return any(not _gated(s) for s in self.waiting) or any(not s.awaiting_kv for s in self.running)

    # ---- disaggregated decode
    def reserve(self, seq: Sequence, kv_tokens: int, max_skip: int | None = None) -> int:
        """Admit `seq` now, its first `kv_tokens` tokens to arrive by transfer. Returns the leading blocks already
        held (prefix cache hits, at most `max_skip` of them: not sent). Raises OutOfBlocks when there is no slot or
        too few blocks."""
        if not self.free_slots:
            raise OutOfBlocks(f"all {self.cfg.max_num_seqs} decode slots are taken")
        hits, _, _ = self.blocks.match(seq.tokens, False)  # transferred state is whole: no snapshot needed
        bs = self.cfg.block_size
        hits = hits[:kv_tokens // bs if max_skip is None else min(kv_tokens // bs, max_skip)]
        seq.block_ids = self.blocks.allocate(hits, len(seq.tokens))
        self.blocks.record_query(len(seq.tokens), len(hits) * bs)
        seq.slot = self.free_slots.pop()
        seq.prefill_target, seq.num_computed, seq.num_cached, seq.state_src = len(seq.tokens), 0, len(hits) * bs, None
        seq.status, seq.awaiting_kv = Status.RUNNING, True
        self.running.append(seq)
        return len(hits)

    def kv_arrived(self, seq: Sequence, kv_tokens: int) -> None:
        seq.awaiting_kv = False
        seq.num_computed = kv_tokens
        self.blocks.register(seq.block_ids, seq.tokens, kv_tokens, self._hashes(seq, kv_tokens))

    # ---- planning
    def schedule(self) -> StepPlan:
        plan = StepPlan()
        for seq in list(self.running):
            if seq.is_prefilling or seq.awaiting_kv or seq not in self.running:
                continue
            while True:
                try:
                    self.blocks.grow(seq.block_ids, seq.num_tokens)
                    plan.decodes.append(seq)
                    break
                except OutOfBlocks:
                    victim = next(s for s in reversed(self.running) if not s.awaiting_kv)
                    self._preempt(victim, plan)
                    if victim is seq:
                        break
        budget = self.cfg.max_num_batched_tokens
        if plan.decodes and self.cfg.mixed_batched_tokens is not None:  # the decodes wait for the prefill's work
            budget = min(budget, self.cfg.mixed_batched_tokens)
        pinned: set[int] = set()
        for seq in plan.decodes:
            self._decode_snapshot(seq, pinned)
        for seq in self.running:
            if (seq.is_prefilling and not seq.awaiting_kv and budget > 0
                    and len(plan.prefills) < self.cfg.max_prefill_seqs):
                budget -= self._chunk(seq, budget, plan, pinned)
        i = 0  # in arrival order, passing those whose prefix has not started arriving
        while (i < len(self.waiting) and budget > 0 and self.free_slots
               and len(plan.prefills) < self.cfg.max_prefill_seqs and not plan.preempted):
            seq = self.waiting[i]
            if _gated(seq):
                i += 1
                continue
            if not self._admit(seq):
                break
            del self.waiting[i]
            budget -= self._chunk(seq, budget, plan, pinned)
        if plan.decodes and plan.prefills and self.cfg.token_buckets and not self.cfg.has_request_state:
            self._fit_bucket(plan)
        return plan

    def _fit_bucket(self, plan: StepPlan) -> None:
        """A step that prefills while others decode runs as one program over its tokens (prefill chunks and one
        per decode) padded to the next of `token_buckets`. Where those tokens pass a bucket by a few, the last
        chunk leaves them (its end on a block boundary) to the next step, which runs anyway for the decodes: a
        256-token prompt beside 2 decodes runs 240 + 2 tokens in the 256 bucket, then 16 + 2, instead of 258 in
        the 384 bucket. Only where the tokens moved are at most a quarter of the padding saved."""
        buckets, bs = self.cfg.token_buckets, self.cfg.block_size
        bucket = lambda n: next((b for b in buckets if b >= n), n)  # noqa: E731
        total = len(plan.decodes) + sum(c.length for c in plan.prefills)
        lower = max((b for b in buckets if b < total), default=None)
        c = plan.prefills[-1]
        if lower is None or c.snapshot_row is not None:
            return
        end = (c.end - (total - lower)) // bs * bs
        moved = c.end - end
        if end > c.start and 4 * moved <= bucket(total) - bucket(total - moved):
            c.length = end - c.start

    def _admit(self, seq: Sequence) -> bool:
        tokens = seq.tokens
        hits, cached, row = self.blocks.match(tokens, self.cfg.has_request_state)
        inc, bs = seq.transfer.into, self.cfg.block_size
        n = min(len(inc.blocks), (len(tokens) - 1) // bs) if inc is not None and inc.pending else 0
        if n * bs > cached:  # (a token is left to compute)
            hits, cached, row = inc.blocks[:n], n * bs, None
        else:
            seq.transfer.into = None
        try:
            seq.block_ids = self.blocks.allocate(hits, len(tokens))
        except OutOfBlocks:
            return False
        self.blocks.record_query(len(tokens), cached)
        seq.slot = self.free_slots.pop()
        seq.prefill_target, seq.num_computed, seq.num_cached, seq.state_src = len(tokens), cached, cached, row
        seq.status = Status.RUNNING
        self.running.append(seq)
        return True

    def _chunk(self, seq: Sequence, budget: int, plan: StepPlan, pinned: set[int]) -> int:
        bs, start, target = self.cfg.block_size, seq.num_computed, seq.prefill_target
        end = min(start + min(self.cfg.chunk_size, budget), target)
        if end < target and end // bs * bs > start:
            end = end // bs * bs
        last_boundary = (target - 1) // bs * bs
        if self.cfg.has_request_state and start < last_boundary < end:
            end = last_boundary
        chunk = PrefillChunk(seq, start, end - start)
        if seq.state_src is not None:
            pinned.add(seq.state_src)
        if self.cfg.has_request_state and end % bs == 0 and self.blocks.snapshots.capacity:
            h = self._hashes(seq, end)[-1]  # registered only once computed (complete_prefill)
            chunk.snapshot_row = self.blocks.snapshots.acquire(h, pinned)
            if chunk.snapshot_row is not None:
                pinned.add(chunk.snapshot_row)
        plan.prefills.append(chunk)
        return chunk.length

    def _hashes(self, seq: Sequence, n: int) -> list[bytes]:
        """Chain hashes of the full blocks among seq's first n tokens, extending those it holds (a sequence's
        tokens only grow, so each block is hashed once)."""
        bs = self.cfg.block_size
        if len(seq.hashes) < n // bs:
            seq.hashes = block_hashes(seq.tokens[:n], bs, seq.hashes)
        return seq.hashes[:n // bs]

    def block_hash(self, seq: Sequence, n: int) -> bytes:
        """The chain hash of the block ending at seq's token n (n a multiple of block_size)."""
        return self._hashes(seq, n)[-1]

    def _decode_snapshot(self, seq: Sequence, pinned: set[int]) -> None:
        """A decode step whose token completes a block also saves the request-level state there, so the next
        turn of a conversation (prompt + answer + message) can reuse the answer too. One pool row per request,
        moved forward boundary by boundary (SnapshotPool.rekey); pinned for the step."""
        seq.decode_snapshot = None
        n = seq.num_tokens  # the KV / state of all of them once this step has run
        if seq.kv_partial or not (self.cfg.has_request_state and self.blocks.snapshots.capacity
                                  and n % self.cfg.block_size == 0):
            return
        if self.cfg.decode_snapshots is not None and len(pinned) >= self.cfg.decode_snapshots:
            return  # the step's snapshots are taken (pinned holds them alone until the prefills')
        h = self._hashes(seq, n)[-1]
        row = self.blocks.snapshots.rekey(seq.snapshot_hash, h, pinned)
        if row is not None:
            seq.decode_snapshot, seq.snapshot_hash = row, h
            pinned.add(row)

    def requeue(self, seq: Sequence) -> None:
        """Preempt a running request outside planning (its KV here cannot be trusted: it is recomputed)."""
        self._preempt(seq, StepPlan())

    def _preempt(self, seq: Sequence, plan: StepPlan) -> None:
        self._release(seq)
        seq.status, seq.num_computed, seq.state_src, seq.kv_partial = Status.WAITING, 0, None, False
        seq.transfer.into = None  # what arrives meanwhile is matched in the prefix cache at its next admission
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        plan.preempted.append(seq)
        if seq in plan.decodes:
            plan.decodes.remove(seq)

    # ---- results
    def complete_prefill(self, chunk: PrefillChunk) -> None:
        seq = chunk.seq
        seq.num_computed = chunk.end
        seq.state_src = None
        self.blocks.register(seq.block_ids, seq.tokens, chunk.end, self._hashes(seq, chunk.end))

    def complete_decode(self, seq: Sequence) -> None:
        seq.num_computed = seq.num_tokens - 1  # the newest token is the next step's input
        if seq.num_computed % self.cfg.block_size == 0 and not seq.kv_partial:
            # a block of generated tokens is complete: cached like a prompt's, so the next turn of a
            # conversation (prompt + this answer + a new message) reuses the answer's KV too
            self.blocks.register(seq.block_ids, seq.tokens, seq.num_computed, self._hashes(seq, seq.num_computed))
