"""The overlapped decode loop: while the device runs decode step n, the host prepares and dispatches step n + 1,
and reads step n's tokens only then (vLLM's asynchronous scheduling).

A steady decode step (every running request decoding, nothing to admit, no constrained output, no helper, a model
without request-level state, a pool of its own) is dispatched and left in flight (`Ahead`). The next
`LLMEngine.step` grows each request's blocks for the token still on the device, dispatches step n + 1 with that
token taken from the device (each slot's last sampled token: step_io.FROM_DEVICE), and only then reads step n and
records its tokens, so the device is never left waiting on the host between steps.

A request that ends at step n (an end-of-sequence or stop token, a stop string, an abort) was dispatched for step
n + 1 already: that token is dropped when read. Its blocks and slot, freed when step n is read, are reused only by
programs dispatched after step n + 1, which the device runs after it, and step n + 1 writes only the KV of a
position past the request's last token, in a block the prefix cache does not hold. A request whose max_tokens or
context ends at step n is not dispatched for step n + 1 (the host knows it ends). Anything else (a request to
admit or prefill, a constrained row, a migration, a hybrid model, a multi-host instance) reads the step in flight
first, and the engine steps synchronously until steady again. Outputs are those of the synchronous loop (tests/engine/test_overlap.py).

Single-threaded: the engine loop's thread.
"""

from __future__ import annotations

from dataclasses import dataclass

from .runner import DecodeRow, ModelRunner


@dataclass
class Ahead:
    """A decode step dispatched and not yet read."""
    seqs: list  # the rows' sequences, in row order
    rows: list[DecodeRow]
    out: object  # the device array of its sampled tokens (runner.collect reads it)


def _plain(seq) -> bool:
    """Whether `seq` decodes here with nothing but its tokens: no KV awaited, no constraint, no helper."""
    return (not seq.is_prefilling and not seq.awaiting_kv and seq.guide is None and seq.migration is None
            and seq.handoff is None and not seq.kv_partial)


def can_start(engine, plan) -> bool:
    """Whether a synchronous step's plan (decodes only) may be left in flight."""
    return (enabled(engine) and not plan.prefills and not plan.preempted and bool(plan.decodes)
            and all(_plain(s) and s.decode_snapshot is None for s in plan.decodes))


def enabled(engine) -> bool:
    """engine.overlap on, no request-level state, a pool of its own, no move out, and a runner of this process
    (a multi-host instance's leader drives its followers call by call, worker/group.py: it steps synchronously)."""
    return (engine.cfg.overlap and isinstance(engine.runner, ModelRunner) and not engine.layout.has_request_state
            and engine.runner.shared is None and not engine.outbound)


def next_rows(engine, ahead: Ahead) -> tuple[list, list[DecodeRow]] | None:
    """(sequences, rows) of the step after `ahead`, their blocks grown for it; None when the engine cannot step
    ahead now (something waits to be admitted, or is not plain decoding, or the pool is short)."""
    sch = engine.scheduler
    if not enabled(engine) or (sch.waiting and sch.free_slots) or not all(_plain(s) for s in sch.running):
        return None
    pending = {id(s) for s in ahead.seqs if not s.finished}
    bs, seqs, rows, grow = engine.cfg.block_size, [], [], []
    for seq in sch.running:
        p = int(id(seq) in pending)  # its token at step n, still on the device
        if p and (len(seq.output) + 1 >= seq.params.max_tokens or seq.num_tokens + 1 >= engine.max_model_len):
            continue  # step n's token is its last: it ends when read
        n = seq.num_tokens + p  # its tokens once step n is read
        grow.append((seq, n))
        seqs.append(seq)
        rows.append(DecodeRow(seq.slot, 0 if p else seq.output[-1] if seq.output else seq.prompt[-1], n - 1,
                              seq.block_ids, seq.params, len(seq.output) + p, None, seq.request_id, bool(p)))
    need = sum(max(0, -(-n // bs) - len(seq.block_ids)) for seq, n in grow)
    if not rows or need > engine.blocks.num_free:
        return None
    for seq, n in grow:
        engine.blocks.grow(seq.block_ids, n)
    return seqs, rows
