"""The global KV store's pool in shared memory (cache/shared_pool.py), read in place by a prefill instance on its
host: engines in one process standing for the store and the prefill instance. A prefix reaches the store over
the transfer layer (its numpy import into the segment, then published in the segment's table); the reader maps
the segment, finds the prefix's blocks by hash and copies them into its own prefix cache, without the store
doing anything: in one pass with the program compiled for that store (cache/pool_copy.py), or staged on the
host and imported with its warmed import program. The reader's greedy tokens for a longer prompt equal the
colocated engine's (dense, sliding window, MLA + linear attention with request-level state); reading compiles
nothing past the reader's warm-up; a read that a write of the store races is refused and leaves nothing behind
(also under a writer thread hammering the block); the store still exports over the transfer layer from the
shared pool."""

from __future__ import annotations

import dataclasses
import itertools
import sys
import threading
import time

import jax
import numpy as np
import pytest

from jaxserve import LLM
from jaxserve.cache.block_manager import block_hashes
from jaxserve.cache.shared_pool import Missed, SharedPool
from jaxserve.engine.llm_engine import LLMEngine
from tests.disagg.test_inprocess import CFG, GREEDY
from tests.disagg.test_prefix_move import FOLLOWUP, PREFIX, PROMPT, Mover, run
from jaxserve.transfer.bufpool import aligned_empty
from jaxserve.transfer.plan import layer_groups, staging


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
    groups = layer_groups(reader.layout.num_layers, 1)  # a layer group per layer (what a staged load would use)
    reader.runner.warmup_transfer("float32", groups, export=False, receive=True, progress=False)
    warmed = len(reader.runner._io._import)
    desc = store.runner.shared.describe()
    assert reader.prepare_loads(SharedPool.shapes(desc, reader.layout, "float32")) == 1  # from shapes alone
    pool = SharedPool.attach(desc, reader.layout, "float32")
    try:
        assert reader.prepare_loads(pool) == 0  # compiled for that store already
        held, mine = store.blocks.num_referenced(), reader.blocks.num_referenced()
        with pytest.raises(Missed, match="does not hold"):  # a prefix the store never saw: nothing taken
            reader.connector.load_prefix(PROMPT[:8] + [60, 61, 62, 63], pool, groups)
        assert reader.blocks.num_referenced() == mine and len(reader.blocks.snapshots) == 0
        # one pass: 3 blocks (and the snapshot at their end), nothing staged
        block = sum(a[0].nbytes for g, gl in zip(pool.arrays, reader.layout.groups) if gl.kind == "full"
                    for a in jax.tree.leaves(g))
        got = reader.connector.load_prefix(PREFIX, pool, groups)
        assert got >= 3 * block and (got > 3 * block) == reader.layout.has_request_state, (got, block)
        assert reader.connector._load_buf.nbytes == 0 and len(reader.runner._io._import) == warmed  # nothing compiled
        assert len(reader.runner.copies) == 1
        assert store.blocks.num_referenced() == held  # the store did nothing for the read

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
    """bfloat16 lives in the segment as its uint16 bits: a reader's blocks equal the computing engine's bit for
    bit, staged and in one pass. A pool of another layout or dtype is refused by name."""
    path = checkpoint_dir("llama")
    src, store = store_of(path, "bfloat16")
    desc = store.runner.shared.describe()
    assert {lf["dtype"] for lf in desc["leaves"]} == {"uint16"}
    pools = []
    try:
        for one_pass in (False, True):
            reader = LLMEngine(path, "bfloat16", CFG, progress=False)
            reader.blocks.allocate([], 7 * CFG.block_size)
            pools.append(pool := SharedPool.attach(desc, reader.layout, "bfloat16"))
            if one_pass:
                assert reader.prepare_loads(pool) == 1
            assert reader.connector.load_prefix(PREFIX, pool) > 0
            assert (reader.connector._load_buf.nbytes == 0) == one_pass
            mine = reader.connector.cached_prefix(PREFIX)[0]
            theirs = src.connector.cached_prefix(PREFIX)[0]
            assert mine != theirs
            for g in range(len(reader.layout.groups)):
                a = np.asarray(jax.device_get(reader.runner.pool[g][np.asarray(mine)]))
                b = np.asarray(jax.device_get(src.runner.pool[g][np.asarray(theirs)]))
                assert a.dtype == b.dtype and a.tobytes() == b.tobytes(), one_pass
        with pytest.raises(ValueError, match="another model's KV"):
            SharedPool.attach(desc, reader.layout, "float32")
        with pytest.raises(ValueError, match="do not match"):
            SharedPool.attach({**desc, "leaves": desc["leaves"][:1] * 2}, reader.layout, "bfloat16")
        with pytest.raises(ValueError, match="another model's KV"):
            SharedPool.shapes(desc, reader.layout, "float32")
    finally:
        for pool in pools:
            pool.close()
        store.runner.shared.close()


