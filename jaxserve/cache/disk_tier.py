"""A disk tier under the prefix cache: full blocks evicted from the pool keep their KV in files, by chain hash.

An instance with a spill directory (the global KV store, `instance.spill_mb`) does not lose a cached block when
the pool needs its room: the block manager hands the evicted blocks to `DiskTier.save` before they are reused
(their KV read from the pool first), and they stay matchable by chain hash; a prefix read later (the store's
Export) brings them back into fresh blocks (`load`). The tier keeps at most `budget_bytes`; past it the least
recently used blocks are deleted, and only then does the cache report them lost (the router's index counts a
spilled block as held). One file per block: the KV of every full-attention cache group for that block, raw,
the layout's shapes and dtype (a file of the wrong size is treated as missing). Request-level state
(snapshots) is not spilled: for a model with such state a spilled prefix comes back only while its snapshot
is in memory.

Plain Python and numpy; the engine thread owns it.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections import OrderedDict

import numpy as np

log = logging.getLogger("jaxserve.cache")


class DiskTier:
    def __init__(self, path: str, budget_bytes: int, shapes: list[tuple[tuple[int, ...], np.dtype]]):
        """shapes: one block's (shape, dtype) of every full-attention cache group, in pool order."""
        if budget_bytes <= 0:
            raise ValueError(f"the spill budget must be positive, got {budget_bytes} bytes")
        self.path, self.budget = os.path.abspath(os.path.expanduser(path)), budget_bytes
        self.shapes = [(tuple(s), np.dtype(d)) for s, d in shapes]
        self.block_bytes = sum(int(np.prod(s)) * d.itemsize for s, d in self.shapes)
        if self.block_bytes > budget_bytes:
            raise ValueError(f"the spill budget ({budget_bytes} bytes) is smaller than one block "
                             f"({self.block_bytes} bytes)")
        if os.path.isdir(self.path):  # a previous process's files: its hashes are not this cache's
            shutil.rmtree(self.path)
        os.makedirs(self.path)
        self._lru: OrderedDict[bytes, None] = OrderedDict()  # oldest first
        self.saved = self.loaded = self.dropped = 0

    def __contains__(self, h: bytes) -> bool:
        return h in self._lru

    def __len__(self) -> int:
        return len(self._lru)

    def hashes(self) -> list[bytes]:
        return list(self._lru)

    @property
    def bytes(self) -> int:
        return len(self._lru) * self.block_bytes

    def _file(self, h: bytes) -> str:
        return os.path.join(self.path, h.hex())

    def save(self, items: list[tuple[bytes, list[np.ndarray]]]) -> list[bytes]:
        """Keep each (hash, [one block's array per group]); returns the hashes dropped to stay in budget (the
        oldest; possibly some of these)."""
        for h, arrays in items:
            if len(arrays) != len(self.shapes) or any(a.shape != s for a, (s, _) in zip(arrays, self.shapes)):
                raise ValueError(f"a spilled block has shapes {[a.shape for a in arrays]}, the tier "
                                 f"{[s for s, _ in self.shapes]}")
            with open(self._file(h), "wb") as f:
                for a, (_, d) in zip(arrays, self.shapes):
                    f.write(np.ascontiguousarray(a, d).tobytes())
            self._lru[h] = None
            self._lru.move_to_end(h)
            self.saved += 1
        dropped = []
        while self.bytes > self.budget:
            h, _ = self._lru.popitem(last=False)
            self._remove(h)
            dropped.append(h)
        self.dropped += len(dropped)
        return dropped

    def load(self, h: bytes) -> list[np.ndarray] | None:
        """One block's arrays, or None when it is not here (or its file is damaged: then it is forgotten)."""
        if h not in self._lru:
            return None
        try:
            with open(self._file(h), "rb") as f:
                raw = f.read()
        except OSError as e:
            log.warning("spilled block %s unreadable: %s", h.hex(), e)
            raw = b""
        if len(raw) != self.block_bytes:
            self.forget(h)
            return None
        out, at = [], 0
        for s, d in self.shapes:
            n = int(np.prod(s)) * d.itemsize
            out.append(np.frombuffer(raw, d, int(np.prod(s)), at).reshape(s))
            at += n
        self._lru.move_to_end(h)
        self.loaded += 1
        return out

    def forget(self, h: bytes) -> None:
        self._lru.pop(h, None)
        self._remove(h)

    def _remove(self, h: bytes) -> None:
        try:
            os.remove(self._file(h))
        except FileNotFoundError:
            pass

    def stats(self) -> dict:
        return {"spilled_blocks": len(self._lru), "spill_saved": self.saved, "spill_loaded": self.loaded,
                "spill_dropped": self.dropped}
