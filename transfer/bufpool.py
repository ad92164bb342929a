"""Preallocated, 64-byte-aligned receive pools.

A receiving worker allocates one large host buffer up front and hands each incoming transfer a region of
it, so `recv_into` writes the bytes where they stay and `jax.numpy.from_dlpack` wraps them without a copy
(JAX copies DLPack buffers that are not 64-byte aligned). Regions are whole pages (4 KiB, so every region is
aligned) managed by the segment allocator the KV pool uses: a transfer gets one contiguous region, and
frees merge back. A transfer that does not fit waits or is refused (`PoolFull`), which is the receive side's
backpressure. A `shared` pool lives in a POSIX shared-memory segment (page aligned), so a sender on the same
host can write a region directly (shm.py). Segments are committed whole when created and removed when their
process exits (`remove_owned`: at exit, or before an os._exit; a killed process's go when the launcher reaps
or restarts it); a process that attaches one maps its pages on a thread of its own (`populate`), which touches
nothing else. Thread-safe (one lock).
"""

from __future__ import annotations

import atexit
import ctypes
import mmap
import os
import sys
import threading
import uuid

import numpy as np

from .segments import OutOfBlocks, SegmentAllocator

PAGE = 4096
ALIGN = 64


class PoolFull(RuntimeError):
    pass


class ShmFull(OSError):
    """/dev/shm cannot hold a new segment (its message says what sets the size)."""


SHM_DIR = "/dev/shm"


_OWNED: set[str] = set()  # segments created by this process and not removed yet: removed when it exits


@atexit.register
def remove_owned() -> None:
    """Remove the segments this process created (at exit; a process ending with os._exit calls it first)."""
    mine = f"jaxserve-kv-{os.getpid()}-"  # not a forked child's: the set came with the fork
    for name in list(_OWNED):
        if name.startswith(mine):
            remove_segment(name)


def create_segment(nbytes: int, what: str = "") -> tuple[str, mmap.mmap]:
    """A new POSIX shared-memory segment (owner-only) mapped here: (name, mapping). Page aligned. Its memory is
    committed now: where /dev/shm cannot hold it this raises (ShmFull naming the size, the space left and
    `what` sets the size) rather than a write into it killing a process with SIGBUS later. Removed when this
    process exits, unless removed before (a killed process's segments: `remove_segments_of`)."""
    name = f"jaxserve-kv-{os.getpid()}-{uuid.uuid4().hex[:12]}"
    path = os.path.join(SHM_DIR, name)
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    _OWNED.add(name)
    try:
        os.ftruncate(fd, nbytes)
        try:
            if hasattr(os, "posix_fallocate"):  # where the OS has it (Linux does)
                os.posix_fallocate(fd, 0, nbytes)
        except OSError as e:
            st = os.statvfs(SHM_DIR)
            raise ShmFull(e.errno, f"{SHM_DIR} cannot hold a shared-memory segment of {nbytes} bytes "
                                   f"({os.strerror(e.errno)}; {st.f_bavail * st.f_frsize} bytes free): "
                                   f"{what + ', or ' if what else ''}a larger {SHM_DIR} (a container's: "
                                   f"docker run --shm-size)") from None
        return name, mmap.mmap(fd, nbytes)
    except BaseException:
        remove_segment(name)
        raise
    finally:
        os.close(fd)


def attach_segment(name: str) -> mmap.mmap:
    """Map an existing segment (another process's receive pool or KV pool) into this process; its pages are
    mapped in the background (`populate`)."""
    if "/" in name:
        raise ValueError(f"bad shared-memory segment name {name!r}")
    fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
    try:
        mapping = mmap.mmap(fd, 0)
    finally:
        os.close(fd)
    populate(mapping)
    return mapping


MADV_POPULATE_READ = 22  # Linux 5.14+


def populate(mapping: mmap.mmap) -> threading.Thread | None:
    """Map all of `mapping`'s pages into this process's page tables, on a thread of its own (-> it; None off
    Linux). Without it, the first read of each part of another process's segment takes page faults (one per
    page, or per few with the kernel's fault-around): a load of a prefix from the store's shared pool into
    blocks this process had not read before ran about 10% slower here. Best effort: where the kernel lacks
    MADV_POPULATE_READ (before 5.14), or the mapping is closed meanwhile, madvise fails and pages fault in as
    they are first read."""
    if not sys.platform.startswith("linux") or not len(mapping):
        return None
    view = ctypes.c_char.from_buffer(mapping)
    addr, n = ctypes.addressof(view), len(mapping)
    del view  # no export held: the mapping may still be closed
    libc = ctypes.CDLL(None, use_errno=True)
    # a foreign call: the GIL is released while the kernel maps the pages
    t = threading.Thread(target=libc.madvise, args=(ctypes.c_void_p(addr), ctypes.c_size_t(n), MADV_POPULATE_READ),
                         name="shm-populate", daemon=True)
    t.start()
    return t


def remove_segment(name: str) -> None:
    _OWNED.discard(name)
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
            self.shm_name, mapping = create_segment(self.num_pages * PAGE, "a smaller transfer.recv_pool_mb, "
                                                    "transfer.shared_memory: false")
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
