"""The device backend's same-GPU path (transfer/ipc.py, transfer/cuda.py): arrays named by IPC handles in the PULL
frame, copied out of the sender's memory by the receiver, released on the acknowledgement.

On this CPU the CUDA driver is not there: `HostIpc` stands in for the mechanism alone (its "handle" is the address
and size of a host buffer of this process, its "mapping" that address), so everything else runs as on a GPU: the
handles through the wire, the DLPack views (cuda.RawView), the copies, the bounds and device checks, the release
of the sender's arrays and the closing of mappings. The CUDA calls themselves run in bench/gpu_check.sh
(bench.transfer part a's `cuda_ipc` rotation, two processes on one GPU).
"""

from __future__ import annotations

import ctypes
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from tests.transfer.helpers import export
from tests.transfer.test_pull import pull_send, planned
from tests.transfer.test_transfer_host import TOKEN, Pair, _assert_same
from jaxserve.transfer import cuda
from jaxserve.transfer import ipc as ipc_mod
from jaxserve.transfer import wire
from jaxserve.transfer.bufpool import aligned_empty
from jaxserve.transfer.cuda import KDL_CPU, HANDLE_BYTES, RawView, dl_dtype
from jaxserve.transfer.ipc import IpcShare
from jaxserve.transfer.pull import PullLink, PullServer
from jaxserve.transfer.state import KVPoll
from jaxserve.transfer.tcp import KVServer


# the stand-in shares host buffers: its tests run where JAX's arrays live in host memory; on a GPU the last test
# shares device memory between two processes through the real driver (bench/gpu_check.sh runs this file there)
host_arrays = pytest.mark.skipif(jax.default_backend() != "cpu", reason="the stand-in shares host memory")
on_gpu = pytest.mark.skipif(jax.default_backend() != "gpu", reason="CUDA IPC needs a GPU")


class HostIpc:
    """The IPC mechanism on host memory of this process: a handle is (address, bytes) of the array's buffer."""

    def __init__(self, key: str = "host-0"):
        self.key, self.dl_device = key, (KDL_CPU, 0)
        self.exported: list[bytes] = []
        self.opened: list[int] = []
        self.closed: list[int] = []

    def export(self, x):
        self.exported.append(struct.pack("<QQ", x.unsafe_buffer_pointer(), x.nbytes).ljust(HANDLE_BYTES, b"\0"))
        return self.exported[-1], 0

    def open(self, handle: bytes):
        base, size = struct.unpack_from("<QQ", handle)
        self.opened.append(base)
        return base, size

    def close(self, base: int) -> None:
        self.closed.append(base)


def ipc_pair(receiver_key: str | None = "host-0", idle_s: float = 30.0):
    """A KV server whose PullServer copies through HostIpc (receiver_key None: one without IPC) and a PullLink
    sharing its arrays that way. -> (pair, sender's PullServer, receiver's PullServer)"""
    src = PullServer(connections=1, ipc=IpcShare(HostIpc()))
    dst = PullServer(connections=1, ipc=IpcShare(HostIpc(receiver_key), idle_s=idle_s) if receiver_key else None)
    p = Pair()
    p.link.close()
    p.server.close()
    p.server = KVServer(TOKEN, puller=dst)
    p.link = PullLink(p.server.address, TOKEN, src, 10.0, ipc=True, connections=2)
    return p, src, dst


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.int32, np.uint8])
def test_a_raw_view_wraps_memory_without_a_copy(dtype):
    buf = aligned_empty(3 * 5 * np.dtype(dtype).itemsize).view(dtype).reshape(3, 5)
    buf[...] = (np.arange(15).reshape(3, 5) % 7).astype(dtype)
    before = set(cuda._CONSUMED)
    x = jax.dlpack.from_dlpack(RawView(buf.ctypes.data, (3, 5), dtype, KDL_CPU))
    held = set(cuda._CONSUMED) - before  # the view's structures, alive while JAX holds the array
    assert len(held) == 1
    assert x.dtype == np.dtype(dtype) and x.shape == (3, 5)
    # the values read through a copy: numpy's view of a CPU array (JAX 0.11 keeps one for bfloat16) would hold the
    # buffer past `delete`
    np.testing.assert_array_equal(np.asarray(jnp.array(x, copy=True)), buf)
    assert x.unsafe_buffer_pointer() == buf.ctypes.data  # the same bytes
    x.delete()  # the consumer's deleter call: the view's structures go (not the memory, still buf's)
    assert not held & set(cuda._CONSUMED)
    with pytest.raises(TypeError, match="no DLPack type"):
        dl_dtype(np.complex64)


