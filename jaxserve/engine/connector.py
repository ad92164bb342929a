"""The engine's seam for KV that crosses instances, in the manner of vLLM's KV connector: what jaxserve/disagg/
and a worker's prefix calls may ask of the engine, and all they may ask (`LLMEngine.connector`).

- **Receiving side** (a decode instance, or any instance a cached prefix is moved to): `reserve` a request's
  slot and blocks before its prefill runs elsewhere, and `kv_arrived` imports its KV and starts decoding it;
  `reserve_prefix`, `import_kv`, `prefix_row` and `cache_arrived` receive a cached prefix into the prefix cache,
  `load_prefix` copies one out of the global KV store's shared pool on this host.
- **Sending side** (a prefill instance, the store): `export` dispatches a layer group's export from the pool;
  `cached_prefix` finds a prefix of the prefix cache to send with no step.
- **Step side** (LLMEngine.step calls these): `stage` plans how a prefill step runs for the transfers of its
  requests (the hand-offs of those whose prompt chunks run begin; the prefixes still arriving are waited for
  layer group by layer group); once its programs are dispatched, `send_computed` exports what an earlier chunk of
  a longer prompt completed; after it ran, `settle_chunk` ends each chunk's wait for its prefix (one that failed
  to arrive sends its request back to be computed here) and `hand_off` finishes a hand-off with the first token.

A request's transfer is its `Sequence.transfer` (sequence.py `Transfer`): where its KV goes (`out`, an
`Outgoing`: a disagg.prefill_side.Handoff) and the cached prefix arriving for it (`into`, an `Incoming`: a
disagg.decode_side.IncomingPrefix). Engine thread only.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

import numpy as np

from jaxserve.transfer.segments import OutOfBlocks

from ..cache.block_manager import block_hashes
from ..sampling import SamplingParams
from .client import RequestError
from .rows import Prefix

if TYPE_CHECKING:
    from .scheduler import PrefillChunk, StepPlan
    from .sequence import Sequence

log = logging.getLogger("jaxserve.engine")


@dataclass(eq=False)
class Stages:
    """How one prefill step runs for the transfers of its requests (`KVConnector.stage`)."""
    groups: list[tuple[int, int]] | None  # the layer groups the step runs as (None: one program)
    staged: set[str]  # the requests whose rows run as those groups
    before: Callable[[int], None] | None  # before group k runs: the arriving prefixes' part of it imported
    after: Callable[[int], None] | None  # as group k is dispatched: the streamed hand-offs export it
    due: list  # [(Outgoing, Sequence)]: the hand-offs of the requests whose last prompt chunk runs
    fetching: list  # the requests whose cached prefix is still arriving
    earlier: list  # [(Outgoing, PrefillChunk)]: the hand-offs of the requests whose earlier chunk runs
    spoiled: dict = field(default_factory=dict)  # fetching requests whose prefix did not arrive: why

    @property
    def transfers(self) -> bool:
        """Whether any request of the step hands off or fetches (the step then runs without decodes mixed in)."""
        return bool(self.due or self.fetching)


class KVConnector:
    def __init__(self, llm):
        """llm: the LLMEngine whose seam this is."""
        self._llm = llm
        self._load_buf = np.empty(0, np.uint8)  # load_prefix's staging region
        self.prefix_loads = {"one_pass": 0, "staged": 0}  # load_prefix's copies out of a store's pool, by path

    # ---- facts
    @property
    def layout(self):
        return self._llm.layout

    @property
    def dtype_name(self) -> str:
        return self._llm.dtype_name

    @property
    def head_parts(self):
        return self._llm.runner.head_parts

    @property
    def num_blocks(self) -> int:
        return self._llm.blocks.num_blocks

    def blocks_for(self, tokens: int) -> int:
        return self._llm.blocks.blocks_for(tokens)

    # ---- receiving side: a request's KV
    def reserve(self, request_id: str, prompt: list[int], params: SamplingParams, kv_tokens: int,
                output: list[int] | None = None, logprobs: list | None = None,
                max_skip: int | None = None) -> tuple[Sequence, int]:
        """Take a slot and blocks for a request whose first `kv_tokens` tokens of KV (of prompt + output: a
        resumed request, as in add_request) another instance sends. Returns (sequence, leading blocks already
        held, at most `max_skip`, which are not sent). Raises RequestError, OutOfBlocks (no room now)."""
        llm = self._llm
        ids = llm.encode(prompt)
        llm.validate(ids, params, output)
        n = len(ids) + len(output or ())
        if not 0 < kv_tokens <= n:
            raise RequestError(f"kv_tokens must be in [1, {n}], got {kv_tokens}")
        if output and kv_tokens == n:
            raise RequestError("a resumed request leaves its last token to decode: kv_tokens < prompt + output")
        if request_id in llm.requests:
            raise RequestError(f"duplicate request id {request_id!r}", "request_id")
        seq = llm._sequence(request_id, ids, dataclasses.replace(params, n=1), output, logprobs)
        skip = llm.scheduler.reserve(seq, kv_tokens, max_skip)
        llm.requests[request_id] = seq
        return seq, skip

    def kv_arrived(self, seq: Sequence, staging, views, kv_tokens: int, first: dict | None) -> bool:
        """The transfer completed: import it and start decoding. first: the token prefill sampled ({"token",
        "logprob", "top"}), or None when prefill left the last prompt token to decode. Returns whether the
        sequence changed (it got its first token)."""
        llm = self._llm
        bs = llm.cfg.block_size
        skip, n = seq.num_cached // bs, -(-kv_tokens // bs)
        llm.runner.import_kv(staging, views, seq.block_ids[skip:n], seq.slot)
        llm.scheduler.kv_arrived(seq, kv_tokens)
        if first is None or first.get("token") is None:
            return False
        prefix = Prefix(seq.request_id, seq.slot, seq.block_ids, kv_tokens, int(first["token"]),
                        float(first.get("logprob", 0.0)), [tuple(t) for t in first.get("top", [])],
                        llm.runner._prompt_mask(seq.prompt, seq.params))
        llm.runner.insert([(prefix, seq.slot)])
        llm._append(seq, prefix.token, prefix.logprob, prefix.top)
        return True

    def fail(self, seq: Sequence, error: str) -> None:
        """Finish a request with an error (its transfer failed); frees its slot and blocks."""
        self._llm.fail(seq, error)

    def release(self, seq: Sequence) -> None:
        self._llm.release(seq)

    # ---- receiving side: cached prefixes (the router's prefix moves, router/prefix.py)
    def _prefix_hashes(self, tokens) -> list[bytes]:
        llm = self._llm
        bs = llm.cfg.block_size
        if not tokens or len(tokens) % bs:
            raise RequestError(f"a cached prefix is whole blocks of {bs} tokens, got {len(tokens)} tokens", "prompt")
        ids = llm.encode(list(tokens))
        llm.validate(ids, SamplingParams(max_tokens=1))  # ids in range, room for a token after them
        return block_hashes(ids, bs)

    def reserve_prefix(self, tokens) -> tuple[list[int], int, list[bytes]]:
        """Blocks for the KV of `tokens` (whole blocks) that another instance's prefix cache sends, the leading
        ones this instance holds skipped (never the last: with it comes the state). Returns (block ids, skip, the
        tokens' chain hashes). Raises RequestError, OutOfBlocks. Ended by disagg.decode_side.IncomingPrefix."""
        hashes = self._prefix_hashes(tokens)
        hits, _ = self._llm.blocks.cached(hashes[:-1], False)
        return self._llm.blocks.allocate(hits, len(tokens)), len(hits), hashes

    def free(self, blocks: list[int]) -> None:
        """Drop a reservation's references to its blocks (cached ones stay in the prefix cache)."""
        self._llm.blocks.free(blocks)

    def import_kv(self, staging, views, blocks: list[int], row: int, groups=None, wait: bool = True) -> None:
        """Write received KV (its layer groups `groups`, default all) into `blocks` and its state into `row`."""
        self._llm.runner.import_kv(staging, views, blocks, row, groups, wait=wait)

    def settle(self) -> None:
        """Wait until the imports dispatched without waiting (import_kv wait=False) are done."""
        self._llm.runner.settle()

    @property
    def scratch_row(self) -> int:
        return self._llm.layout.scratch_row

    def prefix_row(self, hashes: list[bytes]) -> int:
        """The state row a cached prefix's request-level state goes to (a snapshot keyed by its last block's
        hash, when the model has such state and the snapshot pool room; else the scratch row)."""
        llm = self._llm
        row = None
        if llm.layout.has_request_state and llm.blocks.snapshots.capacity:
            row = llm.blocks.snapshots.acquire(hashes[-1])
        return llm.layout.scratch_row if row is None else row + llm.snapshot_base

    def cache_arrived(self, blocks: list[int], tokens, hashes: list[bytes], row: int) -> None:
        """KV for `tokens` (whole blocks) written into `blocks` (and the state at their end into snapshot row
        `row`) becomes prefix cache; a store's shared pool makes it readable in place (cache/shared_pool.py)."""
        llm = self._llm
        llm.blocks.register(blocks, tokens, len(tokens), hashes)
        if llm.runner.shared is not None:
            llm.runner.shared.publish(blocks, hashes, row, hashes[-1] if row != llm.layout.scratch_row else None)

    # ---- receiving side: the global KV store's shared pool (cache/shared_pool.py), prefixes read in place
    def load_prefix(self, tokens, src, groups: list[tuple[int, int]] | None = None) -> int:
        """Copy a cached prefix (whole blocks) from another pool on this host (`src`: the store's SharedPool) into
        this instance's prefix cache, without a call to the store: its blocks (and the snapshot at its end) found
        by hash, copied and checked untouched by the store meanwhile. The copy is one program straight from the
        store's arrays (cache/pool_copy.py) once LLMEngine.prepare_loads compiled it for that store; else they are
        staged on the host in the layer groups `groups` (default: one) and imported with the import program that
        KV arriving over the transfer layer in those groups runs (warmed with them): nothing compiles -> the bytes
        copied. Raises shared_pool.Missed (the store no longer holds it, a write raced the read, or no snapshot
        row is free here for a model with request-level state: the prefill computes it), RequestError,
        OutOfBlocks."""
        from ..cache.shared_pool import Missed
        llm = self._llm
        blocks, skip, hashes = self.reserve_prefix(tokens)
        taken = False  # a snapshot row keyed by the prefix's end that does not hold its state yet
        try:
            state = llm.layout.has_request_state
            src_blocks, src_row, ticket = src.locate(hashes[skip:], hashes[-1] if state else None)
            n = len(blocks) - skip
            one_pass = llm.runner.can_copy(src.arrays, n)
            if not one_pass:  # staged first: a snapshot row is keyed only once the read held
                st, staged = self._stage_prefix(src, src_blocks, src_row if state else None, ticket, n, groups)
            row = self.prefix_row(hashes)
            taken = row != llm.layout.scratch_row
            if state and not taken:
                raise Missed("no snapshot row free here for the prefix's state")
            if one_pass:  # the store's arrays into the pool: the read is checked once the copy is done
                llm.runner.copy_from(src.views(), src_blocks, blocks[skip:], src_row, row)
                if not src.intact(ticket):
                    raise Missed("the store wrote the prefix's blocks while they were read")
                nbytes = llm.runner.copies.nbytes(src.arrays, n, state)
            else:
                llm.runner.import_kv(st, staged, blocks[skip:], row)  # waits: the staging region is read whole
                nbytes = st.nbytes
            self.cache_arrived(blocks, tokens, hashes, row)
            taken = False
            self.prefix_loads["one_pass" if one_pass else "staged"] += 1
        finally:
            if taken:  # the read failed: the row is given back
                llm.blocks.snapshots.release(hashes[-1])
            llm.blocks.free(blocks)
        return nbytes

    def _stage_prefix(self, src, src_blocks: list[int], src_row: int | None, ticket, n: int, groups) -> tuple:
        """Gather n of the store's blocks (and its state row) into the staging region, checked untouched by the
        store meanwhile -> (the Staging, its views). Raises shared_pool.Missed."""
        from jaxserve.transfer.bufpool import aligned_empty
        from jaxserve.transfer.plan import staging
        from ..cache.shared_pool import Missed
        llm = self._llm
        st = staging(llm.layout, llm.dtype_name, n, groups or [(0, llm.layout.num_layers)])
        if self._load_buf.nbytes < st.nbytes:  # one region, reused (its pages stay mapped)
            self._load_buf = aligned_empty(st.nbytes)
        views = st.views(self._load_buf)
        src.stage(st, views, src_blocks, src_row)
        if not src.intact(ticket):
            raise Missed("the store wrote the prefix's blocks while they were read")
        return st, views

    # ---- sending side
    def export(self, staging, k: int, blocks: list[int], row: int, spans=None) -> list:
        """Dispatch layer group k's export of `blocks` (and the state in `row`; spans: only these spans of the
        rows, None: all) -> [(array index, device array)]."""
        return self._llm.runner.export_kv(staging, k, blocks, row, spans)

    @property
    def span_rows(self) -> int:
        """The rows of a hand-off's spans (transfer/plan.py): the largest power of two of blocks that one prefill
        chunk fills, so an earlier chunk's KV leaves while the later chunks compute."""
        n = max(self._llm.runner.chunk_size // self._llm.layout.block_size, 1)
        return 1 << (n.bit_length() - 1)

    def cached_prefix(self, tokens) -> tuple[list[int], int] | None:
        """(block ids, state row) holding the KV of `tokens` (whole blocks) and, for a model with request-level
        state, the snapshot at their end; None when this instance no longer holds all of it. Read them before the
        next step (export programs dispatched now read the pool as it is)."""
        llm = self._llm
        hashes = self._prefix_hashes(tokens)
        hits, row = llm.blocks.cached(hashes, llm.layout.has_request_state)
        if len(hits) < len(hashes) and not llm.layout.has_request_state:
            hits = self._restore(tokens, hashes, hits)
        if len(hits) < len(hashes):
            return None
        return hits, (llm.layout.scratch_row if row is None else row + llm.snapshot_base)

    def _restore(self, tokens, hashes: list[bytes], hits: list[int]) -> list[int]:
        """The blocks of `hashes` with those after the cached `hits` brought back from the disk tier (as many as
        follow on there, into fresh blocks, cached again) -> the blocks now cached for them, a chain."""
        blocks = self._llm.blocks
        n = blocks.spilled(hashes, len(hits))
        data = []
        for h in hashes[len(hits):len(hits) + n]:
            d = blocks.spill.load(h)
            if d is None:
                break
            data.append(d)
        if not data:
            return hits
        bs = self._llm.cfg.block_size
        try:
            ids = blocks.allocate(hits, (len(hits) + len(data)) * bs)
        except OutOfBlocks:
            return hits
        self._llm.runner.write_blocks(ids[len(hits):], data)
        k = len(ids)
        self.cache_arrived(ids, list(tokens)[:k * bs], hashes[:k], self._llm.layout.scratch_row)
        blocks.free(ids)
        return ids

    # ---- step side (LLMEngine.step)
    def stage(self, plan: StepPlan) -> Stages:
        """How this prefill step runs for the transfers of its requests. A prefix that has landed whole is
        imported now (its prefill runs unstaged). The hand-offs of the requests whose prompt chunks run begin
        (one whose prefix is still arriving, once its first group is in; an earlier chunk's spans leave after the
        step, `send_computed`); with layer-wise streaming the last chunk's step runs as layer groups and each
        group's KV is exported as soon as its program is dispatched, so it travels while the later groups compute;
        a request whose cached prefix is still arriving waits for each group's part of it before that group runs:
        fetch, compute and export overlap."""
        llm = self._llm
        L = llm.layout.num_layers
        for c in plan.prefills:
            inc = c.seq.transfer.into
            if inc is not None and inc.pending and inc.landed and inc.take(self, L, c.seq.slot):
                c.seq.transfer.into = None
        due = [(c.seq.transfer.out, c.seq) for c in plan.prefills if c.last and c.seq.transfer.out is not None]
        earlier = [(c.seq.transfer.out, c) for c in plan.prefills if not c.last and c.seq.transfer.out is not None]
        fetching = [c.seq for c in plan.prefills if c.seq.transfer.into is not None]
        groups, streamed, staged = None, [], {s.request_id for s in fetching}
        for h, seq in [(h, c.seq) for h, c in earlier] + due:
            if h.begun:  # its rows are read where they are now
                h.follow(seq)
        for h, c in earlier:  # a longer prompt's hand-off begins with its first chunk (its prefix arrived)
            if c.seq.transfer.into is None and not h.begun:
                h.begin(self, c.seq)
        for h, seq in due:
            g = h.groups(self)
            if seq.transfer.into is None and not h.begun:
                h.begin(self, seq)
            if g is not None and (groups is None or g == groups):
                groups = g
                streamed.append((h, seq))
                staged.add(seq.request_id)
        if groups is None and fetching:
            groups = next((s.transfer.into.groups for s in fetching if s.transfer.into.groups), None)
        st = Stages(groups or llm.stage_groups, staged, None, None, due, fetching, earlier)
        if fetching:
            deferred = {seq for _, seq in due if seq.transfer.into is not None}  # hand-offs begun by `_fetch`
            st.before = lambda k: self._fetch(st, (st.groups or [(0, L)])[k][1], k, deferred)
        # as group k's programs are dispatched, a streamed hand-off exports group k; once the last group's are
        # (before the step reads its first tokens back), every other hand-off exports all of it and an earlier
        # chunk's the spans it completed: the exports run right after the prefill on the device, and neither the
        # first token nor the next step waits for their dispatch
        last = len(st.groups or [None]) - 1
        whole = [(h, seq) for h, seq in due if all(h is not x for x, _ in streamed)]
        if streamed or whole or earlier:
            def after(k: int) -> None:
                for h, seq in streamed:
                    if seq not in st.spoiled:
                        h.export(k)
                if k == last:
                    for h, seq in whole:
                        if h.begun and seq not in st.spoiled:
                            h.export_all()
                    self.send_computed(st)
            st.after = after
        return st

    def _fetch(self, st: Stages, hi: int, k: int, deferred: set) -> None:
        """Before a prefill step's layer group k runs: every fetching request's prefix up to layer hi is in the
        pool (waited for and imported), and the deferred hand-offs begin once the first group is in; a request
        whose prefix failed is spoiled (its rows compute on and are thrown away)."""
        for seq in st.fetching:
            if seq in st.spoiled:
                continue
            if not seq.transfer.into.take(self, hi, seq.slot):
                st.spoiled[seq] = seq.transfer.into.error
            elif k == 0 and seq in deferred and not seq.transfer.out.begun:
                seq.transfer.out.begin(self, seq)

    def send_computed(self, st: Stages) -> None:
        """Once the step's programs are dispatched (its after-hook; LLMEngine after a packed mixed step, which runs
        none): each begun hand-off whose earlier chunk ran exports the spans of rows computed by now (their export
        programs run after the step's on the device)."""
        for h, c in st.earlier:
            if h.begun and c.seq not in st.spoiled:
                h.export_computed(c.end)

    def abort(self, st: Stages, why: str) -> None:
        """The step failed: the hand-offs it began fail with it."""
        for h, _ in st.due + st.earlier:
            h.abort(why)

    def settle_chunk(self, st: Stages, c: PrefillChunk, changed: list) -> bool:
        """After the step: every layer of chunk c's arriving prefix was waited for by now, or it failed (the request
        no longer waits on it) -> whether the chunk counts (False: its prefix failed to arrive, and the request is
        computed again here or fails)."""
        c.seq.transfer.into = None
        if c.seq in st.spoiled:
            self._refetch(c.seq, st.spoiled[c.seq], changed)
            return False
        return True

    def hand_off(self, seq: Sequence, prefix: Prefix, changed: list) -> bool:
        """After the step that ran a request's last prompt chunk: with a hand-off, the remaining layer groups
        (all of them when not streamed) and the first token leave now, and the request ends here (its blocks stay
        as prefix cache) -> True; False: it decodes here. The first token is recorded as decode will record it
        (text, logprobs), and whether it ends the request."""
        out, llm = seq.transfer.out, self._llm
        if out is None:
            return False
        out.finish(prefix)
        out.ends = llm._record(seq, prefix.token, prefix.logprob, prefix.top) is not None
        seq.finish_time = time.monotonic()
        llm.scheduler.finish(seq, "handoff")
        changed.append(seq)
        return True

    def _refetch(self, seq: Sequence, error: str, changed: list) -> None:
        """A fetching request's prefix failed during its first chunk: recomputed whole, unless its hand-off had
        started sending (then it fails; the router retries it)."""
        why = f"its cached prefix did not arrive: {error}"
        if seq.transfer.out is not None and seq.transfer.out.begun:
            seq.transfer.out.abort(why)
            self._llm.fail(seq, why)
            changed.append(seq)
        else:
            log.warning("%s: %s; computing it here", seq.request_id, why)
            self._llm.scheduler.requeue(seq)
