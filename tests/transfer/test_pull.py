"""The device backend (transfer/pull.py): the receiver pulls staged arrays from the sender's JAX transfer
server, named by PULL frames on the authenticated TCP control connection; refusals and a dead sender."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
import time

import jax.numpy as jnp
import numpy as np
import pytest

from tests.transfer.helpers import export
from tests.transfer.test_transfer_host import TOKEN, Pair, _assert_same, _raw_connection
from jaxserve.transfer import wire
from jaxserve.transfer.plan import PlanError, TransferPlan, layer_groups
from jaxserve.transfer.pull import PullLink, PullServer
from jaxserve.transfer.sender import KVSender
from jaxserve.transfer.state import KVPoll
from jaxserve.transfer.tcp import KVServer


@pytest.fixture(scope="module")
def servers():
    """Two transfer servers, as the decode and the prefill process each run one."""
    return PullServer(connections=2), PullServer(connections=2)


def pull_pair(servers, puller=True) -> Pair:
    p = Pair()
    p.link.close()
    p.server.close()
    p.server = KVServer(TOKEN, puller=servers[0] if puller else None)
    p.link = PullLink(p.server.address, TOKEN, servers[1], 10.0, connections=2)
    return p


def pull_send(p: Pair, rid, src, dst, n=14, groups=2):
    """Offer each layer group's staged arrays as device arrays (what the feeder does on this backend)."""
    gs = layer_groups(p.lay.num_layers, groups)
    plan = TransferPlan.build(p.lay, "float32", n, src, dst, 0, gs)
    st = plan.check(p.lay, "float32", dst, n, 0)
    s = KVSender(rid, p.link, plan, st)
    s.start()
    arrays = export(p.lay, p.pool, st, src, 1)
    for k in range(len(gs)):
        s.offer_arrays([(a.index, jnp.asarray(arrays[a.index])) for a in st.arrays if a.layer_group == k])
    s.finish({"token": 7, "logprob": -0.5})
    return s, st, arrays


