"""Host side of the transfer layer: state machine, alignment, plans, receive pools, and the TCP backend over
real loopback sockets (corruption, truncation, unknown ids, refused plans, foreign peers, deadlines).

Size: over 600 lines as the host side's tests in one module, sharing their helpers (plans, pools, sockets)."""

from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from tests.transfer.helpers import export, layout, random_pool
from jaxserve.transfer import wire
from jaxserve.transfer.align import Run, align, contiguous_runs
from jaxserve.transfer.bufpool import PoolFull, RecvPool
from jaxserve.transfer.link import LinkEmulation, TokenBucket
from jaxserve.transfer.net import Timeouts
from jaxserve.transfer.plan import PlanError, TransferPlan, layer_groups, staging
from jaxserve.transfer.receiver import KVReceiver, region_bytes
from jaxserve.transfer.sender import KVSender
from jaxserve.transfer.state import IllegalTransition, KVPoll, TransferState
from jaxserve.transfer.shm import ShmLink
from jaxserve.transfer.tcp import KVServer, TcpLink

TOKEN = "cluster-secret"


def test_state_machine_legal_and_illegal_moves():
    s = TransferState("t")
    s.advance(KVPoll.TRANSFERRING)
    s.advance(KVPoll.DONE)
    with pytest.raises(IllegalTransition):
        s.advance(KVPoll.TRANSFERRING)
    assert not s.fail("late")  # final states stay final
    s2 = TransferState("u")
    with pytest.raises(IllegalTransition):
        s2.advance(KVPoll.DONE)  # must transfer before it is done
    assert s2.fail("dead peer") and s2.poll() is KVPoll.FAILED and s2.reason == "dead peer"


def test_align_maximal_runs_contiguous_on_both_sides():
    src = [3, 4, 5, 9, 10, 11, 12]
    dst = [7, 8, 20, 21, 22, 30, 31]
    runs = align(src, dst)
    assert runs == [Run(0, 3, 7, 2), Run(2, 5, 20, 1), Run(3, 9, 21, 2), Run(5, 11, 30, 2)]
    # every run is contiguous on both sides and they tile the request, and no two neighbours could merge
    assert sum(r.length for r in runs) == len(src)
    for a, b in zip(runs, runs[1:]):
        assert not (b.src == a.src + a.length and b.dst == a.dst + a.length)
    assert align(list(range(100)), list(range(50, 150))) == [Run(0, 0, 50, 100)]
    assert contiguous_runs(src) == 2 and contiguous_runs(dst) == 3
    with pytest.raises(ValueError):
        align([1, 2], [1])


def test_plan_checks_reject_mismatches():
    lay = layout()
    dst = [7, 8, 9, 20]
    plan = TransferPlan.build(lay, "float32", 14, [3, 4, 9, 10], dst, 0, layer_groups(lay.num_layers, 2))
    st = plan.check(lay, "float32", dst, 14, 0)
    # bytes on the wire: 4 blocks of the full group, the sliding ring, the linear state
    g = lay.groups
    want = (4 * 3 * 2 * 4 * 2 * 8 * 4) + (1 * 2 * 4 * 2 * 8 * 4) + (3 * 16 * 4 + 2 * 4 * 4 * 4)
    assert st.sent_bytes == want and g[0].kind == "full"
    assert all(a.offset % 64 == 0 for a in st.arrays)
    with pytest.raises(PlanError, match="dtype"):
        plan.check(lay, "bfloat16", dst, 14, 0)
    other = layout(block_size=8)
    with pytest.raises(PlanError, match="layout"):
        TransferPlan.build(other, "float32", 14, [3, 4], [7, 8], 0, [(0, 5)]).check(lay, "float32", dst, 14, 0)
    with pytest.raises(PlanError, match="run"):
        plan.check(lay, "float32", [7, 8, 10, 20], 14, 0)  # not the reserved blocks
    bad = TransferPlan.from_meta({**plan.to_meta(), "layer_groups": [[0, 2], [3, 5]]})
    with pytest.raises(PlanError, match="partition"):
        bad.check(lay, "float32", dst, 14, 0)
    with pytest.raises(PlanError, match="malformed"):
        TransferPlan.from_meta({"runs": "x"})
    # skipping the receiver's prefix blocks: only the rest is planned
    skip = TransferPlan.build(lay, "float32", 14, [3, 4, 9, 10], dst, 2, [(0, 5)])
    assert skip.nblocks == 2 and [r.index for r in skip.runs] == [0, 1]


def test_recv_pool_alignment_and_backpressure():
    pool = RecvPool(64 * 4096)
    a = pool.allocate(10_000)
    assert a.buf.ctypes.data % 64 == 0 and a.buf.nbytes == 10_000
    b = pool.allocate(4096 * 60)
    with pytest.raises(PoolFull):
        pool.allocate(4096 * 2)
    a.free()
    with pytest.raises(ValueError):
        a.free()
    b.free()
    assert pool.free_bytes == pool.capacity


