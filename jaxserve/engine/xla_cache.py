"""XLA's persistent compilation cache as the engine uses it: on, every program cached however fast it compiled,
bounded, and kept cheap to write.

Bounded, JAX reads and writes each entry under a file lock, which processes sharing a host need: unbounded, JAX
writes an entry in place, and another process reading it meanwhile (instances warming up from one cache) loads a
partial executable (a worker crashed so, in a segmentation fault). But JAX's bounded cache, before each write,
lists the directory and stats and reads every entry's access time, holding the lock: 160 ms a write at 3,000
entries on a 2-core VM (the test suite's cache), every other process's reads and writes waiting behind it.
`cheap_eviction` replaces that scan with one that sums the entries' sizes from a single directory listing, at
most every SCAN_EVERY writes of a process unless its own writes may have crossed the bound, and reads access
times only when something must go. Entries, their names and the lock stay JAX's own: a process without the
change shares the directory safely (it only writes slower).

One lock per cache directory, JAX's; the scan state is per process, under that lock.
"""

from __future__ import annotations

import heapq
import importlib.util
import logging
import os

import jax

log = logging.getLogger("jaxserve.engine")

XLA_CACHE_MAX_BYTES = 32 << 30  # the persistent compilation cache's bound
SCAN_EVERY = 64  # writes between two listings of the directory (others' writes are seen at the next)
CACHE_SUFFIX, ATIME_SUFFIX = "-cache", "-atime"  # JAX's entry and access-time files (jax/_src/lru_cache.py)


def use_compilation_cache(path: str | None) -> str | None:
    """XLA's persistent compilation cache in `path`, every program cached however fast it compiled, so a
    restart on the same model and config compiles nothing. A cache JAX already has (JAX_COMPILATION_CACHE_DIR,
    or an earlier engine in this process) is kept; None or "" leaves it off. Returns the directory in use.

    The cache is bounded (XLA_CACHE_MAX_BYTES, least recently used entries evicted past it) unless a bound is
    set already, and its eviction made cheap (`cheap_eviction`)."""
    current = jax.config.jax_compilation_cache_dir
    if jax.config.jax_compilation_cache_max_size == -1 and importlib.util.find_spec("filelock") is not None:
        jax.config.update("jax_compilation_cache_max_size", XLA_CACHE_MAX_BYTES)  # JAX locks with filelock
    cheap_eviction()
    if current or not path:
        return current or None
    d = os.path.abspath(os.path.expanduser(path))
    os.makedirs(d, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", d)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    return d


def entries(path: str) -> tuple[int, list[tuple[str, int]]]:
    """(total bytes, [(key, bytes)]) of the cache entries in directory `path`, from one listing."""
    total, found = 0, []
    with os.scandir(path) as it:
        for e in it:
            if e.name.endswith(CACHE_SUFFIX):
                try:
                    size = e.stat().st_size
                except FileNotFoundError:  # evicted by another process meanwhile
                    continue
                total += size
                found.append((e.name[:-len(CACHE_SUFFIX)], size))
    return total, found


def _last_used(path: str, key: str) -> int:
    try:
        with open(os.path.join(path, key + ATIME_SUFFIX), "rb") as f:
            return int.from_bytes(f.read(), "little")
    except (FileNotFoundError, ValueError):
        return 0  # no access time: the first to go


def evict(path: str, max_size: int, additional_size: int = 0) -> int:
    """Delete the least recently used entries of the cache in `path` until it holds at most max_size bytes with
    `additional_size` more -> its bytes after (the caller holds the cache's lock)."""
    total, found = entries(path)
    if total + additional_size <= max_size:
        return total
    heap = [(_last_used(path, key), key, size) for key, size in found]
    heapq.heapify(heap)
    while heap and total + additional_size > max_size:
        _, key, size = heapq.heappop(heap)
        for suffix in (CACHE_SUFFIX, ATIME_SUFFIX):
            try:
                os.unlink(os.path.join(path, key + suffix))
            except FileNotFoundError:
                pass
        total -= size
    return total


_jax_evict = None  # JAX's own LRUCache._evict_if_needed, for a cache not on a local file system


def _evict_if_needed(self, *, additional_size: int = 0) -> None:
    """LRUCache._evict_if_needed, listing the directory only every SCAN_EVERY writes or when this process's
    writes since the last listing could reach the bound."""
    if not self.eviction_enabled:
        return
    if not os.path.isdir(str(self.path)):  # a remote path (etils' epath): JAX's own listing
        return _jax_evict(self, additional_size=additional_size)
    state = self.__dict__.setdefault("_jaxserve_scan", {"writes": 0, "total": None, "added": 0})
    state["writes"] += 1
    near = state["total"] is None or state["total"] + state["added"] + additional_size > self.max_size
    if near or state["writes"] % SCAN_EVERY == 0:
        state["total"], state["added"] = evict(str(self.path), self.max_size, additional_size), 0
    state["added"] += additional_size


def cheap_eviction() -> bool:
    """JAX's bounded file cache evicts through `_evict_if_needed` above, in this process -> whether it does (False:
    a JAX whose cache is not laid out as expected keeps its own)."""
    try:
        from jax._src import lru_cache
    except ImportError:
        return False
    cls = getattr(lru_cache, "LRUCache", None)
    if cls is None or not callable(getattr(cls, "_evict_if_needed", None)) \
            or (getattr(lru_cache, "_CACHE_SUFFIX", None), getattr(lru_cache, "_ATIME_SUFFIX", None)) \
            != (CACHE_SUFFIX, ATIME_SUFFIX):
        log.debug("JAX's compilation cache is not laid out as expected: its own eviction is kept")
        return False
    global _jax_evict
    if cls._evict_if_needed is not _evict_if_needed:
        _jax_evict, cls._evict_if_needed = cls._evict_if_needed, _evict_if_needed
    return True
