"""Frames on a data connection: a fixed header, the request id, a JSON meta record, then the payload.

    magic "JXKV" | version u8 | kind u8 | flags u16 | seq u32 | id_len u16 | meta_len u32 | payload_len u64 |
    checksum u64 (of the payload; 0 with flag TRAILER) | head checksum u64 | request id (utf-8) | meta (JSON) |
    zero pad | payload | [checksum u64, with flag TRAILER] | zero pad

The head checksum covers the fields before it, the id and the meta record: a bit flipped in transit in a
control frame (a PLAN's block list, a HELLO's token, a length) is a `ProtocolError`, never a frame read as
something else.

The pads make the header part and the body each a multiple of ALIGN (64) bytes, so every payload starts
64-byte aligned in the stream. The kernel fills its socket buffers in stream order, so copying a payload out
of them into a 64-byte-aligned receive region is then aligned on both sides; with a bare 40-byte header and
8-byte trailer it was not, and the link measured about 10% slower (bench/transfer.py (a)).

Kinds: HELLO opens a connection (meta: cluster token, sender name); PLAN announces what a transfer will send
(transfer/plan.py); DATA carries bytes of one staged array (meta: array index, byte offset); META carries the
first sampled token; PUT says bytes were written into the receiver's shared-memory region (shm.py); PULL names
staged arrays the receiver fetches from the sender's JAX transfer server (pull.py), or copies out of the
sender's memory on their shared GPU by the CUDA IPC handles it carries (ipc.py); ACK / NACK answer a frame by
(request id, seq) (NACK meta: reason, whether a resend can help); ABORT tells the receiver the sender gave up.

The payload checksum is XXH3-64 (xxhash), computed as the bytes go out or come in: the sender hashes each
1 MiB piece right after the socket has copied it, the receiver each read right after it lands, so the hash
reads them from cache (about 45-55 GB/s there, 20-25 GB/s from memory, with the GIL released; zlib's CRC-32
runs at 4 GB/s and would make the checksum, not the socket, the bottleneck of a 2-core host). A DATA frame
whose sender computes it while sending carries it in an 8-byte trailer after the payload (flag TRAILER);
other frames carry it in the header. It is an integrity check against transmission errors and truncation,
not against an adversary (the cluster token authenticates peers).

A header that cannot be a frame (bad magic, version or kind, an id that is not UTF-8, a meta record that is not
a JSON object or is longer than the reader allows) is a `ProtocolError`: the stream cannot be trusted past it.
A meta record that is a JSON object of the wrong shape is a `MetaError` (`check_meta`, per kind): the frame's
body can still be skipped and the frame refused, and the connection goes on. Plain functions over sockets and
buffers.
"""

from __future__ import annotations

import json
import socket
import struct
from dataclasses import dataclass, field

import xxhash

MAGIC = b"JXKV"
VERSION = 5
HEADER = struct.Struct("<4sBBHIHIQQQ")
_HEAD_SUMMED = HEADER.size - 8  # the head checksum covers the fields before it
TRAILER = struct.Struct("<Q")
ALIGN = 64  # the header part and the body of a frame are each padded to a multiple of this
F_TRAILER = 1  # header flag: the payload's checksum follows the payload, not in the header

HELLO, PLAN, DATA, META, ACK, NACK, ABORT, PUT, PULL = range(1, 10)
KIND_NAMES = {HELLO: "HELLO", PLAN: "PLAN", DATA: "DATA", META: "META", ACK: "ACK", NACK: "NACK", ABORT: "ABORT",
              PUT: "PUT", PULL: "PULL"}
MAX_META = 16 << 20
MAX_ID = 1024


class ProtocolError(RuntimeError):
    """A frame that cannot be read: bad magic or version, or the peer closed mid-frame."""


class PeerClosed(ProtocolError):
    """The peer closed the connection between frames."""


class Idle(TimeoutError):
    """No frame began within the socket's timeout (nothing of the stream was consumed: reading may go on)."""


class MetaError(ValueError):
    """A frame's meta record does not fit its kind (the reason names the field)."""


@dataclass
class Frame:
    kind: int
    request_id: str
    seq: int = 0
    meta: dict = field(default_factory=dict)
    payload: memoryview | bytes = b""
    digest: int | None = None  # computed on encode when None

    @property
    def name(self) -> str:
        return KIND_NAMES.get(self.kind, str(self.kind))


PIECE = 1 << 20  # bytes sent, then checksummed, at a time: small enough to stay in cache (L2)