def test_token_bucket_rate():
    import time
    tb = TokenBucket(rate=2e6, burst=1e5)
    t = time.monotonic()
    for _ in range(10):
        tb.consume(100_000)
    dt = time.monotonic() - t
    assert dt >= 0.4  # 1 MB at 2 MB/s with a 100 kB burst: at least 0.45 s


def test_shaper_bandwidth_changes_at_run_time():
    """A lower rate set mid-stream paces what follows at the new rate (the admin endpoint's bandwidth drop)."""
    import time
    from jaxserve.transfer.link import Shaper
    sh = Shaper(LinkEmulation(bandwidth_gbps=0.8))  # 100 MB/s
    sh.bucket.consume(int(sh.bucket.burst))  # empty the bucket
    sh.set_bandwidth(0.016)  # 2 MB/s: its burst is one 1 MiB piece
    assert sh.emu.bandwidth_gbps == 0.016 and sh.bucket.rate == 2e6
    t = time.monotonic()
    for _ in range(3):
        sh.bucket.consume(sh.PIECE)
    assert time.monotonic() - t >= 2 * sh.PIECE / 2e6 * 0.95  # the first piece may ride the refill
    sh.set_bandwidth(None)
    assert sh.bucket is None


class Pair:
    """A receiver server and a helper to run one transfer of the test layout through a link."""

    def __init__(self, shm: bool = False, server_tls=None, **link_kw):
        self.lay = layout()
        self.pool = random_pool(self.lay)
        self.server = KVServer(TOKEN, tls=server_tls)
        self.rpool = RecvPool(1 << 22, shared=shm)
        kw = {"connections": 2, "chunk_bytes": 512, **link_kw}
        self.link = (ShmLink(self.server.address, TOKEN, self.rpool.shm_name, **kw) if shm
                     else TcpLink(self.server.address, TOKEN, **kw))
        self.done: list[KVReceiver] = []
        self.regions: dict[str, int] = {}

    def receiver(self, rid, dst, n=14, skip=0, deadline=10.0):
        region = self.rpool.allocate(region_bytes(self.lay, "float32", n, skip))
        self.regions[rid] = region.offset
        r = KVReceiver(rid, self.lay, "float32", dst, n, skip, region, deadline, self.done.append)
        self.server.expect(r)
        return r

    def send(self, rid, src, dst, n=14, skip=0, groups=2, dtype="float32", lay=None):
        lay = lay or self.lay
        plan = TransferPlan.build(lay, dtype, n, src, dst, skip, layer_groups(lay.num_layers, groups))
        st = plan.check(lay, dtype, dst, n, skip)
        s = KVSender(rid, self.link, plan, st, shm_base=self.regions.get(rid) if self.rpool.shm_name else None)
        s.start()
        arrays = export(lay, self.pool, st, src[skip:], 1)
        for i, a in enumerate(arrays):
            s.send_array(i, a)
        s.finish({"token": 7, "logprob": -0.5})
        return s, st, arrays

    def refused(self, link) -> None:
        """A transfer through `link` (one the server will not admit) fails as unreachable, nothing received."""
        r = self.receiver("x", [7, 8, 9, 20])
        plan = TransferPlan.build(self.lay, "float32", 14, [3, 4, 9, 10], [7, 8, 9, 20], 0, [(0, 5)])
        s = KVSender("x", link, plan, plan.check(self.lay, "float32", [7, 8, 9, 20], 14, 0))
        s.start()
        try:
            assert s.wait(10) is KVPoll.FAILED and "unreachable" in s.state.reason
            assert r.received == 0
        finally:
            link.close()

    def close(self):
        self.link.close()
        self.server.close()
        self.rpool.close()


def _assert_same(st, got, sent):
    for a, g, e in zip(st.arrays, got, sent):
        n = a.rows if a.kind == "blocks" else len(g)
        np.testing.assert_array_equal(g[:n], e[:n])


