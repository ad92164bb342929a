"""The engine loop: schedule -> prefill program -> insert -> decode program -> postprocess (stop checks).

`LLMEngine` owns the model, the block manager, the scheduler and the device programs (`ModelRunner`);
`step()` runs one iteration and returns the requests that changed. Detokenisation is incremental per
request, constant work per token (engine/detokenizer.py); stop strings are matched on the text and the text is cut
before them. A steady decode step is left in flight and read after the next is dispatched (engine/overlap.py).
The module is over 600 lines: the disaggregated and prefix-move entry points stay beside the loop they feed until
the engine's KV connector takes them (the seams issue). Single-threaded: the offline
`LLM` calls it directly, the server drives it from one engine thread (async_engine.py).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import jax
import numpy as np
from flax import nnx

from jaxserve.pallas_kernels import check
from jaxserve.pallas_kernels.select import mode_of, resolve as resolve_kernels

from ..cache.block_manager import BlockManager
from ..cache.events import CacheEvents
from ..cache.layout import RING_SNAPSHOTS, PoolLayout
from ..checkpoint import load_any
from ..models.cache_spec import cache_spec
from ..models.config import load_config
from ..models.fuse import fuse
from ..models.model import kernel_cases, model_graphdef, packs_prefill
from ..models.stack import layer_stack
from ..sampling import SamplingParams
from ..structured import GuidedError, Grammars
from ..tokenizer import Tokenizer
from . import overlap
from .client import RequestError, encode
from .connector import KVConnector
from .detokenizer import Detokenizer
from .memory import MAX_DEFAULT_SEQS, activation_bytes, size_cache
from .migration import Guests, MigrationError, RemoteFailed, facts as migration_facts, plan_move, start_move
from .rows import DecodeRow, PrefillRow
from .runner import ModelRunner
from .scheduler import Scheduler, SchedulerConfig
from .settings import EngineConfig, default_batched_tokens, default_dtype, default_overlap
from .sequence import Sequence
from .steptimer import StepTimer
from .xla_cache import use_compilation_cache

log = logging.getLogger("jaxserve.engine")

DTYPES = {"float32": jax.numpy.float32, "bfloat16": jax.numpy.bfloat16}


# a chunk after cached tokens gathers the whole context (one program per chunk bucket) where the full-attention
# layers' KV of a longest context is at most this (a hybrid model's few such layers); else its width is bucketed
WIDE_GATHER_BYTES = 16 << 20
DENSE_CHUNK = 256  # the default chunk of a model that prefills in dense [B, T] programs
# ... and at most this with its prefill kernels compiled: a step of several rows pads each to the chunk (the
# kernels skip the padding's tiles, the [B, T] K/V around them do not), and 2,048 tokens keep an 8B's step
# compute-bound (~45 ms of matmuls against ~4 ms of weight reads on an H200)
COMPILED_CHUNK = 2048


def default_chunk_size(paged_prefill: bool, max_num_batched_tokens: int, block_size: int,
                       compiled_prefill: bool = False) -> int:
    """Prefill tokens per request per step when not configured, a multiple of block_size. A model that prefills
    over the pool in one packed program (runner.paged_prefill) takes the step's whole budget: a prompt that fits
    is prefilled in one step, as vLLM's scheduler does (each extra chunk costs a step: its weight reads and, on
    a colocated instance, one more stall of the running requests' decoding). So does one whose prefill kernels
    are compiled, up to COMPILED_CHUNK (compiled_prefill: the Pallas kernels on a GPU, where a step's host work
    and weight reads are what a small chunk multiplies: on an H200, 256-token chunks made a 2,048-token prompt 8
    steps, a SmolLM2-shaped TTFT of 51.6 ms, and held an 8B's 1 x 2,048 prefill to 36% of the bf16 rate). Other
    dense [B, T] prefill programs (the references, interpreted kernels) keep DENSE_CHUNK: their shapes, and
    warm-up's programs, grow with the chunk."""
    if paged_prefill:
        chunk = max_num_batched_tokens
    elif compiled_prefill:
        chunk = min(max_num_batched_tokens, COMPILED_CHUNK)
    else:
        chunk = DENSE_CHUNK
    return max(block_size, chunk // block_size * block_size)


def device_platform(mesh=None) -> str:
    """The platform (jax's: cpu, gpu, tpu) of the devices an engine on `mesh` (None: the first local device) runs
    on."""
    return (mesh.devices.flat[0] if mesh is not None else jax.local_devices()[0]).platform


class LLMEngine:
    def __init__(self, model: str, dtype: str = "auto", config: EngineConfig | None = None, mesh=None,
                 progress: bool = True):
        if dtype != "auto" and dtype not in DTYPES:
            raise ValueError(f"dtype must be auto or one of {sorted(DTYPES)}, got {dtype!r}")
        from ..bundled import resolve
        model = resolve(model, progress)  # a GGUF file or a named model -> its checkpoint directory
        if not os.path.isdir(model):
            raise FileNotFoundError(f"{model}: not a model directory")
        self.cfg = cfg = config or EngineConfig()
        platform = device_platform(mesh)
        told = "" if dtype != "auto" else f" (dtype auto on a {platform})"
        dtype = default_dtype(platform) if dtype == "auto" else dtype
        budget = f"; max_num_batched_tokens {cfg.max_num_batched_tokens}"
        if cfg.max_num_batched_tokens is None:  # the step's budget from the device (engine/settings.py)
            self.cfg = cfg = dataclasses.replace(cfg, max_num_batched_tokens=default_batched_tokens(platform))
            budget = (f"; max_num_batched_tokens {cfg.max_num_batched_tokens} (on a {platform}: "
                      "engine.max_num_batched_tokens sets it)")
        if cfg.overlap is None:  # steps left in flight where the device is not the host's own cores
            self.cfg = cfg = dataclasses.replace(cfg, overlap=default_overlap(platform))
        self.path, self.dtype, self.dtype_name, self.mesh = model, DTYPES[dtype], dtype, mesh
        self.compilation_cache = use_compilation_cache(cfg.compilation_cache)  # before anything compiles
        self.model_config = load_config(model)
        self.cache_spec = cache_spec(self.model_config)
        _, state = load_any(model, self.model_config, dtype, mesh, progress)
        if cfg.num_blocks is None:  # the cache takes what the weights leave of the memory the instance may use
            self.cfg = cfg = self._sized(cfg, state, mesh)
        else:
            self.cache_line = (f"KV cache: {cfg.num_blocks} blocks of {cfg.block_size} tokens (engine.num_blocks); "
                               f"max_num_seqs {cfg.max_num_seqs}")
        self.cache_line += f"{budget}; {dtype}{told}"  # what the worker and the server print at start-up
        log.info("%s", self.cache_line)
        # kernels: auto compiles each kernel the model uses and runs any that fails as its reference. The native
        # CPU kernels are opaque to XLA's partitioner, which would gather the sharded pool for them: a mesh of
        # several devices runs the references (auto) or is refused (native)
        kernels = cfg.kernels
        if mesh is not None and mesh.size > 1 and resolve_kernels(kernels) == "native":
            if kernels == "native":
                raise ValueError("engine.kernels: native runs on one device; a tensor-parallel instance (tp "
                                 f"{mesh.size}) takes auto or reference")
            kernels = "reference"
        self.kernels, self.kernel_fallbacks = check.plan(
            kernels, kernel_cases(self.model_config, self.dtype, cfg.block_size), progress, self.compilation_cache)
        for why in self.kernel_fallbacks.values():
            log.warning("kernel replaced by its jnp reference: %s", why)
        if dtype == "bfloat16" and jax.default_backend() == "cpu":
            # XLA's CPU backend computes a bf16 scatter in float32, converting the whole pool there and back at
            # every KV write (a tiny model's decode step: 1.1 ms at 512 blocks, 32 ms at 8,192)
            log.warning("bfloat16 on a CPU: each step's KV write converts the whole cache (%d blocks) to float32 "
                        "and back, so a step's time grows with the cache; float32 is faster here", cfg.num_blocks)
        # Q/K/V and gate/up as one product each (models/fuse.py): the state loaded is the model's from here
        net = nnx.merge(model_graphdef(self.model_config, self.dtype, self.kernels), state)
        del state
        self.fused = fuse(net, mesh.shape.get("tp", 1) if mesh is not None else 1)
        self.graphdef, state = nnx.split(net)
        del net
        self.tokenizer = Tokenizer.maybe_load(model)
        bs = cfg.block_size
        self.max_model_len = min(cfg.max_model_len or self.model_config.max_position_embeddings,
                                 self.model_config.max_position_embeddings, cfg.num_blocks * bs)
        self.layout = PoolLayout.build(self.cache_spec, bs, cfg.num_blocks, cfg.max_num_seqs, cfg.num_snapshots)
        self.snapshot_base = cfg.max_num_seqs
        self.cache_events = CacheEvents()  # what the router's global KV index follows (cache/events.py)
        self.blocks = BlockManager(cfg.num_blocks, bs, cfg.num_snapshots, cfg.prefix_caching, self.cache_events)
        # runs of identical layers run as one lax.scan (models/stack.py; every paged kernel takes a traced layer
        # index): by default with the CPU kernels, where compiling is most of a start, and on an accelerator where
        # asked (engine.scan_layers; a prefill instance's default, worker/setup.py); the reference gathers a
        # ragged list of the batch's blocks (its count bucketed: `ragged`)
        paged = {mode_of(k, self.kernels) for k in ("paged_attention", "paged_mla_attention")}
        scan = paged <= {"reference", "native"} if cfg.scan_layers is None else cfg.scan_layers
        ragged = paged == {"reference"}
        # the native and the Pallas decode kernels read only the blocks in use (decode tables of one width, the
        # programs keyed by their rows alone); with the native kernels (and the Pallas ones where
        # engine.packed_prefill asks) a model whose every layer is full GQA attention prefills over the pool in one
        # packed program per step (runner.paged_prefill)
        packs = {None: {"native"}, True: {"native", "pallas", "interpret"}, False: set()}[cfg.packed_prefill]
        paged_prefill = (mode_of("paged_prefill_attention", self.kernels) in packs
                         and not self.layout.has_request_state and not any(g.mla for g in self.layout.groups))
        # where gathering a whole context of the full-attention layers is cheap (hybrid models: few such layers),
        # a chunk after cached tokens reads the full table: one program per chunk bucket instead of one per width
        max_blocks = -(-self.max_model_len // bs)
        full_bytes = sum(int(np.prod(s.shape[1:])) * np.dtype(s.dtype).itemsize
                         for gl, s in zip(self.layout.groups, self.layout.shapes(self.dtype)) if gl.kind == "full")
        # the paged prefill kernels (native on a CPU, Pallas on a GPU) read each token's blocks in place up to
        # itself: the [B, T] prefill programs of the models not prefilled packed attend with them, a chunk's cost
        # following its context, not its table: one program per chunk bucket for the chunks after cached tokens
        # (runner.inplace_prefill), and with the native kernels for first chunks alone too (inplace_first; on a
        # GPU they keep flash attention over their own keys)
        needs = {mode_of("paged_mla_prefill_attention" if g.mla else "paged_prefill_attention", self.kernels)
                 for g in self.layout.groups if g.kind == "full"}
        inplace = not paged_prefill and bool(needs) and "reference" not in needs
        wide = inplace or (not paged_prefill and max_blocks * full_bytes <= WIDE_GATHER_BYTES)
        self.stage_groups: list[tuple[int, int]] | None = None  # a layer-wise prefill instance's (stream_layers)
        if cfg.chunk_size is None:
            self.cfg = cfg = dataclasses.replace(cfg, chunk_size=default_chunk_size(
                paged_prefill, cfg.max_num_batched_tokens, bs, compiled_prefill=needs == {"pallas"}))
        self.timer = StepTimer()  # where each step's time goes (bench/offline.py)
        self.runner = ModelRunner(self.graphdef, state, self.layout, self.model_config.vocab_size, self.dtype,
                                  num_slots=cfg.max_num_seqs, max_prefill_seqs=cfg.max_prefill_seqs,
                                  chunk_size=cfg.chunk_size, max_blocks_per_seq=max_blocks, wide_cached=wide,
                                  mesh=mesh, timer=self.timer, ragged=ragged, full_tables="reference" not in paged,
                                  paged_prefill=paged_prefill, pack_first=packs_prefill(self.model_config),
                                  inplace_prefill=inplace, inplace_first=inplace and needs == {"native"},
                                  max_batched_tokens=cfg.max_num_batched_tokens,
                                  stack=layer_stack(self.model_config, scan=scan,
                                                    switch=platform == "cpu"))
        del state  # the runner's params hold the weights (stacked runs: their only copy)
        self.connector = KVConnector(self)  # what disaggregation may ask of the engine (connector.py)
        self.scheduler = Scheduler(SchedulerConfig(
            max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
            chunk_size=cfg.chunk_size, max_prefill_seqs=cfg.max_prefill_seqs, max_waiting=cfg.max_waiting,
            block_size=bs, has_request_state=self.layout.has_request_state,
            mixed_batched_tokens=cfg.mixed_batched_tokens,
            token_buckets=tuple(self.runner.buckets) if paged_prefill else (),
            decode_snapshots=RING_SNAPSHOTS if any(g.kind == "sliding" for g in self.layout.groups) else None),
            self.blocks)
        if cfg.spill_dir is not None:
            from ..cache.disk_tier import DiskTier
            shapes = [(s.shape[1:], s.dtype) for gl, s in zip(self.layout.groups, self.layout.shapes(self.dtype))
                      if gl.kind == "full"]
            self.blocks.spill = DiskTier(cfg.spill_dir, cfg.spill_mb << 20, shapes)
            self.blocks.read_blocks = lambda ids: self.runner.read_blocks(ids)  # the runner in use then
        self.eos = set(self.model_config.eos_token_ids)
        self.requests: dict[str, Sequence] = {}
        self._rng = np.random.default_rng()
        self.outbound: dict[int, object] = {}  # moves of work from here to helpers (engine/migration.py)
        self._guests: Guests | None = None
        self._move_facts: tuple | None = None  # (migration facts that do not change)
        self.moves = {"started": 0, "failed": 0, "calls": 0}  # moves from here, their helpers' calls, failures
        self._grammars: Grammars | None = None
        self._ahead: overlap.Ahead | None = None  # a decode step dispatched, not yet read (engine/overlap.py)
        self._unreported: list[Sequence] = []  # requests changed outside a step (`_settle`): the next step's
        self.overlapped = 0  # decode steps dispatched before the one in flight was read

    def _sized(self, cfg: EngineConfig, state, mesh) -> EngineConfig:
        """`cfg` with num_blocks (and max_num_seqs, when not configured) from memory (engine/memory.py)."""
        bs, mc = cfg.block_size, self.model_config
        slots = cfg.max_num_seqs or MAX_DEFAULT_SEQS

        def pool_bytes(n: int) -> int:
            layout = PoolLayout.build(self.cache_spec, bs, n, slots, cfg.num_snapshots)
            return sum(s.size * s.dtype.itemsize for s in jax.tree.leaves(layout.shapes(self.dtype)))
        block = pool_bytes(2) - pool_bytes(1)
        mlp = max(getattr(l.mlp, "top_k", 1) * l.mlp.intermediate_size + getattr(l.mlp, "shared_intermediate_size", 0)
                  for l in mc.layers)
        devices = ([d for d in mesh.devices.flat if d.process_index == jax.process_index()] if mesh is not None
                   else jax.local_devices()[:1])
        longest = min(cfg.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        size = size_cache(devices=devices, fraction=cfg.memory_fraction, block_bytes=block,
                          fixed_bytes=pool_bytes(1) - block,
                          weight_bytes=sum(x.nbytes for x in jax.tree.leaves(state)),
                          activations=activation_bytes(mc.hidden_size, mlp, mc.vocab_size,
                                                       cfg.max_num_batched_tokens + slots,
                                                       slots + cfg.max_prefill_seqs),
                          block_size=bs, max_blocks=slots * -(-longest // bs))
        sized = dataclasses.replace(cfg, num_blocks=size.num_blocks)
        self.cache_line = (f"{size.line}; max_num_seqs {sized.max_num_seqs}"
                           + ("" if cfg.max_num_seqs else " (from the cache: engine.max_num_seqs sets it)"))
        return sized

    # ---- requests
    def encode(self, prompt) -> list[int]:
        return encode(self.tokenizer, prompt)

    def validate(self, ids: list[int], params: SamplingParams, output: list[int] | None = None) -> None:
        V = self.model_config.vocab_size
        if not ids:
            raise RequestError("empty prompt: send at least one token", "prompt")
        for name, xs in (("prompt", ids), ("output", output or [])):
            bad = [t for t in xs if not 0 <= t < V]
            if bad:
                raise RequestError(f"token ids out of range [0, {V}): {bad[:5]}", name)
        if output and (params.n != 1 or len(output) >= params.max_tokens):
            raise RequestError(f"a resumed request takes n = 1 and fewer output tokens ({len(output)}) than "
                               f"max_tokens ({params.max_tokens})", "output")
        if len(ids) + params.max_tokens > self.max_model_len:
            raise RequestError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the maximum "
                               f"context length {self.max_model_len}", "max_tokens")
        if params.stop and self.tokenizer is None:
            raise RequestError("stop strings need a tokenizer; use stop_token_ids", "stop")
        if params.guided is not None:
            try:
                self.grammars.check(params.guided)
            except GuidedError as e:
                raise RequestError(str(e), e.param) from None

    @property
    def grammars(self) -> Grammars:
        """The grammar engine for this model's tokenizer (structured outputs), made on first use."""
        if self._grammars is None:
            if self.tokenizer is None:
                raise RequestError("structured outputs need the model's tokenizer (tokenizer.json)",
                                   "response_format")
            self._grammars = Grammars(self.tokenizer.to_json(), self.model_config.vocab_size,
                                      sorted(self.model_config.eos_token_ids))
        return self._grammars

    def add_request(self, request_id: str, prompt, params: SamplingParams, output: list[int] | None = None,
                    logprobs: list | None = None) -> list[Sequence]:
        """Queue a request (n sequences for n > 1, seeds seed, seed + 1, ...). Raises RequestError / QueueFull.
        output (n = 1): resume a request whose first tokens (and their logprobs) were already generated elsewhere;
        it continues as a preempted request does (its prompt and output recomputed, then decoding)."""
        ids = self.encode(prompt)
        self.validate(ids, params, output)
        base = params.seed if params.seed is not None else int(self._rng.integers(0, 2**31))
        seqs = []
        for i in range(params.n):
            rid = request_id if params.n == 1 else f"{request_id}-{i}"
            if rid in self.requests:
                raise RequestError(f"duplicate request id {rid!r}", "request_id")
            seq = self._sequence(rid, ids, dataclasses.replace(params, seed=base + i, n=1), output, logprobs)
            self.scheduler.add(seq)
            self.requests[rid] = seq
            seqs.append(seq)
        return seqs

    def _sequence(self, rid: str, ids: list[int], params: SamplingParams, output, logprobs) -> Sequence:
        seq = Sequence(rid, list(ids), params)
        seq.detok = Detokenizer(self.tokenizer, params.stop)
        for t in output or ():
            seq.output.append(int(t))
            seq.detok.add(int(t))
        if params.guided is not None:  # its own matcher, past the tokens it has already
            seq.guide = self.grammars.guide(params.guided, seq.output)
        if params.logprobs is not None and output:
            if logprobs is None or len(logprobs) != len(output):
                raise RequestError("a resumed request needs one logprobs entry per output token", "logprobs")
            seq.logprobs = [(float(lp), [tuple(t) for t in top]) for lp, top in logprobs]
        return seq

    def prepare_loads(self, src) -> int:
        """Compile the one-pass copy out of store pool `src` (a SharedPool, or its arrays as ShapeDtypeStructs:
        SharedPool.shapes); any thread -> the programs compiled (0 or 1)."""
        return self.runner.prepare_copies(getattr(src, "arrays", src))

    def fail(self, seq: Sequence, error: str) -> None:
        """Finish a request with an error (its transfer failed); frees its slot and blocks."""
        self.scheduler.abort(seq, "error")
        seq.error = error
        seq.finish_time = time.monotonic()

    def abort(self, request_id: str) -> None:
        seq = self.requests.pop(request_id, None)
        if seq is not None:
            self.scheduler.abort(seq)
            if self.outbound:
                self._end_moves()

    def stream_layers(self, groups: list[tuple[int, int]] | None, min_tokens: int | None = None) -> None:
        """A layer-wise prefill instance: every prefill step gets these layer groups, and a program shape at least
        min_tokens long (runner `_long`) always runs as them, so no shape needs both a whole and a staged program
        (the hand-offs of requests that stream export each group as it is dispatched). None: no longer."""
        self.stage_groups = list(groups) if groups else None
        self.runner.stream_layers(min_tokens if groups else None)

    def release(self, seq: Sequence) -> None:
        """Forget a finished request (its caller has read the result)."""
        self.requests.pop(seq.request_id, None)

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work or self._ahead is not None

    # ---- one iteration
    def step(self) -> list[Sequence]:
        """One iteration: schedule, run, record -> the requests that changed (new tokens, finished). With a decode
        step in flight (engine/overlap.py): the next one dispatched when the engine can step ahead, then the one in
        flight read."""
        if self._ahead is not None:
            return self._step_ahead()
        self.timer.begin()
        plan = self.scheduler.schedule()
        self.timer.mark("schedule")
        changed, self._unreported = self._unreported, []
        for seq in plan.preempted:  # recomputed from its tokens: whatever part of it ran on a helper ends
            seq.migration = None
        local = [s for s in plan.decodes if s.migration is None]  # the rest run partly on a helper
        decoded = self._prefill(plan, local, changed) if plan.prefills else None
        if plan.decodes:
            self._decode(plan, local, decoded, changed)
        if self.outbound:
            self._end_moves()
        self.timer.end("mixed" if plan.prefills and plan.decodes else "prefill" if plan.prefills
                       else "decode" if plan.decodes else "")
        return changed

    def _prefill(self, plan, local: list[Sequence], changed: list) -> list | None:
        """Run the step's prefill chunks and record what they produced -> the decode rows' tokens where one packed
        program computed them with the chunks (the weights read once), else None. The transfers of the step's
        requests (hand-offs to decode elsewhere, prefixes still arriving) shape how it runs (connector.py)."""
        rows = []
        for c in plan.prefills:
            seq = c.seq
            src = seq.state_src + self.snapshot_base if seq.state_src is not None else seq.slot
            snap = c.snapshot_row + self.snapshot_base if c.snapshot_row is not None else None
            rows.append(PrefillRow(seq.request_id, seq.tokens[c.start:c.end], c.start, seq.block_ids, src,
                                   seq.slot, snap, c.last, seq.params, len(seq.output),
                                   seq.tokens if c.last else None))
        st = self.connector.stage(plan)
        decoded = None
        if self.runner.paged_prefill and local and not st.transfers:
            prefixes, decoded = self.runner.mixed(rows, self._decode_rows(local), self._masks)
            self.connector.send_computed(st)  # a packed mixed step runs no after-hook: its spans leave now
        else:
            try:
                prefixes = self.runner.prefill(rows, st.groups, st.after, st.staged, st.before, self._masks)
            except BaseException as e:
                self.connector.abort(st, f"prefill step failed: {type(e).__name__}: {e}")
                raise
        inserts = []
        for c, prefix in zip(plan.prefills, prefixes):
            if not self.connector.settle_chunk(st, c, changed):
                continue
            self.scheduler.complete_prefill(c)
            if prefix is None or self.connector.hand_off(c.seq, prefix, changed):
                continue
            inserts.append((prefix, c.seq.slot))
            self._append(c.seq, prefix.token, prefix.logprob, prefix.top)
            changed.append(c.seq)
        self.runner.insert(inserts)  # the step's new decoders' penalty state, in one program
        self.timer.mark("prefill.output")
        return decoded

    def _decode(self, plan, local: list[Sequence], decoded: list | None, changed: list) -> None:
        """Run the step's decode rows (or take their tokens from the packed step) and record them; a steady step
        is left in flight instead where the engine can step ahead (read at the next step)."""
        if overlap.can_start(self, plan):
            rows = self._decode_rows(local)
            self._ahead = overlap.Ahead(local, rows, self.runner.dispatch(rows, masks=self._masks))
            self.timer.mark("decode.prepare")
            return
        got = dict(zip(local, decoded if decoded is not None else
                       self.runner.generate(self._decode_rows(local), masks=self._masks) if local else []))
        for out in {id(s.migration): s.migration for s in plan.decodes if s.migration is not None}.values():
            got.update(self._remote_decode(out, [s for s in plan.decodes if s.migration is out]))
        for seq in plan.decodes:
            if seq in got:
                self._append(seq, *got[seq])
                changed.append(seq)
        self.timer.mark("decode.output")

    def _step_ahead(self, go_on: bool = True) -> list[Sequence]:
        """The step in flight read (and its tokens recorded) after the next one is dispatched, where the engine
        can step ahead (and go_on); else it alone is read, and the next step runs synchronously."""
        ahead, self._ahead = self._ahead, None
        self.timer.begin()
        nxt = overlap.next_rows(self, ahead) if go_on else None
        self.timer.mark("schedule")
        seqs, rows, held = nxt if nxt is not None else (None, None, None)
        guided = nxt is not None and overlap.constrained(seqs)
        if guided:  # the model now, the sampling once the grammars have taken step n's tokens (split_step.py)
            fwd = self.runner.forward(rows)
        elif nxt is not None:
            self._ahead = overlap.Ahead(seqs, rows, self.runner.dispatch(rows), held)
            self.timer.mark("decode.prepare")
        got = self.runner.collect(ahead.rows, ahead.out)
        self.timer.mark("decode.device")
        changed, self._unreported = self._unreported, []
        for seq, g in zip(ahead.seqs, got):
            if not seq.finished:  # (aborted meanwhile: its token is dropped)
                self._append(seq, *g)
                changed.append(seq)
        overlap.settle_snapshots(self, ahead.held)
        self.timer.mark("decode.output")
        if guided:  # a request that ended at step n samples freely (its token is dropped)
            masks = self._masks(rows)
            out = (self.runner.pick(rows, fwd, masks) if fwd is not None  # else its programs still compile:
                   else self.runner.dispatch(rows, masks=lambda _: masks))  # the whole step, after the read
            self._ahead = overlap.Ahead(seqs, rows, out, held)
            self.timer.mark("decode.prepare")
        self.overlapped += nxt is not None
        self.timer.end("decode")
        return changed

    def _settle(self) -> None:
        """Read the decode step in flight, if any, and record its tokens (the requests that changed are returned by
        the next `step`): for what needs every running request's tokens on the host."""
        if self._ahead is not None:
            self._unreported = self._step_ahead(go_on=False)

    # ---- migration (engine/migration.py)
    def migrate(self, kind: str, heads: list[int] | None, layers: list[int] | None, src: str, dst: str,
                link) -> dict:
        """Move part of the decode work of the requests decoding here now to helper `dst` (`link` carries the
        messages to it). Raises MigrationError for an impossible move (nothing decoding, heads or layers out of
        range, the helper refusing)."""
        spec = plan_move(self, kind, heads, layers)
        self._settle()
        seqs = [s for s in self.scheduler.running if s.migration is None and s.transfer.out is None
                and not s.awaiting_kv and not s.is_prefilling and s.output]
        if not seqs:
            raise MigrationError(f"nothing is decoding on {src} (or all of it has moved already)", "src")
        t0 = time.monotonic()
        out, nbytes = start_move(self, spec, seqs, src, dst, link)
        self.outbound[out.mid] = out
        self.moves["started"] += 1
        for s in seqs:
            s.migration = out
            s.kv_partial = s.kv_partial or kind == "layers"
            s.migrations.append({"kind": kind, "src": src, "dst": dst})
        log.info("moved %s of %d requests to %s (%d bytes, %.3fs)", kind, len(seqs), dst, nbytes,
                 time.monotonic() - t0)
        return {"requests": [s.request_id for s in seqs], "bytes": nbytes, "seconds": round(time.monotonic() - t0, 4)}

    def _remote_decode(self, out, seqs: list[Sequence]) -> list:
        """The decode step of a move's rows; a helper that fails ends the move: heads-migrated rows of a model
        without request-level state run the step here again (it rewrites what the failed one wrote), the others
        are recomputed (preempted: a linear layer's state has taken the failed step's token already, and a
        layers-migrated request's pool misses the moved layers)."""
        try:
            return list(zip(seqs, self.runner.generate(self._decode_rows(seqs), remote=out.step(seqs),
                                                       masks=self._masks)))
        except RemoteFailed as e:
            log.warning("migration %d to %s failed (%s): %d requests continue here", out.mid, out.dst, e, len(seqs))
            self._end_move(out)
            if out.spec.kind == "heads" and not self.layout.has_request_state:  # the same step again, here
                return list(zip(seqs, self.runner.generate(self._decode_rows(seqs), masks=self._masks)))
            for s in seqs:
                self.scheduler.requeue(s)
            return []

    def _end_move(self, out) -> None:
        self.moves["calls"] += out.calls
        self.moves["failed"] += bool(out.failed)
        for s in out.seqs:
            if s.migration is out:
                s.migration = None
        self.outbound.pop(out.mid, None)
        out.release()

    def _end_moves(self) -> None:
        """End the moves none of whose requests still runs partly on the helper."""
        for out in list(self.outbound.values()):
            if all(s.finished or s.migration is not out for s in out.seqs):
                self._end_move(out)

    @property
    def guests(self) -> Guests:
        """The moves this instance helps with (made on first use)."""
        if self._guests is None:
            self._guests = Guests(self)
        return self._guests

    def _decode_rows(self, seqs: list[Sequence]) -> list[DecodeRow]:
        return [DecodeRow(s.slot, s.output[-1] if s.output else s.prompt[-1], s.num_tokens - 1, s.block_ids,
                          s.params, len(s.output),
                          None if s.decode_snapshot is None else s.decode_snapshot + self.snapshot_base,
                          s.request_id)
                for s in seqs]

    def _masks(self, rows: list) -> np.ndarray | None:
        """The runner's sampler rows' next-token bitmasks [len(rows), W] (structured outputs): each constrained
        request's guide fills its row, the others allow every token; None when no row is constrained."""
        seqs = [self.requests.get(r.request_id) if r is not None else None for r in rows]
        if not any(s is not None and s.guide is not None for s in seqs):
            return None
        out = np.full((len(rows), self.runner.mask_words), -1, np.int32)
        for i, s in enumerate(seqs):
            if s is not None and s.guide is not None and not s.finished:
                s.guide.fill(out[i])
        return out

    def _record(self, seq: Sequence, tok: int, lp: float, top) -> str | None:
        """Append a sampled token (output, logprobs, text); returns the reason it ends the request, or None."""
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        seq.output.append(tok)
        if seq.params.logprobs is not None:
            seq.logprobs.append((lp, top))
        p = seq.params
        if seq.guide is not None:
            seq.guide.advance(tok)
        if tok in p.stop_token_ids or (tok in self.eos and not p.ignore_eos):
            return "stop"
        if seq.detok.add(tok):
            return "stop"
        if seq.guide is not None and seq.guide.done:  # the grammar accepts nothing further
            return "stop"
        if len(seq.output) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _append(self, seq: Sequence, tok: int, lp: float, top) -> None:
        reason = self._record(seq, tok, lp, top)
        self.scheduler.complete_decode(seq)  # before a finish too: the last full block joins the prefix cache
        if reason is not None:
            seq.detok.finish()
            self.runner.free(seq.slot)
            self.scheduler.finish(seq, reason)
            seq.finish_time = time.monotonic()

    # ---- introspection
    def stats(self) -> dict:
        b = self.blocks
        used = b.num_referenced()
        return {"waiting": len(self.scheduler.waiting), "running": len(self.scheduler.running),
                "blocks_total": b.num_blocks, "blocks_free": b.num_free, "blocks_used": used,
                "busy": round(self.timer.busy(), 4), "swapped": self.scheduler.num_preempted_waiting(),
                "prefix_hit_rate": b.hit_rate, "compiled_programs": len(self.runner.programs),
                "preemptions": self.scheduler.num_preemptions, "kernel_fallbacks": len(self.kernel_fallbacks),
                "overlapped_steps": self.overlapped,
                **{f"prefix_loads_{k}": v for k, v in self.connector.prefix_loads.items()},
                **migration_facts(self, used), **(b.spill.stats() if b.spill is not None else {})}