class Checksum:
    """Incremental payload checksum: feed the pieces in order, of any sizes."""

    def __init__(self):
        self._h = xxhash.xxh3_64()

    def update(self, buf) -> None:
        self._h.update(buf)

    def digest(self) -> int:
        return self._h.intdigest()


def checksum(buf) -> int:
    return xxhash.xxh3_64_intdigest(buf)


def spoil(digest: int, lost: bool) -> int:
    """The checksum a frame goes out with: wrong when the link emulation loses the frame (link.py)."""
    return digest ^ 0xFFFFFFFF if lost else digest


def _pad(n: int) -> int:
    return -n % ALIGN


def encode_header(f: Frame, trailer: bool = False) -> bytes:
    """trailer: the payload's checksum follows the payload (`send_payload`), rather than in this header."""
    meta = json.dumps(f.meta, separators=(",", ":")).encode() if f.meta else b""
    digest = 0 if trailer else checksum(f.payload) if f.digest is None else f.digest
    return pack_header(f.kind, F_TRAILER if trailer else 0, f.seq, f.request_id.encode(), meta, len(f.payload),
                       digest)


def pack_header(kind: int, flags: int, seq: int, rid: bytes, meta: bytes, payload_len: int, digest: int,
                version: int = VERSION, magic: bytes = MAGIC) -> bytes:
    """A frame's header part from raw fields (id and meta as bytes), head checksum and pad included."""
    fields = HEADER.pack(magic, version, kind, flags, seq, len(rid), len(meta), payload_len, digest, 0)
    fields = fields[:_HEAD_SUMMED]
    head = fields + struct.pack("<Q", checksum(fields + rid + meta)) + rid + meta
    return head + bytes(_pad(len(head)))


def tail_len(payload_len: int, trailer: bool) -> int:
    """Bytes after a payload of payload_len bytes: the trailer if any, then the pad to the next ALIGN boundary."""
    t = TRAILER.size if trailer else 0
    return t + _pad(payload_len + t)


def tail(payload_len: int, digest: int | None = None) -> bytes:
    """What follows a payload of payload_len bytes: the trailer (when `digest` goes there), then the pad."""
    n = tail_len(payload_len, digest is not None)
    return bytes(n) if digest is None else TRAILER.pack(digest) + bytes(n - TRAILER.size)


def send_payload(send, payload, lost: bool = False) -> None:
    """A trailer frame's payload, then its checksum, computed piece by piece as each piece is sent (one read
    of the bytes from memory). `send(bytes)` writes to the socket; lost: send a wrong checksum."""
    check = Checksum()
    view = memoryview(payload).cast("B")
    for i in range(0, len(view), PIECE):
        piece = view[i:i + PIECE]
        send(piece)
        check.update(piece)  # after the socket's copy has read it: from cache, not from memory again
    send(tail(len(view), spoil(check.digest(), lost)))


def send_frame(sock: socket.socket, f: Frame) -> None:
    sock.sendall(encode_header(f))
    if len(f.payload):
        sock.sendall(f.payload)
        sock.sendall(tail(len(f.payload)))


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview, check: Checksum | None = None) -> None:
    """Fill `view` from the socket; with `check`, checksum each read as it lands, in cache. Each read asks for
    all that is left (fewer, larger reads cost the receiver less CPU per byte than reads capped at a piece)."""
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError(f"peer closed the connection {got}/{n} bytes into a read")
        if check is not None:
            check.update(view[got:got + k])
        got += k


@dataclass
class Header:
    kind: int
    seq: int
    request_id: str
    meta: dict
    payload_len: int
    digest: int
    trailer: bool = False  # the digest follows the payload (`read_tail` returns it)

    @property
    def tail_len(self) -> int:
        return tail_len(self.payload_len, self.trailer)

    @property
    def body_len(self) -> int:
        """Bytes after the header part: the payload and its tail."""
        return self.payload_len + self.tail_len


def read_tail(sock: socket.socket, h: Header) -> int:
    """Read what follows a frame's payload; the payload's checksum as sent (the trailer's or the header's)."""
    raw = recv_exact(sock, h.tail_len) if h.tail_len else b""
    return TRAILER.unpack_from(raw)[0] if h.trailer else h.digest


