"""Block manager: reference counts, prefix hash chain, state snapshots, LRU eviction, no leaks. No JAX."""

import pytest

from jaxserve.cache.block_manager import BlockManager, block_hashes
from jaxserve.transfer.segments import OutOfBlocks


def test_hash_chain_names_the_whole_prefix():
    a = block_hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    b = block_hashes([1, 2, 3, 4, 5, 6, 7, 8, 9], 4)
    c = block_hashes([0, 2, 3, 4, 5, 6, 7, 8], 4)
    assert a == b and len(a) == 2
    assert a[1] != c[1]  # same second block, different first: different chain
    # a growing sequence extends its chain: the same hashes as hashing it all again
    tokens = list(range(3, 30))
    assert block_hashes(tokens, 4, block_hashes(tokens[:9], 4)) == block_hashes(tokens, 4)
    assert block_hashes(tokens[:5], 4, block_hashes(tokens, 4)) == block_hashes(tokens[:5], 4)


def test_prefix_hit_shares_blocks_and_leaves_one_token():
    m = BlockManager(16, 4)
    p = list(range(10))
    blocks = m.allocate([], len(p))
    m.register(blocks, p, len(p))
    hits, cached, _ = m.match(p, needs_snapshot=False)
    assert hits == blocks[:2] and cached == 8
    exact = list(range(8))  # a prompt of exactly two blocks reuses only the first
    assert m.match(exact, False)[1] == 4
    other = m.allocate(hits, len(p))
    assert other[:2] == blocks[:2] and m.ref[blocks[0]] == 2
    m.free(blocks)
    m.free(other)
    m.check()
    assert m.num_free == 16 and len(m.evictable) == 2  # hashed blocks stay cached


def test_eviction_is_lru_and_drops_hashes():
    m = BlockManager(4, 2)
    a, b = [1, 2, 3, 4, 5], [6, 7, 8, 9, 10]
    ba = m.allocate([], 4)
    m.register(ba, a, 4)
    m.free(ba)
    bb = m.allocate([], 4)  # the pool has 4 blocks: a's two cached blocks are still free
    m.register(bb, b, 4)
    m.free(bb)
    assert m.match(a, False)[1] == 4 and m.match(b, False)[1] == 4
    got = m.allocate([], 4)  # no free block left: evicts the 2 least recently released (a's)
    m.check()
    assert sorted(got) == sorted(ba) and m.num_free == 2
    assert m.match(a, False)[1] == 0 and m.match(b, False)[1] == 4
    with pytest.raises(OutOfBlocks):
        m.allocate([], 6)
    m.free(got)
    m.check()


def test_snapshots_gate_reuse_for_request_state():
    m = BlockManager(16, 4, num_snapshots=2)
    p = list(range(13))
    blocks = m.allocate([], len(p))
    hashes = m.register(blocks, p, 12)
    assert m.match(p, needs_snapshot=True)[1] == 0  # blocks cached, but no state snapshot anywhere
    row = m.snapshots.acquire(hashes[1])
    hits, cached, got = m.match(p, needs_snapshot=True)
    assert cached == 8 and got == row and hits == blocks[:2]
    # LRU over snapshot rows, pinned rows are never replaced
    r2 = m.snapshots.acquire(hashes[0])
    assert m.snapshots.acquire(hashes[2], pinned={row, r2}) is None
    assert m.snapshots.acquire(hashes[2], pinned={r2}) == row  # `row` was least recently used... replaced
    m.free(blocks)
    m.check()


def test_refcount_errors():
    m = BlockManager(4, 2)
    b = m.allocate([], 2)
    m.free(b)
    with pytest.raises(ValueError, match="freed more often"):
        m.free(b)


def test_uncache_drops_a_cached_block_that_no_request_holds():
    """A warm-up after start-up writes block 0: if the prefix cache holds it, it must leave the cache first."""
    from jaxserve.cache.events import CacheEvents
    ev = CacheEvents()
    m = BlockManager(8, 4, events=ev)
    p = list(range(9))
    blocks = m.allocate([], len(p))
    first = m.register(blocks, p, len(p))[0]
    seq = ev.next_seq
    assert m.uncache(blocks[0]) is False  # a request holds it: left alone
    assert m.match(p, False)[1] == 8
    m.free(blocks)
    assert m.uncache(blocks[0]) is True
    assert m.match(p, False)[1] == 0  # the chain is broken at its first block
    assert m.match(p[4:], False)[1] == 0
    m.check()
    assert m.num_free == 8 and blocks[0] not in m.evictable
    assert ev.since(seq)["events"] == [["removed", [first.hex()]]]  # the router's KV index hears of it
    assert m.uncache(7) is True  # neither cached nor held: nothing to do
    m.check()


def test_held_blocks_are_counted_without_a_pass_over_the_pool_and_a_leak_is_still_caught():
    """num_referenced (the engine's stats ask each step) is the pool less its free and evictable blocks, equal to
    counting the held ones through allocation, sharing, caching, eviction and freeing; check() counts them one by
    one, so a block lost from every list is still found."""
    m = BlockManager(32, 4)
    counted = lambda: sum(1 for r in m.ref if r > 0)  # noqa: E731
    p = list(range(17))
    a = m.allocate([], len(p))
    m.register(a, p, len(p))
    b = m.allocate(m.match(p, False)[0], len(p) + 3)  # shares a's cached blocks
    assert m.num_referenced() == counted() == len(set(a) | set(b))
    m.free(a)
    assert m.num_referenced() == counted() == len(b)
    m.free(b)
    assert m.num_referenced() == counted() == 0 and len(m.evictable) > 0
    c = m.allocate([], 4 * 32)  # evicts every cached block
    assert m.num_referenced() == counted() == 32
    m.free(c)
    m.check()
    m.ref[c[0]] = 1  # held by nobody's list: a leak
    with pytest.raises(AssertionError, match="block leak"):
        m.check()
