"""TLS on the KV link and on gRPC (transfer/tls.py): transfers arrive exact over TLS (plain and shared-memory
links), a plaintext peer, a server certificate from another CA and (mutual) a client without the cluster's
certificate are refused, and the worker / router gRPC ports speak TLS only."""

from __future__ import annotations

import asyncio
import socket
import ssl

import grpc
import pytest

from jaxserve.worker import rpc
from tests.transfer.test_transfer_host import TOKEN, Pair, _assert_same
from jaxserve.transfer import wire
from jaxserve.transfer.net import Timeouts
from jaxserve.transfer.state import KVPoll
from jaxserve.transfer.tcp import TcpLink
from jaxserve.transfer.tls import Tls, make_certs


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    d = tmp_path_factory.mktemp("certs")
    ours = make_certs(str(d / "ours"), ["127.0.0.1", "localhost"], ["server", "client"])
    theirs = make_certs(str(d / "theirs"), ["127.0.0.1"], ["server"])
    ca = ours["ca"][0]
    return {"server": Tls(ca, *ours["server"], mutual=True), "client": Tls(ca, *ours["client"], mutual=True),
            "foreign": Tls(theirs["ca"][0], *theirs["server"], mutual=True), "ca": ca}


def _transfer(p: Pair) -> None:
    r = p.receiver("a", [7, 8, 9, 20])
    s, st, arrays = p.send("a", [3, 4, 9, 10], [7, 8, 9, 20])
    assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE, s.state.reason
    assert r.first == {"token": 7, "logprob": -0.5}
    _assert_same(st, r.arrays(), arrays)


@pytest.mark.parametrize("shm", [False, True])
def test_a_transfer_over_mutual_tls_arrives_exact_and_its_connections_are_tls(certs, shm):
    p = Pair(shm=shm, server_tls=certs["server"].server_context(), tls=certs["client"].client_context())
    try:
        _transfer(p)
        conns = list(p.server._conns)
        assert conns and all(isinstance(c, ssl.SSLSocket) and c.getpeercert() for c in conns)
    finally:
        p.close()


def test_a_plaintext_peer_is_refused_by_a_tls_server(certs):
    p = Pair(server_tls=certs["server"].server_context())
    try:
        with socket.create_connection(p.server.address, timeout=5) as sock:
            wire.send_frame(sock, wire.Frame(wire.HELLO, "", 0, {"token": TOKEN}))  # the right token, no TLS
            try:
                back = sock.recv(1 << 16)  # a TLS alert, then the server closes
            except ConnectionResetError:
                back = b""
            assert wire.MAGIC not in back  # never a frame (an ACK of the HELLO)
        p.refused(TcpLink(p.server.address, TOKEN, connections=1, timeouts=Timeouts(connect_s=0.5)))
        assert any("TLS handshake failed" in x for x in p.server.rejections)
    finally:
        p.close()


def test_a_server_certificate_from_another_ca_is_refused_at_once(certs):
    p = Pair(server_tls=certs["foreign"].server_context(), tls=certs["client"].client_context(),
             timeouts=Timeouts(connect_s=30))
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, _, _ = p.send("a", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.FAILED  # well before connect_s: a refused certificate is not retried
        assert "TLS certificate was refused" in s.state.reason and r.received == 0
    finally:
        p.close()


def test_mutual_tls_refuses_a_client_without_a_cluster_certificate(certs):
    one_way = Tls(certs["ca"], certs["client"].cert_file, certs["client"].key_file, mutual=False)
    for client in (one_way.client_context(), certs["foreign"].client_context()):
        client.check_hostname, client.verify_mode = False, ssl.CERT_NONE  # even trusting any server
        p = Pair(server_tls=certs["server"].server_context(), tls=client, timeouts=Timeouts(connect_s=0.5))
        try:
            r = p.receiver("a", [7, 8, 9, 20])
            s, _, _ = p.send("a", [3, 4, 9, 10], [7, 8, 9, 20])
            assert s.wait(10) is KVPoll.FAILED and r.received == 0
            assert any("TLS handshake failed" in x for x in p.server.rejections), list(p.server.rejections)
        finally:
            p.close()


def test_grpc_over_mutual_tls_and_refused_without_it(certs):
    async def health(req, ctx):
        return {"ok": True}

    async def main():
        from jaxserve.worker import messages
        srv = rpc.server(TOKEN)
        srv.add_generic_rpc_handlers((rpc.handler({"Health": health}, {}, {"Health": messages.WORKER["Health"]}),))
        port = rpc.listen(srv, "127.0.0.1:0", certs["server"])
        await srv.start()
        addr = f"127.0.0.1:{port}"
        try:
            c = rpc.Client(addr, TOKEN, certs["client"])
            assert await c.call("Health", {}, timeout=10) == {"ok": True}
            await c.close()
            one_way = Tls(certs["ca"], certs["client"].cert_file, certs["client"].key_file, mutual=False)
            for client in (rpc.Client(addr, TOKEN), rpc.Client(addr, TOKEN, one_way),
                           rpc.Client(addr, TOKEN, certs["foreign"])):
                with pytest.raises(grpc.aio.AioRpcError) as e:
                    await client.call("Health", {}, timeout=3)
                assert e.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
                await client.close()
        finally:
            await srv.stop(0)
    asyncio.run(main())
