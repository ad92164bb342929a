"""The default KV cache size from the memory the instance may use (engine/memory.py): an accelerator's memory
after the weights and activations, a share of the host's on a CPU; explicit settings win; too little memory is a
clear error naming the setting."""

from __future__ import annotations

import logging

import pytest

from jaxserve.engine import memory, overlap
from jaxserve.engine.llm_engine import EngineConfig, LLMEngine

GiB = memory.GiB


class FakeDevice:
    def __init__(self, limit, used):
        self.stats = {"bytes_limit": limit, "bytes_in_use": used}

    def memory_stats(self):
        return self.stats


def test_an_accelerator_gives_the_cache_what_weights_and_activations_leave():
    # 100 GiB the allocator may use, 16 GiB of weights, 2 GiB of activations, 0.9 of it: 72 GiB for blocks of 2 MiB
    got = memory.size_cache(devices=[FakeDevice(100 * GiB, 16 * GiB)], fraction=None, block_bytes=2 << 20,
                            fixed_bytes=0, weight_bytes=16 * GiB, activations=2 * GiB, block_size=16,
                            max_blocks=10**9)
    assert got.num_blocks == (90 * GiB - 18 * GiB) // (2 << 20) == 36864
    assert "0.9 of 100.0 GiB per device" in got.line and "36864 blocks" in got.line
    # two devices (the pool split over their heads): the tightest one's room, twice, less the state rows
    two = memory.size_cache(devices=[FakeDevice(100 * GiB, 16 * GiB), FakeDevice(100 * GiB, 20 * GiB)],
                            fraction=0.5, block_bytes=2 << 20, fixed_bytes=GiB, weight_bytes=0,
                            activations=2 * GiB, block_size=16, max_blocks=10**9)
    assert two.num_blocks == (2 * (50 * GiB - 20 * GiB - GiB) - GiB) // (2 << 20)
    # never more than every slot's longest context
    assert memory.size_cache(devices=[FakeDevice(100 * GiB, 0)], fraction=None, block_bytes=1024, fixed_bytes=0,
                             weight_bytes=0, activations=0, block_size=16, max_blocks=4096).num_blocks == 4096
    with pytest.raises(ValueError, match="engine.memory_fraction: 0.2 of 100.0 GiB.*raise engine.memory_fraction "
                                         "or set engine.num_blocks"):
        memory.size_cache(devices=[FakeDevice(100 * GiB, 19 * GiB)], fraction=0.2, block_bytes=2 << 20,
                          fixed_bytes=0, weight_bytes=0, activations=GiB, block_size=16, max_blocks=10**9)


class CPU:
    def memory_stats(self):
        return None


def test_a_cpu_gives_the_cache_a_share_of_the_host():
    host = memory.host_memory()
    got = memory.size_cache(devices=[CPU()], fraction=None, block_bytes=1 << 20, fixed_bytes=0, weight_bytes=GiB,
                            activations=GiB, block_size=16, max_blocks=10**9)
    assert got.num_blocks == int(memory.CPU_FRACTION * host) // (1 << 20)
    assert f"0.05 of the host's {host / GiB:.1f} GiB" in got.line


def test_the_engine_sizes_its_cache_unless_told(checkpoint_dir, caplog):
    path = checkpoint_dir("llama")
    with caplog.at_level(logging.INFO, logger="jaxserve.engine"):
        eng = LLMEngine(path, config=EngineConfig(max_num_seqs=4, compilation_cache=None), progress=False)
    # the tiny model's blocks are small: capped at every slot's longest context (512 tokens, 32 blocks, 4 slots)
    assert eng.cfg.num_blocks == 4 * 32 and eng.blocks.num_blocks == 128 and eng.cfg.max_num_seqs == 4
    assert any("KV cache: 128 blocks of 16 tokens" in r.message and "max_num_seqs 4" in r.message
               for r in caplog.records)
    assert eng.cache_line.startswith("KV cache: 128 blocks of 16 tokens (2048 tokens") and "0.05 of the host" in \
        eng.cache_line  # what the worker and the server print at start-up
    sized = LLMEngine(path, config=EngineConfig(compilation_cache=None), progress=False)
    assert sized.cfg.max_num_seqs == 256 and sized.cfg.num_blocks == 256 * 32  # 256 slots from the cache
    told = LLMEngine(path, config=EngineConfig(num_blocks=40, compilation_cache=None), progress=False)
    assert told.cfg.num_blocks == 40 and told.cfg.max_num_seqs == 8  # explicit wins; slots from its cache
    assert told.cache_line == ("KV cache: 40 blocks of 16 tokens (engine.num_blocks); max_num_seqs 8; "
                               "max_num_batched_tokens 1024 (on a cpu: engine.max_num_batched_tokens sets it); "
                               "float32 (dtype auto on a cpu)")
    assert told.cfg.max_num_batched_tokens == told.scheduler.cfg.max_num_batched_tokens == 1024  # a CPU's budget
    assert told.dtype_name == "float32"  # dtype auto on a CPU
    assert told.cfg.overlap is False and not overlap.enabled(told)  # synchronous steps on a CPU (settings.py)
    budget = LLMEngine(path, "float32", EngineConfig(num_blocks=40, max_num_batched_tokens=64, compilation_cache=None),
                       progress=False)
    assert budget.cache_line.endswith("; max_num_batched_tokens 64; float32")  # explicit: said as it is
    assert "bfloat16 on a CPU" not in caplog.text  # float32: no word about it
    LLMEngine(path, "bfloat16", EngineConfig(num_blocks=40, compilation_cache=None), progress=False)
    assert "bfloat16 on a CPU: each step's KV write converts the whole cache (40 blocks)" in caplog.text
    with pytest.raises(ValueError, match="memory_fraction must be in"):
        EngineConfig(memory_fraction=1.5)
