"""Preallocated, 64-byte-aligned receive pools.

A receiving worker allocates one large host buffer up front and hands each incoming transfer a region of
it, so `recv_into` writes the bytes where they stay and `jax.numpy.from_dlpack` wraps them without a copy
(JAX copies DLPack buffers that are not 64-byte aligned). Regions are whole pages (4 KiB, so every region is
aligned) managed by the segment allocator the KV pool uses: a transfer gets one contiguous region, and
frees merge back. A transfer that does not fit waits or is refused (`PoolFull`), which is the receive side's
backpressure. Thread-safe (one lock).
"""

from __future__ import annotations

import threading

import numpy as np

from jaxserve.cache.allocator import OutOfBlocks, SegmentAllocator

PAGE = 4096
ALIGN = 64


class PoolFull(RuntimeError):
    pass


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array of nbytes whose data pointer is a multiple of `align`."""
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


class Region:
    def __init__(self, pool: "RecvPool", start_page: int, pages: int, nbytes: int):
        self.pool, self.start_page, self.pages, self.nbytes = pool, start_page, pages, nbytes
        self.buf = pool.buf[start_page * PAGE:start_page * PAGE + nbytes]
        self.freed = False

    def free(self) -> None:
        self.pool.free(self)


class RecvPool:
    def __init__(self, nbytes: int):
        if nbytes < PAGE:
            raise ValueError(f"receive pool of {nbytes} bytes is smaller than one page ({PAGE})")
        self.num_pages = nbytes // PAGE
        self.buf = aligned_empty(self.num_pages * PAGE)
        self._alloc = SegmentAllocator(self.num_pages)
        self._lock = threading.Lock()

    @property
    def capacity(self) -> int:
        return self.num_pages * PAGE

    @property
    def free_bytes(self) -> int:
        with self._lock:
            return self._alloc.num_free * PAGE

    def allocate(self, nbytes: int) -> Region:
        pages = max(1, -(-nbytes // PAGE))
        with self._lock:
            if pages > self._alloc.num_free:
                raise PoolFull(f"receive pool: need {nbytes} bytes, {self._alloc.num_free * PAGE} free "
                               f"of {self.capacity}")
            try:
                ids = self._alloc.allocate(pages)
            except OutOfBlocks as e:
                raise PoolFull(str(e)) from None
            if ids != list(range(ids[0], ids[0] + pages)):  # fragmented: a region must be contiguous
                self._alloc.free(ids)
                raise PoolFull(f"receive pool: no contiguous {nbytes} bytes free (fragmented)")
        return Region(self, ids[0], pages, nbytes)

    def free(self, region: Region) -> None:
        with self._lock:
            if region.freed:
                raise ValueError("receive region freed twice")
            region.freed = True
            self._alloc.free(list(range(region.start_page, region.start_page + region.pages)))