def test_head_parts_stage_each_ranks_heads_contiguously_and_cross_whole():
    """A sender whose pool splits KV heads over 2 ranks stages its attention arrays as 2 head parts (HND: each
    rank's heads one array, sent as it is); together they take the whole arrays' bytes, and the receiver's
    region, read back whole, holds exactly what an unsplit transfer delivers."""
    lay = layout()
    dst, src = [7, 8, 9, 20], [3, 4, 9, 10]
    groups = layer_groups(lay.num_layers, 2)
    whole = TransferPlan.build(lay, "float32", 14, src, dst, 0, groups).check(lay, "float32", dst, 14, 0)
    plan = TransferPlan.build(lay, "float32", 14, src, dst, 0, groups, [2, 2, 1])
    plan = TransferPlan.from_meta(plan.to_meta())  # as the receiver reads it off the PLAN frame
    st = plan.check(lay, "float32", dst, 14, 0)
    assert (st.nbytes, st.sent_bytes) == (whole.nbytes, whole.sent_bytes)
    kinds = [(a.kind, a.part, a.parts, a.shape[-2]) for a in st.arrays]
    assert kinds.count(("blocks", 1, 2, 1)) == 3 and kinds.count(("ring", 1, 2, 1)) == 1  # 2 heads -> 1 + 1
    assert [w.shape for w, _ in st.logical] == [a.shape for a in whole.arrays]
    for w, parts in st.logical:  # parts back to back, the whole array where the unsplit one is
        assert [p.offset for p in parts] == [w.offset + i * parts[0].padded_bytes for i in range(len(parts))]
    assert len(plan.sends(st)) == 3 * 2 * 3 + 2 + 2  # runs x parts x block arrays + ring parts + conv, ssm
    for bad, why in (([2, 2, 2], "linear"), ([3, 1, 1], "2 KV heads"), ([2, 2], "the layout has 3")):
        with pytest.raises(PlanError, match=why):
            TransferPlan.build(lay, "float32", 14, src, dst, 0, groups, bad).check(lay, "float32", dst, 14, 0)
    p = Pair()
    try:
        r = p.receiver("h", dst)
        s = KVSender("h", p.link, plan, st)
        s.start()
        for i, a in enumerate(export(lay, p.pool, st, src, 1)):
            s.send_array(i, a)
        s.finish({"token": 1})
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        got = [np.concatenate([r.arrays()[q.index] for q in parts], axis=-2) for _, parts in st.logical]
        _assert_same(whole, got, export(lay, p.pool, whole, src, 1))
    finally:
        p.close()


def test_spans_split_the_rows_into_unsplit_shapes_and_cross_as_the_unsplit_plan():
    """A plan in spans of 4 rows (11 blocks: 4 + 4 + 3): each span's arrays have the shapes of an unsplit staging
    of its own rows (the programs are those), the rings and state go with the last span, the split staging takes
    no more bytes than the unsplit one (nor than the receiver's worst-case region, for any rows and span), its
    sends tile each array once, and a transfer whose earlier spans go first delivers exactly the unsplit KV."""
    lay = layout()
    src = [3, 4, 9, 10, 11, 12, 13, 14, 25, 26, 27]
    dst = [7, 8, 9, 20, 21, 22, 23, 28, 29, 30, 31]
    n, groups = 43, layer_groups(lay.num_layers, 2)
    whole = TransferPlan.build(lay, "float32", n, src, dst, 0, groups).check(lay, "float32", dst, n, 0)
    plan = TransferPlan.from_meta(TransferPlan.build(lay, "float32", n, src, dst, 0, groups, span_rows=4).to_meta())
    st = plan.check(lay, "float32", dst, n, 0)
    assert plan.span_rows == 4 and st.spans == [(0, 4), (4, 4), (8, 3)] and whole.spans == [(0, 11)]
    assert st.sent_bytes == whole.sent_bytes and st.nbytes <= whole.nbytes
    def shape(arrays):
        return [(w.group, w.kind, w.j0, w.j1, w.shape) for w, _ in arrays]
    for s, arrays in st.units():
        rows = st.spans[s][1]
        assert shape(arrays) == shape(staging(lay, "float32", rows, groups).logical), s
    assert {a.span for a in st.arrays if a.kind != "blocks"} == {2}
    covered: dict[int, list] = {}
    for a, off, nb in plan.sends(st):
        covered.setdefault(a, []).append((off, nb))
    for a in st.arrays:  # each array's sends: back to back from 0 to its bytes
        pos = 0
        for off, nb in sorted(covered[a.index]):
            assert off == pos and nb > 0
            pos += nb
        assert pos == a.sent_bytes, a
    for rows in range(1, 40):
        for P in (1, 2, 4, 8, 16):
            split = staging(lay, "float32", rows, layer_groups(lay.num_layers, 2), span_rows=P)
            assert split.nbytes <= region_bytes(lay, "float32", rows * lay.block_size, 0), (rows, P)
    # an unsplit plan's frame is as before spans; spans no smaller than the rows are no spans
    assert "span_rows" not in TransferPlan.build(lay, "float32", n, src, dst, 0, groups).to_meta()
    assert TransferPlan.build(lay, "float32", n, src, dst, 0, groups, span_rows=16).span_rows is None
    for bad in (3, 0, "4"):
        with pytest.raises(PlanError, match="span_rows"):
            TransferPlan.from_meta({**plan.to_meta(), "span_rows": bad})
    with pytest.raises(PlanError, match="one span"):
        TransferPlan.from_meta({**plan.to_meta(), "span_rows": 16}).check(lay, "float32", dst, n, 0)
    p = Pair()
    try:
        r = p.receiver("s", dst, n)
        sender = KVSender("s", p.link, plan, st)
        sender.start()
        arrays = export(lay, p.pool, st, src, 1)
        order = sorted(range(len(arrays)), key=lambda i: -st.arrays[i].span)  # the earlier spans last, even
        for i in order:
            sender.send_array(i, arrays[i])
        sender.finish({"token": 3})
        assert sender.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        got = r.arrays()
        for (w, _), rows in zip(whole.logical, export(lay, p.pool, whole, src, 1)):  # the unsplit KV, rebuilt
            mine = [got[a.index][:a.rows] if a.kind == "blocks" else got[a.index] for a in st.arrays
                    if (a.layer_group, a.group, a.kind) == (w.layer_group, w.group, w.kind)]
            np.testing.assert_array_equal(np.concatenate(mine) if w.kind == "blocks" else mine[0],
                                          rows[:w.rows] if w.kind == "blocks" else rows)
    finally:
        p.close()


