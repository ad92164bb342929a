"""The global KV index: which instance holds which prefix, kept from the workers' prefix-cache events.

Every worker numbers its cache events (jaxserve/cache/events.py) within an epoch (one per process). Its
heartbeat carries the events after the last one the router applied (`want`: the number the router expects
next, which the heartbeat's answer returns), or the full state when the router asks for it. The index
answers, for a prompt, how many leading tokens each instance holds: the longest run of the prompt's block
chain hashes the instance has stored, cut, for a model with request-level state, back to the longest
boundary where it also holds a state snapshot (such state is reusable only at exactly that length; a chain
hash names one token sequence, so one length). Always at least one prompt token is left to compute, as the
engine does.

Staleness is never trusted: an instance's entries are dropped, and its full state asked for, when its events
skip a number (a lost batch), when its epoch changes (it restarted), and when it is removed (it died or
left; `drop`); until the full state arrives the instance counts as holding nothing. So a request is never
placed on the strength of a cache that is not there. Thread-safe (one lock): heartbeats apply on the control
port's thread, requests read on the router's loop.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from jaxserve.cache.block_manager import block_hashes


@dataclass
class _Entry:
    epoch: str | None = None
    want: int | None = None  # the next event number expected; None: the full state is needed
    blocks: set = field(default_factory=set)
    snaps: set = field(default_factory=set)


class KVIndex:
    def __init__(self, block_size: int, request_state: bool = False):
        """request_state: the model has linear-attention / sliding-window layers (prefixes need a snapshot)."""
        self.block_size, self.request_state = block_size, request_state
        self._entries: dict[str, _Entry] = {}
        self.resyncs = 0  # full states asked for after a gap, a restart or a removal
        self._lock = threading.Lock()

    # ---- the heartbeat side
    def apply(self, instance: str, batch: dict | None, epoch: str | None = None) -> int | None:
        """Apply one heartbeat's batch ({"epoch", "from", "events", "next"} or {"epoch", "full", "next"}, or
        None when the worker sent nothing); epoch: the worker's current event epoch, which every heartbeat
        carries (a restarted worker's first heartbeat, before it has a batch to send, already drops what the
        old process held). Returns the number to ask for next (None: the full state)."""
        with self._lock:
            e = self._entries.setdefault(instance, _Entry())
            if epoch is not None and e.epoch is not None and epoch != e.epoch:
                self._reset(e, None)  # a new process: nothing of the old one counts
            if batch is None:
                return e.want
            epoch = batch["epoch"]
            if batch.get("full") is not None:
                e.epoch, e.want = epoch, int(batch["next"])
                e.blocks = set(batch["full"]["blocks"])
                e.snaps = set(batch["full"]["snaps"])
                return e.want
            if epoch != e.epoch or e.want is None or int(batch["from"]) != e.want:
                self._reset(e, epoch)  # restarted, never synced, or events were lost
                return None
            for kind, hashes in batch["events"]:
                if kind == "stored":
                    e.blocks.update(hashes)
                elif kind == "removed":
                    e.blocks.difference_update(hashes)
                elif kind == "snap":
                    e.snaps.update(hashes)
                elif kind == "unsnap":
                    e.snaps.difference_update(hashes)
                elif kind == "cleared":
                    e.blocks.clear()
                    e.snaps.clear()
            e.want = int(batch["next"])
            return e.want

    def want(self, instance: str) -> int | None:
        with self._lock:
            e = self._entries.get(instance)
            return e.want if e is not None else None

    def _reset(self, e: _Entry, epoch: str | None) -> None:
        if e.epoch is not None or e.blocks or e.snaps:
            self.resyncs += 1
        e.epoch, e.want = epoch, None
        e.blocks, e.snaps = set(), set()

    def drop(self, instance: str) -> None:
        """The instance is gone (down, restarted, removed): nothing of it counts until its full state."""
        with self._lock:
            e = self._entries.get(instance)
            if e is not None and (e.blocks or e.snaps or e.want is not None):
                self._reset(e, None)

    # ---- the request side
    def hashes(self, tokens: list[int]) -> list[str]:
        return [h.hex() for h in block_hashes(tokens, self.block_size)]

    def match(self, tokens: list[int], instances=None, whole: bool = False) -> dict[str, int]:
        """instance -> prompt tokens whose KV it holds (only instances holding some), over `instances` (names;
        None: all). A prompt's last token is always left to compute; whole: `tokens` is a prefix, all of it may
        match."""
        hashes = self.hashes(tokens)
        bs = self.block_size
        out = {}
        with self._lock:
            for name, e in self._entries.items():
                if instances is not None and name not in instances or e.want is None:
                    continue
                n = 0
                while n < len(hashes) and (n + 1) * bs < len(tokens) + whole and hashes[n] in e.blocks:
                    n += 1
                if self.request_state:
                    while n and hashes[n - 1] not in e.snaps:
                        n -= 1
                if n:
                    out[name] = n * bs
        return out

    def stats(self) -> dict:
        with self._lock:
            return {"instances": sum(1 for e in self._entries.values() if e.want is not None),
                    "blocks": sum(len(e.blocks) for e in self._entries.values()),
                    "snapshots": sum(len(e.snaps) for e in self._entries.values()), "resyncs": self.resyncs}