def test_pull_lands_the_staged_arrays_on_the_device(servers):
    p = pull_pair(servers)
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, st, arrays = pull_send(p, "a", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        got = r.arrays()
        assert all(not isinstance(g, np.ndarray) for g in got)  # device arrays, not views of the region
        _assert_same(st, [np.asarray(g) for g in got], arrays)
        assert r.first == {"token": 7, "logprob": -0.5}
        assert r.received == st.sent_bytes == s.bytes_acked == p.server.bytes_received
        assert s.sends == 3 and s.frames == 3 + 2  # one PULL per layer group, plus plan and record
        assert p.link.metrics.snapshot()["bytes_sent"] == 0  # no KV bytes on the control connections
    finally:
        p.close()


def test_pull_to_an_instance_without_device_transfer_is_refused(servers):
    p = pull_pair(servers, puller=False)
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, _, _ = pull_send(p, "a", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.FAILED and "does not take device pulls" in s.state.reason
        assert r.received == 0
    finally:
        p.close()


def planned(p):
    """Request "a" expected by p's server, and a bare connection on which its plan was accepted.
    -> (receiver, socket, staging)"""
    r = p.receiver("a", [7, 8, 9, 20])
    sock, _ = _raw_connection(p.server)
    plan = TransferPlan.build(p.lay, "float32", 14, [3, 4, 9, 10], [7, 8, 9, 20], 0, layer_groups(5, 2))
    st = plan.check(p.lay, "float32", [7, 8, 9, 20], 14, 0)
    wire.send_frame(sock, wire.Frame(wire.PLAN, "a", 0, plan.to_meta()))
    assert wire.read_header(sock).kind == wire.ACK
    return r, sock, st


def test_pull_frames_outside_the_plan_are_refused(servers):
    p = pull_pair(servers)
    try:
        r, sock, st = planned(p)
        bad = [({"arrays": [99], "bytes": 1}, "not in the plan"),
               ({"arrays": [0, 0], "bytes": 2 * st.arrays[0].sent_bytes}, "named twice"),
               ({"arrays": [0], "bytes": st.arrays[0].sent_bytes + 1}, "the plan")]
        for i, (meta, why) in enumerate(bad, 1):
            wire.send_frame(sock, wire.Frame(wire.PULL, "a", i, {**meta, "uuid": 1, "addr": servers[1].address}))
            h = wire.read_header(sock)
            assert h.kind == wire.NACK and why in h.meta["reason"], (meta, h.meta)
        assert r.received == 0 and not r.state.final  # refused frames leave the transfer as it was
        sock.close()
    finally:
        p.close()


def _offering_process(q) -> None:
    """A sender process that starts its transfer server and then only waits (it is killed mid-pull)."""
    srv = PullServer(connections=1)
    q.put(srv.address)
    signal.pause()


def test_sender_killed_mid_pull_fails_the_transfer_at_once(servers):
    """The prefill process dies while decode pulls from it: the pull fails (PJRT sees the socket close), the
    frame is refused with the reason, and the receiver fails now rather than at its deadline."""
    p = pull_pair(servers)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    child = ctx.Process(target=_offering_process, args=(q,), daemon=True)
    child.start()
    try:
        address = q.get(timeout=60)
        r = p.receiver("a", [7, 8, 9, 20], deadline=60.0)
        sock, _ = _raw_connection(p.server)
        plan = TransferPlan.build(p.lay, "float32", 14, [3, 4, 9, 10], [7, 8, 9, 20], 0, layer_groups(5, 2))
        st = plan.check(p.lay, "float32", [7, 8, 9, 20], 14, 0)
        wire.send_frame(sock, wire.Frame(wire.PLAN, "a", 0, plan.to_meta()))
        assert wire.read_header(sock).kind == wire.ACK
        # uuid 1 is never offered: the pull waits until the process dies
        wire.send_frame(sock, wire.Frame(wire.PULL, "a", 1, {"arrays": [0], "bytes": st.arrays[0].sent_bytes,
                                                             "uuid": 1, "addr": address}))
        os.kill(child.pid, signal.SIGKILL)
        h = wire.read_header(sock)
        assert h.kind == wire.NACK and "pull failed" in h.meta["reason"]
        assert r.state.wait(5) is KVPoll.FAILED and "pull failed" in r.state.reason
        assert p.done == [r]
        sock.close()
    finally:
        child.join(10)
        p.close()


def test_pull_resent_after_it_landed_is_acknowledged(servers):
    """A PULL whose acknowledgement was lost with its connection comes again: it is acknowledged, not refused,
    and its bytes count once."""
    p = pull_pair(servers)
    try:
        r, sock, st = planned(p)
        x = export(p.lay, p.pool, st, [3, 4, 9, 10], 1)[0]
        meta = {"arrays": [0], "bytes": st.arrays[0].sent_bytes, "addr": servers[1].address,
                "uuid": servers[1].offer([jnp.asarray(x)], 10.0)}
        for seq in (1, 2):
            wire.send_frame(sock, wire.Frame(wire.PULL, "a", seq, meta))
            h = wire.read_header(sock)
            assert h.kind == wire.ACK, h.meta
        assert r.received == st.arrays[0].sent_bytes and not r.state.final
        sock.close()
    finally:
        p.close()


def test_pull_resent_while_landing_is_acknowledged_once_landed(servers):
    """A resend of a PULL whose first pull is still copying waits for it: its acknowledgement lets a sender that
    shares the arrays in place (CUDA IPC) free them, so it must not come before the copy ends; a first pull that
    fails makes the resend fail too."""
    p = pull_pair(servers)
    try:
        r, sock, st = planned(p)
        got = {}

        def resend(a):
            try:
                got[a] = r.to_pull([a], st.arrays[a].sent_bytes)
            except PlanError as e:
                got[a] = str(e)
        for a, lands in ((0, True), (1, False)):
            assert r.to_pull([a], st.arrays[a].sent_bytes) is not None  # the first pull starts
            t = threading.Thread(target=resend, args=(a,))
            t.start()
            time.sleep(0.2)
            assert t.is_alive() and a not in got  # the resend waits
            x = jnp.zeros(st.arrays[a].shape, st.arrays[a].dtype)
            r.landed([a], [x] if lands else None)
            t.join(5)
            assert got[a] is None if lands else "their pull failed" in got[a], got
        sock.close()
    finally:
        p.close()
