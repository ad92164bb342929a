"""Prefix-cache events: what a worker's cache gained and lost, numbered, for the router's global KV index.

The block manager reports every chain hash it starts or stops serving (`stored` / `removed`: full blocks,
matchable by any prefix that covers them) and every request-level state snapshot it keeps or drops
(`snap` / `unsnap`: linear-attention and sliding-window state, matchable only at exactly that length),
and `cleared` when everything went. Each event gets the next sequence number of this log's `epoch` (a fresh
random id per process, so a restarted worker is a new epoch). The router (router/kv_index.py) asks for the
events after the last one it applied; when the log no longer holds them (it keeps the newest
`capacity`), or the router has nothing for this epoch, it gets the full state instead (`full`), taken on the
engine thread so it is consistent with the sequence number it carries.

Hashes travel as hex strings. Thread-safe: events are appended on the engine thread, batches taken on the
worker's loop (one lock).
"""

from __future__ import annotations

import collections
import threading
import uuid

KINDS = ("stored", "removed", "snap", "unsnap", "cleared")


class CacheEvents:
    def __init__(self, capacity: int = 4096):
        self.epoch = uuid.uuid4().hex[:16]
        self.capacity = capacity
        self.next_seq = 0  # the number the next event gets
        self._log: collections.deque[tuple[int, str, list[str]]] = collections.deque(maxlen=capacity)
        self._lock = threading.Lock()

    def emit(self, kind: str, hashes: list[bytes] = ()) -> None:
        if kind != "cleared" and not hashes:
            return
        with self._lock:
            self._log.append((self.next_seq, kind, [h.hex() for h in hashes]))
            self.next_seq += 1

    def since(self, seq: int | None, limit: int = 512) -> dict | None:
        """{"epoch", "from": seq, "events": [[kind, [hash, ...]], ...], "next"}: up to `limit` events from
        `seq` on; None when they are not all held any more (or seq is None, or ahead of this log): the caller
        sends the full state."""
        with self._lock:
            oldest = self._log[0][0] if self._log else self.next_seq
            if seq is None or seq < oldest or seq > self.next_seq:
                return None
            events = [[k, h] for s, k, h in self._log if s >= seq][:limit]
            return {"epoch": self.epoch, "from": seq, "events": events, "next": seq + len(events)}

    def full(self, blocks: list[bytes], snaps: list[bytes]) -> dict:
        """The full state, numbered as of now. Call it on the thread that emits (the engine thread), with the
        block manager's current hashes, so no event falls between the state and its number."""
        with self._lock:
            return {"epoch": self.epoch, "full": {"blocks": [h.hex() for h in blocks],
                                                  "snaps": [h.hex() for h in snaps]}, "next": self.next_seq}
