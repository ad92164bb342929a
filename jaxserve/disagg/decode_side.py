"""Receiving KV: reserve cache for a request before its prefill runs elsewhere, then admit it on arrival.

`KVIntake.reserve` (engine thread) takes a slot and blocks (skipping prefix blocks this instance already holds),
a receive region sized for the transfer, and registers a `KVReceiver` with the instance's KV server. The receiver
counts arriving bytes (or pulled device arrays) on the server's connection threads; when it reaches DONE or
FAILED it posts `arrived` back to the engine thread (`post`), which imports the KV into the reserved blocks and
starts decoding, or fails the request and frees its blocks. A request aborted meanwhile only gives its region
back. `reserve_prefix` receives a cached prefix into this instance's prefix cache the same way (the router's
prefix move between clusters; any instance may receive one). Concurrency: `reserve`, `reserve_prefix` and the
arrivals run on the engine thread; the server's threads only call `post`.
"""

from __future__ import annotations

import logging
import time

from transfer.bufpool import PoolFull, RecvPool
from transfer.receiver import KVReceiver, region_bytes
from transfer.state import KVPoll
from transfer.tcp import KVServer

log = logging.getLogger("jaxserve.decode")


class KVIntake:
    def __init__(self, llm, token: str, post, host: str = "127.0.0.1", port: int = 0, pool_bytes: int = 256 << 20,
                 deadline_s: float = 30.0, shared: bool = False, puller=None, timeouts=None, pull_from=None,
                 tls=None):
        """shared: the receive pool is a shared-memory segment a sender on this host may write directly;
        puller: a transfer.pull.PullServer, to take the device backend's transfers; timeouts, pull_from: the KV
        server's socket limits (transfer/net.py) and its check of PULL addresses (transfer/tcp.py); tls: its
        ssl server context (transfer/tls.py)."""
        self.llm, self.post, self.deadline_s = llm, post, deadline_s
        self.server = KVServer(token, host, port, puller=puller, timeouts=timeouts, pull_from=pull_from, tls=tls)
        self.pool = RecvPool(pool_bytes, shared=shared)
        self.receivers: dict[str, KVReceiver] = {}

    @property
    def address(self) -> tuple[str, int]:
        return self.server.address

    def reserve(self, request_id: str, prompt: list[int], params, kv_tokens: int, deadline_s: float | None = None,
                **resume):
        """-> (sequence, dst block ids, skip). Raises RequestError (bad request) or OutOfBlocks / PoolFull (busy).
        The receiver is `self.receivers[request_id]` (its region's offset: where a local sender writes).
        resume: output= and logprobs= of a resumed request (LLMEngine.reserve)."""
        llm = self.llm
        seq, skip = llm.reserve(request_id, prompt, params, kv_tokens, **resume)
        try:
            region = self.pool.allocate(region_bytes(llm.layout, llm.dtype_name, kv_tokens, skip))
        except PoolFull:
            llm.fail(seq, "receive pool full")
            llm.release(seq)
            raise
        recv = KVReceiver(request_id, llm.layout, llm.dtype_name, seq.block_ids, kv_tokens, skip, region,
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
                changed = self.llm.kv_arrived(seq, recv.staging, recv.arrays(), recv.num_tokens, recv.first)
                return [seq] if changed else []
            log.warning("%s: KV transfer failed: %s", seq.request_id, recv.state.reason)
            self.llm.fail(seq, f"KV transfer failed: {recv.state.reason}")
            return [seq]
        finally:
            recv.release()

    def reserve_prefix(self, request_id: str, tokens: list[int], on_done, deadline_s: float | None = None):
        """A cached prefix another instance sends into this instance's prefix cache (a prefix move): blocks
        (LLMEngine.reserve_prefix) and a receive region. When the transfer ends, on the engine thread, the KV is
        imported and cached, or the blocks are released, and on_done(None or the failure's reason) is called.
        -> (dst block ids, skip). Raises RequestError, OutOfBlocks / PoolFull (busy)."""
        llm = self.llm
        blocks, skip, hashes = llm.reserve_prefix(tokens)
        try:
            region = self.pool.allocate(region_bytes(llm.layout, llm.dtype_name, len(tokens), skip))
        except PoolFull:
            llm.blocks.free(blocks)
            raise

        def arrived(recv: KVReceiver) -> list:
            self.receivers.pop(request_id, None)
            error = None if recv.state.poll() is KVPoll.DONE else recv.state.reason
            try:
                if error is None:
                    llm.prefix_arrived(tokens, hashes, blocks, skip, recv.staging, recv.arrays())
                else:
                    llm.blocks.free(blocks)
            except Exception as e:  # noqa: BLE001 - a failed import releases the blocks like a failed transfer
                log.exception("%s: importing a cached prefix failed", request_id)
                llm.blocks.free(blocks)
                error = f"import failed: {type(e).__name__}: {e}"
            finally:
                recv.release()
            on_done(error)
            return []

        recv = KVReceiver(request_id, llm.layout, llm.dtype_name, blocks, len(tokens), skip, region,
                          deadline_s or self.deadline_s, on_done=lambda r: self.post(lambda: arrived(r)))
        self.receivers[request_id] = recv
        self.server.expect(recv)
        return list(blocks), skip

    def cancel(self, request_id: str) -> None:
        """The request was aborted: stop expecting its KV."""
        recv = self.receivers.pop(request_id, None)
        if recv is not None:
            self.server.forget(request_id)
            recv.fail("request aborted")

    def stats(self) -> dict:
        """Reservations waiting for KV, receive-pool bytes held, and the age of the oldest reservation (a leak
        check reads these once the instance is idle: all must be 0)."""
        now = time.monotonic()
        recvs = list(self.receivers.values())
        return {"reservations": len(recvs), "pool_used_bytes": self.pool.capacity - self.pool.free_bytes,
                "oldest_reservation_s": max((now - r.created for r in recvs), default=0.0)}

    def shm_base(self, request_id: str) -> int | None:
        """The request's region offset in this instance's shared-memory pool (None: TCP only), where a sender
        on this host writes its KV; the segment itself is named in this worker's Health (the peer table)."""
        recv = self.receivers.get(request_id)
        return recv.region.offset if self.pool.shm_name is not None and recv is not None else None

    def close(self) -> None:
        self.server.close()
        self.pool.close()
