"""Segment allocator (FlowKV): best fit, contiguity, neighbour merge, errors. No JAX."""

import random

import pytest

from jaxserve.transfer.segments import OutOfBlocks, SegmentAllocator


def test_contiguous_best_fit_and_merge():
    a = SegmentAllocator(32)
    x = a.allocate(8)
    y = a.allocate(4)
    z = a.allocate(8)
    assert x == list(range(0, 8)) and y == list(range(8, 12)) and z == list(range(12, 20))
    a.free(y)  # hole of 4 at 8, tail of 12 at 20
    assert a.segments() == [(8, 4), (20, 12)]
    assert a.allocate(3) == [8, 9, 10]  # best fit: the 4-hole, not the 12-tail
    a.free([8, 9, 10])
    assert a.segments() == [(8, 4), (20, 12)]
    a.free(x)  # merges with the hole on its right
    assert a.segments() == [(0, 12), (20, 12)]
    a.free(z)  # bridges both
    assert a.segments() == [(0, 32)] and a.num_free == 32


def test_hint_continues_a_request_and_fragmented_fallback():
    a = SegmentAllocator(16)
    first = a.allocate(4)
    assert a.allocate(2, hint=first[-1] + 1) == [4, 5]
    # fragment: free every other pair so no run of 6 exists
    b = SegmentAllocator(12)
    blocks = b.allocate(12)
    b.free(blocks[0:2] + blocks[4:6] + blocks[8:10])
    got = b.allocate(6)
    assert sorted(got) == [0, 1, 4, 5, 8, 9] and b.num_free == 0
    with pytest.raises(OutOfBlocks):
        b.allocate(1)


def test_errors():
    a = SegmentAllocator(8)
    with pytest.raises(OutOfBlocks):
        a.allocate(9)
    assert a.num_free == 8  # nothing taken by a failed allocation
    got = a.allocate(2)
    a.free(got)
    with pytest.raises(ValueError, match="double free"):
        a.free(got)
    with pytest.raises(ValueError, match="outside"):
        a.free([8])


def test_random_workload_never_leaks_and_stays_merged():
    rng = random.Random(0)
    a = SegmentAllocator(200)
    held = []
    for _ in range(2000):
        if held and (rng.random() < 0.5 or a.num_free < 10):
            a.free(held.pop(rng.randrange(len(held))))
        else:
            n = rng.randint(1, 10)
            held.append(a.allocate(n))
        owned = sorted(b for h in held for b in h)
        assert len(owned) == len(set(owned)) and len(owned) + a.num_free == 200
        segs = a.segments()
        assert all(s1 + l1 < s2 for (s1, l1), (s2, _) in zip(segs, segs[1:]))  # maximal runs
    for h in held:
        a.free(h)
    assert a.segments() == [(0, 200)]


def test_runs_allocate_best_fit_and_free_without_block_lists():
    a = SegmentAllocator(1 << 20)  # a receive pool's pages: runs must not cost time per page
    x = a.allocate_run(1000)
    y = a.allocate_run(10)
    assert (x, y) == (0, 1000) and a.num_free == (1 << 20) - 1010
    a.free_run(x, 1000)  # a hole of 1000 at 0, the tail after 1010
    assert a.allocate_run(600) == 0  # best fit: the hole, not the tail
    assert a.segments() == [(600, 400), (1010, (1 << 20) - 1010)]
    with pytest.raises(ValueError, match="double free"):
        a.free_run(500, 200)
    with pytest.raises(ValueError, match="outside"):
        a.free_run((1 << 20) - 5, 10)
    with pytest.raises(ValueError):
        a.allocate_run(0)
    b = SegmentAllocator(12)
    blocks = b.allocate(12)
    b.free(blocks[0:2] + blocks[4:6] + blocks[8:10])  # 6 free, no run of 3
    with pytest.raises(OutOfBlocks, match="contiguous"):
        b.allocate_run(3)
    assert b.num_free == 6  # nothing taken by a failed allocation
    a.free_run(0, 600)
    a.free_run(y, 10)
    assert a.segments() == [(0, 1 << 20)]
