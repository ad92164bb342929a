"""transfer/arena.py: places in driver allocations for CUDA IPC staging (plain bookkeeping, a fake driver)."""

from __future__ import annotations

import pytest

from jaxserve.transfer.arena import ALIGN, Arena, ArenaFull


class Driver:
    """alloc / free over made-up addresses, 1 GiB apart; refuses once `left` allocations are spent."""

    def __init__(self, left: int = 99):
        self.live: dict[int, int] = {}
        self.left, self.next = left, 1 << 30

    def alloc(self, n: int) -> int:
        if not self.left:
            raise RuntimeError("cuMemAlloc_v2: CUDA_ERROR_OUT_OF_MEMORY")
        self.left -= 1
        base, self.next = self.next, self.next + (1 << 30)
        self.live[base] = n
        return base

    def free(self, base: int) -> None:
        del self.live[base]


def test_places_are_aligned_first_fit_and_merge_when_given_back():
    d = Driver()
    a = Arena(d.alloc, d.free, chunk_bytes=8 * ALIGN, limit_bytes=64 * ALIGN)
    base, o1 = a.take(1)
    assert o1 == 0 and d.live == {base: 8 * ALIGN}
    assert a.take(ALIGN + 1) == (base, ALIGN)  # rounded up to two units
    assert a.take(ALIGN) == (base, 3 * ALIGN)
    assert a.used == 4 * ALIGN and a.reserved == 8 * ALIGN
    a.give(base, ALIGN)  # a hole of two units between the first and the third
    assert a.take(2 * ALIGN) == (base, ALIGN)  # first fit: the hole
    a.give(base, ALIGN)
    a.give(base, 0)
    a.give(base, 3 * ALIGN)  # all three merge with the tail: one hole of the whole chunk
    assert a.used == 0 and a.take(8 * ALIGN) == (base, 0)
    with pytest.raises(KeyError):
        a.give(base, ALIGN)  # never taken


def test_the_arena_grows_by_chunks_up_to_its_limit_then_refuses():
    d = Driver()
    a = Arena(d.alloc, d.free, chunk_bytes=4 * ALIGN, limit_bytes=12 * ALIGN)
    b1, _ = a.take(4 * ALIGN)
    b2, o = a.take(ALIGN)  # the first chunk is full: a second
    assert b2 != b1 and o == 0
    with pytest.raises(ArenaFull, match="do not fit"):
        a.take(5 * ALIGN)  # a chunk of its own size would pass the limit (4 + 4 + 5 > 12)
    b3, o = a.take(4 * ALIGN)  # a chunk-sized one still fits under it
    assert o == 0 and len(d.live) == 3 and a.reserved == 12 * ALIGN
    a.give(b1, 0)
    assert a.take(3 * ALIGN) == (b1, 0)  # room given back is found again, no new chunk
    a.close()
    assert d.live == {} and a.reserved == 0


def test_a_driver_out_of_memory_is_arena_full():
    d = Driver(left=1)
    a = Arena(d.alloc, d.free, chunk_bytes=2 * ALIGN, limit_bytes=64 * ALIGN)
    a.take(2 * ALIGN)
    with pytest.raises(ArenaFull, match="CUDA_ERROR_OUT_OF_MEMORY"):
        a.take(ALIGN)
    assert a.reserved == 2 * ALIGN


def test_sizes_that_cannot_work_are_refused():
    d = Driver()
    for chunk, limit in ((0, 1 << 20), (ALIGN + 1, 1 << 20), (4 * ALIGN, 2 * ALIGN)):
        with pytest.raises(ValueError, match="chunk_bytes"):
            Arena(d.alloc, d.free, chunk, limit)
