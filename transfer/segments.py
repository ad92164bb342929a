"""FlowKV's segment allocator: free blocks kept as contiguous segments, best-fit allocation, merge on free.

Free space is a set of maximal runs [start, start + length). Runs are indexed by start and by end (for
merging with neighbours in O(1)) and sit in min-heaps, one per size class (floor(log2(length))), keyed by
(length, start) with lazy deletion. Allocating n blocks takes the smallest run of length >= n (best fit:
scan n's own class, otherwise the top of the next non-empty class), so a request lands in one contiguous
run whenever one exists; otherwise it takes the largest runs until satisfied ("one or few segments").
`hint` lets a growing request continue right after its last block when that block is free.

Plain Python, single-threaded (the engine thread owns it).
"""

from __future__ import annotations

import heapq


class OutOfBlocks(RuntimeError):
    pass


class SegmentAllocator:
    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._by_start: dict[int, int] = {}  # start -> length
        self._by_end: dict[int, int] = {}  # end (exclusive) -> start
        self._heaps: dict[int, list[tuple[int, int]]] = {}
        self.num_free = 0
        self._insert(0, num_blocks)

    # ---- segment bookkeeping
    def _insert(self, start: int, length: int) -> None:
        self._by_start[start] = length
        self._by_end[start + length] = start
        heapq.heappush(self._heaps.setdefault(length.bit_length() - 1, []), (length, start))
        self.num_free += length

    def _remove(self, start: int) -> int:
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        self.num_free -= length
        return length  # its heap entry goes stale and is skipped later

    def _live(self, entry: tuple[int, int]) -> bool:
        length, start = entry
        return self._by_start.get(start) == length

    def _best_fit(self, n: int) -> int | None:
        cls = n.bit_length() - 1
        heap = self._heaps.get(cls)
        if heap:
            best = None
            for entry in heap:
                if entry[0] >= n and self._live(entry) and (best is None or entry < best):
                    best = entry
            if best is not None:
                return best[1]
        for c in sorted(k for k in self._heaps if k > cls):
            heap = self._heaps[c]
            while heap and not self._live(heap[0]):
                heapq.heappop(heap)
            if heap:
                return heap[0][1]
        return None

    def segments(self) -> list[tuple[int, int]]:
        """Free runs as sorted (start, length)."""
        return sorted(self._by_start.items())

    # ---- public API
    def allocate(self, n: int, hint: int | None = None) -> list[int]:
        """n block ids; raises OutOfBlocks (allocating nothing) when fewer than n are free."""
        if n <= 0:
            return []
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        out: list[int] = []
        if hint is not None and hint in self._by_start:
            out += range(hint, hint + self._cut(hint, n))
        while len(out) < n:
            need = n - len(out)
            start = self._best_fit(need)
            if start is None:  # no single run fits: largest first
                start = max(self._by_start.items(), key=lambda kv: (kv[1], -kv[0]))[0]
            out += range(start, start + self._cut(start, need))
        return out

    def allocate_run(self, n: int) -> int:
        """The first of n contiguous blocks (best fit), in time independent of n; raises OutOfBlocks when no
        free run is that long."""
        if n <= 0:
            raise ValueError(f"a run needs at least one block, got {n}")
        start = self._best_fit(n)
        if start is None:
            raise OutOfBlocks(f"no {n} contiguous blocks free ({self.num_free} free in {len(self._by_start)} runs)")
        self._cut(start, n)
        return start

    def _cut(self, start: int, n: int) -> int:
        """Take up to n blocks from the front of the free run at `start`; how many were taken."""
        length = self._remove(start)
        k = min(n, length)
        if length > k:
            self._insert(start + k, length - k)
        return k

    def free(self, blocks) -> None:
        """Return blocks; each maximal run merges with free neighbours on both sides."""
        ids = sorted(blocks)
        i = 0
        while i < len(ids):
            j = i
            while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
                j += 1
            self.free_run(ids[i], ids[j] - ids[i] + 1)
            i = j + 1

    def free_run(self, start: int, length: int) -> None:
        """Return the blocks [start, start + length); the run merges with free neighbours on both sides."""
        if start < 0 or start + length > self.num_blocks:
            raise ValueError(f"blocks [{start}, {start + length}) outside the pool of {self.num_blocks}")
        if self._overlaps(start, length):
            raise ValueError(f"double free of blocks in [{start}, {start + length})")
        if start in self._by_end:  # merge left
            left = self._by_end[start]
            length += self._remove(left)
            start = left
        if start + length in self._by_start:  # merge right
            length += self._remove(start + length)
        self._insert(start, length)

    def _overlaps(self, start: int, length: int) -> bool:
        # a free run containing `start`, or starting inside [start, start + length)
        for s, ln in self._by_start.items():
            if s < start + length and start < s + ln:
                return True
        return False
