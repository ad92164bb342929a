"""Fuzzing the KV plane with hypothesis: byte-level against the frame parser, and frame-level against a live
KV server (an authenticated peer sending arbitrary headers, metas and bodies). Nothing may raise anything but
the parser's own errors, no connection thread may die on an exception, and the server must still carry a valid
transfer afterwards."""

from __future__ import annotations

import json
import socket
import threading

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.transfer.test_transfer_host import Pair, _assert_same, _raw_connection
from jaxserve.transfer import wire
from jaxserve.transfer.state import KVPoll

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck))


def _parse(data: bytes):
    a, b = socket.socketpair()
    try:
        a.sendall(data)
        a.shutdown(socket.SHUT_WR)
        b.settimeout(1.0)
        h = wire.read_header(b)
        wire.check_meta(h.kind, h.meta)
        return h
    finally:
        a.close(), b.close()


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes_are_refused_by_the_parser(data):
    try:
        _parse(data)
    except (wire.ProtocolError, wire.MetaError, wire.Idle):
        pass


json_values = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(st.text(max_size=6), c, max_size=4),
                           max_leaves=12)
META_KEYS = ["a", "o", "n", "at", "arrays", "uuid", "addr", "bytes", "token", "logprob", "top", "reason", "retry",
             "signature", "dtype", "num_tokens", "skip", "nblocks", "layer_groups", "runs", "head_parts", "shm_base"]
metas = st.dictionaries(st.sampled_from(META_KEYS) | st.text(max_size=6), json_values, max_size=6)


@FUZZ
@given(kind=st.integers(0, 12), meta=metas, flags=st.integers(0, 3), payload=st.binary(max_size=64),
       version=st.sampled_from([wire.VERSION, wire.VERSION, 3, 255]))
def test_well_formed_headers_of_any_shape_parse_or_are_refused(kind, meta, flags, payload, version):
    m = json.dumps(meta).encode()
    data = wire.pack_header(kind, flags, 1, b"r", m, len(payload), 0, version=version) + payload
    try:
        _parse(data)
    except (wire.ProtocolError, wire.MetaError, wire.Idle):
        pass


@FUZZ
@given(blocks=st.lists(st.integers(0, 10_000), min_size=1, max_size=16), bit=st.integers(0, 10**6))
def test_a_bit_flipped_in_a_control_frame_header_is_refused_never_misread(blocks, bit):
    """A PLAN-like control frame (its block list in the meta) with one bit flipped anywhere in its header part:
    the parser refuses it (head checksum) or, for a bit in the zero pad, reads exactly the frame sent."""
    sent = wire.Frame(wire.PLAN, "req-1", 7, {"blocks": blocks, "skip": 0})
    head = bytearray(wire.encode_header(sent))
    bit %= len(head) * 8
    head[bit // 8] ^= 1 << (bit % 8)
    sock = _socket_with(bytes(head))
    try:
        h = wire.read_header(sock)
    except (wire.ProtocolError, wire.Idle):
        return
    finally:
        sock.close()
    assert (h.kind, h.request_id, h.seq, h.meta, h.payload_len) == (sent.kind, sent.request_id, sent.seq,
                                                                     sent.meta, 0), bit


def _socket_with(data: bytes) -> socket.socket:
    """A socket that yields `data`, then end of stream."""
    a, b = socket.socketpair()
    a.sendall(data)
    a.close()
    b.settimeout(1.0)
    return b


@pytest.fixture(scope="module")
def live():
    p = Pair()
    died = []
    old = threading.excepthook
    threading.excepthook = lambda args: died.append(args)
    yield p, died
    threading.excepthook = old
    p.close()
    p.server.close()


frames = st.lists(st.tuples(st.sampled_from(sorted(wire.KIND_NAMES)), st.sampled_from(["x", "y", "unknown"]), metas,
                            st.binary(max_size=32)), min_size=1, max_size=6)


@FUZZ
@given(frames=frames)
def test_a_member_sending_frames_of_any_shape_never_kills_a_connection_thread(live, frames):
    p, died = live
    sock, h = _raw_connection(p.server)
    assert h.kind == wire.ACK
    sock.settimeout(5)
    try:
        for seq, (kind, rid, meta, payload) in enumerate(frames):
            if kind in (wire.ACK, wire.NACK, wire.HELLO):
                payload = b""
            wire.send_frame(sock, wire.Frame(kind, rid, seq, meta, payload))
            if kind == wire.ABORT and isinstance(meta.get("reason", ""), str) and set(meta) <= {"reason"}:
                continue  # a valid ABORT is not answered
            try:
                r = wire.read_header(sock)
            except (wire.ProtocolError, OSError):
                break  # the server closed this connection (a frame that cannot be one): fine
            assert r.kind in (wire.ACK, wire.NACK)
    except OSError:
        pass
    finally:
        sock.close()
    assert died == [], died


def test_after_the_fuzzing_a_valid_transfer_still_succeeds(live):
    p, died = live
    r = p.receiver("valid", [7, 8, 9, 20])
    s, stg, arrays = p.send("valid", [3, 4, 9, 10], [7, 8, 9, 20])
    assert s.wait(15) is KVPoll.DONE and r.state.wait(15) is KVPoll.DONE
    _assert_same(stg, r.arrays(), arrays)
    r.release()
    assert died == [] and p.server.pending() == 0
