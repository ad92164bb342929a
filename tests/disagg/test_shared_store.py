"""The global KV store's pool in shared memory (cache/shared_pool.py), read in place by a prefill instance on its
host: engines in one process standing for the store and the prefill instance. A prefix reaches the store over
the transfer layer (its numpy import into the segment), the store leases it, the reader maps the segment,
stages the prefix's blocks from it and imports them into its own prefix cache with its warmed import program; the reader's greedy tokens for a longer prompt
equal the colocated engine's (dense, sliding window, MLA + linear attention with request-level state), the
lease pins what it names, reading it compiles nothing past the reader's transfer warm-up, and the store still
exports over the transfer layer from the shared pool."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.cache.shared_pool import SharedPool
from jaxserve.engine.llm_engine import LLMEngine
from tests.disagg.test_inprocess import CFG, GREEDY
from tests.disagg.test_prefix_move import FOLLOWUP, PREFIX, PROMPT, Mover, run
from transfer.plan import layer_groups
from transfer.segments import OutOfBlocks


def store_of(path: str, dtype: str = "float32") -> tuple[LLMEngine, LLMEngine]:
    """(src: an engine that computed PROMPT, store: a shared-pool engine that received PREFIX from it)"""
    src = LLMEngine(path, dtype, CFG, progress=False)
    store = LLMEngine(path, dtype, CFG, progress=False)
    store.runner.share_pool()
    store.blocks.allocate([], 5 * CFG.block_size)  # block ids differ between the pools
    run(src, "a", PROMPT)
    move(src, store, "m")
    return src, store


def move(src: LLMEngine, dst: LLMEngine, rid: str) -> None:
    """PREFIX from src's prefix cache into dst's, over the transfer layer."""
    mover = Mover(dst)
    try:
        outcomes, _, _ = mover.move(src, rid, PREFIX)
        assert outcomes == [None]
    finally:
        mover.close()


@pytest.mark.parametrize("family", ["llama", "gpt_oss", "kimi_linear"])
def test_a_prefix_read_from_the_stores_shared_pool_serves_the_next_request(checkpoint_dir, family):
    path = checkpoint_dir(family)
    want = LLM(path, progress=False, engine=CFG).generate([FOLLOWUP], GREEDY)[0].token_ids
    src, store = store_of(path)
    reader = LLMEngine(path, "float32", CFG, progress=False)
    reader.blocks.allocate([], 2 * CFG.block_size)
    groups = layer_groups(reader.layout.num_layers, 1)  # a layer group per layer: staged group by group
    reader.runner.warmup_transfer("float32", groups, export=False, receive=True, progress=False)
    warmed = len(reader.runner._io._import)
    pool = SharedPool.attach(store.runner.shared.describe(), reader.layout, "float32")
    try:
        held = store.blocks.num_referenced()
        lease = store.lease_prefix(PREFIX)
        assert lease is not None and store.lease_prefix(PROMPT[:8] + [60, 61, 62, 63]) is None
        blocks, row = lease
        assert store.blocks.num_referenced() == held + len(blocks)  # pinned: never evicted while leased
        assert (row - store.snapshot_base in store.leased_rows) == store.layout.has_request_state
        with pytest.raises(OutOfBlocks):  # every block but the leased ones is taken: the lease holds
            store.blocks.allocate([], (CFG.num_blocks - held) * CFG.block_size)
        assert reader.load_prefix(PREFIX, pool, blocks, row, groups) == len(PREFIX)
        assert len(reader.runner._io._import) == warmed  # the transfer layer's import programs, as warmed
        store.end_lease(blocks, row)
        assert store.blocks.num_referenced() == held and not store.leased_rows

        seq = run(reader, "b", FOLLOWUP)
        assert seq.num_cached == len(PREFIX)  # served from the copied blocks (and snapshot), not recomputed
        assert seq.output == want, family
        reader.blocks.check()
        assert reader.blocks.num_referenced() == 2

        # the store still serves a reader on another host: its export reads the shared pool
        far = LLMEngine(path, "float32", CFG, progress=False)
        move(store, far, "m2")
        seq = run(far, "c", FOLLOWUP)
        assert seq.num_cached == len(PREFIX) and seq.output == want, family
        store.blocks.check()
    finally:
        pool.close()
        store.runner.shared.close()


def test_the_shared_pool_carries_bfloat16_bits_exactly_and_refuses_another_model(checkpoint_dir):
    """bfloat16 lives in the segment as its uint16 bits: the reader's blocks equal the computing engine's bit
    for bit. A pool of another layout or dtype is refused by name."""
    path = checkpoint_dir("llama")
    src, store = store_of(path, "bfloat16")
    reader = LLMEngine(path, "bfloat16", CFG, progress=False)
    reader.blocks.allocate([], 7 * CFG.block_size)
    desc = store.runner.shared.describe()
    assert {lf["dtype"] for lf in desc["leaves"]} == {"uint16"}
    pool = SharedPool.attach(desc, reader.layout, "bfloat16")
    try:
        blocks, row = store.lease_prefix(PREFIX)
        assert reader.load_prefix(PREFIX, pool, blocks, row) == len(PREFIX)
        store.end_lease(blocks, row)
        mine = reader.cached_prefix(PREFIX)[0]
        theirs = src.cached_prefix(PREFIX)[0]
        assert mine != theirs
        for g in range(len(reader.layout.groups)):
            a = np.asarray(jax.device_get(reader.runner.pool[g][np.asarray(mine)]))
            b = np.asarray(jax.device_get(src.runner.pool[g][np.asarray(theirs)]))
            assert a.dtype == b.dtype and a.tobytes() == b.tobytes()
        with pytest.raises(ValueError, match="another model's KV"):
            SharedPool.attach(desc, reader.layout, "float32")
        with pytest.raises(ValueError, match="do not match"):
            SharedPool.attach({**desc, "leaves": desc["leaves"][:1] * 2}, reader.layout, "bfloat16")
    finally:
        pool.close()
        store.runner.shared.close()
