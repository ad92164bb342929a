"""The KV cache's size when it is not configured, from the memory the instance may use (vLLM's rule).

On an accelerator the instance may take `memory_fraction` (default 0.9) of each device's memory as JAX's
allocator reports it (`bytes_limit`: XLA_PYTHON_CLIENT_MEM_FRACTION of the card, 0.75 unless set): what the
weights already hold (`bytes_in_use` once they are loaded) and an estimate of the programs' activations come
off, and the cache takes the rest. On a CPU the cache takes `memory_fraction` (default 0.05) of the host's
memory (the cgroup's limit where lower), beside the weights. The blocks are that budget over one block's bytes
(full-attention layers) after the request-level state rows of the slots; `max_num_seqs`, when not configured,
follows from the blocks (engine/settings.py `default_max_num_seqs`, up to 256). Explicit settings win.

Plain functions; the caller passes the devices and the pool's byte counts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

ACCELERATOR_FRACTION = 0.9
CPU_FRACTION = 0.05
MAX_DEFAULT_SEQS = 256  # the most concurrent requests a default takes
MIN_BLOCKS = 16
GiB = 1 << 30


class NoRoom(ValueError):
    """The memory the instance may use holds no cache (the message names the setting to change)."""


@dataclass(frozen=True)
class CacheSize:
    num_blocks: int
    budget: int  # bytes the cache may take
    line: str  # what was chosen and from what, for the startup log


def host_memory() -> int:
    """Bytes of host memory this process may use: the machine's, or its cgroup's limit where lower."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                v = f.read().strip()
        except OSError:
            continue
        if v.isdigit():
            total = min(total, int(v))
    return total


def device_memory(devices) -> tuple[int, int] | None:
    """(bytes the allocator may hand out, bytes in use) of the tightest of `devices`, or None where the devices
    report no memory statistics (a CPU)."""
    stats = [d.memory_stats() for d in devices]
    if not stats or any(not s or "bytes_limit" not in s for s in stats):
        return None
    s = min(stats, key=lambda s: s["bytes_limit"] - s.get("bytes_in_use", 0))
    return int(s["bytes_limit"]), int(s.get("bytes_in_use", 0))


def activation_bytes(hidden: int, intermediate: int, vocab: int, tokens: int, rows: int) -> int:
    """An upper estimate of one step's working memory: float32 residual, attention and MLP intermediates of its
    tokens, the logits and sampling buffers of its rows, and a fixed margin for XLA's scratch."""
    per_token = 4 * (8 * hidden + 3 * intermediate)
    return 2 * tokens * per_token + 4 * 4 * rows * vocab + GiB // 2


def size_cache(*, devices, fraction: float | None, block_bytes: int, fixed_bytes: int, weight_bytes: int,
               activations: int, block_size: int, max_blocks: int) -> CacheSize:
    """The number of cache blocks for the memory the instance may use (see the module docstring). block_bytes:
    one block's bytes over the whole pool (all full-attention groups); fixed_bytes: the pool's bytes that do not
    scale with blocks (state rows); max_blocks: the most worth having (every default slot at the longest
    context). Raises NoRoom when fewer than MIN_BLOCKS fit."""
    mem = device_memory(devices)
    n = len(devices)
    if mem is not None:
        f = ACCELERATOR_FRACTION if fraction is None else fraction
        limit, used = mem
        budget = int(f * limit) - used - activations // n
        budget = budget * n - fixed_bytes  # the pool is split over the devices (heads), evenly
        where = (f"{f:g} of {limit / GiB:.1f} GiB per device, {used / GiB:.1f} GiB in use (weights), "
                 f"{activations / GiB:.1f} GiB kept for activations")
    else:
        f = CPU_FRACTION if fraction is None else fraction
        host = host_memory()
        budget = int(f * host) - fixed_bytes
        where = f"{f:g} of the host's {host / GiB:.1f} GiB (the weights take {weight_bytes / GiB:.2f} GiB beside it)"
    blocks = min(max(budget, 0) // max(block_bytes, 1), max_blocks)
    if blocks < MIN_BLOCKS:
        raise NoRoom(f"engine.memory_fraction: {where} leaves room for {blocks} KV cache blocks "
                           f"({block_bytes / (1 << 20):.1f} MiB each), fewer than {MIN_BLOCKS}; raise "
                           "engine.memory_fraction or set engine.num_blocks")
    line = (f"KV cache: {blocks} blocks of {block_size} tokens ({blocks * block_size} tokens, "
            f"{blocks * block_bytes / GiB:.2f} GiB) from {where}"
            + (" (capped: every slot's longest context)" if blocks == max_blocks else ""))
    return CacheSize(int(blocks), int(blocks * block_bytes), line)
