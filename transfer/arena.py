"""Places in a few large allocations of the driver's own: the staging memory CUDA IPC shares where JAX's own
allocations cannot be shared (ipc.StagedCudaIpc).

Chunks are allocated as needed (`chunk_bytes` each, or a request's own size where it is larger) up to
`limit_bytes`, and kept for the process's life, so a peer maps each chunk once and keeps the mapping. A place is
taken first fit in the first chunk with room and given back when the peer has copied it; adjacent free space
merges. `alloc` and `free` are the driver's (ptr = alloc(nbytes), free(ptr)); the bookkeeping is plain Python.
`ArenaFull` when the limit is reached or the driver has no memory left: the caller sends that offer another way.
Concurrency: one lock, held across a chunk's allocation (rare) and every take and give.
"""

from __future__ import annotations

import threading

ALIGN = 512  # every place starts at a multiple (DMA-friendly, and any dtype's alignment)


class ArenaFull(RuntimeError):
    """No place for that many bytes within the arena's limit (or the driver refused another chunk)."""


def _up(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


class Arena:
    def __init__(self, alloc, free, chunk_bytes: int = 64 << 20, limit_bytes: int = 4 << 30):
        if chunk_bytes <= 0 or chunk_bytes % ALIGN or limit_bytes < chunk_bytes:
            raise ValueError(f"chunk_bytes {chunk_bytes} must be a positive multiple of {ALIGN}, "
                             f"limit_bytes {limit_bytes} at least that")
        self._alloc, self._free = alloc, free
        self.chunk_bytes, self.limit_bytes = chunk_bytes, limit_bytes
        self._chunks: dict[int, int] = {}  # base -> bytes, in allocation order
        self._holes: dict[int, list[list[int]]] = {}  # base -> [[offset, bytes]] free, by offset
        self._taken: dict[tuple[int, int], int] = {}  # (base, offset) -> bytes
        self._lock = threading.Lock()

    @property
    def reserved(self) -> int:
        """Bytes allocated from the driver."""
        with self._lock:
            return sum(self._chunks.values())

    @property
    def used(self) -> int:
        """Bytes in places taken and not given back."""
        with self._lock:
            return sum(self._taken.values())

    def take(self, nbytes: int) -> tuple[int, int]:
        """A place for `nbytes` -> (its chunk's base pointer, its offset there). Raises ArenaFull."""
        n = _up(nbytes)
        with self._lock:
            for base in self._chunks:
                off = self._fit(base, n)
                if off is not None:
                    return base, off
            size = max(self.chunk_bytes, n)
            have = sum(self._chunks.values())
            if have + size > self.limit_bytes:
                raise ArenaFull(f"{nbytes} bytes do not fit: {have} of the staging limit {self.limit_bytes} "
                                f"allocated, {sum(self._taken.values())} in use")
            try:
                base = self._alloc(size)
            except Exception as e:  # noqa: BLE001 - the driver's error (out of memory): the caller goes another way
                raise ArenaFull(f"the driver gave no {size} bytes more: {e}") from e
            self._chunks[base] = size
            self._holes[base] = [[0, size]]
            return base, self._fit(base, n)

    def _fit(self, base: int, n: int) -> int | None:
        holes = self._holes[base]
        for i, (off, size) in enumerate(holes):
            if size >= n:
                if size == n:
                    del holes[i]
                else:
                    holes[i] = [off + n, size - n]
                self._taken[(base, off)] = n
                return off
        return None

    def give(self, base: int, offset: int) -> None:
        """The place (base, offset) is free again. Raises KeyError for one not taken."""
        with self._lock:
            n = self._taken.pop((base, offset))
            holes = self._holes[base]
            i = next((k for k, h in enumerate(holes) if h[0] > offset), len(holes))
            holes.insert(i, [offset, n])
            if i + 1 < len(holes) and offset + n == holes[i + 1][0]:  # merge with the next
                holes[i][1] += holes.pop(i + 1)[1]
            if i > 0 and holes[i - 1][0] + holes[i - 1][1] == offset:  # and the previous
                holes[i - 1][1] += holes.pop(i)[1]

    def close(self) -> None:
        """Give every chunk back to the driver (no peer may read them any more)."""
        with self._lock:
            chunks, self._chunks, self._holes, self._taken = list(self._chunks), {}, {}, {}
        for base in chunks:
            self._free(base)
