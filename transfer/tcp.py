"""TCP backend: `KVServer` on the receiving worker, `TcpLink` (N parallel connections) on the sending one.

Receiver: one listening socket; a thread per accepted connection, bounded (net.py `Timeouts`): at most
`max_connections` open and `max_unauthenticated` not yet authenticated, the rest closed at once. A connection
must open within `hello_s` with a HELLO of at most `hello_max_bytes` carrying the cluster token (compared in
constant time), or it is refused and closed with the reason logged; nothing else is read or parsed before.
With TLS (tls.py) a connection must first complete its handshake within `hello_s` (pre-authentication work
too; with mutual TLS the peer's certificate is checked there). Every socket has timeouts and keepalive (net.py);
a connection that carries no frame for `idle_s` is closed.
Each frame's meta is checked against its kind (wire.check_meta; the plan's by plan.TransferPlan.from_meta):
one that does not fit is drained and refused with NACK(final), and the connection goes on; a header that
cannot be a frame closes the connection. Each DATA frame's payload is read with `recv_into` straight into its
place in the request's receive region (bufpool.py; data that overtook its plan on another connection waits for
it), its checksum (wire.py) verified, and answered ACK, or NACK(retry) on a checksum mismatch. Frames for an
unknown request id, a refused plan (mismatched layout or dtype, blocks that are not the reservation, a
shared-memory offset that is not the request's region) or bytes outside the plan are drained and answered
NACK(final) with the reason, which is also logged. A reaper thread fails receivers whose deadline passed
(their sender died, stalled or was cut off). A PULL frame (device backend) names staged arrays the server's
`puller` (pull.py) fetches from the sender's JAX transfer server, whose address must be a registered prefill
instance's (`pull_from`), before answering (or copies them out of the sender's memory on this GPU, when the
frame names them by CUDA IPC handles: ipc.py); a pull that fails fails the transfer at once.

Sender: a link owns N connections to one receiver address, shared by all transfers to it. Frames wait in
one queue; each connection has a writer thread that takes the next frame (so the connections share the
load), applies the link emulation (link.py) and sends header then payload from the caller's buffer, and a
reader thread that matches ACK / NACK to the frames it has outstanding. A NACK(retry) requeues the frame;
a broken connection, a write that times out, or a frame unacknowledged for `ack_s` (a silent partition)
requeues everything the connection had outstanding and reconnects; a receiver unreachable for `connect_s`
fails the transfers waiting on it; with TLS, a receiver certificate the CA does not vouch for fails them at
once, and the writer and reader share the connection's SSL object under its lock (tls.SharedTls).
Concurrency: threads and locks throughout.

Size: about 600 lines: the receiving server and the sending link of one wire protocol, kept together.
"""

from __future__ import annotations

import collections
import hmac
import logging
import queue
import socket
import ssl
import threading
import time

from . import wire
from .bufpool import PAGE
from .link import LinkEmulation, LinkMetrics, Shaper
from .net import Timeouts, tune
from .plan import PlanError, TransferPlan
from .receiver import KVReceiver
from .sender import Outgoing
from .state import KVPoll
from .tls import SharedTls, shutdown

log = logging.getLogger("jaxserve.transfer")
MAX_PAYLOAD = 1 << 30  # a DATA frame's payload (a send is split into frames of at most transfer.chunk_mb)


