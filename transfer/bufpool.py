"""Preallocated, 64-byte-aligned receive pools.

A receiving worker allocates one large host buffer up front and hands each incoming transfer a region of
it, so `recv_into` writes the bytes where they stay and `jax.numpy.from_dlpack` wraps them without a copy
(JAX copies DLPack buffers that are not 64-byte aligned). Regions are whole pages (4 KiB, so every region is
aligned) managed by the segment allocator the KV pool uses: a transfer gets one contiguous region, and
frees merge back. A transfer that does not fit waits or is refused (`PoolFull`), which is the receive side's
backpressure. A `shared` pool lives in a POSIX shared-memory segment (page aligned), so a sender on the same
host can write a region directly (shm.py). Thread-safe (one lock).
"""

from __future__ import annotations

import mmap
import os
import threading
import uuid

import numpy as np

from .segments import OutOfBlocks, SegmentAllocator

PAGE = 4096
ALIGN = 64


class PoolFull(RuntimeError):
    pass


SHM_DIR = "/dev/shm"


def create_segment(nbytes: int) -> tuple[str, mmap.mmap]:
    """A new POSIX shared-memory segment (owner-only) mapped here: (name, mapping). Page aligned."""
    name = f"jaxserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return name, mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)


def attach_segment(name: str) -> mmap.mmap:
    """Map an existing segment (another process's receive pool) into this process."""
    if "/" in name:
        raise ValueError(f"bad shared-memory segment name {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        return mmap.mmap(fd, 0)
    finally:
        os.close(fd)


def remove_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass


def remove_segments_of(pid: int) -> list[str]:
    """Remove the receive-pool segments a (dead) process created: a killed worker cannot remove its own."""
    prefix = f"jaxserve-kv-{pid}-"
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(prefix)]
    except FileNotFoundError:
        return []
    for n in names:
        remove_segment(n)
    return names


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """An uninitialised uint8 array of nbytes whose data pointer is a multiple of `align`."""
    raw = np.empty(nbytes + align, np.uint8)
    off = (-raw.ctypes.data) % align
    return raw[off:off + nbytes]


class Region:
    def __init__(self, pool: "RecvPool", start_page: int, pages: int, nbytes: int):
        self.pool, self.start_page, self.pages, self.nbytes = pool, start_page, pages, nbytes
        self.offset = start_page * PAGE  # in the pool (in its shared-memory segment, for a shared pool)
        self.buf = pool.buf[start_page * PAGE:start_page * PAGE + nbytes]
        self.freed = False

    def free(self) -> None:
        self.pool.free(self)


class RecvPool:
    def __init__(self, nbytes: int, shared: bool = False):
        if nbytes < PAGE:
            raise ValueError(f"receive pool of {nbytes} bytes is smaller than one page ({PAGE})")
        self.num_pages = nbytes // PAGE
        self.shm_name: str | None = None  # the shared-memory segment, when shared
        if shared:
            self.shm_name, mapping = create_segment(self.num_pages * PAGE)
            self.buf = np.frombuffer(mapping, np.uint8)
        else:
            self.buf = aligned_empty(self.num_pages * PAGE)
        self._alloc = SegmentAllocator(self.num_pages)
        self._lock = threading.Lock()

    def close(self) -> None:
        """Remove the shared-memory segment's name (the memory goes when the last mapping of it does)."""
        if self.shm_name is not None:
            remove_segment(self.shm_name)
            self.shm_name = None

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
                start = self._alloc.allocate_run(pages)  # a region must be contiguous
            except OutOfBlocks:
                raise PoolFull(f"receive pool: no contiguous {nbytes} bytes free (fragmented)") from None
        return Region(self, start, pages, nbytes)

    def free(self, region: Region) -> None:
        with self._lock:
            if region.freed:
                raise ValueError("receive region freed twice")
            region.freed = True
            self._alloc.free_run(region.start_page, region.pages)
