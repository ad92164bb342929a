"""engine/xla_cache.py: JAX's bounded compilation cache with a cheap eviction, against JAX's own file cache: the
bound holds, the least recently used entries go first, and the directory is listed once per SCAN_EVERY writes
when far from the bound instead of on every write."""

import os

from jax._src.lru_cache import LRUCache

from jaxserve.engine import xla_cache


def test_the_bound_holds_and_the_least_recently_used_go_first(tmp_path, monkeypatch):
    assert xla_cache.cheap_eviction()
    assert LRUCache._evict_if_needed is xla_cache._evict_if_needed
    listings = []
    entries = xla_cache.entries
    monkeypatch.setattr(xla_cache, "entries", lambda path: listings.append(path) or entries(path))
    cache = LRUCache(str(tmp_path), max_size=1000)
    for i in range(8):
        cache.put(f"k{i}", bytes(100))
    assert cache.get("k0") == bytes(100)  # k0 used last: k1 is now the least recently used
    for i in range(8, 12):
        cache.put(f"k{i}", bytes(100))
    total, found = xla_cache.entries(str(tmp_path))
    assert total == 1000 and {k for k, _ in found} == {"k0"} | {f"k{i}" for i in range(3, 12)}
    assert not (tmp_path / "k1-atime").exists() and (tmp_path / "k0-atime").exists()
    # a listing for the first write, then none until this process's count of what it wrote could pass the bound
    # (the 11th write: 1,000 + 100 bytes), then before each write, near it
    assert len(listings) == 1 + 3
    # far from it: one listing for the first write, then one per SCAN_EVERY writes of this process
    listings.clear()
    far = LRUCache(str(tmp_path / "far"), max_size=1 << 30)
    for i in range(2 * xla_cache.SCAN_EVERY + 5):
        far.put(f"f{i}", bytes(10))
    assert len(listings) == 3 and far.get("f0") == bytes(10)


def test_another_processs_writes_count_at_the_next_listing(tmp_path, monkeypatch):
    """Two caches over one directory (two processes): each one's count misses the other's writes until it lists
    the directory again, every SCAN_EVERY writes, where it evicts what both wrote past the bound."""
    monkeypatch.setattr(xla_cache, "SCAN_EVERY", 8)
    a, b = (LRUCache(str(tmp_path), max_size=2000) for _ in range(2))
    a.put("a0", bytes(100))  # a's first listing: nothing there
    for i in range(15):
        b.put(f"b{i}", bytes(100))  # b lists at its first and 8th writes
    for i in range(1, 6):
        a.put(f"a{i}", bytes(100))  # a counts 600 bytes: no listing
    assert xla_cache.entries(str(tmp_path))[0] == 2100
    b.put("b15", bytes(100))  # b's 16th write lists, and evicts the least recently used
    total, found = xla_cache.entries(str(tmp_path))
    assert total == 2000 and "a0" not in {k for k, _ in found} and "b0" not in {k for k, _ in found}


def test_evict_drops_entries_without_an_access_time_first(tmp_path):
    for key, atime in (("old", 1), ("new", 3), ("none", None)):
        (tmp_path / f"{key}-cache").write_bytes(bytes(10))
        if atime is not None:
            (tmp_path / f"{key}-atime").write_bytes(atime.to_bytes(8, "little"))
    assert xla_cache.evict(str(tmp_path), 30) == 30  # nothing to do
    assert xla_cache.evict(str(tmp_path), 15, additional_size=5) == 10
    assert sorted(os.listdir(tmp_path)) == ["new-atime", "new-cache"]
