"""The engine's settings, `EngineConfig`, and their one set of defaults: the YAML's `engine` section
(config.py) takes its defaults from `DEFAULTS`, `LLM(...)` and `LLMEngine` use them as they are, and the
scheduler's settings are built from them by keyword (scheduler.py `SchedulerConfig` has none of its own). Plain
Python, no JAX: loading a config must not import it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .memory import MAX_DEFAULT_SEQS

XLA_CACHE = "~/.cache/jaxserve/xla"  # engine.compilation_cache's default
MIN_DEFAULT_SEQS = 8  # the fewest concurrent requests a default takes

SLOT_TOKENS = 256  # the cache a default-sized slot can count on
# a step's token budget when not configured: on a CPU a step's time follows its tokens (LLM.generate, 48 prompts
# of ~145 tokens, 64 tokens each, on 2 cores: 1,024 against 512 made 1.05x the tokens/s on bench-llama-32m,
# 1.04x on SmolLM2-135M, 1.03x on Qwen3-0.6B's shape; 2,048 no more; served, SmolLM2 at 0.5 requests/s: TTFT p50
# 0.97x, TPOT p50 1.06x, the decodes beside a prefill waiting for a longer step); on an accelerator a step of few
# tokens is bound by its weight reads and host work (an H200's 8B prefill at 256-token chunks: 36% of the bf16
# rate), and 2,048 keeps an 8B's step compute-bound and a 2,048-token prompt one step (vLLM's default on GPUs of
# <70 GB is 2,048 for its server, 8,192 offline)
CPU_BATCHED_TOKENS = 1024
ACCELERATOR_BATCHED_TOKENS = 2048


def default_dtype(platform: str) -> str:
    """The weights' and cache's dtype `auto` stands for on a device of `platform`: float32 on a CPU (XLA's CPU
    backend computes a bfloat16 KV write in float32 over the whole cache), bfloat16 on an accelerator (half the
    bytes every decode step reads; vLLM's auto is a 16-bit dtype there too)."""
    return "float32" if platform == "cpu" else "bfloat16"


def default_batched_tokens(platform: str) -> int:
    """engine.max_num_batched_tokens when not configured, for a device of `platform` (jax's: cpu, gpu, tpu)."""
    return CPU_BATCHED_TOKENS if platform == "cpu" else ACCELERATOR_BATCHED_TOKENS


def default_overlap(platform: str) -> bool:
    """engine.overlap when not configured: on an accelerator, whose decode step is as short as the host's work
    around it (an H200's 8B step: the GPU busy ~45% of it when synchronous), not on a CPU, whose cores run the
    step and the host's work alike. There a step dispatched ahead buys nothing and makes a request arriving while
    it runs wait for it too (SmolLM2-135M served at 0.5 requests/s on 2 cores, overlapped against synchronous:
    TTFT p50 1.25x, TPOT p50 0.99x; LLM.generate, 48 prompts, 64 tokens each: 1.01x the tokens/s on
    bench-llama-32m, 1.00x on SmolLM2-135M)."""
    return platform != "cpu"


def default_max_num_seqs(num_blocks: int, block_size: int) -> int:
    """Concurrent requests when not configured: as many as the cache holds at SLOT_TOKENS tokens each, from
    MIN_DEFAULT_SEQS to MAX_DEFAULT_SEQS (more slots than the cache can fill only preempt; on a CPU each decode
    batch bucket costs its rows)."""
    return max(MIN_DEFAULT_SEQS, min(MAX_DEFAULT_SEQS, num_blocks * block_size // SLOT_TOKENS))


@dataclass(frozen=True)
class EngineConfig:
    block_size: int = 16
    num_blocks: int | None = None  # default: sized from the memory the instance may use (engine/memory.py)
    memory_fraction: float | None = None  # ... that memory: 0.9 of an accelerator's, 0.05 of a CPU host's
    max_num_seqs: int | None = None  # default: sized from the cache (default_max_num_seqs)
    max_num_batched_tokens: int | None = None  # default: from the device (default_batched_tokens)
    mixed_batched_tokens: int | None = None  # prefill tokens in a step that also decodes (None: the step budget)
    chunk_size: int | None = None  # default: sized from the model and budget (default_chunk_size)
    max_prefill_seqs: int = 4
    max_waiting: int = 256
    max_model_len: int | None = None  # default: the model's context, capped by the pool
    prefix_caching: bool = True
    num_snapshots: int = 32  # request-level state snapshots kept for prefix reuse
    kernels: str = "auto"  # kernels or jnp references: auto / reference / pallas / interpret / native
    spill_dir: str | None = None  # a disk tier for cached blocks evicted from the pool (cache/disk_tier.py) ...
    spill_mb: int | None = None  # ... of at most this size
    compilation_cache: str | None = XLA_CACHE  # XLA's persistent compilation cache (None: off)
    # dispatch a steady decode step before reading the one in flight (engine/overlap.py); None: default_overlap
    overlap: bool | None = None
    # runs of identical layers as one lax.scan (models/stack.py); None: with the CPU kernels, not with Pallas ones
    scan_layers: bool | None = None
    # a model of full GQA attention layers only prefills in one packed program per step over the pool, a mixed
    # step's decode tokens in it too (runner.paged_prefill); None: with the native kernels (a CPU), not the Pallas
    # ones; true: with either
    packed_prefill: bool | None = None

    def __post_init__(self):
        if self.memory_fraction is not None and not 0 < self.memory_fraction <= 1:
            raise ValueError(f"engine.memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.max_num_seqs is None and self.num_blocks is not None:
            object.__setattr__(self, "max_num_seqs", default_max_num_seqs(self.num_blocks, self.block_size))
        if (self.spill_dir is None) != (self.spill_mb is None):
            raise ValueError("engine.spill_dir and engine.spill_mb go together")
        from jaxserve.pallas_kernels.select import MODES
        for name in ("scan_layers", "packed_prefill"):
            if getattr(self, name) not in (None, True, False):
                raise ValueError(f"engine.{name} must be true, false or null, got {getattr(self, name)!r}")
        if self.kernels not in MODES:
            raise ValueError(f"engine.kernels must be one of {', '.join(MODES)}, got {self.kernels!r}")
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if type(v) is int and v < (0 if f.name == "num_snapshots" else 1):
                raise ValueError(f"engine.{f.name} must be >= 1, got {v}")


# field -> its default (None where the engine sizes it: num_blocks, max_num_seqs, chunk_size, ...)
DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
