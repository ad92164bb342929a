"""The overlapped decode loop: while the device runs decode step n, the host prepares and dispatches step n + 1,
and reads step n's tokens only then (vLLM's asynchronous scheduling).

A steady decode step (every running request decoding, nothing to admit, no helper, a pool of its own) is
dispatched and left in flight (`Ahead`). The next `LLMEngine.step` grows each request's blocks for
the token still on the device, dispatches step n + 1 with that token taken from the device (each slot's last
sampled token: step_io.FROM_DEVICE), and only then reads step n and records its tokens, so the device is never
left waiting on the host between steps.

A request that ends at step n (an end-of-sequence or stop token, a stop string, an abort) was dispatched for step
n + 1 already: that token is dropped when read. Its blocks and slot, freed when step n is read, are reused only by
programs dispatched after step n + 1, which the device runs after it, and step n + 1 writes only the KV of a
position past the request's last token, in a block the prefix cache does not hold. A request whose max_tokens or
context ends at step n is not dispatched for step n + 1 (the host knows it ends).

A hybrid model's request-level state (linear state, sliding rings) lives in the request's slot rows, which each
step updates in device order, so its steps run ahead too. A step whose token completes a block also saves that
state as a prefix snapshot, as the synchronous loop's scheduler does; its key, the block's chain hash, needs the
token still on the device, so the row is held unkeyed when the step is dispatched (SnapshotPool.hold) and keyed
once the token is read (`settle_snapshots`), or freed if the request was aborted first.

A constrained row's bitmask for step n + 1 follows its token at step n: on an accelerator such a step dispatches
its model before step n is read and its sampling after, once the grammars have taken step n's tokens
(split_step.py; a request that ended at step n samples freely, its token dropped). While the shape's two programs
compile, and on a CPU (runner.split_steps), the whole step is dispatched right after the read instead. A
multi-host instance does not split a step (its followers repeat whole calls): constrained rows step synchronously
there.

Anything else (a request to admit or prefill, a migration) reads the step in flight first, and the engine steps
synchronously until steady again. A multi-host instance steps ahead as one process does: its
followers repeat each `dispatch` (worker/group.py), and the leader reads the tokens. Outputs are those of the
synchronous loop (tests/engine/test_overlap.py). On by default on an accelerator, not on a CPU (settings.py
`default_overlap`: there a request arriving while step n runs waits for step n + 1 too, and nothing pays for it).

Single-threaded: the engine loop's thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .rows import DecodeRow


@dataclass
class Ahead:
    """A decode step dispatched and not yet read."""
    seqs: list  # the rows' sequences, in row order
    rows: list[DecodeRow]
    out: object  # the device array of its sampled tokens (runner.collect reads it)
    held: list = field(default_factory=list)  # (sequence, tokens covered, snapshot row) saved by this step


def _plain(engine, seq) -> bool:
    """Whether `seq` decodes here with nothing but its tokens (and its grammar, where the runner splits a step):
    no KV awaited, no helper."""
    return (not seq.is_prefilling and not seq.awaiting_kv and seq.migration is None and seq.transfer.out is None
            and not seq.kv_partial and (seq.guide is None or getattr(engine.runner, "splits_ahead", False)))


def constrained(seqs: list) -> bool:
    """Whether a step's rows need their bitmasks: its sampling waits for the step before it (split_step.py)."""
    return any(s.guide is not None for s in seqs)


def can_start(engine, plan) -> bool:
    """Whether a synchronous step's plan (decodes only) may be left in flight."""
    return (enabled(engine) and not plan.prefills and not plan.preempted and bool(plan.decodes)
            and all(_plain(engine, s) and s.decode_snapshot is None for s in plan.decodes))


def enabled(engine) -> bool:
    """engine.overlap on, a pool of its own, no move out, and a runner that steps ahead (a ModelRunner, or a
    multi-host instance's Lockstep, worker/group.py, whose followers repeat each `dispatch`)."""
    return (engine.cfg.overlap and getattr(engine.runner, "steps_ahead", False) and engine.runner.shared is None
            and not engine.outbound)


def next_rows(engine, ahead: Ahead) -> tuple[list, list[DecodeRow], list] | None:
    """(sequences, rows, snapshot rows held) of the step after `ahead`, their blocks grown for it; None when the
    engine cannot step ahead now (something waits to be admitted, or is not plain decoding, or the pool is
    short)."""
    sch = engine.scheduler
    if not enabled(engine) or (sch.waiting and sch.free_slots) or not all(_plain(engine, s) for s in sch.running):
        return None
    pending = {id(s) for s in ahead.seqs if not s.finished}
    bs, seqs, grow = engine.cfg.block_size, [], []
    for seq in sch.running:
        p = int(id(seq) in pending)  # its token at step n, still on the device
        if p and (len(seq.output) + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= engine.max_model_len):
            continue  # step n's token is its last: it ends when read
        grow.append((seq, seq.num_tokens + p, p))  # its tokens once step n is read
        seqs.append(seq)
    need = sum(max(0, -(-n // bs) - len(seq.block_ids)) for seq, n, _ in grow)
    if not grow or need > engine.blocks.num_free:
        return None
    rows, held, pinned = [], [], set()
    snaps = engine.layout.has_request_state and engine.blocks.snapshots.capacity
    for seq, n, p in grow:
        engine.blocks.grow(seq.block_ids, n)
        snap = None
        if snaps and n % bs == 0:  # this step completes a block: it saves the state there (scheduler's rule)
            row = engine.blocks.snapshots.hold(seq.snapshot_hash, pinned)
            if row is not None:
                seq.snapshot_hash = None
                pinned.add(row)
                held.append((seq, n, row))
                snap = row + engine.snapshot_base
        rows.append(DecodeRow(seq.slot, 0 if p else seq.output[-1] if seq.output else seq.prompt[-1], n - 1,
                              seq.block_ids, seq.params, len(seq.output) + p, snap, seq.request_id, bool(p)))
    return seqs, rows, held


def settle_snapshots(engine, held: list) -> None:
    """Key the snapshot rows a step saved, now that its input tokens are on the host: each by the chain hash of
    its request's block (the synchronous loop's key); a request aborted before its token was read frees its row."""
    pool = engine.blocks.snapshots
    for seq, n, row in held:
        if seq.num_tokens < n:
            pool.drop(row)
            continue
        h = engine.scheduler.block_hash(seq, n)
        if pool.key(row, h):
            seq.snapshot_hash = h
