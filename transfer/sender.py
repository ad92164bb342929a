"""`KVSender`: one request's outgoing KV, handed to a backend link frame by frame.

`start()` sends the plan; `send_array(i, arr)` queues every logical send of staged array i (one per aligned
block run, or the whole state array), split into frames (`link.frame_bytes`: a share per connection, at most
the link's chunk size) so the link's connections carry them in parallel; `finish(record)` queues the
first-token record. Prefill calls `send_array` for each layer group as soon as that group's KV exists,
while later groups still compute (or, on a pull.PullLink, `offer_arrays`: the group's device arrays are
offered for the receiver to pull). The sender is DONE when every frame has been acknowledged, FAILED when
the receiver refuses a frame for good (unknown request, refused plan), a frame fails its checksum
`max_resends` times, or the link gives up. The arrays stay referenced until acknowledged: they are the
exported device buffers, sent without a copy.
Thread-safe: the link's reader threads acknowledge concurrently (one lock).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, field

import numpy as np

from . import wire
from .plan import Staging, TransferPlan
from .state import KVPoll, TransferState


@dataclass
class Outgoing:
    sender: "KVSender"
    frame: wire.Frame
    queued_at: float = field(default_factory=time.monotonic)
    attempts: int = 0
    sent_at: float | None = None  # when its last sending finished (None: not yet on the wire)


class KVSender:
    def __init__(self, request_id: str, link, plan: TransferPlan, staging: Staging, max_resends: int = 5,
                 shm_base: int | None = None):
        """shm_base: the receive region's offset in the receiver's shared-memory segment, when `link` is a
        shm.ShmLink to it (pieces then go as PUT frames, written into the segment by the link)."""
        self.request_id, self.link, self.plan, self.staging = request_id, link, plan, staging
        self.shm_base = shm_base
        self.max_resends = max_resends
        self.state = TransferState(f"send {request_id}")
        self._seq = itertools.count()
        self._pending: set[int] = set()
        self._finished = False
        self._lock = threading.Lock()
        self.bytes_acked = 0
        self.frames = 0
        self.sends = 0  # logical sends (runs / state arrays)
        self.resends = 0
        # set when the receiver accepted the plan (or the transfer ended): a sender writing into the receiver's
        # shared memory waits for it, so no byte lands before the receiver has checked where (shm.py)
        self.plan_accepted = threading.Event()
        self._sends_by_array: dict[int, list[tuple[int, int]]] = {}
        for a, off, n in plan.sends(staging):
            self._sends_by_array.setdefault(a, []).append((off, n))

    def start(self) -> None:
        self.state.advance(KVPoll.TRANSFERRING)
        self._submit(wire.Frame(wire.PLAN, self.request_id, meta=self.plan.to_meta()))

    def send_array(self, index: int, arr: np.ndarray) -> None:
        """Queue staged array `index`; arr has its staged shape (block arrays: padded rows allowed)."""
        spec = self.staging.arrays[index]
        if arr.nbytes < spec.sent_bytes or not arr.flags.c_contiguous:
            raise ValueError(f"array {index}: got {arr.shape} {arr.dtype}, staged {spec.shape} {spec.dtype}")
        flat = memoryview(arr.reshape(-1).view(np.uint8))
        for off, n in self._sends_by_array.get(index, []):
            self.sends += 1
            chunk = self.link.frame_bytes(n)
            for o in range(off, off + n, chunk):
                k = min(chunk, off + n - o)
                meta = {"a": index, "o": o}
                if self.shm_base is not None:  # the link writes the piece into the receiver's region
                    meta.update(n=k, at=self.shm_base + spec.offset + o)
                # the link's writer checksums the piece as it sends (or copies) it
                self._submit(wire.Frame(wire.DATA if self.shm_base is None else wire.PUT, self.request_id,
                                        meta=meta, payload=flat[o:o + k]))

    def offer_arrays(self, items: list) -> None:
        """Device backend (pull.PullLink): offer staged arrays [(index, single-device jax.Array)] and announce
        them in one PULL frame; the receiver fetches them and acknowledges the frame."""
        if not items:
            return
        names = self.link.offer([x for _, x in items])  # uuid, address (and CUDA IPC handles)
        idx = [int(i) for i, _ in items]
        self.sends += 1
        self._submit(wire.Frame(wire.PULL, self.request_id, meta={
            "arrays": idx, **names, "bytes": sum(self.staging.arrays[i].sent_bytes for i in idx)}))

    def finish(self, record: dict) -> None:
        """Queue the first-token record; after it nothing more is sent."""
        self._submit(wire.Frame(wire.META, self.request_id, meta=record))
        with self._lock:
            self._finished = True
        self._maybe_done()

    def abort(self, reason: str) -> None:
        self.plan_accepted.set()
        if self.state.fail(reason):
            self.link.submit(Outgoing(self, wire.Frame(wire.ABORT, self.request_id, meta={"reason": reason})))

    def wait(self, timeout: float | None = None) -> KVPoll:
        return self.state.wait(timeout)

    # ---- link callbacks (link threads)
    def acked(self, out: Outgoing) -> None:
        with self._lock:
            self._pending.discard(out.frame.seq)
            self.bytes_acked += out.frame.meta["bytes"] if out.frame.kind == wire.PULL else len(out.frame.payload)
        if out.frame.kind == wire.PLAN:
            self.plan_accepted.set()
        elif out.frame.kind == wire.PULL:
            self.link.release(out.frame.meta)  # the receiver holds its copies: arrays shared in place may go
        self._maybe_done()

    def refused(self, out: Outgoing, reason: str, retry: bool) -> bool:
        """A NACK: True when the frame should be sent again."""
        if retry and out.attempts <= self.max_resends and not self.state.final:
            with self._lock:
                self.resends += 1
            return True
        self.state.fail(f"receiver refused {out.frame.name} frame: {reason}")
        self.plan_accepted.set()
        return False

    def link_failed(self, reason: str) -> None:
        self.state.fail(reason)
        self.plan_accepted.set()

    # ---- internals
    def _submit(self, frame: wire.Frame) -> None:
        if self.state.final:
            return
        frame.seq = next(self._seq)
        with self._lock:
            self._pending.add(frame.seq)
            self.frames += 1
        self.link.submit(Outgoing(self, frame))

    def _maybe_done(self) -> None:
        with self._lock:
            if self._finished and not self._pending and self.state.poll() is KVPoll.TRANSFERRING:
                self.state.advance(KVPoll.DONE)
