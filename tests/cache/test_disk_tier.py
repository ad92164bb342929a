"""The disk tier under the prefix cache (cache/disk_tier.py): evicted blocks keep their KV on disk, stay held for
the router's index until the tier's budget drops them, and come back bit for bit into fresh blocks of an engine
(LLMEngine.cached_prefix: the store's Export path)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from jaxserve.cache.block_manager import BlockManager, block_hashes
from jaxserve.cache.disk_tier import DiskTier
from jaxserve.cache.events import CacheEvents

SHAPES = [((2, 2, 4, 1, 3), np.float32)]  # one block: layers, E, block_size, heads, D


def block(v: float) -> list[np.ndarray]:
    return [np.full(SHAPES[0][0], v, np.float32)]


def test_blocks_evicted_from_the_pool_stay_held_until_the_tier_drops_them(tmp_path):
    events = CacheEvents()
    bm = BlockManager(4, 4, events=events)
    tier = DiskTier(str(tmp_path / "spill"), 2 * (2 * 2 * 4 * 3 * 4), SHAPES)  # room for 2 blocks
    content = {}  # what the "pool" holds per block id
    bm.spill, bm.read_blocks = tier, lambda ids: [block(content[b]) for b in ids]
    toks = list(range(100, 116))  # 4 blocks
    ids = bm.allocate([], 16)
    for b in ids:
        content[b] = float(b + 1)
    hashes = bm.register(ids, toks, 16)
    bm.free(ids)
    seq0 = events.next_seq
    bm.allocate([], 12)  # 3 fresh blocks: three cached ones evicted to disk, the oldest of those dropped
    assert len(tier) == 2 and tier.saved == 3 and tier.dropped == 1
    removed = [h for _, kind, hs in list(events._log) if _ >= seq0 and kind == "removed" for h in hs]
    assert len(removed) == 1  # only the dropped one is lost for the index
    held = set(bm.full_state()["full"]["blocks"])
    assert held == {h.hex() for h in hashes} - set(removed)
    # a spilled chain is found after the cached blocks, and loads back as it was
    start = next(i for i, h in enumerate(hashes) if h.hex() not in removed and h not in bm.hash_block)
    assert bm.spilled(hashes, start) >= 1
    got = tier.load(hashes[start])
    assert got is not None and np.array_equal(got[0], block(content[ids[start]])[0])
    # a damaged file is forgotten, not served
    with open(tier._file(hashes[start]), "wb") as f:
        f.write(b"short")
    assert tier.load(hashes[start]) is None and hashes[start] not in tier
    with pytest.raises(ValueError, match="smaller than one block"):
        DiskTier(str(tmp_path / "x"), 10, SHAPES)


def test_an_engine_brings_a_spilled_prefix_back_bit_for_bit(checkpoint_dir, tmp_path):
    from jaxserve import LLM, SamplingParams

    from tests.engine.test_engine import ENGINE
    cfg = dataclasses.replace(ENGINE, num_blocks=12, spill_dir=str(tmp_path / "spill"), spill_mb=1)
    eng = LLM(checkpoint_dir("llama"), progress=False, engine=cfg).engine
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    def run(prompt, rid):
        eng.add_request(rid, prompt, params)
        while eng.has_work:
            for s in eng.step():
                if s.finished:
                    eng.release(s)
    prefix = [5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14]  # 3 blocks of 4
    run(prefix + [20], "a")
    found = eng.connector.cached_prefix(prefix)
    assert found is not None
    before = eng.runner.read_blocks(found[0])
    for i in range(2):  # other prompts push the prefix out of the 12-block pool
        run([40 + 50 * i + j for j in range(40)], f"b{i}")
    hashes = block_hashes(prefix, 4)
    assert not any(h in eng.blocks.hash_block for h in hashes) and all(h in eng.blocks.spill for h in hashes)
    assert eng.stats()["spilled_blocks"] >= 3
    found = eng.connector.cached_prefix(prefix)  # back from disk into fresh blocks, cached again
    assert found is not None and all(h in eng.blocks.hash_block for h in hashes)
    after = eng.runner.read_blocks(found[0])
    assert all(np.array_equal(x, y) for a, b in zip(before, after) for x, y in zip(a, b))
    assert eng.stats()["spill_loaded"] == 3
    eng.blocks.check()
