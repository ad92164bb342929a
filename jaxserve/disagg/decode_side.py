"""Receiving KV: reserve cache for a request before its prefill runs elsewhere, then admit it on arrival.

`KVIntake.reserve` (engine thread) takes a slot and blocks (skipping prefix blocks this instance already holds),
a receive region sized for the transfer, and registers a `KVReceiver` with the instance's KV server. The receiver
counts arriving bytes (or pulled device arrays) on the server's connection threads; when it reaches DONE or
FAILED it posts `arrived` back to the engine thread (`post`), which imports the KV into the reserved blocks and
starts decoding, or fails the request and frees its blocks. A request aborted meanwhile only gives its region
back. `reserve_prefix` receives a cached prefix into this instance's prefix cache the same way (the router's
prefix move: from the global KV store, or between clusters; any instance may receive one). A prefill may run
over such a prefix while it arrives (`IncomingPrefix`, BanaServe 4.2's three-stage pipeline): it is admitted
once the first layer group has landed, and before each of its layer groups runs, the engine waits until that
group's part of the prefix has landed and imports it, so the fetch of layer group k+1 overlaps the compute of
group k while the finished groups' KV leaves for decode. A prefix that finds no room (blocks, receive region)
waits for it (`reserve_prefix_when_room`): the waiting ones are tried again, oldest first, each time the engine
thread may have freed some (`retry_waiting`, after every step and batch of commands), ahead of the requests
queued for prefill, up to their deadline; refusing it would make its prefill compute the prefix instead, the
work that fills an instance's queue further when it is already short of room.
Concurrency: `reserve`, `reserve_prefix`, the waiting prefixes, `IncomingPrefix` and the arrivals run on the
engine thread; the server's threads only call `post` and feed the receivers.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

from jaxserve.transfer.bufpool import PoolFull, RecvPool
from jaxserve.transfer.receiver import KVReceiver, region_bytes
from jaxserve.transfer.segments import OutOfBlocks
from jaxserve.transfer.state import KVPoll
from jaxserve.transfer.tcp import KVServer

log = logging.getLogger("jaxserve.decode")


class KVIntake:
    def __init__(self, kv, token: str, post, host: str = "127.0.0.1", port: int = 0, pool_bytes: int = 256 << 20,
                 deadline_s: float = 30.0, shared: bool = False, puller=None, timeouts=None, pull_from=None,
                 tls=None):
        """kv: the engine's KVConnector (engine/connector.py), all of the engine this module uses; shared: the
        receive pool is a shared-memory segment a sender on this host may write directly; puller: a
        transfer.pull.PullServer, to take the device backend's transfers; timeouts, pull_from: the KV server's
        socket limits (transfer/net.py) and its check of PULL addresses (transfer/tcp.py); tls: its
        ssl server context (transfer/tls.py)."""
        self.kv, self.post, self.deadline_s = kv, post, deadline_s
        self.server = KVServer(token, host, port, puller=puller, timeouts=timeouts, pull_from=pull_from, tls=tls)
        self.pool = RecvPool(pool_bytes, shared=shared)
        self.receivers: dict[str, KVReceiver] = {}
        self.prefixes: dict[str, IncomingPrefix] = {}  # reserve_prefix's, until they arrive or fail
        self.waiting: collections.deque[_Waiting] = collections.deque()  # prefixes waiting for room, oldest first

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def reserve(self, request_id: str, prompt: list[int], params, kv_tokens: int, deadline_s: float | None = None,
                max_skip: int | None = None, **resume):
        """-> (sequence, dst block ids, skip). Raises RequestError (bad request) or OutOfBlocks / PoolFull (busy).
        The receiver is `self.receivers[request_id]` (its region's offset: where a local sender writes).
        max_skip: at most this many cached leading blocks reused; resume: output= and logprobs= of a resumed
        request (KVConnector.reserve)."""
        kv = self.kv
        seq, skip = kv.reserve(request_id, prompt, params, kv_tokens, max_skip=max_skip, **resume)
        try:
            region = self.pool.allocate(region_bytes(kv.layout, kv.dtype_name, kv_tokens, skip))
        except PoolFull:
            kv.fail(seq, "receive pool full")
            kv.release(seq)
            raise
        recv = KVReceiver(request_id, kv.layout, kv.dtype_name, seq.block_ids, kv_tokens, skip, region,
                          deadline_s or self.deadline_s, on_done=lambda r: self.post(lambda: self.arrived(seq, r)))
        self.receivers[request_id] = recv
        self.server.expect(recv)
        return seq, list(seq.block_ids), skip

    def arrived(self, seq, recv: KVReceiver) -> list:
        """Engine thread: the transfer ended. Returns [seq] when it changed (first token or failure), else []."""
        self.receivers.pop(seq.request_id, None)
        try:
            if seq.finished:  # aborted while its KV was on the way
                return []
            if recv.state.poll() is KVPoll.DONE:
                try:
                    changed = self.kv.kv_arrived(seq, recv.staging, recv.arrays(), recv.num_tokens, recv.first)
                except Exception as e:  # noqa: BLE001 - the request fails (the router places it again), not hangs
                    log.exception("%s: importing the KV failed", seq.request_id)
                    self.kv.fail(seq, f"importing the KV failed: {type(e).__name__}: {e}")
                    return [seq]
                return [seq] if changed else []
            log.warning("%s: KV transfer failed: %s", seq.request_id, recv.state.reason)
            self.kv.fail(seq, f"KV transfer failed: {recv.state.reason}")
            return [seq]
        finally:
            recv.release()

    def reserve_prefix(self, request_id: str, tokens: list[int], on_done, deadline_s: float | None = None,
                       groups: list[tuple[int, int]] | None = None):
        """A cached prefix another instance sends into this instance's prefix cache (a prefix move): blocks
        (KVConnector.reserve_prefix) and a receive region. When the transfer ends, on the engine thread, the KV is
        imported and cached, or the blocks are released, and on_done(None or the failure's reason) is called.
        Until then `self.prefixes[request_id]` is its `IncomingPrefix`, which a prefill may compute over as it
        lands, running as `groups` (layer groups [(lo, hi)]; None: the whole model at once).
        -> (dst block ids, skip). Raises RequestError, OutOfBlocks / PoolFull (busy)."""
        kv = self.kv
        blocks, skip, hashes = kv.reserve_prefix(tokens)
        try:
            region = self.pool.allocate(region_bytes(kv.layout, kv.dtype_name, len(tokens), skip))
        except PoolFull:
            kv.free(blocks)
            raise
        inc = IncomingPrefix(request_id, list(tokens), hashes, list(blocks), skip, groups)

        def arrived(recv: KVReceiver) -> list:
            self.receivers.pop(request_id, None)
            self.prefixes.pop(request_id, None)
            on_done(inc.arrived(kv))
            return []

        inc.recv = KVReceiver(request_id, kv.layout, kv.dtype_name, blocks, len(tokens), skip, region,
                              deadline_s or self.deadline_s, on_done=lambda r: self.post(lambda: arrived(r)))
        self.receivers[request_id] = inc.recv
        self.prefixes[request_id] = inc
        # a request waiting for the prefix's first layer group is admitted once it lands: wake the engine then
        inc.recv.on_layers(inc.first_hi, lambda: self.post(lambda: []))
        self.server.expect(inc.recv)
        return list(blocks), skip

    def reserve_prefix_when_room(self, request_id: str, tokens: list[int], on_done, on_reserved, wait_s: float,
                                 groups: list[tuple[int, int]] | None = None) -> None:
        """`reserve_prefix` now, or once this instance has room for it: a prefix refused only for room now
        (OutOfBlocks / PoolFull) waits behind those already waiting, up to `wait_s`, and `retry_waiting` tries
        it again. on_reserved((dst block ids, skip)) once reserved (its transfer then has what is left of
        wait_s), or on_reserved(the exception) when it cannot be (RequestError; OutOfBlocks for a prefix bigger
        than the whole cache); `withdraw` ends the wait. Engine thread."""
        need = self.kv.blocks_for(len(tokens))
        if need > self.kv.num_blocks:
            on_reserved(OutOfBlocks(f"the prefix needs {need} blocks; this instance has {self.kv.num_blocks} in all"))
            return
        w = _Waiting(request_id, list(tokens), on_done, on_reserved, time.monotonic() + wait_s, groups)
        if self.waiting or not self._try(w):
            self.waiting.append(w)

    def retry_waiting(self) -> None:
        """Engine thread, whenever blocks or receive regions may have been freed: reserve the waiting prefixes
        that fit now, oldest first (one that does not fit holds back those behind it)."""
        while self.waiting and self._try(self.waiting[0]):
            self.waiting.popleft()

    def withdraw(self, request_id: str) -> None:
        """Engine thread: the caller gave up on the prefix (its wait ran out, or it went away): no longer waiting,
        or its reservation, if it was made meanwhile, released."""
        kept = [w for w in self.waiting if w.request_id != request_id]
        if len(kept) == len(self.waiting):
            self.cancel(request_id)
        self.waiting = collections.deque(kept)

    def _try(self, w: "_Waiting") -> bool:
        """Reserve w now -> True once it is settled (reserved, or refused for a cause other than room)."""
        left = w.until - time.monotonic()
        if left <= 0:
            w.on_reserved(OutOfBlocks("no room for the prefix before its deadline"))
            return True
        try:
            reserved = self.reserve_prefix(w.request_id, w.tokens, w.on_done, left, w.groups)
        except (OutOfBlocks, PoolFull):
            return False
        except Exception as e:  # noqa: BLE001 - RequestError, ValueError: handed to the caller
            w.on_reserved(e)
            return True
        w.on_reserved(reserved)
        return True

    def cancel(self, request_id: str) -> None:
        """The request was aborted: stop expecting its KV."""
        recv = self.receivers.pop(request_id, None)
        self.prefixes.pop(request_id, None)
        if recv is not None:
            self.server.forget(request_id)
            recv.fail("request aborted")

    def stats(self) -> dict:
        """Reservations waiting for KV, receive-pool bytes held, and the age of the oldest reservation (a leak
        check reads these once the instance is idle: all must be 0)."""
        now = time.monotonic()
        recvs = list(self.receivers.values())
        return {"reservations": len(recvs), "pool_used_bytes": self.pool.capacity - self.pool.free_bytes,
                "oldest_reservation_s": max((now - r.created for r in recvs), default=0.0),
                "prefixes_waiting": len(self.waiting)}

    def shm_base(self, request_id: str) -> int | None:
        """The request's region offset in this instance's shared-memory pool (None: TCP only), where a sender
        on this host writes its KV; the segment itself is named in this worker's Health (the peer table)."""
        recv = self.receivers.get(request_id)
        return recv.region.offset if self.pool.shm_name is not None and recv is not None else None

    def close(self) -> None:
        self.server.close()
        self.pool.close()


@dataclass(eq=False)
class _Waiting:
    """A cached prefix waiting for room to be reserved (`KVIntake.reserve_prefix_when_room`)."""
    request_id: str
    tokens: list[int]
    on_done: object
    on_reserved: object
    until: float  # time.monotonic() by which it must be reserved and have arrived
    groups: list[tuple[int, int]] | None


@dataclass(eq=False)
class IncomingPrefix:
    """A cached prefix arriving into reserved blocks (`KVIntake.reserve_prefix`), which the prefill of one request
    may compute over while it lands. The scheduler admits that request once the prefix's first layer group has
    landed (`started`; other requests go first meanwhile), with `blocks` as its cached prefix, and before each
    layer group of its first chunk runs, the engine calls `take(kv, hi, row)`: wait until the prefix's layers below
    hi have landed and import them (blocks, and request-level state into the request's row, where the chunk
    reads its state from). `arrived` ends it: the rest is imported and the blocks are cached as prefix cache (a
    model with request-level state also keeps a snapshot at the prefix's end), or released. Engine thread."""
    request_id: str
    tokens: list[int]
    hashes: list[bytes]
    blocks: list[int]  # the prefix's blocks: `skip` held here already, the rest reserved for the transfer
    skip: int
    groups: list[tuple[int, int]] | None  # the layer groups a prefill over it runs as (None: one)
    recv: KVReceiver | None = None
    imported: set[int] = field(default_factory=set)  # the plan's layer groups imported into the pool
    error: str | None = None  # why it did not arrive (or was not waited for)
    ended: bool = False  # `arrived` ran

    @property
    def pending(self) -> bool:
        """Still arriving, and nothing gave up on it."""
        return not self.ended and self.error is None

    @property
    def first_hi(self) -> int:
        """The layers a prefill over it runs first: its first layer group's end."""
        return self.groups[0][1] if self.groups else self.recv.layout.num_layers

    @property
    def started(self) -> bool:
        """The layers of the first group have landed (the scheduler admits a request over it from then on, so
        a step never waits for the holder's first answer; only for groups that have not kept up with compute)."""
        return self.recv.layers_landed(self.first_hi)

    @property
    def landed(self) -> bool:
        """Every layer has landed (a prefill over it may import it whole and run unstaged)."""
        return self.recv.layers_landed(self.recv.layout.num_layers)

    def take(self, kv, hi: int, row: int) -> bool:
        """Wait until the prefix's layers [0, hi) have landed (until the transfer's deadline) and import those not
        imported yet -> True; False when it failed or timed out (`error` says why; nothing more is waited for)."""
        if self.ended:  # imported whole already (request-level state to its snapshot, not to `row`)
            return self.error is None and not kv.layout.has_request_state
        if self.error is None and not self.recv.wait_layers(hi, max(0.0, self.recv.deadline - time.monotonic())):
            self.error = self.recv.state.reason or f"the prefix's layers below {hi} did not arrive in time"
        if self.error is not None:
            return False
        new = set(self.recv.groups_below(hi)) - self.imported
        if new:
            kv.import_kv(self.recv.staging, self.recv.landed_arrays(), self.blocks[self.skip:], row, new,
                         wait=False)  # the region outlives it: `arrived` settles before releasing
            self.imported |= new
        return True

    def arrived(self, kv) -> str | None:
        """The transfer ended: import what no prefill took (all of it again where a snapshot of the request-level
        state is kept: what a prefill took went to its own row), cache the blocks and drop the reservation's
        references -> None; or release them -> the reason it failed."""
        recv, self.ended = self.recv, True
        error = None if recv.state.poll() is KVPoll.DONE else recv.state.reason
        try:
            if error is None:
                row = kv.prefix_row(self.hashes)
                rest = {a.layer_group for a in recv.staging.arrays}
                if row == kv.scratch_row:
                    rest -= self.imported
                if rest:
                    kv.import_kv(recv.staging, recv.arrays(), self.blocks[self.skip:], row, rest)
                kv.cache_arrived(self.blocks, self.tokens, self.hashes, row)
        except Exception as e:  # noqa: BLE001 - a failed import releases the blocks like a failed transfer
            log.exception("%s: importing a cached prefix failed", self.request_id)
            error = f"import failed: {type(e).__name__}: {e}"
        finally:
            kv.free(self.blocks)
            if self.imported:
                kv.settle()
            recv.release()
        self.error = self.error or error
        return error
