"""Warm-up: compile what an instance runs before it serves, so that traffic compiles nothing afterwards: every
step program shape of the runner's prefill groups and decode batches (`compile_steps`, ModelRunner.warmup), and
the KV export and import programs of every staged row-count bucket (`compile_transfers`,
ModelRunner.warmup_transfer). Plain functions over a ModelRunner (runner.py), on the engine thread or before it
starts.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from .rows import DRAWN, IDLE, DecodeRow, PrefillRow, pow2_bucket


def compile_steps(runner, progress: bool = True, stages: list[tuple[int, int]] | None = None, tails: bool = False,
                  decode: bool = True, whole: bool = True, stage_cached: bool = False, reverse: bool = False) -> int:
    """Compile what an instance runs (every shape of `prefill_groups` and `decode_batch`), so that traffic
    compiles nothing afterwards:
      decode  the decode program for every batch bucket and block-table width (ragged: every total-blocks
              bucket; full tables: the one width, or those from runner.full_width on)
      whole   the whole-model prefill programs: first chunks alone (every chunk bucket) and together (every
              packed token bucket, where the runner packs them: pack_first), and chunks after cached tokens
              (every chunk bucket and table width that can follow; wide_cached: the one width; inplace_first:
              the first chunks alone run these programs, compiled once); paged prefill:
              every token bucket up to the step's token budget, at the full table's width and at each wider
              one past runner.full_width (a long-context model)
      stages  a layer-wise prefill instance's layer groups: the shapes at least stage_min_tokens long
              (`_long`) are compiled as layer groups instead of whole, and with stage_cached every chunk
              after cached tokens is compiled as layer groups too (a prefill over a prefix loaded as it runs)
      tails   (without whole) the one-token chunk at the end of a sequence of every table width: what a
              decode instance runs when KV arrives for all but the last token, a resumed request's or one
              prefill left with transfer.leave_last_token
    Where the samplers are specialised to their rows (runner.static_sampling: an accelerator), every program
    that samples compiles for greedy rows and for drawing ones; a step whose rows ask for top logprobs compiles
    its program the first time one runs.
    reverse: compile the shapes in the opposite order. Instances of one role on a host share XLA's persistent
    cache: the second starting from the other end, each finds the programs the other compiled in the cache by
    the time it reaches them, so the pair compiles each program once (`Worker._warm`).
    Writes land in block 0 and the scratch rows, which are rewritten before use."""
    from tqdm import tqdm
    bs = runner.layout.block_size
    widths, w = [], 1
    while w < runner.max_blocks_per_seq:
        widths.append(w)
        w *= 2
    widths.append(runner.max_blocks_per_seq)
    lengths, t = [], 16
    while t < runner.chunk_size:
        lengths.append(t)
        t *= 2
    lengths.append(runner.chunk_size)
    batches = sorted({runner.decode_batch(n) for n in range(1, runner.num_slots + 1)})
    if runner.ragged:  # every total-blocks bucket of every batch bucket, the blocks spread evenly over the rows
        decodes = []
        for b in batches:
            m, hi = b, b * runner.max_blocks_per_seq
            while True:
                decodes.append(("decode", m // b, b))
                if m >= hi:
                    break
                m = min(2 * m, hi)
    else:  # full tables: one width (and the wider ones past FULL_TABLE_BLOCKS)
        full = [1] + [w for w in widths if w > runner.full_width]  # one block: the narrowest full width
        decodes = [("decode", w, b) for w in (full if runner.full_tables else widths) for b in batches]
    BT = runner.max_prefill_seqs * runner.chunk_size
    split = lambda n, k: [n // k + (i < n % k) for i in range(k)]  # noqa: E731  n tokens as k rows
    mixes = []
    if runner.paged_prefill:
        # one program per token bucket up to the step's most prefill tokens (whole prompts: the budget;
        # tails: one token a row), plus, where the instance decodes, a mixed step's decode tokens on top; a
        # bucket past the prefill tokens runs as a mixed step. Then a mixed step per decode batch bucket: its
        # sampler's rows after the prefill rows
        most = runner.most_prefill if whole else (runner.max_prefill_seqs if tails else 0)
        rows = (lambda p: split(p, -(-p // runner.chunk_size))) if whole else (lambda p: [1] * p)  # noqa: E731
        last = runner._bucket(most + (runner.num_slots if decode else 0)) if most else 0
        prefills = [("first", rows(n)) if n <= most else ("mixed", (rows(most), min(n - most, runner.num_slots)))
                    for n in runner.buckets if n <= last]
        # tables past FULL_TABLE_BLOCKS (a long-context model): each bucket's program again per wider width, the
        # first row's table that wide
        prefills += [("wide", (kind, n, w)) for w in widths if w > runner.full_width for kind, n in prefills]
        cached, short = [], prefills
        if decode and most:
            mixes = [("mixed", ([1], b), None) for b in batches]
    else:
        # a chunk after cached tokens: per chunk bucket T and width W, one of length in (previous T, T] ending
        # at the last token of W blocks (none when no such chunk has a token before it); wide_cached: one width
        cached = [(min(t, w * bs - 1), w) for i, t in enumerate(lengths)
                  for w in ([runner.max_blocks_per_seq] if runner.wide_cached else widths)
                  if min(t, w * bs - 1) > (lengths[i - 1] if i else 0)]
        batched = []  # every packed token bucket N of several first chunks (up to the budget's), as rows
        n, top = 16, pow2_bucket(min(runner.max_batched_tokens, BT), 16, BT)
        while runner.max_prefill_seqs > 1 and runner.pack_first:
            m = min(n, top)
            batched.append(split(m, max(2, -(-m // runner.chunk_size))))
            if n >= top:
                break
            n *= 2
        # inplace_first: a first chunk alone runs the program of a chunk after cached tokens of its bucket
        singles = [] if runner.inplace_first else [("first", [t]) for t in lengths]
        prefills = singles + [("first", b) for b in batched] + [("cached", c) for c in cached]
        short = [("cached", c) for c in cached if c[0] <= lengths[0]]
    # (kind, shape, stages, staged): with stages and staged empty the shape decides (`_long`); staged None
    # runs every group of the shape's program as layer groups
    if stages is not None and runner.stage_min_tokens is None:
        raise ValueError("warm-up with layer groups needs stage_min_tokens (LLMEngine.stream_layers)")
    jobs = [(*d, None) for d in decodes] if decode else []
    if whole:
        jobs += [(kind, n, stages, set()) for kind, n in prefills] + [(*m, None) for m in mixes]
    elif tails:
        jobs += [(kind, n, None, None) for kind, n in short] + [(*m, None) for m in mixes]
    if stages is not None and stage_cached:  # a prefill over a prefix arriving layer group by layer group
        jobs += [(kind, n, stages, None) for kind, n in prefills if kind == "cached"]
    scratch = runner.layout.scratch_row
    if reverse:
        jobs.reverse()
    modes = (IDLE, DRAWN) if runner.static_sampling else (IDLE,)
    def firsts(lens: list[int], p, w: int | None = None) -> list[PrefillRow]:
        """Prompts' first chunks of these lengths; w: the first one's last token in block w (its table w wide)."""
        out = [PrefillRow("warmup", [0] * t, 0, [0] * -(-t // bs), scratch, scratch, None, True, p, 0, [0])
               for t in lens]
        if w is not None:
            out[0] = dataclasses.replace(out[0], start=w * bs - lens[0], block_ids=[0] * w)
        return out
    for kind, n, st, staged in tqdm(jobs, desc="compiling", unit="program", disable=not progress):
        for p in modes:
            w = None
            if kind == "wide":  # n: (the kind and shape of a paged prefill's job, its first row's table width)
                kind, n, w = n
            if kind == "decode":  # n: blocks, st: rows; full tables: one token attended, the table n blocks wide
                runner.generate([DecodeRow(0, 0, (bs if runner.full_tables else n * bs) - 1, [0] * n, p, 0)] * st)
            elif kind == "mixed":  # n: (the prefill rows' lengths, decode rows)
                runner.mixed(firsts(n[0], p, w), [DecodeRow(0, 0, bs - 1, [0], p, 0)] * n[1])
            elif kind == "cached":  # n: (tokens, blocks to the chunk's end)
                t, w = n
                runner.prefill([PrefillRow("warmup", [0] * t, w * bs - t, [0] * w, scratch, scratch, None, True,
                                         p, 0, [0])], st, staged=staged)
            else:  # n: the rows' lengths
                runner.prefill(firsts(n, p, w), st, staged=staged)
    if decode:  # the programs that start a step's new decoders (`insert`), every row bucket, on the spare row
        for k in sorted({pow2_bucket(n, 1, runner.max_prefill_seqs) for n in range(1, runner.max_prefill_seqs + 1)}):
            ids = runner._upload(np.full((2, k), runner.num_slots, np.int32))
            runner.prompt_mask, runner.out_counts = runner._insert(runner.prompt_mask, runner.out_counts, ids, None)
    return len(runner.programs)


def compile_transfers(runner, dtype_name: str, groups: list[tuple[int, int]], export: bool, receive: bool,
                      progress: bool = True, by_group: bool = False, reverse: bool = False) -> int:
    """Compile the KV export (prefill side) and import (decode side) programs for every staged row-count
    bucket, so the first disaggregated requests do not wait for them; by_group: also each layer group's
    import alone (a prefill over a cached prefix as it lands). Imports write only out-of-range blocks
    (dropped) and the scratch row. reverse: the buckets in the opposite order (compile_steps). Returns the
    number of transfer programs compiled."""
    from tqdm import tqdm

    from jaxserve.transfer.bufpool import aligned_empty
    from jaxserve.transfer.plan import bucket, staging
    rows = sorted({bucket(n) for n in range(1, runner.max_blocks_per_seq + 1)}, reverse=reverse)
    scratch = runner.layout.scratch_row
    for M in tqdm(rows, desc="compiling transfer", unit="bucket", disable=not progress):
        st = staging(runner.layout, dtype_name, M, groups, runner.head_parts)
        if export:
            for k in range(len(groups)):
                jax.block_until_ready([x for _, x in runner.export_kv(st, k, [0] * M, scratch)])
        if receive:
            buf = aligned_empty(st.nbytes)
            buf[:] = 0
            runner.import_kv(st, st.views(buf), [], scratch)
            for k in range(len(groups) if by_group and len(groups) > 1 else 0):
                runner.import_kv(st, st.views(buf), [], scratch, {k})
    return len(runner._io._export) + len(runner._io._import)