class KVServer:
    def __init__(self, token: str, host: str = "127.0.0.1", port: int = 0, reap_interval_s: float = 0.2,
                 plan_wait_s: float = 10.0, puller=None, timeouts: Timeouts | None = None, pull_from=None,
                 tls: ssl.SSLContext | None = None):
        """puller: a pull.PullServer when this instance takes the device backend's PULL frames; pull_from(address)
        says whether a PULL's transfer-server address is a registered prefill instance's (None: any); tls: a
        server context (tls.py): every connection must complete a TLS handshake within hello_s first."""
        self.token = token.encode()
        self.tls = tls
        self.plan_wait_s = plan_wait_s
        self.puller, self.pull_from = puller, pull_from
        self.timeouts = t = timeouts or Timeouts()
        self._receivers: dict[str, KVReceiver] = {}
        self._lock = threading.Lock()
        self._sock = socket.create_server((host, port), reuse_port=False)
        self._sock.listen(64)
        self.address = self._sock.getsockname()[:2]
        self._closed = threading.Event()
        self._conns: set[socket.socket] = set()
        self._unauthenticated = 0
        self.refused_connections = 0  # closed at accept: over max_connections / max_unauthenticated
        self.rejections: collections.deque[str] = collections.deque(maxlen=256)  # reasons, newest last (logged)
        # recent ids that are done (None) or whose plan was refused (the reason)
        self._completed: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self.bytes_received = 0
        self.corrupt_frames = 0
        self.idle_s = t.idle_s
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

    def connections(self) -> int:
        with self._lock:
            return len(self._conns)

    def close(self) -> None:
        self._closed.set()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept thread, which then ends
        except OSError:
            pass
        try:
            self._sock.close()
        except OSError:
            pass
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            shutdown(c)

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
        t = self.timeouts
        while not self._closed.is_set():
            try:
                conn, addr = self._sock.accept()
            except OSError:
                return
            with self._lock:
                full = len(self._conns) >= t.max_connections or self._unauthenticated >= t.max_unauthenticated
                if not full:
                    self._conns.add(conn)
                    self._unauthenticated += 1
                else:
                    self.refused_connections += 1
            if full:
                log.info("kv connection from %s:%s closed: connection limit reached", *addr[:2])
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn, addr), name="kv-conn", daemon=True).start()

    def _hello(self, conn: socket.socket, peer: str) -> bool:
        """Pre-authentication: a HELLO with the cluster token within hello_s, nothing bigger than
        hello_max_bytes read or parsed. Answers it; True when the peer is a cluster member."""
        t = self.timeouts
        conn.settimeout(t.hello_s)
        try:
            hello = wire.read_header(conn, max_meta=t.hello_max_bytes)
            wire.check_meta(wire.HELLO, hello.meta) if hello.kind == wire.HELLO else None
        except (wire.ProtocolError, wire.MetaError, OSError) as e:
            self._reject(f"connection from {peer}: no valid HELLO within {t.hello_s}s ({e})")
            return False
        token = str(hello.meta.get("token", "")).encode()
        if hello.kind != wire.HELLO or hello.payload_len or not hmac.compare_digest(token, self.token):
            self._reject(f"connection from {peer}: not a cluster member (missing or wrong cluster token)")
            wire.send_frame(conn, wire.Frame(wire.NACK, "", hello.seq, {"reason": "bad cluster token",
                                                                         "retry": False}))
            return False
        wire.send_frame(conn, wire.Frame(wire.ACK, "", hello.seq))
        return True

    def _handshake(self, raw: socket.socket, peer: str) -> ssl.SSLSocket | None:
        """Pre-authentication: the TLS handshake (and with mutual TLS, the peer's certificate) within hello_s.
        The SSL socket takes the place of `raw` among the connections."""
        raw.settimeout(self.timeouts.hello_s)
        try:
            conn = self.tls.wrap_socket(raw, server_side=True)
        except (OSError, ValueError) as e:  # ssl.SSLError, a timeout, a reset
            self._reject(f"connection from {peer}: TLS handshake failed ({e})")
            return None
        with self._lock:
            self._conns.discard(raw)
            self._conns.add(conn)
        return conn

    def _serve(self, conn: socket.socket, addr) -> None:
        peer = f"{addr[0]}:{addr[1]}"
        pending = True  # counted among the unauthenticated connections
        raw = conn

        def authenticated():
            nonlocal pending
            with self._lock:
                self._unauthenticated -= 1
            pending = False
        try:
            tune(conn, self.timeouts)
            if self.tls is not None:
                secured = self._handshake(conn, peer)
                if secured is None:
                    return
                conn = secured
            ok = self._hello(conn, peer)
            authenticated()
            if not ok:
                return
            conn.settimeout(self.timeouts.io_s)
            scratch = memoryview(bytearray(1 << 20))
            last = time.monotonic()
            while not self._closed.is_set():
                try:
                    h = wire.read_header(conn)
                except wire.Idle:
                    if time.monotonic() - last > self.idle_s:
                        log.info("kv connection from %s closed: idle for %.0fs", peer, self.idle_s)
                        return
                    continue
                self._frame(conn, h, scratch)
                last = time.monotonic()
        except wire.PeerClosed:
            pass  # closed between frames: the sender is done with this connection
        except (wire.ProtocolError, OSError) as e:
            if not self._closed.is_set():
                log.info("kv connection from %s closed: %s", peer, e)
        except Exception as e:  # noqa: BLE001 - a bad frame ends its connection, never the server
            log.warning("kv connection from %s closed on an unexpected error: %s: %s", peer, type(e).__name__, e)
        finally:
            if pending:
                authenticated()
            with self._lock:
                self._conns.discard(conn)
                self._conns.discard(raw)
            conn.close()
            raw.close()

    def _frame(self, conn: socket.socket, h: wire.Header, scratch: memoryview) -> None:
        def nack(reason: str, retry: bool = False):
            if not retry:
                self._reject(f"{h.request_id}: {wire.KIND_NAMES[h.kind]} frame refused: {reason}")
            wire.send_frame(conn, wire.Frame(wire.NACK, h.request_id, h.seq, {"reason": reason, "retry": retry}))

        if h.payload_len > (MAX_PAYLOAD if h.kind == wire.DATA else 0):
            raise wire.ProtocolError(f"{wire.KIND_NAMES[h.kind]} frame with a payload of {h.payload_len} bytes")
        try:
            wire.check_meta(h.kind, h.meta)
            plan = TransferPlan.from_meta(h.meta) if h.kind == wire.PLAN else None
        except (wire.MetaError, PlanError) as e:
            wire.discard(conn, h.body_len, scratch)
            return nack(str(e))
        with self._lock:
            recv = self._receivers.get(h.request_id)
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
                recv.accept_plan(plan)
            except PlanError as e:
                self.forget(h.request_id, refused=f"plan refused: {e}")
                return nack(str(e))
        elif h.kind in (wire.DATA, wire.PUT, wire.PULL, wire.META) and not recv.wait_plan(self.plan_wait_s):
            wire.discard(conn, h.body_len, scratch)
            return nack(f"no plan within {self.plan_wait_s}s of the first data")
        elif h.kind in (wire.DATA, wire.PUT):  # PUT: the sender already wrote the bytes into the region (shm.py)
            a, o = h.meta["a"], h.meta["o"]
            n = h.meta["n"] if h.kind == wire.PUT else h.payload_len
            try:
                view = recv.target(a, o, n)
            except PlanError as e:
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
            if self.pull_from is not None and not self.pull_from(h.meta["addr"]):
                return nack(f"pull address {h.meta['addr']!r} is not a registered prefill instance's")
            arrays = h.meta["arrays"]
            try:
                specs = recv.to_pull(arrays, h.meta["bytes"])
            except PlanError as e:
                return nack(str(e))
            if specs is not None:
                xs = None
                try:
                    xs = self.puller.pull(h.meta["addr"], h.meta["uuid"], [(a.shape, a.dtype) for a in specs],
                                          max(recv.deadline - time.monotonic(), 0.1), h.meta.get("ipc"))
                except Exception as e:  # noqa: BLE001 - PullError, or a bad address / uuid in the frame
                    reason = f"pull failed: {e}"  # the offer is gone or unreachable: the transfer fails now
                    self.forget(h.request_id, refused=reason)
                    recv.fail(reason)
                    return nack(reason)
                finally:
                    recv.landed(arrays, xs)
                with self._lock:
                    self.bytes_received += h.meta["bytes"]
        elif h.kind == wire.META:
            wire.discard(conn, h.body_len, scratch)
            try:
                recv.set_first(h.meta)
            except PlanError as e:
                return nack(str(e))
        elif h.kind == wire.ABORT:
            wire.discard(conn, h.body_len, scratch)
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
                 timeouts: Timeouts | None = None, tls: ssl.SSLContext | None = None):
        """tls: a client context (tls.py): each connection is TLS, the receiver's certificate checked against the
        cluster CA and the address's host."""
        if connections < 1:
            raise ValueError(f"connections must be >= 1, got {connections}")
        self.address, self.token = (address[0], int(address[1])), token
        self.tls = tls
        self.connections = connections
        self.chunk_bytes = chunk_bytes
        self.timeouts = timeouts or Timeouts()
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
        self.metrics.queued(1, len(out.frame.payload))
        self._queue.put(out)

    def set_bandwidth(self, gbps: float | None) -> None:
        """Change the emulated bandwidth at run time (the admin endpoint stages a bandwidth drop)."""
        self.shaper.set_bandwidth(gbps)
        self.metrics.bandwidth = self.shaper.emu.bytes_per_s

    def close(self) -> None:
        """Stop the link: its writer threads end (closing their connections), and so do their readers."""
        self._closed.set()
        for _ in self._threads:
            self._queue.put(None)

    def alive_threads(self) -> int:
        return sum(t.is_alive() for t in self._threads)

    # ---- connection threads
    def _connect(self) -> socket.socket:
        t = self.timeouts
        deadline = time.monotonic() + t.connect_s
        delay = 0.01
        while True:
            sock = None
            try:
                sock = socket.create_connection(self.address, timeout=t.connect_s)
                tune(sock, t)
                if self.tls is not None:
                    sock = SharedTls(self.tls.wrap_socket(sock, server_hostname=self.address[0]))
                wire.send_frame(sock, wire.Frame(wire.HELLO, "", 0, {"token": self.token}))
                h = wire.read_header(sock, max_meta=t.hello_max_bytes)
                if h.kind != wire.ACK:
                    raise ConnectionRefusedError(f"receiver refused the connection: {h.meta.get('reason')}")
                self.metrics.track(sock)
                return sock
            except (OSError, wire.ProtocolError) as e:
                if sock is not None:
                    sock.close()
                if isinstance(e, ssl.SSLCertVerificationError):  # retrying cannot help
                    raise ConnectionError(f"KV receiver {self.address[0]}:{self.address[1]}: its TLS certificate "
                                          f"was refused: {e.verify_message}") from e
                if time.monotonic() + delay > deadline or self._closed.is_set():
                    raise ConnectionError(f"KV receiver {self.address[0]}:{self.address[1]} unreachable: {e}") from e
                time.sleep(delay)
                delay = min(delay * 2, 0.5)

    def _ready(self, out: Outgoing) -> bool:
        """Whether the frame may go out now (shm.py waits for the plan's acceptance first)."""
        return True

    def _writer(self) -> None:
        conn: _Conn | None = None
        while True:
            out = self._queue.get()
            if out is None:
                break
            self.metrics.queued(-1, -len(out.frame.payload))
            if out.sender.state.final and out.frame.kind != wire.ABORT:
                continue
            wait = out.queued_at + self.shaper.emu.latency_ms / 1e3 - time.monotonic()
            if wait > 0:
                time.sleep(wait)  # the emulated link's one-way delay
            if not self._ready(out):
                continue
            if conn is None or conn.dead:
                if conn is not None:
                    conn.release(self.metrics)
                tried_at = time.monotonic()
                try:
                    conn = _Conn(self._connect())
                except ConnectionError as e:
                    conn = None
                    out.sender.link_failed(str(e))
                    self._fail_queued(str(e), tried_at)
                    continue
                threading.Thread(target=self._reader, args=(conn,), name="kv-link-reader", daemon=True).start()
            out.attempts += 1
            f = out.frame
            if f.kind != wire.ABORT:
                out.sent_at = None
                with conn.lock:  # the reader drains a dead connection's frames under this lock
                    if not conn.dead:
                        conn.outstanding[(f.request_id, f.seq)] = out
                if conn.dead:
                    self.submit(out)  # its reader has gone: the next connection takes it
                    continue
            try:
                lost = f.kind in (wire.DATA, wire.PUT) and self.shaper.lose()
                self.metrics.add("in_flight", len(f.payload))
                self._emit(conn.sock, f, lost)
                out.sent_at = time.monotonic()
                self.metrics.sent(len(f.payload))
            except OSError as e:  # a broken connection, or a write that timed out (a silent partition)
                log.info("kv link %s: connection lost (%s); its frames are resent", self.metrics.name, e)
                conn.kill()  # the reader exits and requeues what was outstanding
            except Exception as e:  # noqa: BLE001 - the transfer fails; the link and its thread go on
                log.exception("kv link %s: sending %s failed", self.metrics.name, f.name)
                with conn.lock:
                    conn.outstanding.pop((f.request_id, f.seq), None)
                out.sender.link_failed(f"sending a {f.name} frame failed: {type(e).__name__}: {e}")
                conn.kill()  # part of the frame may be on the wire
        if conn is not None:
            conn.release(self.metrics)

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

    def _fail_queued(self, reason: str, before: float) -> None:
        """A connection attempt that began at `before` failed: the frames queued before it began fail with it
        (each would wait out connect_s in turn against the same receiver). Frames queued since stay: the
        receiver may have come back meanwhile (a healed partition), and the next writer tries afresh for them."""
        kept, stop = [], False
        while True:
            try:
                out = self._queue.get_nowait()
            except queue.Empty:
                break
            if out is None:
                stop = True
                break
            if out.queued_at >= before:
                kept.append(out)
                continue
            self.metrics.queued(-1, -len(out.frame.payload))
            out.sender.link_failed(reason)
        for out in kept:
            self._queue.put(out)
        if stop:
            self._queue.put(None)

    def _reader(self, conn: "_Conn") -> None:
        ack_s = self.timeouts.ack_s
        try:
            while not conn.dead:
                try:
                    h = wire.read_header(conn.sock)
                except wire.Idle:
                    if conn.overdue(ack_s):  # sent, never answered: the path is gone without a reset
                        log.info("kv link %s: no acknowledgement for %.0fs; reconnecting", self.metrics.name, ack_s)
                        break
                    continue
                wire.check_meta(h.kind, h.meta)
                if h.kind not in (wire.ACK, wire.NACK) or h.payload_len:
                    raise wire.ProtocolError(f"unexpected {wire.KIND_NAMES[h.kind]} frame from the receiver")
                with conn.lock:
                    out = conn.outstanding.pop((h.request_id, h.seq), None)
                if out is None:
                    continue
                self.metrics.add("in_flight", -len(out.frame.payload))
                if h.kind == wire.ACK:
                    out.sender.acked(out)
                elif out.sender.refused(out, h.meta["reason"], h.meta["retry"]):
                    self.metrics.add("resends", 1)
                    self.submit(out)
        except (wire.ProtocolError, wire.MetaError, OSError):
            pass
        conn.release(self.metrics)
        with conn.lock:
            lost = list(conn.outstanding.values())
            conn.outstanding.clear()
        for out in lost:  # resent on a fresh connection (or failed if the receiver is gone)
            self.metrics.add("in_flight", -len(out.frame.payload))
            if not self._closed.is_set():
                self.submit(out)


class _Conn:
    """One sending connection: its socket and the frames it has sent that are not yet answered. Its writer and
    its reader thread each `release` it when done with it, and the socket is closed after both have: a socket
    closed while the other thread may still call into it could see its descriptor number reused by a new
    connection, and that thread read or write the wrong stream. `kill` (shutdown) wakes both."""

    def __init__(self, sock: socket.socket):
        self.sock = sock
        self.outstanding: dict[tuple[str, int], Outgoing] = {}
        self.lock = threading.Lock()
        self.dead = False
        self._users = 2  # the writer and the reader
        self._metrics: LinkMetrics | None = None

    def overdue(self, ack_s: float) -> bool:
        """A frame fully sent more than ack_s ago is still unanswered."""
        now = time.monotonic()
        with self.lock:
            return any(o.sent_at is not None and now - o.sent_at > ack_s for o in self.outstanding.values())

    def kill(self) -> None:
        self.dead = True
        shutdown(self.sock)

    def release(self, metrics: LinkMetrics) -> None:
        """One of the two threads is done with this connection (killing it); the last closes the socket."""
        self.kill()
        with self.lock:
            self._users -= 1
            last = self._users == 0
        if last:
            metrics.untrack(self.sock)
            self.sock.close()
