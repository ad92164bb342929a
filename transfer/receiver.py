"""`KVReceiver`: one request's incoming KV, from reservation to the arrays the decode engine imports.

The decode worker creates it when it reserves cache space for a request (before prefill starts), with the
reserved blocks, the number of tokens it will receive, the prefix blocks it already holds, and a receive region
sized for the worst case. The backend then feeds it frames: the plan (checked against the reservation), DATA
bytes written straight into the region at their staged offsets (or, on the device backend, whole staged arrays
pulled onto the device: pull.py), and the first-token record. It counts completions; when every expected byte and
the record have arrived it moves to DONE and calls `on_done`, with no extra round trip. A deadline moves it to
FAILED (the sender died or stalled), and the owner frees the reserved blocks. A consumer may also take the KV
layer group by layer group as it lands (`layers_landed`, `on_layers`, `wait_layers`, `landed_arrays`: a prefill
that computes over a prefix still arriving). Thread-safe: backend connection threads call it concurrently (one
lock, and a condition on it for `wait_layers`).
"""

from __future__ import annotations

import threading
import time

from .bufpool import Region
from .plan import PlanError, Staging, TransferPlan, layer_groups, staging
from .state import KVPoll, TransferState


def region_bytes(layout, dtype: str, num_tokens: int, skip: int) -> int:
    """Receive-region size that fits any layer grouping (one layer per group has the most alignment pad)."""
    n = -(-num_tokens // layout.block_size) - skip
    return staging(layout, dtype, n, layer_groups(layout.num_layers, 1)).nbytes


class KVReceiver:
    def __init__(self, request_id: str, layout, dtype: str, dst_blocks: list[int], num_tokens: int, skip: int,
                 region: Region, deadline_s: float, on_done=None):
        self.request_id, self.layout, self.dtype = request_id, layout, dtype
        self.dst_blocks, self.num_tokens, self.skip = list(dst_blocks), num_tokens, skip
        self.region = region
        self.created = time.monotonic()
        self.deadline = self.created + deadline_s
        self.on_done = on_done  # called once with this receiver when it reaches DONE or FAILED
        self.state = TransferState(f"receive {request_id}")
        self.plan: TransferPlan | None = None
        self.staging: Staging | None = None
        self.first: dict | None = None  # the first-token record
        self.received = 0
        self._got: dict[int, list[tuple[int, int]]] = {}  # array -> received (offset, bytes)
        self._bytes: dict[int, int] = {}  # array -> bytes received
        self._pulled: dict[int, object] = {}  # array -> device array (device backend)
        self._pulling: set[int] = set()
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # bytes landed or the state went final
        self._planned = threading.Event()
        self._notified = False
        self._watch: list = []  # (hi, fn): call fn() once layers [0, hi) have landed (`on_layers`)

    # ---- frames (backend threads)
    def accept_plan(self, plan: TransferPlan) -> None:
        try:
            with self._lock:
                if self.plan is not None:
                    if plan.to_meta() == self.plan.to_meta():
                        return  # the same plan again (its acknowledgement was lost with a connection)
                    raise PlanError("a different plan was already accepted for this request")
                if plan.shm_base is not None and (self.region.pool.shm_name is None
                                                  or plan.shm_base != self.region.offset):
                    raise PlanError(f"the plan writes shared memory at {plan.shm_base}; this request's region is "
                                    + (f"at {self.region.offset}" if self.region.pool.shm_name else "not shared"))
                st = plan.check(self.layout, self.dtype, self.dst_blocks, self.num_tokens, self.skip)
                if st.nbytes > self.region.nbytes:
                    raise PlanError(f"staged plan needs {st.nbytes} bytes, region holds {self.region.nbytes}")
                self.plan, self.staging = plan, st
                self.state.advance(KVPoll.TRANSFERRING)
                self._planned.set()
        except PlanError as e:
            self.fail(f"plan refused: {e}")
            raise

    def wait_plan(self, timeout: float) -> bool:
        """Frames travel on several connections, so data can overtake the plan: its connection waits here."""
        return self._planned.wait(timeout) or self.state.final

    def target(self, array: int, offset: int, nbytes: int) -> memoryview | None:
        """Where a DATA frame's payload goes (checked against the plan; raises PlanError). None: these exact bytes
        were already received (a resend whose first acknowledgement was lost): drain and acknowledge."""
        with self._lock:
            if self.state.poll() is KVPoll.DONE:
                return None  # complete: anything more is a resend
            if self.state.poll() is not KVPoll.TRANSFERRING:
                raise PlanError(f"transfer is {self.state.poll().value} ({self.state.reason}), not accepting data")
            if not 0 <= array < len(self.staging.arrays):
                raise PlanError(f"array {array} not in the plan ({len(self.staging.arrays)} arrays)")
            a = self.staging.arrays[array]
            if offset < 0 or nbytes <= 0 or offset + nbytes > a.sent_bytes:
                raise PlanError(f"bytes [{offset}, {offset + nbytes}) outside array {array} ({a.sent_bytes} bytes)")
            for o, n in self._got.get(array, []):
                if (o, n) == (offset, nbytes):
                    return None
                if offset < o + n and o < offset + nbytes:
                    raise PlanError(f"bytes [{offset}, {offset + nbytes}) of array {array} already received")
            start = a.offset + offset
            return memoryview(self.region.buf[start:start + nbytes])

    def to_pull(self, arrays: list[int], nbytes: int) -> list | None:
        """The staged specs of the arrays a PULL frame names, now being pulled (checked against the plan;
        raises PlanError). None: they are here or on the way already (a resend): acknowledge."""
        with self._lock:
            if self.state.poll() is KVPoll.DONE:
                return None
            if self.state.poll() is not KVPoll.TRANSFERRING:
                raise PlanError(f"transfer is {self.state.poll().value} ({self.state.reason}), not accepting data")
            if not arrays or any(not 0 <= a < len(self.staging.arrays) for a in arrays):
                raise PlanError(f"arrays {arrays} not in the plan ({len(self.staging.arrays)} arrays)")
            if len(set(arrays)) != len(arrays):
                raise PlanError(f"arrays {arrays} named twice")
            if all(a in self._pulled or a in self._pulling for a in arrays):
                # a resend of a PULL that landed or is landing: acknowledged once landed (its acknowledgement lets
                # a sender sharing the arrays in place free them, ipc.py)
                self._arrived.wait_for(lambda: not self._pulling.intersection(arrays) or self.state.final,
                                       max(self.deadline - time.monotonic(), 0.0))
                if any(a not in self._pulled for a in arrays):
                    raise PlanError(f"arrays {arrays}: their pull failed")
                return None
            if any(a in self._got or a in self._pulling for a in arrays):
                raise PlanError(f"arrays {arrays} already (partly) received")
            specs = [self.staging.arrays[a] for a in arrays]
            planned = sum(a.sent_bytes for a in specs)
            if nbytes != planned:
                raise PlanError(f"PULL of arrays {arrays} says {nbytes} bytes, the plan {planned}")
            self._pulling.update(arrays)
            return specs

    def landed(self, arrays: list[int], xs: list | None) -> None:
        """The pulled device arrays of `to_pull(arrays)` arrived (xs None: the pull failed)."""
        with self._lock:
            self._pulling.difference_update(arrays)
            if xs is None:
                self._arrived.notify_all()  # a resend waiting on this pull (to_pull)
                return
            for a, x in zip(arrays, xs):
                sent = self.staging.arrays[a].sent_bytes
                self._pulled[a] = x
                self._got[a] = [(0, sent)]
                self._bytes[a] = sent
                self.received += sent
            self._arrived.notify_all()
        if self._watch:
            self._fire()
        self._maybe_done()

    def commit(self, array: int, offset: int, nbytes: int) -> None:
        """A DATA frame arrived intact."""
        with self._lock:
            self._got.setdefault(array, []).append((offset, nbytes))
            self._bytes[array] = self._bytes.get(array, 0) + nbytes
            self.received += nbytes
            self._arrived.notify_all()
        if self._watch:
            self._fire()
        self._maybe_done()

    def set_first(self, record: dict) -> None:
        with self._lock:
            if self.plan is None:
                raise PlanError("first-token record before the plan")
            if self.first is not None:
                return  # a resend
            self.first = dict(record)
        self._maybe_done()

    def fail(self, reason: str) -> None:
        self.state.fail(reason)
        self._planned.set()  # wake connections waiting for a plan that will not come
        with self._lock:
            self._arrived.notify_all()
        self._notify()

    # ---- layer by layer (the consumer's thread)
    def groups_below(self, hi: int) -> list[int]:
        """The plan's layer groups holding any of layers [0, hi) (the plan must be accepted)."""
        return [k for k, (a, _) in enumerate(self.plan.layer_groups) if a < hi]

    def _landed(self, hi: int) -> bool:
        """Whether layers [0, hi) have landed (the lock held)."""
        if self.plan is None:
            return False
        want = set(self.groups_below(hi))
        return all(self._bytes.get(a.index, 0) == a.sent_bytes for a in self.staging.arrays if a.layer_group in want)

    def layers_landed(self, hi: int) -> bool:
        with self._lock:
            return self._landed(hi)

    def on_layers(self, hi: int, fn) -> None:
        """Call fn() once, on the thread that lands the last of them, when layers [0, hi) have landed (at once if
        they have)."""
        with self._lock:
            ready = self._landed(hi)
            if not ready:
                self._watch.append((hi, fn))
        if ready:
            fn()

    def _fire(self) -> None:
        """Call the `on_layers` callbacks whose layers have landed (outside the lock)."""
        with self._lock:
            landed = [(self._landed(hi), hi, fn) for hi, fn in self._watch]
            self._watch = [(hi, fn) for done, hi, fn in landed if not done]
        for fn in (fn for done, _, fn in landed if done):
            fn()

    def wait_layers(self, hi: int, timeout: float) -> bool:
        """Block until every staged array of the layer groups holding layers [0, hi) has landed -> True; False
        when the transfer failed or `timeout` seconds passed first (the transfer itself goes on)."""
        end = time.monotonic() + timeout
        with self._arrived:
            while True:
                if self.state.poll() is KVPoll.FAILED:
                    return False
                if self._landed(hi):
                    return True
                left = end - time.monotonic()
                if left <= 0:
                    return False
                self._arrived.wait(left)

    def landed_arrays(self) -> list:
        """The staged arrays as `arrays` gives them, before the whole transfer is done: read only those of layer
        groups `wait_layers` reported landed."""
        with self._lock:
            pulled = dict(self._pulled)
        return [pulled.get(i, v) for i, v in enumerate(self.staging.views(self.region.buf))]

    # ---- queries
    def expired(self, now: float | None = None) -> bool:
        return not self.state.final and (now or time.monotonic()) > self.deadline

    def arrays(self) -> list:
        """The staged arrays: typed views of the region (valid until `release`), or the pulled device arrays."""
        if self.state.poll() is not KVPoll.DONE:
            raise RuntimeError(f"{self.request_id}: transfer is {self.state.poll().value}")
        return [self._pulled.get(i, v) for i, v in enumerate(self.staging.views(self.region.buf))]

    def release(self) -> None:
        if not self.region.freed:
            self.region.free()

    # ---- internals
    def _maybe_done(self) -> None:
        with self._lock:
            if (self.state.poll() is KVPoll.TRANSFERRING and self.first is not None
                    and self.received == self.staging.sent_bytes):
                self.state.advance(KVPoll.DONE)
        self._notify()

    def _notify(self) -> None:
        with self._lock:
            if not self.state.final or self._notified:
                return
            self._notified = True
        if self.on_done is not None:
            self.on_done(self)