@pytest.mark.parametrize("one_pass", [False, True], ids=["staged", "one_pass"])
def test_a_read_that_a_store_write_races_is_refused_and_takes_nothing(checkpoint_dir, one_pass):
    """The store rewrites one of the prefix's blocks (its disk tier's write path) while the reader copies them
    (staged: as it stages them; in one pass: after the reader located them, before its copy read them): the read
    is refused (the block's generation moved) and the reader keeps neither blocks nor hashes nor a snapshot row
    (one pass takes the row before the copy and gives it back); while the block is unpublished it is not read at
    all; once the store publishes it again, the same read succeeds."""
    path = checkpoint_dir("kimi_linear")  # blocks and a snapshot row
    src, store = store_of(path)
    reader = LLMEngine(path, "float32", CFG, progress=False)
    pool = SharedPool.attach(store.runner.shared.describe(), reader.layout, "float32")
    if one_pass:
        reader.prepare_loads(pool)
    blocks, row = store.connector.cached_prefix(PREFIX)
    data = store.runner.read_blocks(blocks[1:2])

    class Racing:  # the store's pool, with the store's write landing while the reader copies
        def __getattr__(self, name):
            return getattr(pool, name)

        def stage(self, *a):
            store.runner.write_blocks(blocks[1:2], data)  # the same KV, even: a write is a write
            pool.stage(*a)

        def views(self):
            if one_pass:
                store.runner.write_blocks(blocks[1:2], data)
            return pool.views()
    try:
        mine = reader.blocks.num_referenced()
        with pytest.raises(Missed, match="while they were read"):
            reader.connector.load_prefix(PREFIX, Racing())
        with pytest.raises(Missed, match="does not hold block 1"):  # written, not published again yet
            reader.connector.load_prefix(PREFIX, pool)
        assert reader.blocks.num_referenced() == mine and not reader.blocks.hash_block
        assert len(reader.blocks.snapshots) == 0
        assert len(reader.blocks.snapshots._free) == reader.blocks.snapshots.capacity
        store.connector.cache_arrived(blocks, PREFIX, block_hashes(PREFIX, CFG.block_size), row)
        assert reader.connector.load_prefix(PREFIX, pool) > 0
        assert (reader.connector._load_buf.nbytes == 0) == one_pass
        seq = run(reader, "b", FOLLOWUP)
        assert seq.num_cached == len(PREFIX)
        assert seq.output == LLM(path, progress=False, engine=CFG).generate([FOLLOWUP], GREEDY)[0].token_ids
    finally:
        pool.close()
        store.runner.shared.close()