def test_tcp_transfer_exact_bytes_and_first_token():
    p = Pair()
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, st, arrays = p.send("a", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        assert r.first == {"token": 7, "logprob": -0.5} and p.done == [r]
        _assert_same(st, r.arrays(), arrays)
        assert r.received == st.sent_bytes == s.bytes_acked
        assert s.sends == 3 * 3 + 3  # 3 runs x 3 block arrays (layer groups of 2 over 5 layers) + ring, conv, ssm
        r.release()
        assert p.rpool.free_bytes == p.rpool.capacity
    finally:
        p.close()


def test_link_reports_the_bytes_waiting_in_its_queue():
    """Frames held by the link's one-way delay count in queue_depth and queued_bytes (the router's estimate of
    the link's backlog), and leave both once sent."""
    p = Pair(emulation=LinkEmulation(latency_ms=1000))  # a second: the snapshot below is taken well inside it
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, _, _ = p.send("a", [3, 4, 9, 10], [7, 8, 9, 20])
        snap = p.link.metrics.snapshot()
        assert snap["queue_depth"] > 1 and snap["queued_bytes"] > 0
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        snap = p.link.metrics.snapshot()
        assert snap["queue_depth"] == snap["queued_bytes"] == snap["in_flight_bytes"] == 0
        r.release()
    finally:
        p.close()


def test_tcp_emulated_loss_is_detected_and_resent():
    p = Pair(emulation=LinkEmulation(loss=0.3, seed=3))
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, st, arrays = p.send("a", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        assert s.resends > 0 and p.server.corrupt_frames == s.resends
        assert p.link.metrics.snapshot()["resends"] == s.resends
        _assert_same(st, r.arrays(), arrays)
    finally:
        p.close()


def test_shared_memory_transfer_writes_the_region_directly_and_resends(monkeypatch):
    """Local backend: the pieces are copied into the receiver's shared-memory region by the sender (PUT frames
    carry no payload on the socket), checked there; emulated loss is NACKed and the piece put again."""
    sent = []
    orig = wire.send_frame
    monkeypatch.setattr(wire, "send_frame", lambda sock, f: (sent.append(f.kind), orig(sock, f))[1])
    p = Pair(shm=True, emulation=LinkEmulation(loss=0.3, seed=5))
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, st, arrays = p.send("a", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        _assert_same(st, r.arrays(), arrays)
        assert r.received == st.sent_bytes == s.bytes_acked == p.server.bytes_received
        assert s.resends > 0 and p.server.corrupt_frames == s.resends
        assert p.link.metrics.snapshot()["bytes_sent"] >= st.sent_bytes
        r.release()
        assert p.rpool.free_bytes == p.rpool.capacity
    finally:
        p.close()


def test_shared_memory_put_outside_the_plan_is_refused():
    p = Pair(shm=True)
    try:
        p.receiver("a", [7, 8, 9, 20])
        sock, hello = _raw_connection(p.server)
        plan = TransferPlan.build(p.lay, "float32", 14, [3, 4, 9, 10], [7, 8, 9, 20], 0, layer_groups(5, 2))
        wire.send_frame(sock, wire.Frame(wire.PLAN, "a", 0, plan.to_meta()))
        assert wire.read_header(sock).kind == wire.ACK
        wire.send_frame(sock, wire.Frame(wire.PUT, "a", 1, {"a": 0, "o": 1 << 30, "n": 64, "at": 0}, b"", 0))
        h = wire.read_header(sock)
        assert h.kind == wire.NACK and "outside array 0" in h.meta["reason"]
        sock.close()
    finally:
        p.close()


def _raw_connection(server, token=TOKEN):
    sock = socket.create_connection(server.address)
    wire.send_frame(sock, wire.Frame(wire.HELLO, "", 0, {"token": token}))
    return sock, wire.read_header(sock)


def test_corrupted_payload_bytes_are_refused_then_accepted():
    p = Pair()
    try:
        lay = p.lay
        r = p.receiver("c", [1, 2, 3, 4])
        plan = TransferPlan.build(lay, "float32", 14, [1, 2, 3, 4], [1, 2, 3, 4], 0, [(0, 5)])
        st = plan.check(lay, "float32", [1, 2, 3, 4], 14, 0)
        sock, h = _raw_connection(p.server)
        assert h.kind == wire.ACK
        wire.send_frame(sock, wire.Frame(wire.PLAN, "c", 1, plan.to_meta()))
        assert wire.read_header(sock).kind == wire.ACK
        arrays = export(lay, p.pool, st, [1, 2, 3, 4], 1)
        for i, a in enumerate(arrays):
            data = a.reshape(-1).view(np.uint8)[:st.arrays[i].sent_bytes]
            bad = data.copy()
            bad[len(bad) // 2] ^= 0x5A  # flipped in flight: the header carries the true checksum
            wire.send_frame(sock, wire.Frame(wire.DATA, "c", 10 + i, {"a": i, "o": 0}, bad, wire.checksum(data)))
            h = wire.read_header(sock)
            assert h.kind == wire.NACK and h.meta["retry"] and "checksum" in h.meta["reason"]
            wire.send_frame(sock, wire.Frame(wire.DATA, "c", 20 + i, {"a": i, "o": 0}, data))
            assert wire.read_header(sock).kind == wire.ACK
        wire.send_frame(sock, wire.Frame(wire.META, "c", 99, {"token": 1}))
        assert wire.read_header(sock).kind == wire.ACK
        assert r.state.wait(5) is KVPoll.DONE and p.server.corrupt_frames == len(arrays)
        _assert_same(st, r.arrays(), arrays)
        sock.close()
    finally:
        p.close()


def test_a_send_is_split_into_a_frame_per_connection():
    """Frames are few and large (each costs a header, an ACK and the sender's CPU): a send is split into one
    page-aligned share per connection, no smaller than MIN_FRAME, no larger than chunk_bytes; a transfer of
    small runs goes as one frame per run."""
    MiB = 1 << 20
    link = TcpLink(("127.0.0.1", 9), TOKEN, connections=4, chunk_bytes=64 * MiB)  # connects on first frame only
    small = TcpLink(("127.0.0.1", 9), TOKEN, connections=4, chunk_bytes=512)
    try:
        assert link.frame_bytes(256 * MiB) == 64 * MiB and link.frame_bytes(1 << 30) == 64 * MiB
        assert link.frame_bytes(10 * MiB) == 10 * MiB // 4 and link.frame_bytes(10 * MiB + 1) % 4096 == 0
        assert 4 * link.frame_bytes(10 * MiB + 1) >= 10 * MiB + 1
        assert link.frame_bytes(100_000) == link.frame_bytes(3 * MiB) == MiB
        assert small.frame_bytes(256 * MiB) == 512
    finally:
        link.close()
        small.close()
    p = Pair(connections=2, chunk_bytes=64 * MiB)
    try:
        r = p.receiver("f", [7, 8, 9, 20])
        s, st, arrays = p.send("f", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        assert s.frames == s.sends + 2  # plan, one DATA frame per send, first-token record
        _assert_same(st, r.arrays(), arrays)
    finally:
        p.close()


def test_truncated_frame_is_resent_on_a_new_connection():
    """A connection dies mid-payload: the receiver drops the partial frame, the sender resends it."""
    p = Pair(connections=1, chunk_bytes=1 << 20)
    try:
        r = p.receiver("t", [7, 8, 9, 20])
        orig = p.link.shaper.send
        cut = threading.Event()

        def truncating(sock, data):
            if not cut.is_set() and len(memoryview(data)) > 1000:
                cut.set()
                sock.sendall(memoryview(data)[:100])
                sock.shutdown(socket.SHUT_RDWR)  # the peer sees a frame cut short
                raise ConnectionResetError("cut")
            orig(sock, data)
        p.link.shaper.send = truncating
        s, st, arrays = p.send("t", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE and cut.is_set()
        _assert_same(st, r.arrays(), arrays)
    finally:
        p.close()


def test_unknown_request_and_refused_plan_fail_the_sender_with_reason(caplog):
    p = Pair()
    try:
        s, _, _ = p.send("nobody", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.FAILED and "unknown request id" in s.state.reason
        r = p.receiver("b", [7, 8, 9, 20])
        s2, _, _ = p.send("b", [3, 4, 9, 10], [7, 8, 9, 20], dtype="bfloat16")
        assert s2.wait(10) is KVPoll.FAILED and "mismatched dtype" in s2.state.reason
        assert r.state.wait(5) is KVPoll.FAILED and p.done == [r]
        assert any("unknown request id" in x for x in p.server.rejections)
        assert any("mismatched dtype" in x for x in p.server.rejections)
        assert "unknown request id" in caplog.text
    finally:
        p.close()


def test_peer_without_cluster_token_is_rejected():
    p = Pair()
    try:
        sock, h = _raw_connection(p.server, token="intruder")
        assert h.kind == wire.NACK and "token" in h.meta["reason"]
        assert sock.recv(1) == b""  # and the connection is closed
        assert any("not a cluster member" in x for x in p.server.rejections)
        p.refused(TcpLink(p.server.address, "wrong", connections=1, timeouts=Timeouts(connect_s=0.5)))
    finally:
        p.close()


def test_receiver_deadline_fails_and_frees():
    p = Pair()
    try:
        r = p.receiver("late", [7, 8, 9, 20], deadline=0.3)
        assert r.state.wait(5) is KVPoll.FAILED and "deadline" in r.state.reason and p.done == [r]
        assert p.server.pending() == 0
        r.release()
        assert p.rpool.free_bytes == p.rpool.capacity
    finally:
        p.close()


def test_receiver_gone_fails_the_sender():
    p = Pair(timeouts=Timeouts(connect_s=0.5))
    p.receiver("g", [7, 8, 9, 20])
    p.server.close()  # the decode worker died
    s, _, _ = p.send("g", [3, 4, 9, 10], [7, 8, 9, 20])
    assert s.wait(15) is KVPoll.FAILED
    p.link.close()


class _CountingSocket:
    """A socket whose reads are counted: `at` is the stream offset of the next byte."""

    def __init__(self, sock):
        self.sock, self.at = sock, 0

    def recv(self, n):
        b = self.sock.recv(n)
        self.at += len(b)
        return b

    def recv_into(self, view, n=0):
        k = self.sock.recv_into(view, n)
        self.at += k
        return k


def test_frames_keep_every_payload_64_byte_aligned_in_the_stream():
    """Headers and bodies are padded so each payload starts at a multiple of 64 bytes of the connection's
    stream, whatever the id, meta and payload sizes; the frames still parse and their checksums verify."""
    a, b = socket.socketpair()
    rng = np.random.default_rng(3)
    cases = [("", {}, 1, True), ("r", {"a": 0}, 63, True), ("req-12345", {"o": 7}, 64, False),
             ("x" * 37, {"a": 1, "o": 99}, 65, True), ("y", {}, 1000003, False)]
    frames = [(rid, meta, rng.integers(0, 256, n, dtype=np.uint8), trailer) for rid, meta, n, trailer in cases]

    def send():
        for i, (rid, meta, data, trailer) in enumerate(frames):
            f = wire.Frame(wire.DATA, rid, i, meta, data)
            if trailer:  # as the TCP link sends DATA: checksum in the trailer, computed while sending
                a.sendall(wire.encode_header(f, trailer=True))
                wire.send_payload(a.sendall, data)
            else:
                wire.send_frame(a, f)
        a.sendall(wire.encode_header(wire.Frame(wire.ACK, "end", 99)))
    t = threading.Thread(target=send)
    t.start()
    sock = _CountingSocket(b)
    for i, (rid, meta, data, trailer) in enumerate(frames):
        h = wire.read_header(sock)
        assert (h.request_id, h.meta, h.seq, h.payload_len, h.trailer) == (rid, meta, i, len(data), trailer)
        assert sock.at % 64 == 0, (i, sock.at)  # the payload starts aligned
        got = bytearray(len(data))
        check = wire.Checksum()
        wire.recv_into_exact(sock, memoryview(got), check)
        assert wire.read_tail(sock, h) == check.digest() == wire.checksum(data) and bytes(got) == data.tobytes()
        assert sock.at % 64 == 0  # and so does the next frame
    assert wire.read_header(sock).request_id == "end"
    t.join()
    a.close()
    b.close()


def test_checksum_incremental_equals_whole_and_detects_corruption():
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 3 * wire.PIECE + 12345, dtype=np.uint8)
    c = wire.Checksum()
    for i, j in zip([0, 100, 4097, wire.PIECE + 5], [100, 4097, wire.PIECE + 5, len(data)]):  # reads of any size
        c.update(memoryview(data)[i:j])
    assert c.digest() == wire.checksum(data)
    base = wire.checksum(data)
    for pos in (0, 7, 4096, len(data) - 1, len(data) - 13000):
        bad = data.copy()
        bad[pos] ^= 1
        assert wire.checksum(bad) != base, pos
    swapped = data.copy()
    swapped[:4096], swapped[4096:8192] = data[4096:8192], data[:4096]  # two 4 KiB chunks reordered
    assert wire.checksum(swapped) != base
    assert wire.checksum(data[:-1]) != base  # truncation


def _proxied_pair(t: Timeouts, connections: int):
    """A Pair whose link reaches the server through a fault proxy (bench/faultproxy.py) -> (pair, proxy)."""
    from bench.faultproxy import FaultProxy
    p = Pair(connections=connections, chunk_bytes=1 << 20, timeouts=t)
    proxy = FaultProxy(p.server.address)
    p.link.close()
    p.link = TcpLink(proxy.address, TOKEN, connections=connections, chunk_bytes=1 << 20, timeouts=t)
    return p, proxy


def test_silent_partition_fails_the_transfer_frees_everything_and_the_link_recovers():
    """A partition with no reset (a proxy that stops forwarding and closes nothing) in the middle of a
    transfer: the sender fails within the acknowledgement timeout plus a reconnect attempt, the receiver's
    reservation fails at its deadline and its region is freed, the link's connections are rebuilt and the next
    transfer through it succeeds, and no thread is left behind."""
    t = Timeouts(io_s=1.0, ack_s=2.0, connect_s=1.0, idle_s=3.0)
    p, proxy = _proxied_pair(t, connections=2)
    try:
        r = p.receiver("cut", [7, 8, 9, 20], deadline=4.0)
        orig = p.link.shaper.send

        def partition_at_data(sock, data):
            if len(memoryview(data)) > 1000:  # the first DATA piece: from here on nothing gets through
                proxy.set("blackhole")
            orig(sock, data)
        p.link.shaper.send = partition_at_data
        t0 = time.monotonic()
        s, st, arrays = p.send("cut", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(15) is KVPoll.FAILED, s.state.poll()
        failed_after = time.monotonic() - t0
        assert failed_after < t.ack_s + t.connect_s + 2.0, failed_after
        assert r.state.wait(10) is KVPoll.FAILED and "deadline" in r.state.reason
        r.release()
        assert p.rpool.free_bytes == p.rpool.capacity and p.server.pending() == 0
        # the partition heals: the same link rebuilds its connections and carries the next transfer
        p.link.shaper.send = orig
        proxy.set("pass")
        r2 = p.receiver("after", [7, 8, 9, 20])
        s2, st2, arrays2 = p.send("after", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s2.wait(15) is KVPoll.DONE and r2.state.wait(15) is KVPoll.DONE
        _assert_same(st2, r2.arrays(), arrays2)
        r2.release()
        p.link.close()
        for th in p.link._threads:
            th.join(10)
        assert p.link.alive_threads() == 0  # a closed link's writers end
    finally:
        proxy.close()
        p.server.close()


def test_a_failed_connection_attempt_fails_only_what_was_queued_before_it():
    """A writer's connection attempt into a partition fails the transfers queued before it began, not one queued
    while it ran: when the partition heals meanwhile, that transfer goes through on the next attempt."""
    p, proxy = _proxied_pair(Timeouts(io_s=1.0, ack_s=2.0, connect_s=1.0, idle_s=3.0), connections=1)
    try:
        proxy.set("blackhole")  # connections are accepted and never answered: the attempt waits out connect_s
        r = p.receiver("early", [7, 8, 9, 20])
        s, _, _ = p.send("early", [3, 4, 9, 10], [7, 8, 9, 20])
        deadline = time.monotonic() + 10
        while proxy.accepted == 0:  # the writer's attempt has begun (its HELLO now goes unanswered)
            assert time.monotonic() < deadline, "the link never tried to connect"
            time.sleep(0.005)
        proxy.set("pass")  # heals while that attempt still waits
        r2 = p.receiver("late", [7, 8, 9, 20])
        s2, st2, arrays2 = p.send("late", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(15) is KVPoll.FAILED and "unreachable" in s.state.reason
        assert s2.wait(15) is KVPoll.DONE, s2.state.reason
        assert r2.state.wait(15) is KVPoll.DONE
        _assert_same(st2, r2.arrays(), arrays2)
        r2.release()
        r.state.wait(15)
        r.release()
    finally:
        p.link.close()
        proxy.close()
        p.server.close()


def test_frames_of_the_wrong_shape_are_refused_and_the_connection_goes_on():
    """Well-formed JSON of the wrong shape in any frame's meta is NACKed (final) with a reason naming the field;
    the same connection then carries a valid transfer. A header that cannot be a frame closes the connection,
    and the server goes on serving others."""
    p = Pair()
    try:
        r = p.receiver("ok", [1, 2, 3, 4])
        plan = TransferPlan.build(p.lay, "float32", 14, [1, 2, 3, 4], [1, 2, 3, 4], 0, [(0, 5)])
        sock, h = _raw_connection(p.server)
        assert h.kind == wire.ACK
        bad = [(wire.PLAN, {**plan.to_meta(), "runs": "all of them"}, "runs"),
               (wire.PLAN, {**plan.to_meta(), "num_tokens": "14"}, "num_tokens"),
               (wire.PLAN, {**plan.to_meta(), "layer_groups": [[0, 5, 9]]}, "layer_groups"),
               (wire.DATA, {"a": "0", "o": 0}, "'a'"),
               (wire.DATA, {"a": 0}, "'o'"),
               (wire.PULL, {"arrays": {"0": 1}, "uuid": 1, "addr": "x", "bytes": 1}, "arrays"),
               (wire.META, {"token": 3, "top": [[1, "x"]]}, "top"),
               (wire.META, {"token": 3.5}, "token"),
               (wire.ABORT, {"reason": ["x"]}, "reason")]
        for seq, (kind, meta, field) in enumerate(bad, start=10):
            wire.send_frame(sock, wire.Frame(kind, "ok", seq, meta))
            a = wire.read_header(sock)
            assert a.kind == wire.NACK and a.seq == seq and not a.meta["retry"] and field in a.meta["reason"], \
                (kind, a.meta)
        assert r.state.poll() is KVPoll.INIT  # frames refused for their shape do not touch the request
        # a plan of the right shape that does not fit the reservation fails the request (a run far past its
        # blocks is refused without building it), and so does one writing shared memory the region is not
        wire.send_frame(sock, wire.Frame(wire.PLAN, "ok", 29, {**plan.to_meta(), "runs": [[0, 1, 1, 10**12]]}))
        a = wire.read_header(sock)
        assert a.kind == wire.NACK and "does not match the reserved blocks" in a.meta["reason"]
        r3 = p.receiver("shm", [1, 2, 3, 4])
        wire.send_frame(sock, wire.Frame(wire.PLAN, "shm", 30, {**plan.to_meta(), "shm_base": 4096}))
        a = wire.read_header(sock)
        assert a.kind == wire.NACK and "shared memory" in a.meta["reason"]
        for x in (r, r3):
            assert x.state.poll() is KVPoll.FAILED  # nothing is held
            x.release()
        # the connection is still good: a fresh request's transfer over it
        r2 = p.receiver("ok2", [1, 2, 3, 4])
        st = plan.check(p.lay, "float32", [1, 2, 3, 4], 14, 0)
        wire.send_frame(sock, wire.Frame(wire.PLAN, "ok2", 40, plan.to_meta()))
        assert wire.read_header(sock).kind == wire.ACK
        arrays = export(p.lay, p.pool, st, [1, 2, 3, 4], 1)
        for i, arr in enumerate(arrays):
            for a_, off, n in plan.sends(st):
                if a_ == i:
                    payload = arr.reshape(-1).view(np.uint8)[off:off + n]
                    wire.send_frame(sock, wire.Frame(wire.DATA, "ok2", 50 + i, {"a": i, "o": off}, payload))
                    assert wire.read_header(sock).kind == wire.ACK
        wire.send_frame(sock, wire.Frame(wire.META, "ok2", 99, {"token": 1}))
        assert wire.read_header(sock).kind == wire.ACK and r2.state.poll() is KVPoll.DONE
        _assert_same(st, r2.arrays(), arrays)
        r2.release()
        # a header that cannot be a frame (meta not an object) ends that connection only
        body = b"[1]"
        sock.sendall(wire.pack_header(wire.META, 0, 1, b"x", body, 0, 0))
        assert sock.recv(64) == b""  # closed
        sock2, h2 = _raw_connection(p.server)
        assert h2.kind == wire.ACK
        sock.close(), sock2.close()
    finally:
        p.close()
        p.server.close()


def _closed_by_peer(s: socket.socket) -> bool:
    """The peer closed s (an orderly close, or a reset when it closed with our bytes unread)."""
    s.settimeout(5)
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_unauthenticated_connections_are_bounded_and_timed_out():
    """At most max_unauthenticated connections may wait to authenticate, more are closed at once; one that sends
    no HELLO within hello_s, or a HELLO bigger than hello_max_bytes, is closed; members still get in."""
    t = Timeouts(hello_s=1.0, max_unauthenticated=4, hello_max_bytes=256)
    server = KVServer(TOKEN, timeouts=t)
    try:
        idle = [socket.create_connection(server.address) for _ in range(4)]
        extra = socket.create_connection(server.address)
        assert _closed_by_peer(extra)  # over the cap: closed at once
        assert all(_closed_by_peer(s) for s in idle)  # no HELLO within hello_s: closed
        big = socket.create_connection(server.address)
        wire.send_frame(big, wire.Frame(wire.HELLO, "", 0, {"token": TOKEN, "name": "x" * 1000}))
        assert _closed_by_peer(big)
        sock, h = _raw_connection(server)
        assert h.kind == wire.ACK
        assert server.refused_connections == 1 and any("no valid HELLO" in x for x in server.rejections)
        for s in idle + [extra, big, sock]:
            s.close()
    finally:
        server.close()