@host_arrays
def test_an_array_of_another_size_than_planned_is_refused():
    share = IpcShare(HostIpc())
    handles = IpcShare(HostIpc()).offer(1, [jnp.zeros(8, jnp.float32)], 10.0)
    with pytest.raises(ipc_mod.IpcError, match="32 bytes offered where the plan stages"):
        share.copy_in("peer:1", handles, [((16,), "float32")], jax.devices()[0])
    assert share.mapped() == 0  # refused before anything was mapped


@host_arrays
def test_arrays_shared_in_place_are_copied_and_released_on_acknowledgement():
    p, src, dst = ipc_pair()
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, st, arrays = pull_send(p, "a", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        got = r.arrays()
        _assert_same(st, [np.asarray(g) for g in got], arrays)
        mech = dst.ipc.mech
        # one mapping per sender buffer (each its own allocation here; a buffer freed once its group was acknowledged
        # may come back at the same address, the same handle, for a later group)
        buffers = len(set(src.ipc.mech.exported))
        per_group = max(sum(a.layer_group == k for a in st.arrays) for k in {a.layer_group for a in st.arrays})
        assert len(mech.opened) == buffers and per_group <= buffers <= len(st.arrays)  # a group's arrays: all alive
        assert not {g.unsafe_buffer_pointer() for g in got} & set(mech.opened)  # copies, not the sender's memory
        assert src.ipc.offered() == 0  # every PULL acknowledged: the sender keeps nothing
        assert r.received == st.sent_bytes == s.bytes_acked
        assert p.link.metrics.snapshot()["bytes_sent"] == 0  # no KV bytes on the control connections
        assert dst.ipc.mapped() == buffers and dst.ipc.forget(src.address) == buffers
        assert sorted(mech.closed) == sorted(mech.opened) and dst.ipc.mapped() == 0
    finally:
        p.close()
        src.close()
        dst.close()


@host_arrays
def test_arrays_on_another_device_go_through_the_transfer_server():
    """A tensor-parallel pool's part on the process's second device is not named by IPC handles (the share, and the
    receiver's check, are of the first device): its group goes through the transfer server."""
    p, src, dst = ipc_pair()
    try:
        first, second = jax.devices()[:2]
        assert "ipc" in p.link.offer([jax.device_put(jnp.ones(8), first)]) and src.ipc.offered() == 1
        meta = p.link.offer([jax.device_put(jnp.ones(8), first), jax.device_put(jnp.ones(8), second)])
        assert "ipc" not in meta and src.ipc.offered() == 1
    finally:
        p.close()
        src.close()
        dst.close()


@host_arrays
def test_mappings_of_a_peer_gone_or_idle_are_closed(monkeypatch):
    monkeypatch.setattr(ipc_mod, "SWEEP_S", 0.05)
    alive = {"yes": True}
    share = IpcShare(HostIpc(), alive=lambda owner: alive["yes"], idle_s=0.3)
    x = jnp.arange(64, dtype=jnp.float32)
    handles = IpcShare(HostIpc()).offer(1, [x], 10.0)
    dev = jax.devices()[0]
    (y,) = share.copy_in("peer:1", handles, [((64,), "float32")], dev)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    assert share.mapped() == 1
    deadline = time.monotonic() + 5
    while share.mapped() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert share.mapped() == 0 and share.mech.closed == share.mech.opened  # idle: closed
    share.copy_in("peer:1", handles, [((64,), "float32")], dev)
    alive["yes"] = False  # the peer's transfer server refuses connections: closed on the next sweep
    time.sleep(0.2)
    assert share.mapped() == 0 and len(share.mech.closed) == 2
    share.close()


@host_arrays
def test_a_receiver_that_cannot_map_stops_offering_the_path():
    """An allocation the driver will not map (processes in separate IPC namespaces): the copy fails with the reason
    and the share's advertised key goes, so the worker's peers link through the transfer server from then on."""
    class Refusing(HostIpc):
        def open(self, handle):
            raise cuda.CudaError("cuIpcOpenMemHandle_v2: CUDA_ERROR_INVALID_CONTEXT")
    share = IpcShare(Refusing())
    handles = IpcShare(HostIpc()).offer(1, [jnp.zeros(8, jnp.float32)], 10.0)
    assert share.advertised == "host-0"
    with pytest.raises(ipc_mod.IpcError, match="CUDA_ERROR_INVALID_CONTEXT"):
        share.copy_in("peer:1", handles, [((8,), "float32")], jax.devices()[0])
    assert share.advertised is None and "INVALID_CONTEXT" in share.broken


@host_arrays
def test_offers_never_acknowledged_expire(monkeypatch):
    monkeypatch.setattr(ipc_mod, "EXPIRY_MARGIN_S", 0.0)
    share = IpcShare(HostIpc())
    share.offer(1, [jnp.zeros(4)], 0.05)
    assert share.offered() == 1
    time.sleep(0.15)
    share.offer(2, [jnp.zeros(4)], 10.0)  # an offer drops the expired ones
    assert share.offered() == 1
    share.release(2)
    assert share.offered() == 0


@host_arrays
def test_ipc_pulls_another_instance_cannot_take_are_refused():
    """A receiver without IPC, or on another device, refuses the frame and the transfer fails at once."""
    for key, why in ((None, "does not take CUDA IPC pulls"), ("host-1", "this instance runs on host-1")):
        p, src, dst = ipc_pair(receiver_key=key)
        try:
            r = p.receiver("a", [7, 8, 9, 20])
            s, _, _ = pull_send(p, "a", [3, 4, 9, 10], [7, 8, 9, 20])
            assert s.wait(10) is KVPoll.FAILED and why in s.state.reason, s.state.reason
            assert r.state.wait(5) is KVPoll.FAILED and r.received == 0
        finally:
            p.close()
            src.close()
            dst.close()


@host_arrays
def test_handles_outside_their_allocation_are_refused():
    """A frame naming bytes past the mapped allocation fails its transfer; nothing is read there."""
    p, src, dst = ipc_pair()
    try:
        r, sock, st = planned(p)
        x = jnp.asarray(export(p.lay, p.pool, st, [3, 4, 9, 10], 1)[0])
        short = x[:1]  # an allocation one row long, named as if it held the whole array
        (h, off, _), = src.ipc.offer(1, [short], 10.0)
        meta = {"arrays": [0], "bytes": st.arrays[0].sent_bytes, "uuid": 1, "addr": src.address,
                "ipc": {"dev": "host-0", "handles": [[h, off, x.nbytes]]}}
        wire.send_frame(sock, wire.Frame(wire.PULL, "a", 1, meta))
        reply = wire.read_header(sock)
        assert reply.kind == wire.NACK and "bytes at offset 0 of an allocation of" in reply.meta["reason"]
        assert r.state.wait(5) is KVPoll.FAILED and dst.ipc.mapped() == 0  # the failed peer's mappings closed
        sock.close()
    finally:
        p.close()
        src.close()
        dst.close()


def test_pull_meta_checks_the_ipc_names():
    base = {"arrays": [0], "bytes": 8, "uuid": 1, "addr": "h:1"}
    good = {"dev": "GPU-00", "handles": [["ab" * 64, 256, 8]]}
    wire.check_meta(wire.PULL, {**base, "ipc": good})
    for bad in ({"dev": "GPU-00"}, {**good, "handles": [["ab" * 63, 0, 8]]}, {**good, "handles": [["xy" * 64, 0, 8]]},
                {**good, "handles": [["ab" * 64, -1, 8]]}, {**good, "handles": [["ab" * 64, 0, 0]]},
                {**good, "handles": [["ab" * 64, 0]]}, {**good, "extra": 1}):
        with pytest.raises(wire.MetaError, match="ipc"):
            wire.check_meta(wire.PULL, {**base, "ipc": bad})


@host_arrays
def test_a_worker_links_through_cuda_ipc_only_to_an_instance_on_its_gpu():
    """worker/peers.py: the peer table's `ipc` (the GPU a decode instance copies on) picks the link."""
    from jaxserve.config import parse
    from jaxserve.worker.peers import Peers
    cfg = parse({})
    server = PullServer(connections=1, ipc=IpcShare(HostIpc("host-0")))
    kv = KVServer(TOKEN, puller=server)
    peers = Peers(cfg, cfg.instances()[0], server, None)
    try:
        entry = {"kv_address": list(kv.address), "pull": True, "shm": None}
        for ipc, want in (("host-0", True), ("host-1", False), (None, False)):
            link, _ = peers.link({**entry, "ipc": ipc}, "local", None)
            assert isinstance(link, PullLink) and link.ipc is want, (ipc, link.metrics.name)
            assert link.metrics.name.endswith(" (cuda ipc)" if want else " (device)")
    finally:
        peers.close()
        kv.close()
        server.close()


@pytest.fixture(scope="module")
def fake_driver(tmp_path_factory):
    """transfer/cuda.py's Driver over tests/transfer/fake_libcuda.c (the driver's signatures, host memory)."""
    import shutil
    import subprocess
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    lib = tmp_path_factory.mktemp("fakecuda") / "libfakecuda.so"
    subprocess.run([cc, "-shared", "-fPIC", "-O1", "-o", str(lib), str(Path(__file__).with_name("fake_libcuda.c"))],
                   check=True)
    return cuda.Driver(0, lib=str(lib)), ctypes.CDLL(str(lib))


@host_arrays
def test_the_driver_bindings_pass_what_the_c_signatures_take(fake_driver):
    """Pointers, the 64-byte handle by value and error names through ctypes; then CudaIpc's whole offer / copy
    over the bindings, the array at an offset inside its allocation."""
    driver, lib = fake_driver
    lib.fake_register.argtypes = [ctypes.c_uint64, ctypes.c_size_t]
    assert driver.uuid == "GPU-" + bytes(range(7, 23)).hex()
    with pytest.raises(cuda.CudaError, match="cuDeviceGet: CUDA_ERROR_INVALID_DEVICE"):
        cuda.Driver(1, lib=lib._name)
    with pytest.raises(cuda.CudaError, match="no CUDA driver"):
        cuda.Driver(0, lib="libcuda-not-here.so.1")
    buf = aligned_empty(1 << 16)
    base = buf.ctypes.data
    lib.fake_register(base, buf.nbytes)
    assert driver.allocation(base + 1000) == (base, buf.nbytes)
    with pytest.raises(cuda.CudaError, match="cuMemGetAddressRange_v2: CUDA_ERROR_INVALID_VALUE"):
        driver.allocation(base + buf.nbytes)
    vals = np.arange(512, dtype=np.float32).reshape(4, 128)
    buf[4096:4096 + vals.nbytes] = vals.view(np.uint8).reshape(-1)
    x = jax.dlpack.from_dlpack(RawView(base + 4096, (4, 128), np.float32, KDL_CPU))  # an array inside it
    sender, receiver = ipc_mod.CudaIpc(0, driver), ipc_mod.CudaIpc(0, driver)
    for m in (sender, receiver):
        m.dl_device = (KDL_CPU, 0)  # host memory here, the GPU's own ordinal on one
    (h, off, n), = IpcShare(sender).offer(1, [x], 10.0)
    assert (off, n) == (4096, vals.nbytes) and bytes.fromhex(h)[:4] == b"fake"
    share = IpcShare(receiver)
    (y,) = share.copy_in("peer:1", [[h, off, n]], [((4, 128), "float32")], jax.devices()[0])
    np.testing.assert_array_equal(np.asarray(y), vals)
    assert lib.fake_opened() == 1 and share.forget("peer:1") == 1 and lib.fake_closed() == 1
    x.delete()


@host_arrays
def test_a_share_stages_in_driver_memory_where_only_that_can_be_shared(fake_driver):
    """cuda_share's probe: JAX's array refused, then the driver's own cuMemAlloc'd block tried (and freed): where
    that can be shared the share stages its offers there (StagedCudaIpc); where not, the error says the machine
    shares no memory at all."""
    driver, lib = fake_driver
    lib.fake_refuse.argtypes = [ctypes.c_int, ctypes.c_int]
    dev = jax.devices()[0]  # its arrays are no registered range: the fake's address lookup refuses them
    try:
        assert driver.own_memory_refused() is None and lib.fake_owned() == 0
        share = ipc_mod.cuda_share(dev, driver=driver)
        assert share.staged and isinstance(share.mech, ipc_mod.StagedCudaIpc) and share.advertised == share.key
        share.close()
        lib.fake_refuse(1, 1)
        assert driver.own_memory_refused() == "cuIpcGetMemHandle: CUDA_ERROR_INVALID_VALUE"
        with pytest.raises(cuda.CudaError, match=r"JAX's arrays cannot be shared \(cuMemGetAddressRange_v2: "
                           r"CUDA_ERROR_INVALID_VALUE\); memory the driver allocates itself cannot either "
                           r"\(cuIpcGetMemHandle: CUDA_ERROR_INVALID"):
            ipc_mod.cuda_share(dev, driver=driver)
        assert lib.fake_owned() == 0  # the probe's block freed whatever the handle did
    finally:
        lib.fake_refuse(0, 0)


@host_arrays
def test_a_staged_offer_is_a_copy_in_driver_memory_given_back_on_acknowledgement(fake_driver, monkeypatch):
    """StagedCudaIpc over the driver bindings: an offer's arrays copied (on the driver's stream) into one chunk of
    its arena, named by the chunk's handle; the receiver copies them out as from any allocation; acknowledged or
    expired, the places go back; closing frees the chunk."""
    driver, lib = fake_driver
    monkeypatch.setattr(ipc_mod, "EXPIRY_MARGIN_S", 0.0)
    dev = jax.devices()[0]
    share = IpcShare(ipc_mod.StagedCudaIpc(0, driver, chunk_bytes=1 << 20, limit_bytes=2 << 20))
    share.mech.dl_device = (KDL_CPU, 0)
    x = jnp.arange(3000, dtype=jnp.float32).reshape(3, 1000)
    y = jnp.full((100,), 3.0, jnp.bfloat16)
    copies = lib.fake_copies()
    entries = share.offer(1, [x, y], 10.0)
    (hx, ox, nx), (hy, oy, ny) = entries
    assert hx == hy and (ox, nx, oy, ny) == (0, x.nbytes, 12288, y.nbytes)  # one chunk, 512-byte aligned places
    base = struct.unpack_from("<Q", bytes.fromhex(hx), 56)[0]  # the fake's handle carries the allocation's base
    assert base not in (x.unsafe_buffer_pointer(), y.unsafe_buffer_pointer())
    assert lib.fake_copies() == copies + 2 and lib.fake_owned() == 1 and share.mech.arena.used == 12800
    receiver = IpcShare(ipc_mod.CudaIpc(0, driver))
    receiver.mech.dl_device = (KDL_CPU, 0)
    gx, gy = receiver.copy_in("peer:1", entries, [((3, 1000), "float32"), ((100,), "bfloat16")], dev)
    np.testing.assert_array_equal(np.asarray(gx), np.asarray(x))
    np.testing.assert_array_equal(np.asarray(gy, np.float32), np.full(100, 3.0, np.float32))
    share.release(1)
    assert share.offered() == 0 and share.mech.arena.used == 0
    share.offer(2, [x], 0.05)  # never acknowledged: its place goes back when a later offer finds it expired
    time.sleep(0.15)
    share.offer(3, [y], 10.0)
    assert share.offered() == 1 and share.mech.arena.used == 512
    with pytest.raises(ipc_mod.ArenaFull):  # past the limit: nothing of the offer is kept
        share.offer(4, [y, jnp.zeros((3 << 18,), jnp.float32)], 10.0)
    assert share.offered() == 1 and share.mech.arena.used == 512
    receiver.close()
    share.close()
    assert lib.fake_owned() == 0


@host_arrays
def test_an_offer_the_staging_arena_has_no_room_for_goes_through_the_transfer_server():
    class Full(HostIpc):
        staged = True
        refused = 0

        def export(self, x):
            Full.refused += 1
            raise ipc_mod.ArenaFull("no room")

        def shutdown(self):
            pass
    p, src, dst = ipc_pair()
    src.ipc = IpcShare(Full())
    try:
        r = p.receiver("a", [7, 8, 9, 20])
        s, st, arrays = pull_send(p, "a", [3, 4, 9, 10], [7, 8, 9, 20])
        assert s.wait(10) is KVPoll.DONE and r.state.wait(10) is KVPoll.DONE
        _assert_same(st, [np.asarray(g) for g in r.arrays()], arrays)
        assert Full.refused >= 1 and src.ipc.offered() == 0 and dst.ipc.mapped() == 0  # tried, none went by IPC
    finally:
        p.close()
        src.close()
        dst.close()


def _offer_on_the_gpu(q, done) -> None:
    """Another process on the same GPU: two arrays offered through CUDA IPC, kept until the parent is done."""
    import os
    os.environ["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"  # before JAX starts: both processes share the device
    try:
        share = ipc_mod.cuda_share(jax.local_devices()[0])
        x = jnp.arange(3 << 20, dtype=jnp.float32).reshape(3, -1) * 0.5
        y = jnp.full((1000,), 3.0, jnp.bfloat16)
        q.put((share.key, share.offer(1, [x, y], 60.0)))
    except Exception as e:  # the parent fails at once with it rather than waiting out its timeout
        q.put(f"{type(e).__name__}: {e}")
        return
    done.wait(120)


@on_gpu
def test_cuda_ipc_copies_another_processs_arrays_on_this_gpu():
    import multiprocessing as mp
    share = ipc_mod.cuda_share(jax.local_devices()[0])  # fails here, with why, where this machine cannot share
    ctx = mp.get_context("spawn")
    q, done = ctx.Queue(), ctx.Event()
    child = ctx.Process(target=_offer_on_the_gpu, args=(q, done), daemon=True)
    child.start()
    try:
        got = q.get(timeout=120)
        assert not isinstance(got, str), f"the offering process failed: {got}"
        key, handles = got
        assert key == share.key  # the same physical GPU
        x, y = share.copy_in("peer", handles, [((3, 1 << 20), "float32"), ((1000,), "bfloat16")],
                             jax.local_devices()[0])
        np.testing.assert_array_equal(np.asarray(x), np.arange(3 << 20, dtype=np.float32).reshape(3, -1) * 0.5)
        np.testing.assert_array_equal(np.asarray(y, np.float32), np.full(1000, 3.0, np.float32))
        assert share.forget("peer") >= 1 and share.mapped() == 0
    finally:
        done.set()
        child.join(30)
