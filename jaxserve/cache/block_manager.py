"""Block manager: reference-counted blocks of the shared pool, prefix caching, LRU eviction.

A block holds `block_size` consecutive tokens of one request for every full-attention layer. Blocks come
from the segment allocator (transfer/segments.py, which serves the receive pools too), so a request's blocks
are contiguous whenever possible.

Prefix cache (vLLM style): a full block of prompt tokens gets the hash of (hash of the previous block, its
tokens), a chain that names the whole prefix. A new request reuses the longest chain of cached blocks
(reference count + 1), always leaving at least one prompt token to compute. Blocks whose count drops to 0
keep their hash and wait in an LRU list; they are evicted (hash dropped, returned to the allocator) only
when fresh blocks are needed.

Request-level state (linear-attention and sliding-window layers) cannot be cut at any length: the
`SnapshotPool` keeps copies of it taken at block boundaries, keyed by the chain hash at that boundary, so
it is reusable only at exactly that length. A model with such state reuses a prefix only up to a boundary
that has a snapshot.

With a disk tier (`spill`, disk_tier.py) evicted blocks keep their KV on disk and stay held (matchable by a
prefix read, `spilled`) until the tier drops them past its budget.

Every hash and snapshot gained or lost is reported to an events log (events.py) when one is given: the
router's global KV index follows it. Invariant (checked by `check()`): free + evictable + referenced blocks
== total. Plain Python; the engine thread owns it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

from jaxserve.transfer.segments import OutOfBlocks, SegmentAllocator


def block_hashes(tokens, block_size: int, known: list[bytes] = ()) -> list[bytes]:
    """Chain hash of every full block of `tokens`. known: the hashes of its first blocks, already computed
    (a growing sequence extends its chain instead of hashing it all again)."""
    out = list(known[:len(tokens) // block_size])
    prev = out[-1] if out else b""
    arr = np.asarray(tokens[len(out) * block_size:len(tokens) // block_size * block_size], np.int64)
    for i in range(len(arr) // block_size):
        prev = hashlib.blake2b(prev + arr[i * block_size:(i + 1) * block_size].tobytes(), digest_size=16).digest()
        out.append(prev)
    return out


class SnapshotPool:
    """`capacity` state rows holding request-level state at block boundaries; LRU replacement."""

    def __init__(self, capacity: int, events=None):
        self.capacity = capacity
        self.events = events  # events.CacheEvents or None
        self._rows: OrderedDict[bytes, int] = OrderedDict()  # hash -> row, oldest first
        self._free = list(range(capacity))

    def lookup(self, h: bytes) -> int | None:
        row = self._rows.get(h)
        if row is not None:
            self._rows.move_to_end(h)
        return row

    def __contains__(self, h: bytes) -> bool:
        return h in self._rows

    def acquire(self, h: bytes, pinned: set[int] = frozenset()) -> int | None:
        """A row to save the snapshot for `h` into (None when all rows are pinned or there are none)."""
        if h in self._rows:
            return None  # already held
        row = self._take(pinned)
        if row is not None:
            self.key(row, h)
        return row

    def _take(self, pinned: set[int]) -> int | None:
        """A free row, else the least recently used one not pinned (its snapshot forgotten); None if none."""
        if self._free:
            return self._free.pop()
        victim = next((k for k, r in self._rows.items() if r not in pinned), None)
        if victim is None:
            return None
        if self.events is not None:
            self.events.emit("unsnap", [victim])
        return self._rows.pop(victim)

    def rekey(self, old: bytes | None, h: bytes, pinned: set[int] = frozenset()) -> int | None:
        """A row for `h`, reusing the one keyed by `old` when it is still held (a decoding request moves its one
        snapshot forward to each new block boundary instead of filling the pool); else as `acquire`."""
        if old is None or old not in self._rows or h in self._rows:
            return self.acquire(h, pinned)
        row = self._rows.pop(old)
        self._rows[h] = row
        if self.events is not None:
            self.events.emit("unsnap", [old])
            self.events.emit("snap", [h])
        return row

    def release(self, h: bytes) -> None:
        """Forget the snapshot for `h` (its row was taken and never written): the row is free again."""
        row = self._rows.pop(h, None)
        if row is None:
            return
        self._free.append(row)
        if self.events is not None:
            self.events.emit("unsnap", [h])

    def __len__(self) -> int:
        return len(self._rows)

    def keys(self) -> list[bytes]:
        """The chain hashes whose snapshots are held, oldest first."""
        return list(self._rows)

    def hold(self, old: bytes | None, pinned: set[int] = frozenset()) -> int | None:
        """A row for a snapshot whose hash is not known yet (the overlapped loop: the token that completes its
        block is still on the device): the row keyed by `old` when still held, else a free or evicted one; it
        stays unkeyed, and out of eviction's reach, until `key` or `drop`. None when every row is pinned."""
        if old is not None and old in self._rows:
            row = self._rows.pop(old)
            if self.events is not None:
                self.events.emit("unsnap", [old])
            return row
        return self._take(pinned)

    def key(self, row: int, h: bytes) -> bool:
        """Key a held row by `h`, as `rekey` would have; False (the row freed) when `h` is held already."""
        if h in self._rows:
            self._free.append(row)
            return False
        self._rows[h] = row
        if self.events is not None:
            self.events.emit("snap", [h])
        return True

    def drop(self, row: int) -> None:
        """A held row that was never keyed is free again."""
        self._free.append(row)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, num_snapshots: int = 0, prefix_caching: bool = True,
                 events=None):
        """events: a CacheEvents log (events.py) told of every hash and snapshot gained and lost."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.allocator = SegmentAllocator(num_blocks)
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.block_hash: dict[int, bytes] = {}
        self.hash_block: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # ref 0 but hashed, oldest first
        self.events = events
        self.snapshots = SnapshotPool(num_snapshots if prefix_caching else 0, events)
        # a disk tier (disk_tier.py) that evicted cached blocks go to, and how to read their KV from the pool:
        # read_blocks(block ids) -> per block, its arrays (set by the engine with the tier)
        self.spill = None
        self.read_blocks = None
        self.query_tokens = 0
        self.hit_tokens = 0

    # ---- capacity
    @property
    def num_free(self) -> int:
        """Blocks obtainable right now (free + evictable)."""
        return self.allocator.num_free + len(self.evictable)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # ---- prefix cache
    def match(self, tokens, needs_snapshot: bool) -> tuple[list[int], int, int | None]:
        """Longest reusable prefix: (cached block ids, cached tokens, snapshot row or None)."""
        if not self.prefix_caching:
            return [], 0, None
        hashes = block_hashes(tokens, self.block_size)
        hits, row = self.cached(hashes[:(len(tokens) - 1) // self.block_size], needs_snapshot)
        return hits, len(hits) * self.block_size, row

    def cached(self, hashes: list[bytes], needs_snapshot: bool) -> tuple[list[int], int | None]:
        """The blocks of the longest cached run of `hashes` (a chain) and, with needs_snapshot, cut back to its
        longest snapshotted boundary and that snapshot's row: (block ids, row or None)."""
        hits: list[int] = []
        for h in hashes:
            b = self.hash_block.get(h)
            if b is None:
                break
            hits.append(b)
        row = None
        if needs_snapshot:
            while hits and hashes[len(hits) - 1] not in self.snapshots:
                hits.pop()
            if hits:
                row = self.snapshots.lookup(hashes[len(hits) - 1])
        return hits, row

    def record_query(self, num_tokens: int, num_hit: int) -> None:
        self.query_tokens += num_tokens
        self.hit_tokens += num_hit

    def register(self, block_ids: list[int], tokens, num_computed: int, known: list[bytes] = ()) -> list[bytes]:
        """Hash the full blocks among the first `num_computed` tokens (`known`: hashes already computed for the
        first of them); returns the chain hashes."""
        hashes = block_hashes(list(tokens)[:num_computed], self.block_size, known)
        if self.prefix_caching:
            new = []
            for b, h in zip(block_ids, hashes):
                if b not in self.block_hash and h not in self.hash_block:
                    self.block_hash[b], self.hash_block[h] = h, b
                    new.append(h)
            if self.events is not None:
                self.events.emit("stored", new)
        return hashes

    # ---- allocation
    def allocate(self, hits: list[int], num_tokens: int) -> list[int]:
        """Blocks for a request of `num_tokens` tokens whose first blocks are the cached `hits`."""
        new = self.blocks_for(num_tokens) - len(hits)
        if new > self.num_free - sum(1 for b in hits if b in self.evictable):
            raise OutOfBlocks(f"need {new} blocks, {self.num_free} free")
        for b in hits:
            self._incref(b)
        return hits + self._fresh(new, hint=hits[-1] + 1 if hits else None)

    def grow(self, block_ids: list[int], num_tokens: int) -> None:
        """Extend `block_ids` in place to cover `num_tokens` tokens (raises OutOfBlocks, changing nothing)."""
        need = self.blocks_for(num_tokens) - len(block_ids)
        if need > 0:
            block_ids += self._fresh(need, hint=block_ids[-1] + 1 if block_ids else None)

    def _incref(self, b: int) -> None:
        if self.ref[b] == 0:
            self.evictable.pop(b, None)
        self.ref[b] += 1

    def _fresh(self, n: int, hint: int | None) -> list[int]:
        if n <= 0:
            return []
        if n > self.num_free:
            raise OutOfBlocks(f"need {n} blocks, {self.num_free} free")
        evict, gone = [], []
        while self.allocator.num_free + len(evict) < n:
            b, _ = self.evictable.popitem(last=False)
            gone.append(self.block_hash.pop(b))
            del self.hash_block[gone[-1]]
            evict.append(b)
        if self.spill is not None and evict:  # their KV goes to disk: lost only when the tier drops it
            gone = self._spill(evict, gone)
        if self.events is not None:
            self.events.emit("removed", gone)
        self.allocator.free(evict)
        out = self.allocator.allocate(n, hint)
        for b in out:
            self.ref[b] = 1
        return out

    def _spill(self, blocks: list[int], hashes: list[bytes]) -> list[bytes]:
        """Save evicted blocks to the disk tier -> the hashes no longer held anywhere (dropped past its budget)."""
        dropped = self.spill.save(list(zip(hashes, self.read_blocks(blocks))))
        return [h for h in dropped if h not in self.hash_block]

    def spilled(self, hashes: list[bytes], start: int) -> int:
        """How many of hashes[start:] follow on in the disk tier, as a chain."""
        n = 0
        while self.spill is not None and start + n < len(hashes) and hashes[start + n] in self.spill:
            n += 1
        return n

    def uncache(self, block: int) -> bool:
        """Drop `block` from the prefix cache if it is cached and no request holds it (its KV is about to be
        overwritten: a warm-up after start-up writes block 0) -> whether no request holds it."""
        if self.ref[block] > 0:
            return False
        h = self.block_hash.pop(block, None)
        if h is not None:
            del self.hash_block[h]
            self.evictable.pop(block, None)
            if self.events is not None and not (self.spill is not None and h in self.spill):
                self.events.emit("removed", [h])
            self.allocator.free([block])
        return True

    def free(self, block_ids: list[int]) -> None:
        """Drop one reference to each block; tail blocks are freed first so they are evicted first."""
        released = []
        for b in reversed(block_ids):
            if self.ref[b] <= 0:
                raise ValueError(f"block {b} freed more often than referenced")
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.block_hash:
                    self.evictable[b] = None
                else:
                    released.append(b)
        self.allocator.free(released)

    def full_state(self) -> dict:
        """Every hash and snapshot held, numbered (events.py `full`); the events log must be set."""
        disk = [h for h in self.spill.hashes() if h not in self.hash_block] if self.spill is not None else []
        return self.events.full(list(self.hash_block) + disk, list(self.snapshots._rows))

    # ---- stats and invariants
    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def num_referenced(self) -> int:
        """Blocks some request holds: every block is free, evictable or held (`check` counts the held ones one by
        one). O(1): the engine's stats ask each step, and a GPU's pool holds 10^4 to 10^5 blocks."""
        return self.num_blocks - self.allocator.num_free - len(self.evictable)

    def check(self) -> None:
        free, evict, used = self.allocator.num_free, len(self.evictable), sum(1 for r in self.ref if r > 0)
        if free + evict + used != self.num_blocks:
            raise AssertionError(f"block leak: free {free} + evictable {evict} + used {used} != {self.num_blocks}")