def read_header(sock: socket.socket, max_meta: int = MAX_META) -> Header:
    """The next frame's header part (header, id, meta, pad); the caller then reads `payload_len` payload bytes
    and the tail (`read_tail`), or discards `body_len` bytes. Raises Idle when no byte arrives within the
    socket's timeout, PeerClosed when the peer closed between frames, ProtocolError on a broken header."""
    try:
        first = sock.recv(HEADER.size)
    except TimeoutError:
        raise Idle("no frame within the socket timeout") from None
    if not first:
        raise PeerClosed("peer closed the connection")
    raw = first + (recv_exact(sock, HEADER.size - len(first)) if len(first) < HEADER.size else b"")
    magic, version, kind, flags, seq, id_len, meta_len, payload_len, digest, head_sum = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a jaxserve KV connection")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, expected {VERSION}")
    if kind not in KIND_NAMES:
        raise ProtocolError(f"unknown frame kind {kind}")
    if meta_len > max_meta or id_len > MAX_ID:
        raise ProtocolError(f"meta record of {meta_len} bytes or id of {id_len} exceeds {max_meta} / {MAX_ID}")
    rest = recv_exact(sock, id_len + meta_len + _pad(HEADER.size + id_len + meta_len))  # id, meta, pad
    if checksum(raw[:_HEAD_SUMMED] + rest[:id_len + meta_len]) != head_sum:
        raise ProtocolError(f"{KIND_NAMES[kind]} frame header corrupted in transit (head checksum mismatch)")
    try:
        rid = rest[:id_len].decode()
        meta = json.loads(rest[id_len:id_len + meta_len]) if meta_len else {}
    except ValueError as e:
        raise ProtocolError(f"unreadable frame id or meta: {e}") from None
    if not isinstance(meta, dict):
        raise ProtocolError(f"meta record is a {type(meta).__name__}, not an object")
    return Header(kind, seq, rid, meta, payload_len, digest, bool(flags & F_TRAILER))


# ---- meta records by kind
def _int(v, lo: int = 0) -> bool:
    return type(v) is int and v >= lo


def _num(v) -> bool:
    return type(v) in (int, float) and v == v and abs(v) != float("inf")


def _ipc_names(v) -> bool:  # a PULL's CUDA IPC names (transfer/ipc.py): the device; handle, offset, bytes per array
    return (isinstance(v, dict) and set(v) == {"dev", "handles"} and isinstance(v["dev"], str) and len(v["dev"]) < 128
            and isinstance(v["handles"], list) and 0 < len(v["handles"]) <= 4096
            and all(isinstance(h, list) and len(h) == 3 and isinstance(h[0], str) and len(h[0]) == 128
                    and all(c in "0123456789abcdef" for c in h[0]) and _int(h[1]) and _int(h[2], 1)
                    for h in v["handles"]))


def _pair(t) -> bool:
    return isinstance(t, list) and len(t) == 2 and _int(t[0]) and _num(t[1])


_META: dict[int, dict[str, tuple]] = {  # field -> (check, required)
    HELLO: {"token": (lambda v: isinstance(v, str), True), "name": (lambda v: isinstance(v, str), False)},
    DATA: {"a": (_int, True), "o": (_int, True)},
    PUT: {"a": (_int, True), "o": (_int, True), "n": (lambda v: _int(v, 1), True), "at": (_int, True)},
    PULL: {"arrays": (lambda v: isinstance(v, list) and 0 < len(v) <= 4096 and all(_int(a) for a in v), True),
           "uuid": (_int, True), "addr": (lambda v: isinstance(v, str) and len(v) < 512, True),
           "bytes": (_int, True), "ipc": (_ipc_names, False)},
    META: {"token": (lambda v: v is None or _int(v), True), "logprob": (_num, False),
           "top": (lambda v: isinstance(v, list) and len(v) <= 64 and all(_pair(t) for t in v), False)},
    ABORT: {"reason": (lambda v: isinstance(v, str), False)},
    ACK: {},
    NACK: {"reason": (lambda v: isinstance(v, str), True), "retry": (lambda v: isinstance(v, bool), True)},
}


def check_meta(kind: int, meta: dict) -> None:
    """Raise MetaError unless `meta` fits frame kind `kind` (PLAN: plan.TransferPlan.from_meta checks it)."""
    spec = _META.get(kind)
    if spec is None:
        return
    for name in meta:
        if name not in spec:
            raise MetaError(f"{KIND_NAMES[kind]} meta: unknown field {name!r}")
    for name, (ok, required) in spec.items():
        if name not in meta:
            if required:
                raise MetaError(f"{KIND_NAMES[kind]} meta: missing field {name!r}")
        elif not ok(meta[name]):
            raise MetaError(f"{KIND_NAMES[kind]} meta: bad value of {name!r}: {str(meta[name])[:80]}")


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop n bytes (a refused frame's `body_len`: it still has to leave the stream)."""
    while n > 0:
        k = min(n, len(scratch))
        recv_into_exact(sock, scratch[:k])
        n -= k
