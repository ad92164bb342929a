"""The device side of the engine, in JetStream's shape: `prefill` -> `Prefix`, `insert`, `generate`, `free`.

The cache pool (cache/layout.py), the per-slot penalty state (prompt token mask, output token counts) and
the model parameters live on device. Two families of jitted programs do the model's work, each with the pool
donated:
  prefill   B chunks of T tokens (padded to buckets) -> cache written (full-attention layers write into their
            blocks and attend over a copy of their own layer's blocks, or with the native or Pallas kernels over
            the blocks in place: `inplace_prefill`), the hidden state of each chunk's last token
  generate  one token for each running request, the rows padded to a batch bucket; full-attention layers
            write into their blocks and read them with paged attention (no dense copy of the pool),
            request-level state (sliding rings, linear state) is gathered by slot
A decode step runs the model, the LM head and sampling (with the slots' penalty state) as one program (`step`),
its rows' inputs packed into one upload and its sampled tokens into one read (engine/step_io.py); the weights
are flattened once into the list every program takes. A prefill's first tokens are sampled by a small program
keyed by the rows only (`first`), and a mixed step's decode tokens by another (`sample`), so no prefill shape
compiles the sampler again. Samplers take the rows' next-token bitmasks (structured outputs) from the engine's
`masks` callback: a prefill's are filled on the host once the model's program is dispatched, so they are
computed while the device runs; a decode step's before it is dispatched, or, where the step runs ahead of the
one in flight (engine/overlap.py), between its model (`forward`) and its sampling (`pick`: split_step.py).
The model's kernel mode (engine.kernels) picks Pallas kernels or jnp references for both programs.
Shapes are bucketed so that a workload compiles a bounded set of programs, all of which warm-up can compile
ahead (`warmup`): prefill in the three families of `prefill_groups` (chunk lengths and block-table widths in
powers of two, a batch's real tokens packed into a power-of-two bucket where every mixer takes packed input),
decode in `decode_batch` rows (with full tables the powers of two and their midpoints up to the slots; else 4
for up to 4 requests, then from max(16, slots / 4)) times the block-table widths (ragged attention: the
buckets of the blocks in use). With the native and the Pallas kernels decode tables are max_blocks_per_seq wide
(the kernels read only the blocks in use; past FULL_TABLE_BLOCKS, that many or a wider power of two): decode
programs are keyed by their rows alone, and with the native kernels (the Pallas ones where engine.packed_prefill
asks) a model of full-attention GQA layers only prefills in one packed program per step over the pool
(`paged_prefill`), keyed by its token bucket (`buckets`), and a step that also decodes runs its decode tokens in
the same program (`mixed`). `programs` records the shapes run.

Colocated mode uses one ModelRunner for both roles: prefill writes straight into the blocks and state row that
decode then reads, so `insert` only records the slot's sampling state. Disaggregated, the prefill instance's
`export_kv` hands a request's staged KV to the transfer layer and the decode instance's `import_kv` writes
what arrived into its reserved blocks and slot (transfer/device.py) before `insert`.

Not thread-safe: one thread (the engine loop) drives it.

Size: one class of about 600 lines: the host side of every device program, which share its state (the pool, the
slots' penalty state, the flattened weights, the compiled programs); the programs themselves are programs.py's,
its rows and buckets rows.py's, its warm-up warmup.py's, the packing of a step's inputs and outputs step_io.py's,
and the pool's KV moved in and out (blocks, transfers, the store's shared pool) pool_io.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxserve.transfer.device import DeviceIO

from ..cache.layout import PoolLayout, head_parts, init_pool, pool_shardings
from ..cache.pool_copy import PoolCopy
from ..models.batch import Batch
from ..models.stack import LayerStack
from ..structured import words
from .pool_io import PoolIO
from .programs import step_programs
from .sampler import MAX_LOGPROBS, sampling_mode
from .split_step import Forward, SplitStep, spec
from .step_io import pack_rows, pack_sampling, read_sampled
from .rows import (FULL_TABLE_BLOCKS, IDLE, SMALL_DECODE_ROWS, DecodeRow, PrefillRow, Prefix, next_bucket, pow2_bucket,
                   token_buckets)
from .steptimer import StepTimer

class ModelRunner(PoolIO):
    steps_ahead = True  # `dispatch` / `collect`: a decode step may be left in flight (engine/overlap.py)
    splits_ahead = True  # a constrained one too: `forward` (or None: `dispatch` after the read) and `pick`

    def __init__(self, graphdef, state, layout: PoolLayout, vocab_size: int, dtype, *, num_slots: int,
                 max_prefill_seqs: int, chunk_size: int, max_blocks_per_seq: int, mesh=None,
                 timer: StepTimer | None = None, ragged: bool = False, stack: LayerStack | None = None,
                 max_batched_tokens: int | None = None, full_tables: bool = False, paged_prefill: bool = False,
                 wide_cached: bool = False, pack_first: bool = True, inplace_prefill: bool = False,
                 inplace_first: bool = False):
        """ragged: decode attention runs as the jnp reference, which then gathers only the blocks in use
        (the decode programs are keyed by the batch's total blocks instead of the table width). full_tables: the
        decode attention (the native or the Pallas kernel) reads only the blocks in use, so every decode table is
        max_blocks_per_seq wide (the programs are keyed by the rows alone). paged_prefill: every layer is full
        attention over the pool with the native kernels (or the Pallas ones: engine.packed_prefill): a prefill step
        is one packed program whatever its rows (first chunks and chunks after cached tokens together), keyed by
        its token bucket alone, its tokens uploaded packed.
        stack: runs of identical layers to stack and scan (models/stack.py); the runner then holds the only copy
        of their weights (`params`): drop `state` after this. max_batched_tokens: the most prompt tokens of one
        prefill step (the scheduler's budget; warm-up compiles the packed buckets up to it). wide_cached: a
        chunk after cached tokens reads a table max_blocks_per_seq wide (one program per chunk bucket, not one
        per chunk bucket and width), where gathering the whole context is cheap (LLMEngine: `WIDE_GATHER_BYTES`).
        pack_first: several first chunks run as one packed program (models.model.packs_prefill: every mixer
        takes packed input, so the [B, T] padding costs attention only); otherwise each runs alone in a program
        of its own length (a packed program's MLA, KDA and Gated DeltaNet layers run every padded row: two
        16-token prompts of the bundled Kimi Linear took 690 ms packed, 44 ms alone one after the other).
        inplace_prefill: the [B, T] programs of chunks after cached tokens attend over the pool in place in their
        full-attention layers (the paged prefill kernels, native or Pallas: each token reads its row's blocks up
        to itself), so a chunk's cost follows its context, not its table's width (one program per chunk bucket,
        the table max_blocks_per_seq wide). inplace_first: first chunks too (the native kernels), and a first
        chunk alone then runs the program of a chunk after cached tokens of its length bucket: one prefill
        program per chunk bucket.
        stage_min_tokens (set by a layer-wise prefill instance, `stream_layers`): prefill shapes at least this
        long always run as layer groups when given them, shorter ones whole unless a row needs its groups, so
        no shape is compiled both ways."""
        self.layout, self.V, self.dtype = layout, vocab_size, dtype
        self.ragged, self.full_tables, self.paged_prefill = ragged, full_tables, paged_prefill
        self.timer = timer or StepTimer()  # phases: input preparation, the device program (to results on host)
        self.num_slots, self.max_prefill_seqs, self.chunk_size = num_slots, max_prefill_seqs, chunk_size
        self.max_blocks_per_seq = max_blocks_per_seq
        self.wide_cached, self.pack_first, self.inplace_prefill = wide_cached, pack_first, inplace_prefill
        self.inplace_first = inplace_first
        if inplace_prefill and (paged_prefill or not wide_cached):
            raise ValueError("inplace_prefill runs the [B, T] prefill programs with wide tables (wide_cached), "
                             "not paged_prefill's packed ones")
        if inplace_first and not inplace_prefill:
            raise ValueError("inplace_first needs inplace_prefill")
        self.stage_min_tokens: int | None = None
        self.max_batched_tokens = max_batched_tokens or max_prefill_seqs * chunk_size
        # paged prefill's token buckets: up to a step's most prefill tokens, and a mixed step's decode tokens on top
        self.most_prefill = min(self.max_batched_tokens, max_prefill_seqs * chunk_size)
        most = self.most_prefill + num_slots
        self.buckets = sorted(set(token_buckets(16, most)) | {self.most_prefill})
        self.stack = stack or LayerStack(())
        self.params = self.stack.stack(state)  # (rest, stacks): the model's weights
        # the programs take the weights as a flat list, flattened here once: a Flax state is flattened in Python
        # (every variable, each call), a list of arrays by jit's C++ path
        tree = jax.tree.structure(self.params)
        self._leaves = jax.tree.leaves(self.params)
        # committed from the start (as every program's outputs are), so a warmed program is not compiled again
        # for committed arguments after the first step
        sharding = (jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()) if mesh is not None
                    else jax.sharding.SingleDeviceSharding(jax.local_devices()[0]))
        self.pool = init_pool(layout, dtype, sharding if mesh is None else pool_shardings(layout, mesh))
        # one-pass copies out of a store's shared pool on this host (cache/pool_copy.py): a pool on one CPU device
        self.copies = PoolCopy(tuple(gl.kind for gl in layout.groups), max_blocks_per_seq, self.pool) \
            if mesh is None and jax.local_devices()[0].platform == "cpu" else None
        self.head_parts = head_parts(layout, mesh)  # how a transfer from this pool splits each group's heads
        # per-slot penalty state, one more row for the padding rows of a decode batch to write to
        self.prompt_mask = jnp.zeros((num_slots + 1, vocab_size), bool, device=sharding)
        self.out_counts = jnp.zeros((num_slots + 1, vocab_size), jnp.int32, device=sharding)
        self.last_tokens = jnp.zeros((num_slots + 1,), jnp.int32, device=sharding)  # each slot's last decode token
        self.programs: set[tuple] = set()
        self._zeros: dict = {}  # hidden-state shape -> zeros on the device (`_x0`)
        self._replicated = sharding
        merge = lambda leaves: self.stack.merge(graphdef, jax.tree.unflatten(tree, leaves))  # noqa: E731
        self._merge = merge

        p = step_programs(layout, self.stack, merge, num_slots, paged_prefill=paged_prefill,
                          inplace_prefill=inplace_prefill, inplace_first=inplace_first, chunk=chunk_size)
        self._prefill, self._decode, self._step, self._first, self._sample, self._insert = (
            p.prefill, p.decode, p.step, p.first, p.sample, p.insert)
        self.split = SplitStep(p.forward, p.pick)
        # a constrained step split in two where the device is not the host's own cores. On a CPU a program queued
        # behind one still running costs both (SmolLM2, 16 rows, 2 cores: the forward 86 ms and the sampling 17 ms
        # one after the other, 113 ms with the sampling dispatched while the forward runs, the whole step 101 ms):
        # there the whole step is dispatched once the masks are filled
        self.split_steps = jax.local_devices()[0].platform != "cpu"
        # the samplers specialised to what their rows ask for (sampler.py `sample`'s mode) where a conditional
        # would hold the dispatching thread (a GPU); on a CPU a conditional costs nothing and one program serves
        self.static_sampling = self.split_steps
        self._io = DeviceIO()
        self.mask_words = words(vocab_size)  # a row of a next-token bitmask
        self._free: dict[int, jax.Array] = {}  # rows -> every token allowed (no row constrained)
        self._no_masks: dict[int, jax.Array] = {}  # rows -> no prompt tokens (no repetition penalty)
        full = self._full = [i for i, gl in enumerate(layout.groups) if gl.kind == "full"]
        self.shared = None  # cache/shared_pool.py SharedPool: the pool lives in it (`share_pool`)
        self._reads: list[jax.Array] = []  # with `shared`: export results not yet known computed
        # read back whole on the host (replicated: a multi-host instance's leader holds only its own heads)
        self._read_blocks = jax.jit(lambda pool, ids: [pool[i][ids] for i in full],
                                    **({} if mesh is None else {"out_shardings": sharding}))
        self._write_blocks = jax.jit(lambda pool, ids, vals: [
            pool[i].at[ids].set(vals[full.index(i)].astype(pool[i].dtype), mode="drop") if i in full else pool[i]
            for i in range(len(pool))], donate_argnums=(0,))

    # ---- helpers
    @property
    def full_width(self) -> int:
        """With full tables, the narrowest decode table (rows.FULL_TABLE_BLOCKS)."""
        return min(self.max_blocks_per_seq, FULL_TABLE_BLOCKS)

    def _width(self, rows_blocks: list[list[int]], min_width: int) -> int:
        return pow2_bucket(max([min_width] + [len(b) for b in rows_blocks]), 1, self.max_blocks_per_seq)

    def _table(self, rows_blocks: list[list[int]], B: int, min_width: int, W: int | None = None) -> np.ndarray:
        table = np.zeros((B, W or self._width(rows_blocks, min_width)), np.int32)
        for i, blocks in enumerate(rows_blocks):
            table[i, :len(blocks)] = blocks
        return table

    def _prompt_mask(self, prompt: list[int] | None, params=None) -> np.ndarray | None:
        """[V] bool: the prompt's tokens, which the repetition penalty reads; None when `params` apply none."""
        if params is not None and params.repetition_penalty == 1.0:
            return None
        m = np.zeros(self.V, bool)
        if prompt:
            m[np.asarray(prompt)] = True
        return m

    @staticmethod
    def _upload(x: np.ndarray) -> jax.Array:
        """The one host-to-device copy of a step's packed inputs."""
        return jax.device_put(x)

    @staticmethod
    def _read(x: jax.Array) -> np.ndarray:
        """The one device-to-host copy of a step's sampled tokens (step_io.pack_sampled)."""
        return jax.device_get(x)

    # ---- protocol
    def prefill_groups(self, rows: list[PrefillRow]) -> list[list[PrefillRow]]:
        """The programs a prefill step over `rows` runs. Paged prefill: one, B max_prefill_seqs + num_slots, T
        chunk_size, W a full table's (full_width, or a wider power of two past it), N = the rows' tokens' bucket
        in `buckets`. Otherwise the first chunks
        (nothing cached) together (pack_first; else each alone), each chunk that reads cached tokens alone, so
        that every prefill program has one of the shapes warm-up compiles:
          first chunks, one     B 1, T = pow2 bucket of its length, W from T, unpacked
          first chunks, several B max_prefill_seqs, T chunk_size, W from T, N = pow2 bucket of their tokens
                                (packed: the [B, T] padding costs attention only)
          a chunk after cached  B 1, T = pow2 bucket of its length, W = pow2 bucket of the blocks to its end
        (wide_cached: W max_blocks_per_seq; inplace_first: a first chunk alone too, as a chunk after cached)"""
        if self.paged_prefill:
            return [rows]
        fresh = [r for r in rows if r.start == 0]
        firsts = [fresh] if fresh and self.pack_first else [[r] for r in fresh]
        return firsts + [[r] for r in rows if r.start > 0]

    def prefill(self, rows: list[PrefillRow], stages: list[tuple[int, int]] | None = None,
                on_stage=None, staged: set[str] | None = None, before_stage=None, masks=None) -> list[Prefix | None]:
        """One prefill step over `rows` (one program per `prefill_groups` group). stages: run the layers as these
        groups [(lo, hi)], one program each, calling on_stage(k) once group k's programs are dispatched (its KV
        is in the pool for the programs dispatched next: layer-wise export) and before_stage(k) before they are
        (a cached prefix arriving layer by layer is imported then); staged: the request ids that need it (their
        programs' groups run layer by layer, the others whole; None: all); stages None: the whole model at
        once. masks(rows) -> the next-token bitmasks [len(rows), mask_words] of the rows a first-token program
        samples (None entries: padding), or None when none is constrained; called once the model's programs are
        dispatched, so the host fills them while the device runs."""
        whole = [(0, self.layout.num_layers)]
        stages = stages or whole
        if not rows or len(rows) > self.max_prefill_seqs:
            raise ValueError(f"prefill takes 1..{self.max_prefill_seqs} rows, got {len(rows)}")
        groups = self.prefill_groups(rows)
        preps = [self._prefill_inputs(g) for g in groups]
        plans = [stages if staged is None or any(r.request_id in staged for r in g) or self._long(*shape) else whole
                 for g, (shape, *_) in zip(groups, preps)]
        self.timer.mark("prefill.prepare")
        xs: list = [None] * len(groups)
        for k in range(len(stages)):
            if before_stage is not None:
                before_stage(k)
            for gi, ((B, T, W, N, fresh), args, sargs, _) in enumerate(preps):
                if k >= len(plans[gi]):
                    continue
                last = k == len(plans[gi]) - 1
                lo, hi, shift = self._stage(*plans[gi][k], last)
                self.programs.add(("prefill", B, T, W, lo, hi, N, fresh))
                if shift is not None and lo == 0:  # one program wherever the group lies: x in, both out
                    x = self._x0(args[0]) if xs[gi] is None else xs[gi]
                    self.pool, out = self._prefill(self._leaves, self.pool, x, shift, *args, lo=lo, hi=hi, last=False)
                    xs[gi] = out[1] if last else out[0]
                else:
                    self.pool, xs[gi] = self._prefill(self._leaves, self.pool, xs[gi], shift, *args, lo=lo, hi=hi,
                                                      last=last)
                if last:  # the first tokens: [B, 1, H] -> (tokens, logprobs, top ids, top logprobs)
                    S = sargs[1].shape[0]
                    mode = self._mode([r for r in groups[gi][:S] if r is not None])
                    self.programs.add(("first", S) + self._key(mode))
                    xs[gi] = self._first(self._leaves, xs[gi], *sargs, self._allowed(S, masks, groups[gi][:S]),
                                         mode=mode)
            if on_stage is not None:
                on_stage(k)
        got = {}
        for g, (*_, pmask), rest in zip(groups, preps, xs):
            got.update(self._firsts(g, rest, pmask))
        self.timer.mark("prefill.device")
        return [self._prefix(r, got[id(r)]) if r.sample else None for r in rows]

    def _firsts(self, rows: list[PrefillRow | None], sampled, pmask) -> dict:
        """{id(row): (token, logprob, top ids, top logprobs, prompt mask or None)} from `first_fn`'s result."""
        tok, lp, ids, tlp = read_sampled(self._read(sampled))
        return {id(r): (int(tok[i]), float(lp[i]), ids[i], tlp[i], pmask[i]) for i, r in enumerate(rows)
                if r is not None}

    def _prefix(self, r: PrefillRow, got) -> Prefix:
        tok, lp, ids, tlp, mask = got
        return Prefix(r.request_id, r.dst_row, list(r.block_ids), r.start + len(r.tokens), tok, lp,
                      self._top(r.params, ids, tlp), mask)

    def stream_layers(self, min_tokens: int | None) -> None:
        """Prefill shapes at least min_tokens long run as layer groups whenever a step is given them (`_long`);
        None: only where a row needs its groups."""
        self.stage_min_tokens = min_tokens

    def _long(self, B: int, T: int, W: int, N: int, fresh: bool) -> bool:
        """Whether a prefill program of this shape runs as layer groups whatever its rows (stage_min_tokens): a
        paged program's every bucket (any prompt's chunk shares it), a first chunk of at least that many tokens
        (its bucket), a chunk after cached tokens whose table covers that many."""
        if self.stage_min_tokens is None:
            return False
        if self.paged_prefill:
            return True
        return (T if B == 1 else N) >= self.stage_min_tokens if fresh else W * self.layout.block_size >= \
            self.stage_min_tokens

    def _stage(self, lo: int, hi: int, last: bool) -> tuple[int, int, jax.Array | None]:
        """The program that runs layers lo..hi-1 of a prefill: (lo, hi) it is compiled for, and the shift to the
        layers run (an int32 argument; None: unshifted). Layers stacked by class, or every layer in one run (a
        dense model scanned): every group of one size runs one program, wherever it lies (compiled as layers
        0..hi-lo-1 shifted; it embeds the tokens where the shift is 0 and gives both the hidden states and each
        row's last). Otherwise a group inside a run of stacked layers, neither the first (embedding) nor the last
        (LM head), runs the program of the run's earliest group of its size: one program for all the middle
        groups of a run, however many layer groups a layer-wise prefill streams."""
        n = self.layout.num_layers
        if self.stack.classes or self.stack.runs == ((0, n),):
            return (lo, hi, None) if hi - lo == n else (0, hi - lo, jnp.int32(lo))
        run = self.stack.run_of(lo)
        if lo == 0 or last or run is None or hi > run[1]:
            return lo, hi, None
        base = max(run[0], 1)
        return base, base + hi - lo, jnp.int32(lo - base)

    def _x0(self, batch: Batch) -> jax.Array:
        """Zeros of the batch's hidden-state shape, kept per shape: what a class-stacked layer group's program
        takes at layer 0, where it embeds the tokens instead (`_stage`)."""
        key = tuple(a.shape for a in jax.tree.leaves(batch))
        if key not in self._zeros:
            s = jax.eval_shape(lambda p, b: self._merge(p)[0].embed(b.spread(self.chunk_size)), self._leaves, batch)
            self._zeros[key] = jnp.zeros(s.shape, s.dtype, device=self._replicated)
        return self._zeros[key]

    def _bucket(self, n: int) -> int:
        """Paged prefill's bucket of n tokens: the smallest of `buckets` >= n (n itself past them)."""
        return next((b for b in self.buckets if b >= n), n)

    def _prefill_inputs(self, rows: list[PrefillRow | None]):
        """One prefill program's ((B, T, W, N, fresh) shape, arguments, `first_fn`'s arguments, [S, V] prompt
        masks) for a `prefill_groups` group: row i of the batch is rows[i] (None: an empty row). Paged prefill:
        B = max_prefill_seqs + num_slots (a `mixed` step's decode tokens in the rows after the first
        max_prefill_seqs), of which `first_fn` samples the first S = max_prefill_seqs; otherwise S = B."""
        paged = self.paged_prefill
        real = [(i, r) for i, r in enumerate(rows) if r is not None]
        if paged:
            B, S = self.max_prefill_seqs + self.num_slots, self.max_prefill_seqs
        else:
            B = S = 1 if len(rows) == 1 else self.max_prefill_seqs
        # a first chunk alone reads the pool in place as a chunk after cached tokens does: their shared program
        fresh = not paged and not (self.inplace_first and B == 1) and all(r.start == 0 for _, r in real)
        T = self.chunk_size if B > 1 else pow2_bucket(len(rows[0].tokens), 16, self.chunk_size)
        bs = self.layout.block_size
        # a paged step's tokens go up as packed (Batch.spread, below), not as B rows of a whole chunk each
        tokens = None if paged else np.zeros((B, T), np.int32)
        start, lengths = np.zeros(B, np.int32), np.zeros(B, np.int32)
        scratch = self.layout.scratch_row
        src, dst, snap = (np.full(B, scratch, np.int32) for _ in range(3))
        pmask: list[np.ndarray | None] = [None] * S  # the prompts' tokens where a repetition penalty reads them
        blocks = [[] for _ in range(B)]
        for i, r in real:
            if not paged:
                tokens[i, :len(r.tokens)] = r.tokens
            start[i], lengths[i] = r.start, len(r.tokens)
            src[i], dst[i] = r.src_row, r.dst_row
            snap[i] = scratch if r.snap_row is None else r.snap_row
            if r.sample:
                pmask[i] = self._prompt_mask(r.prompt, r.params)
            # the row's table up to the block holding its chunk's end (the blocks after it are not read)
            blocks[i] = r.block_ids[:-(-(r.start + len(r.tokens)) // bs)]
        # first chunks' tables as wide as T (their keys are the chunk's own): the width follows the chunk, not the
        # prompt; paged prefill's as a full decode table (max_blocks_per_seq, but past FULL_TABLE_BLOCKS that many
        # or the power of two that holds the longest row: a long-context model's B rows of its whole table would
        # be megabytes built and uploaded every step)
        if paged:
            table = self._table(blocks, B, self.full_width)
        else:
            table = self._table(blocks, B, -(-T // bs) if fresh else max(map(len, blocks)),
                                self.max_blocks_per_seq if self.wide_cached and not fresh else None)
        st = pack_sampling([r.params if r else IDLE for r in rows[:S]], [r.step if r else 0 for r in rows[:S]], S,
                           spare=self.num_slots)
        if any(m is not None for m in pmask):
            masks = np.zeros((S, self.V), bool)
            for i, m in enumerate(pmask):
                if m is not None:
                    masks[i] = m
            masks = self._upload(masks)
        else:  # no row's repetition penalty reads its prompt: no [S, V] upload
            if S not in self._no_masks:
                self._no_masks[S] = self._upload(np.zeros((S, self.V), bool))
            masks = self._no_masks[S]
        # pack the real tokens so only attention itself sees the [B, T] padding (models/batch.py)
        if paged:
            N = self._bucket(int(lengths.sum()))
        else:
            N = pow2_bucket(int(lengths.sum()), 16, B * T) if B > 1 else B * T
        packed = None
        if N < B * T or paged:
            packed = np.full(N, B * T, np.int32)
            packed[:int(lengths.sum())] = np.concatenate([i * T + np.arange(n, dtype=np.int32)
                                                          for i, n in enumerate(lengths) if n])
            if paged:
                tokens = np.zeros(N, np.int32)
                tokens[:int(lengths.sum())] = np.concatenate([np.asarray(r.tokens, np.int32) for _, r in real])
            packed = jnp.asarray(packed)
        batch = Batch(jnp.asarray(tokens), jnp.asarray(start), jnp.asarray(lengths), packed, fresh)
        args = (batch, jnp.asarray(table), jnp.asarray(src), jnp.asarray(dst), jnp.asarray(snap))
        return (B, T, table.shape[1], N, fresh), args, (self._upload(st), masks), pmask

    def insert(self, items: list[tuple[Prefix, int]]) -> None:
        """Make each `slot` of items (prefix, slot) decode the request of `prefix` (colocated: its cache is already
        in place): one program for a step's prefixes, its rows bucketed to powers of two."""
        if not items:
            return
        k = pow2_bucket(len(items), 1, self.max_prefill_seqs)  # n itself past max_prefill_seqs
        ids = np.full((2, k), self.num_slots, np.int32)  # padding: the spare row
        ids[:, :len(items)] = [[slot for _, slot in items], [p.token for p, _ in items]]
        masks = None
        if any(p.prompt_mask is not None for p, _ in items):
            masks = np.zeros((k, self.V), bool)
            for i, (p, _) in enumerate(items):
                if p.prompt_mask is not None:
                    masks[i] = p.prompt_mask
            masks = self._upload(masks)
        self.prompt_mask, self.out_counts = self._insert(self.prompt_mask, self.out_counts, self._upload(ids), masks)

    def decode_batch(self, n: int) -> int:
        """Rows of the decode program for n running requests, at most num_slots. With full tables (one decode
        program per row bucket) the powers of two and the midpoints between them: 1, 2, 3, 4, 6, 8, 12, 16, 24,
        ...; otherwise SMALL_DECODE_ROWS for up to that many (a light load's steps), then the powers of two from
        max(16, num_slots / 4): at most four buckets, each compiled at warm-up for every table width. Padding
        rows cost their share of the products on a CPU (SmolLM2 on 2 cores: 5 requests decoding, 57 ms a step in
        8 rows, 45 ms in 6; 3 requests 40 ms in 4 rows, 37 ms in 3)."""
        if self.full_tables:
            b = 1
            while b < n and b < self.num_slots:
                b = next_bucket(b, 2)
            return min(b, self.num_slots)
        if n <= SMALL_DECODE_ROWS:
            return min(SMALL_DECODE_ROWS, self.num_slots)
        return pow2_bucket(n, min(max(16, self.num_slots // 4), self.num_slots), self.num_slots)

    def generate(self, rows: list[DecodeRow], remote=None,
                 masks=None) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """One decode step for the given slots: per row (token, logprob, top logprobs). The program runs
        `decode_batch(len(rows))` rows, the given ones first, the rest padding: one upload of the rows' packed
        inputs (step_io.pack_rows), one program (the model and sampling), one read of the sampled tokens.
        remote: an engine/migration.py `RemoteStep` when part of the rows' step runs on a helper instance (then
        the model and sampling are two programs, the helper's answers checked between them); raises RemoteFailed
        (nothing sampled) when the helper failed during the step. masks: as `prefill`'s, for the rows, called
        before the step is dispatched (a row's mask follows its last token)."""
        out = self.dispatch(rows, remote, masks)
        got = self.collect(rows, out)
        self.timer.mark("decode.device")
        return got

    def dispatch(self, rows: list[DecodeRow], remote=None, masks=None) -> jax.Array:
        """`generate`'s step dispatched, not read: its sampled tokens on the device (`collect` reads them). A
        row with from_device set takes as input the token its slot's previous decode step sampled (engine/
        overlap.py: that step's result not yet read)."""
        if remote is not None and any(r.from_device for r in rows):
            raise ValueError("a decode step with a helper takes its input tokens from the host")
        B, W, M, x = self._decode_inputs(rows, remote is not None)
        mig = remote.arrays(B) if remote is not None else None
        x = self._upload(x)
        allowed = self._allowed(B, masks, rows)
        mode = self._mode(rows)
        self.programs.add(("decode", B, 1, W, M) + ((remote.spec,) if remote else ()) + self._key(mode))
        self.timer.mark("decode.prepare")
        if remote is None:
            self.pool, self.out_counts, self.last_tokens, out = self._step(
                self._leaves, self.pool, self.prompt_mask, self.out_counts, self.last_tokens, x, allowed,
                total_blocks=M, mode=mode)
        else:
            self.pool, h = self._decode(self._leaves, self.pool, x, mig, total_blocks=M, remote=remote.spec)
            jax.block_until_ready(h)
            remote.check()  # the helper answered every call of the step (else nothing is sampled)
            self.programs.add(("sample", B, 0) + self._key(mode))
            self.out_counts, out = self._sample(self._leaves, h, self.prompt_mask, self.out_counts, x, allowed,
                                                mode=mode)
        return out

    def _decode_inputs(self, rows: list[DecodeRow], narrow: bool = False) -> tuple[int, int, int | None, np.ndarray]:
        """A decode step's (rows B, table width W, total blocks M or None, packed inputs [B, COLS + W]). narrow:
        the table of only the blocks in use (a step with a helper: its split attention reads a dense view)."""
        if not 0 < len(rows) <= self.num_slots:
            raise ValueError(f"decode takes 1..{self.num_slots} rows, got {len(rows)}")
        B = self.decode_batch(len(rows))
        bs = self.layout.block_size
        used = [-(-(r.position + 1) // bs) for r in rows]  # blocks each row attends over
        M = W = None
        if self.ragged and not narrow:  # the blocks in use, bucketed; a table as wide as the longest row can be
            M = pow2_bucket(sum(used), B, B * self.max_blocks_per_seq)
            W = min(M, self.max_blocks_per_seq)
        tables = [r.block_ids[:u] for r, u in zip(rows, used)] if narrow else [r.block_ids for r in rows]
        if W is None:
            W = self._width(tables, max(used))
            if self.full_tables and not narrow:
                W = max(W, self.full_width)
        return B, W, M, pack_rows(rows, B, W, scratch=self.layout.scratch_row, spare=self.num_slots, tables=tables)

    def forward(self, rows: list[DecodeRow]) -> Forward | None:
        """The model of a decode step over `rows` dispatched, its sampling left to `pick` (rows whose masks are
        known only after the step in flight is read: split_step.py); None, with nothing dispatched, while the
        shape's programs compile (behind the engine) or where steps are not split (`split_steps`): the step then
        runs as `dispatch` after the read."""
        if not self.split_steps:
            return None
        B, W, M, x = self._decode_inputs(rows)
        mode = self._mode(rows)
        pair = self.split.programs((B, W, M, mode), lambda: (
            spec((self._leaves, self.pool, self.last_tokens)) + (spec(x, self._replicated),), M,
            spec((self.prompt_mask, self.out_counts, self.last_tokens))
            + (spec(np.empty((B, self.mask_words), np.int32), self._replicated),)))
        if pair is None:
            return None
        self.programs.update({("forward", B, 1, W, M), ("pick", B) + self._key(mode)})
        self.pool, h, cols = pair.forward(self._leaves, self.pool, self.last_tokens, self._upload(x))
        self.timer.mark("decode.prepare")
        return Forward(B, h, cols, pair.pick)

    def pick(self, rows: list[DecodeRow], fwd: Forward, masks: np.ndarray | None) -> jax.Array:
        """`forward`'s step sampled with the rows' bitmasks [len(rows), mask_words] (None: every token allowed):
        its sampled tokens on the device, as `dispatch` returns them (`collect` reads them)."""
        allowed = self._allowed(fwd.rows, None if masks is None else (lambda _: masks), rows)
        self.out_counts, self.last_tokens, out = fwd.pick(self._leaves, fwd.h, self.prompt_mask, self.out_counts,
                                                          self.last_tokens, fwd.x, allowed)
        return out

    def _mode(self, rows: list) -> tuple[bool, bool] | None:
        """The sampler's mode for these rows (DecodeRow or PrefillRow): `sampling_mode` of their parameters where
        samplers are specialised (`static_sampling`), else None (decided on the device)."""
        return sampling_mode([r.params for r in rows]) if self.static_sampling else None

    @staticmethod
    def _key(mode) -> tuple:
        """A program's key's part for the sampler's mode (none where the device decides)."""
        return () if mode is None else (("draw" if mode[0] else "greedy") + ("+top" if mode[1] else ""),)

    def collect(self, rows: list[DecodeRow], out: jax.Array) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """Per row of a dispatched step (token, logprob, top logprobs): waits for it, one read."""
        return self._sampled(rows, out)

    def _allowed(self, B: int, masks, rows: list) -> jax.Array:
        """[B, mask_words] int32 next-token bitmasks for the B rows a sampler runs, the first len(rows) from
        masks(rows) (see `prefill`), every token allowed in the others (and in all when masks gives None)."""
        got = masks(rows) if masks is not None else None
        if got is None:
            if B not in self._free:
                self._free[B] = self._upload(np.full((B, self.mask_words), -1, np.int32))
            return self._free[B]
        out = np.full((B, self.mask_words), -1, np.int32)
        out[:len(got)] = got
        return self._upload(out)

    def _sampled(self, rows: list[DecodeRow], out: jax.Array) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """Per row (token, logprob, top logprobs) from a sampler's packed result (one read)."""
        tok, lp, ids, tlp = read_sampled(self._read(out))
        return [(int(tok[i]), float(lp[i]), self._top(r.params, ids[i], tlp[i])) for i, r in enumerate(rows)]

    def _sample_decode(self, rows: list[DecodeRow], h, at: int,
                       masks=None) -> list[tuple[int, float, list[tuple[int, float]]]]:
        """The decode rows' tokens from hidden states h (rows at.. of it), `decode_batch` rows sampled, with
        each slot's penalty state and `masks` (see `prefill`)."""
        B = self.decode_batch(len(rows))
        x = self._upload(pack_rows(rows, B, 0, scratch=self.layout.scratch_row, spare=self.num_slots))
        mode = self._mode(rows)
        self.programs.add(("sample", B, at) + self._key(mode))
        self.out_counts, out = self._sample(self._leaves, h, self.prompt_mask, self.out_counts, x,
                                            self._allowed(B, masks, rows), at=at, mode=mode)
        return self._sampled(rows, out)

    def mixed(self, prefills: list[PrefillRow], decodes: list[DecodeRow], masks=None):
        """A step's prefill chunks and decode tokens as one packed program (paged prefill only): each decode token
        is a one-token chunk after its request's cached tokens, in the rows after the prefill rows, so the
        weights are read once for both. -> (what `prefill` returns for `prefills`, what `generate` returns
        for `decodes`). masks: as `prefill`'s."""
        P = self.max_prefill_seqs
        if not self.paged_prefill or not 0 < len(prefills) <= P or not 0 < len(decodes) <= self.num_slots:
            raise ValueError(f"a mixed step (paged prefill) takes 1..{P} prefill and 1..{self.num_slots} decode "
                             f"rows, got {len(prefills)} and {len(decodes)}")
        if any(r.snap_row is not None for r in decodes):
            raise ValueError("a mixed step has no request-level state to snapshot")
        chunks = [PrefillRow("", [r.token], r.position, r.block_ids, r.slot, r.slot, None, False, r.params, r.step)
                  for r in decodes]
        rows = prefills + [None] * (P - len(prefills)) + chunks
        (B, T, W, N, fresh), args, sargs, pmask = self._prefill_inputs(rows)
        L = self.layout.num_layers
        mode = self._mode(prefills)
        self.programs.update({("prefill", B, T, W, 0, L, N, fresh), ("first", P) + self._key(mode)})
        self.timer.mark("mixed.prepare")
        self.pool, h = self._prefill(self._leaves, self.pool, None, None, *args, lo=0, hi=L, last=True)
        got = self._firsts(rows[:P], self._first(self._leaves, h, *sargs, self._allowed(P, masks, rows[:P]),
                                                 mode=mode), pmask)
        out = self._sample_decode(decodes, h, P, masks)
        self.timer.mark("mixed.device")
        return [self._prefix(r, got[id(r)]) if r.sample else None for r in prefills], out

    def _top(self, params, ids, tlp) -> list[tuple[int, float]]:
        k = min(params.logprobs or 0, MAX_LOGPROBS, self.V)
        return list(zip(ids[:k].tolist(), tlp[:k].tolist()))

    def warmup(self, progress: bool = True, stages: list[tuple[int, int]] | None = None, tails: bool = False,
               decode: bool = True, whole: bool = True, stage_cached: bool = False, reverse: bool = False) -> int:
        """Compile every step program shape this instance runs -> the programs compiled (warmup.py)."""
        from .warmup import compile_steps
        return compile_steps(self, progress, stages, tails, decode, whole, stage_cached, reverse)

    def warmup_transfer(self, dtype_name: str, groups: list[tuple[int, int]], export: bool, receive: bool,
                        progress: bool = True, by_group: bool = False, reverse: bool = False) -> int:
        """Compile the KV export / import programs of every staged row-count bucket -> how many (warmup.py)."""
        from .warmup import compile_transfers
        return compile_transfers(self, dtype_name, groups, export, receive, progress, by_group, reverse)

    def free(self, slot: int) -> None:
        """Nothing on device: the slot's rows are overwritten by the next insert / first chunk."""