def test_reads_under_a_writer_thread_never_see_a_torn_block(checkpoint_dir):
    """A writer thread rewrites block 0 over and over (write i: every value i, published under hash A for even
    i, B for odd), each time followed by a write of block 1, as a reader looks for hash A and stages it. Every
    read that `intact` accepts holds one even value throughout; the race is exercised (some reads are refused)
    and reads do succeed. Publishing what an entry holds already writes nothing."""
    eng = LLMEngine(checkpoint_dir("llama"), "float32", CFG, progress=False)
    layout = dataclasses.replace(eng.layout, block_size=512, num_blocks=2)  # 256 KiB blocks: the copies take time
    owner = SharedPool.create(layout, "float32")
    pool = SharedPool.attach(owner.describe(), layout, "float32")
    keys = [bytes([k]) * 16 for k in (1, 2, 3)]
    shape = owner.arrays[0].shape[1:]
    st = staging(layout, "float32", 1, [(0, layout.num_layers)])
    views = st.views(aligned_empty(st.nbytes))
    done = threading.Event()
    counts = {"good": 0, "refused": 0, "last": 0}

    def writer():
        # At least 600 writes, and on until the reader has both succeeded and been refused (a loaded machine's
        # reader may otherwise lose every race): a short pause every 8 writes leaves it windows to succeed in.
        deadline = time.monotonic() + 60
        try:
            for i in itertools.count():
                owner.write_blocks([0], [0], [[np.full(shape, float(i), np.float32)]])
                owner.publish([0], [keys[i % 2]])
                owner.write_blocks([0], [1], [[np.full(shape, -1.0, np.float32)]])  # block 0 stays put meanwhile
                owner.publish([1], [keys[2]])
                counts["last"] = i
                if i >= 599 and ((counts["good"] and counts["refused"]) or time.monotonic() > deadline):
                    break
                if i % 8 == 7:
                    time.sleep(0.002)
        finally:
            done.set()
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    t = threading.Thread(target=writer)
    t.start()
    good, refused, torn = 0, 0, 0
    try:
        while not done.is_set():
            counts.update(good=good, refused=refused)
            try:
                blocks, _, ticket = pool.locate(keys[:1], None)
            except Missed:
                refused += 1
                continue
            pool.stage(st, views, blocks, 0)
            if not pool.intact(ticket):
                refused += 1
                continue
            got = np.asarray(views[0])
            if got.min() != got.max() or int(got.flat[0]) % 2:
                torn += 1
            good += 1
        t.join()
        g = owner.gens[:2].copy()
        # as they are (a put sharing them): readers unaffected
        owner.publish([0, 1], [keys[counts["last"] % 2], keys[2]])
        assert (owner.gens[:2] == g).all()
        other = keys[1 - counts["last"] % 2]
        owner.publish([0], [other])  # another hash: a write
        assert owner.gens[0] == g[0] + 2 and pool.locate([other], None)[0] == [0]
    finally:
        done.wait()
        t.join()
        sys.setswitchinterval(old)
        pool.close()
        owner.close()
    assert torn == 0, (torn, good, refused)
    assert good > 0 and refused > 0, (good, refused)


def test_a_reader_holding_the_prefix_in_part_reads_only_the_rest(checkpoint_dir):
    """The reader holds the prefix's first blocks already (an earlier, shorter read): a read of the whole prefix
    copies only the blocks after them, and the next request is served from both, with the colocated tokens."""
    path = checkpoint_dir("llama")
    want = LLM(path, progress=False, engine=CFG).generate([FOLLOWUP], GREEDY)[0].token_ids
    src, store = store_of(path)
    reader = LLMEngine(path, "float32", CFG, progress=False)
    pool = SharedPool.attach(store.runner.shared.describe(), reader.layout, "float32")
    try:
        first = reader.connector.load_prefix(PREFIX[:8], pool)  # two of its three blocks
        rest = reader.connector.load_prefix(PREFIX, pool)
        assert 0 < rest < first  # staged: the third block only (padded to its bucket)
        seq = run(reader, "b", FOLLOWUP)
        assert seq.num_cached == len(PREFIX) and seq.output == want
        reader.blocks.check()
    finally:
        pool.close()
        store.runner.shared.close()
