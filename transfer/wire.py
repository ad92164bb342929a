"""Frames on a data connection: a fixed header, the request id, a JSON meta record, then the payload.

    magic "JXKV" | version u8 | kind u8 | flags u16 | seq u32 | id_len u16 | meta_len u32 | payload_len u64 |
    crc32 u32 (of the payload) | request id (utf-8) | meta (JSON) | payload

Kinds: HELLO opens a connection (meta: cluster token, sender name); PLAN announces what a transfer will send
(transfer/plan.py); DATA carries bytes of one staged array (meta: array index, byte offset); META carries the
first sampled token; ACK / NACK answer a frame by (request id, seq) (NACK meta: reason, whether a resend can
help); ABORT tells the receiver the sender gave up. The payload is checked with CRC-32 (zlib releases the GIL
for large buffers, so connections check in parallel). Plain functions over sockets and buffers.
"""

from __future__ import annotations

import json
import socket
import struct
import zlib
from dataclasses import dataclass, field

MAGIC = b"JXKV"
VERSION = 1
HEADER = struct.Struct("<4sBBHIHIQI")

HELLO, PLAN, DATA, META, ACK, NACK, ABORT = range(1, 8)
KIND_NAMES = {HELLO: "HELLO", PLAN: "PLAN", DATA: "DATA", META: "META", ACK: "ACK", NACK: "NACK", ABORT: "ABORT"}
MAX_META = 16 << 20


class ProtocolError(RuntimeError):
    """A frame that cannot be read: bad magic or version, or the peer closed mid-frame."""


class PeerClosed(ProtocolError):
    """The peer closed the connection between frames."""


@dataclass
class Frame:
    kind: int
    request_id: str
    seq: int = 0
    meta: dict = field(default_factory=dict)
    payload: memoryview | bytes = b""
    crc: int | None = None  # computed on encode when None

    @property
    def name(self) -> str:
        return KIND_NAMES.get(self.kind, str(self.kind))


def checksum(buf) -> int:
    return zlib.crc32(buf) & 0xFFFFFFFF


def encode_header(f: Frame) -> bytes:
    rid = f.request_id.encode()
    meta = json.dumps(f.meta, separators=(",", ":")).encode() if f.meta else b""
    crc = checksum(f.payload) if f.crc is None else f.crc
    return HEADER.pack(MAGIC, VERSION, f.kind, 0, f.seq, len(rid), len(meta), len(f.payload), crc) + rid + meta


def send_frame(sock: socket.socket, f: Frame) -> None:
    sock.sendall(encode_header(f))
    if len(f.payload):
        sock.sendall(f.payload)


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    recv_into_exact(sock, memoryview(buf))
    return bytes(buf)


def recv_into_exact(sock: socket.socket, view: memoryview) -> None:
    got, n = 0, len(view)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ProtocolError(f"peer closed the connection {got}/{n} bytes into a read")
        got += k


@dataclass
class Header:
    kind: int
    seq: int
    request_id: str
    meta: dict
    payload_len: int
    crc: int


def read_header(sock: socket.socket) -> Header:
    """The next frame's header, id and meta; the caller then reads `payload_len` payload bytes."""
    first = sock.recv(HEADER.size)
    if not first:
        raise PeerClosed("peer closed the connection")
    raw = first + (recv_exact(sock, HEADER.size - len(first)) if len(first) < HEADER.size else b"")
    magic, version, kind, _, seq, id_len, meta_len, payload_len, crc = HEADER.unpack(raw)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {magic!r}: not a jaxserve KV connection")
    if version != VERSION:
        raise ProtocolError(f"protocol version {version}, expected {VERSION}")
    if kind not in KIND_NAMES:
        raise ProtocolError(f"unknown frame kind {kind}")
    if meta_len > MAX_META:
        raise ProtocolError(f"meta record of {meta_len} bytes exceeds {MAX_META}")
    rid = recv_exact(sock, id_len).decode()
    meta = json.loads(recv_exact(sock, meta_len)) if meta_len else {}
    return Header(kind, seq, rid, meta, payload_len, crc)


def discard(sock: socket.socket, n: int, scratch: memoryview) -> None:
    """Read and drop n payload bytes (a frame that is refused still has to leave the stream)."""
    while n > 0:
        k = min(n, len(scratch))
        recv_into_exact(sock, scratch[:k])
        n -= k
