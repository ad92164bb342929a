"""TCP backend: `KVServer` on the receiving worker, `TcpLink` (N parallel connections) on the sending one.

Receiver: one listening socket; a thread per accepted connection. A connection must open with HELLO carrying the
cluster token (compared in constant time), or it is refused and closed with the reason logged. Each DATA frame's
payload is read with `recv_into` straight into its place in the request's receive region (bufpool.py; data that
overtook its plan on another connection waits for it), its checksum (wire.py) verified, and answered ACK, or
NACK(retry) on a checksum mismatch. Frames for an unknown request id, a refused plan (mismatched layout or dtype,
blocks that are not the reservation) or bytes outside the plan are drained and answered NACK(final) with the
reason, which is also logged. A reaper thread fails receivers whose deadline passed (their sender died or
stalled). A PULL frame (device backend) names staged arrays the server's `puller` (pull.py) fetches from the
sender's JAX transfer server before answering; a pull that fails fails the transfer at once.

Sender: a link owns N connections to one receiver address, shared by all transfers to it. Frames wait in
one queue; each connection has a writer thread that takes the next frame (so the connections share the
load), applies the link emulation (link.py) and sends header then payload from the caller's buffer, and a
reader thread that matches ACK / NACK to the frames it has outstanding. A NACK(retry) requeues the frame;
a broken connection requeues everything it had outstanding and reconnects; a receiver unreachable for
`connect_timeout_s` fails the transfers waiting on it. Concurrency: threads and locks throughout.
"""

from __future__ import annotations

import collections
import hmac
import logging
import queue
import socket
import threading
import time

from . import wire
from .bufpool import PAGE
from .link import LinkEmulation, LinkMetrics, Shaper
from .plan import PlanError, TransferPlan
from .receiver import KVReceiver
from .sender import Outgoing
from .state import KVPoll

log = logging.getLogger("jaxserve.transfer")


def _tune(sock: socket.socket) -> None:
    """No delay for the small control frames. Socket buffer sizes are left to the kernel's autotuning: fixed
    4 MiB buffers measured about 10% slower on loopback (bench/transfer.py (a))."""
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class KVServer:
    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0, reap_interval_s: float = 0.2,
                 plan_wait_s: float = 10.0, puller=None):
        """puller: a pull.PullServer when this instance takes the device backend's PULL frames."""
        self.token = token.encode()
        self.plan_wait_s = plan_wait_s
        self.puller = puller
        self._receivers: dict[str, KVReceiver] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.listen(64)
        self.address = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self.rejections: list[str] = []  # reasons, newest last (also logged)
        # recent ids that are done (None) or whose plan was refused (the reason)
        self._completed: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self.bytes_received = 0
        self.corrupt_frames = 0
        threading.Thread(target=self._accept, name="kv-accept", daemon=True).start()
        threading.Thread(target=self._reap, args=(reap_interval_s,), name="kv-reaper", daemon=True).start()

    # ---- registry
    def expect(self, receiver: KVReceiver) -> None:
        with self._lock:
            if receiver.request_id in self._receivers:
                raise ValueError(f"a transfer for {receiver.request_id!r} is already expected")
            self._receivers[receiver.request_id] = receiver

    def forget(self, request_id: str, completed: bool = False, refused: str | None = None) -> None:
        """Stop expecting a request. completed: late resends of its frames are acknowledged, not refused;
        refused: its plan was refused for this reason, which its later frames are refused with too (so the
        sender learns the cause whichever of its connections answers first)."""
        with self._lock:
            self._receivers.pop(request_id, None)
            if completed or refused is not None:
                self._completed[request_id] = refused
                while len(self._completed) > 4096:
                    self._completed.popitem(last=False)

    def pending(self) -> int:
        with self._lock:
            return len(self._receivers)

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    # ---- threads
    def _reject(self, reason: str) -> None:
        log.warning("kv transfer rejected: %s", reason)
        with self._lock:
            self.rejections.append(reason)

    def _reap(self, interval: float) -> None:
        while not self._closed.wait(interval):
            now = time.monotonic()
            with self._lock:
                late = [r for r in self._receivers.values() if r.expired(now)]
            for r in late:
                self._reject(f"{r.request_id}: no complete transfer before the deadline "
                             f"({r.received} bytes received)")
                self.forget(r.request_id)
                r.fail("deadline passed before the transfer completed")

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            _tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, addr), name="kv-conn", daemon=True).start()

    def _serve(self, conn: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        scratch = memoryview(bytearray(1 << 20))
        try:
            hello = wire.read_header(conn)
            token = str(hello.meta.get("token", "")).encode()
            if hello.kind != wire.HELLO or not hmac.compare_digest(token, self.token):
                self._reject(f"connection from {peer}: not a cluster member (missing or wrong cluster token)")
                wire.send_frame(conn, wire.Frame(wire.NACK, "", hello.seq, {"reason": "bad cluster token",
                                                                             "retry": False}))
                return
            wire.send_frame(conn, wire.Frame(wire.ACK, "", hello.seq))
            while not self._closed.is_set():
                self._frame(conn, wire.read_header(conn), scratch)
        except wire.PeerClosed:
            pass  # closed between frames: the sender is done with this connection
        except (wire.ProtocolError, OSError, ValueError) as e:
            if not self._closed.is_set():
                log.info("kv connection from %s closed: %s", peer, e)
        finally:
            with self._lock:
                self._conns.discard(conn)
            conn.close()

    def _frame(self, conn: socket.socket, h: wire.Header, scratch: memoryview) -> None:
        with self._lock:
            recv = self._receivers.get(h.request_id)

        def nack(reason: str, retry: bool = False):
            if not retry:
                self._reject(f"{h.request_id}: {wire.KIND_NAMES[h.kind]} frame refused: {reason}")
            wire.send_frame(conn, wire.Frame(wire.NACK, h.request_id, h.seq, {"reason": reason, "retry": retry}))

        if recv is None and h.kind != wire.ABORT:
            wire.discard(conn, h.body_len, scratch)
            with self._lock:
                known = h.request_id in self._completed
                refused = self._completed.get(h.request_id)
            if refused is not None:
                return wire.send_frame(conn, wire.Frame(wire.NACK, h.request_id, h.seq,
                                                        {"reason": refused, "retry": False}))
            if known:
                return wire.send_frame(conn, wire.Frame(wire.ACK, h.request_id, h.seq))
            return nack("unknown request id")
        if h.kind == wire.PLAN:
            wire.discard(conn, h.body_len, scratch)
            try:
                recv.accept_plan(TransferPlan.from_meta(h.meta))
            except PlanError as e:
                self.forget(h.request_id, refused=f"plan refused: {e}")
                return nack(str(e))
        elif h.kind in (wire.DATA, wire.PUT, wire.PULL, wire.META) and not recv.wait_plan(self.plan_wait_s):
            wire.discard(conn, h.body_len, scratch)
            return nack(f"no plan within {self.plan_wait_s}s of the first data")
        elif h.kind in (wire.DATA, wire.PUT):  # PUT: the sender already wrote the bytes into the region (shm.py)
            try:
                a, o = int(h.meta["a"]), int(h.meta["o"])
                n = int(h.meta["n"]) if h.kind == wire.PUT else h.payload_len
                view = recv.target(a, o, n)
            except (PlanError, KeyError, ValueError, TypeError) as e:
                wire.discard(conn, h.body_len, scratch)
                return nack(str(e))
            if view is None:  # a resend of bytes already here
                wire.discard(conn, h.body_len, scratch)
                return wire.send_frame(conn, wire.Frame(wire.ACK, h.request_id, h.seq))
            if h.kind == wire.DATA:
                check = wire.Checksum()
                wire.recv_into_exact(conn, view, check)
                digest, sent = check.digest(), wire.read_tail(conn, h)
            else:
                wire.discard(conn, h.body_len, scratch)
                digest, sent = wire.checksum(view), h.digest
            if digest != sent:
                with self._lock:
                    self.corrupt_frames += 1
                log.info("%s: checksum mismatch on %s array %d bytes [%d, %d); asking for a resend", h.request_id,
                         wire.KIND_NAMES[h.kind], a, o, o + n)
                return nack("checksum mismatch", retry=True)
            with self._lock:
                self.bytes_received += n
            recv.commit(a, o, n)
        elif h.kind == wire.PULL:
            wire.discard(conn, h.body_len, scratch)
            if self.puller is None:
                return nack("this instance does not take device pulls")
            try:
                arrays = [int(a) for a in h.meta["arrays"]]
                specs = recv.to_pull(arrays, int(h.meta["bytes"]))
            except (PlanError, KeyError, ValueError, TypeError) as e:
                return nack(str(e))
            if specs is not None:
                xs = None
                try:
                    xs = self.puller.pull(str(h.meta["addr"]), int(h.meta["uuid"]), [(a.shape, a.dtype) for a in specs],
                                          max(recv.deadline - time.monotonic(), 0.1))
                except Exception as e:  # noqa: BLE001 - PullError, or a bad address / uuid in the frame
                    reason = f"pull failed: {e}"  # the offer is gone or unreachable: the transfer fails now
                    self.forget(h.request_id, refused=reason)
                    recv.fail(reason)
                    return nack(reason)
                finally:
                    recv.landed(arrays, xs)
                with self._lock:
                    self.bytes_received += int(h.meta["bytes"])
        elif h.kind == wire.META:
            wire.discard(conn, h.body_len, scratch)
            try:
                recv.set_first(h.meta)
            except PlanError as e:
                return nack(str(e))
        elif h.kind == wire.ABORT:
            if recv is not None:
                self.forget(h.request_id)
                recv.fail(f"sender aborted: {h.meta.get('reason', '')}")
            return
        else:
            wire.discard(conn, h.body_len, scratch)
            return nack(f"unexpected frame kind {wire.KIND_NAMES[h.kind]}")
        if recv.state.final:
            self.forget(h.request_id, completed=recv.state.poll() is KVPoll.DONE)
        wire.send_frame(conn, wire.Frame(wire.ACK, h.request_id, h.seq))


class TcpLink:
    MIN_FRAME = 1 << 20  # a send is not split into frames smaller than this (each frame costs a header and an ACK)

    def __init__(self, address: tuple[str, int], token: str, connections: int = 4,
                 emulation: LinkEmulation | None = None, name: str | None = None, chunk_bytes: int = 64 << 20,
                 connect_timeout_s: float = 5.0):
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.address, self.token = (address[0], int(address[1])), token
        self.connections = connections
        self.chunk_bytes = chunk_bytes
        self.connect_timeout_s = connect_timeout_s
        self.shaper = Shaper(emulation)
        self.metrics = LinkMetrics(name or f"{address[0]}:{address[1]}", self.shaper.emu.bytes_per_s)
        self._queue: queue.Queue[Outgoing | None] = queue.Queue()
        self._closed = threading.Event()
        self._threads = [threading.Thread(target=self._writer, name=f"kv-link-{i}", daemon=True)
                         for i in range(connections)]
        for t in self._threads:
            t.start()

    def frame_bytes(self, nbytes: int) -> int:
        """Payload bytes per frame of one send of `nbytes`: an equal share for each connection, so they carry it
        in parallel, in whole pages (frames stay page aligned in the receive region), no less than MIN_FRAME
        and no more than `chunk_bytes`. Few large frames: the sender's CPU per byte fell with the frame count
        (bench/transfer.py (a): 4 x 64 MiB frames moved 256 MiB about 8% faster than 32 x 8 MiB)."""
        share = max(-(-nbytes // self.connections), self.MIN_FRAME)
        return min(-(-share // PAGE) * PAGE, self.chunk_bytes)

    def submit(self, out: Outgoing) -> None:
        out.queued_at = time.monotonic()
        self.metrics.add("queue_depth", 1)
        self._queue.put(out)

    def close(self) -> None:
        self._closed.set()
        for _ in self._threads:
            self._queue.put(None)

    # ---- connection threads
    def _connect(self) -> socket.socket:
        deadline = time.monotonic() + self.connect_timeout_s
        delay = 0.01
        while True:
            try:
                sock = socket.create_connection(self.address, timeout=self.connect_timeout_s)
                sock.settimeout(None)
                _tune(sock)
                wire.send_frame(sock, wire.Frame(wire.HELLO, "", 0, {"token": self.token}))
                h = wire.read_header(sock)
                if h.kind != wire.ACK:
                    sock.close()
                    raise ConnectionRefusedError(f"receiver refused the connection: {h.meta.get('reason')}")
                self.metrics.track(sock)
                return sock
            except (OSError, wire.ProtocolError) as e:
                if time.monotonic() + delay > deadline or self._closed.is_set():
                    raise ConnectionError(f"KV receiver {self.address[0]}:{self.address[1]} unreachable: {e}") from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _writer(self) -> None:
        conn: _Conn | None = None
        while True:
            out = self._queue.get()
            if out is None:
                break
            self.metrics.add("queue_depth", -1)
            if out.sender.state.final and out.frame.kind != wire.ABORT:
                continue
            wait = out.queued_at + self.shaper.emu.latency_ms / 1e3 - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the emulated link's one-way delay
            if conn is None or conn.dead:
                if conn is not None:
                    conn.close(self.metrics)
                try:
                    conn = _Conn(self._connect())
                except ConnectionError as e:
                    conn = None
                    out.sender.link_failed(str(e))
                    self._fail_queued(str(e))
                    continue
                threading.Thread(target=self._reader, args=(conn,), name="kv-link-reader", daemon=True).start()
            out.attempts += 1
            f = out.frame
            if f.kind != wire.ABORT:
                with conn.lock:
                    conn.outstanding[(f.request_id, f.seq)] = out
            try:
                lost = f.kind in (wire.DATA, wire.PUT) and self.shaper.lose()
                self.metrics.add("in_flight", len(f.payload))
                self._emit(conn.sock, f, lost)
                self.metrics.sent(len(f.payload))
            except OSError as e:
                log.info("kv link %s: connection lost (%s); its frames are resent", self.metrics.name, e)
                conn.kill()  # the reader exits and requeues what was outstanding
        if conn is not None:
            conn.close(self.metrics)

    def _emit(self, sock: socket.socket, f: wire.Frame, lost: bool) -> None:
        """Writer thread: one frame onto the wire (lost: with a wrong checksum, emulating a corrupted frame). A
        DATA payload is checksummed piece by piece as it goes out, its checksum in a trailer, so its bytes are
        read from memory once, not once for the checksum and again for the socket."""
        send = lambda b: self.shaper.send(sock, b)  # noqa: E731
        if f.kind == wire.DATA:
            send(wire.encode_header(f, trailer=True))
            wire.send_payload(send, f.payload, lost)
            return
        send(wire.encode_header(f))  # control frames (PLAN, META, PULL, ABORT): nothing to lose
        if len(f.payload):
            send(f.payload)
            send(wire.tail(len(f.payload)))

    def _fail_queued(self, reason: str) -> None:
        while True:
            try:
                out = self._queue.get_nowait()
            except queue.Empty:
                return
            if out is None:
                self._queue.put(None)
                return
            self.metrics.add("queue_depth", -1)
            out.sender.link_failed(reason)

    def _reader(self, conn: "_Conn") -> None:
        try:
            while True:
                h = wire.read_header(conn.sock)
                with conn.lock:
                    out = conn.outstanding.pop((h.request_id, h.seq), None)
                if out is None:
                    continue
                self.metrics.add("in_flight", -len(out.frame.payload))
                if h.kind == wire.ACK:
                    out.sender.acked(out)
                elif out.sender.refused(out, str(h.meta.get("reason")), bool(h.meta.get("retry"))):
                    self.metrics.add("resends", 1)
                    self.submit(out)
        except (wire.ProtocolError, OSError):
            pass
        conn.kill()
        with conn.lock:
            lost = list(conn.outstanding.values())
            conn.outstanding.clear()
        for out in lost:  # resent on a fresh connection (or failed if the receiver is gone)
            self.metrics.add("in_flight", -len(out.frame.payload))
            if not self._closed.is_set():
                self.submit(out)


class _Conn:
    """One sending connection: its socket and the frames it has sent that are not yet answered."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.outstanding: dict[tuple[str, int], Outgoing] = {}
        self.lock = threading.Lock()
        self.dead = False

    def kill(self) -> None:
        self.dead = True
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass

    def close(self, metrics: LinkMetrics) -> None:
        metrics.untrack(self.sock)
        self.kill()
        self.sock.close()
