"""Device backend: decode pulls a request's staged KV arrays device to device through JAX's transfer server.

Each worker that uses it runs one `PullServer` (`jax.experimental.transfer`: PJRT moves device buffers
between processes over its own parallel sockets; on GPU / TPU the bytes go from device memory to device
memory without passing through Python or a host staging region of ours). The control path is the TCP link's
(tcp.py): the same authenticated connections carry the plan, the first-token record, acknowledgements,
refusals and aborts. `PullLink` is a `TcpLink` whose sender, instead of DATA frames, offers each layer
group's exported arrays to its server (`offer`: they stay there until pulled or until the transfer deadline)
and sends one payload-less PULL frame naming them (uuid, server address, staged array indices, bytes). The
receiving KV server checks the frame against the plan, `pull`s the arrays onto its own device, and
acknowledges; the arrays go to the import program as they are (no DLPack, no receive region). Where both
ends share one GPU and this process has an `ipc.IpcShare`, a PullLink made with `ipc=True` names the arrays by
CUDA IPC handles in the PULL frame instead of offering them to the transfer server, and the receiver copies them
device to device out of the sender's memory (ipc.py; an offer a staging arena has no room for goes to the
transfer server instead); the control path is the same.

Block arrays cross with their padded row count (the export programs are bucketed to powers of two); the
transfer's byte count is the staged payload, as for the other backends.

A pull waits for its arrays by polling their readiness. PJRT fails a pull whose peer dies on the CPU, but on
a GPU (seen on an H100) such a pull never completes; so while it waits, the peer's transfer server is checked
every PROBE_S with a TCP connect, and a refused connection (the process is gone) fails the pull at once. A pull
of arrays that are never offered fails at its deadline. The device buffers of a pull that never completes stay
allocated in PJRT (it has no cancel); no cache block is held for them. Concurrency: PJRT's transfer server runs its
own threads; `offer` is called from the prefill worker's feeder thread, `pull` from the KV server's
connection threads (a lock guards the connection cache).
"""

from __future__ import annotations

import datetime
import itertools
import logging
import socket
import threading
import time

from .arena import ArenaFull
from .tcp import TcpLink

log = logging.getLogger("jaxserve.transfer")

PROBE_S = 0.2  # while a pull waits: how often the peer's transfer server is checked for life
# the longest sleep between readiness checks: what a pull may finish before the receiver sees it (a layer group's
# import waits on it; 2 ms of a 28 ms pull of 256 MiB on the H200)
POLL_MAX_S = 5e-4


class PullError(RuntimeError):
    """The arrays did not arrive (peer gone, or not offered before the deadline)."""


class PullServer:
    def __init__(self, host: str = "127.0.0.1", connections: int = 4, piece_bytes: int = 4 << 20, ipc=None):
        """connections: the transport's parallel sockets; piece_bytes: its unit of transfer (PJRT's
        `transfer_size`; pieces pipeline, so one much smaller than a request's KV keeps every socket busy);
        ipc: an ipc.IpcShare on this process's device (same-GPU pulls through CUDA IPC), or None."""
        import jax
        from jax.experimental import transfer
        self.device = jax.local_devices()[0]
        self.ipc = ipc
        self._server = transfer.start_transfer_server(self.device.client, f"{host}:0", [f"{host}:0"] * connections,
                                                      transfer_size=piece_bytes)
        self.address: str = self._server.address()
        self._uuids = itertools.count(1)
        self._conns: dict[str, object] = {}
        self._lock = threading.Lock()

    def offer(self, arrays: list, timeout_s: float) -> int:
        """Make `arrays` (single-device jax.Arrays) pullable once, for `timeout_s`; -> the uuid naming them."""
        uuid = next(self._uuids)
        self._server.await_pull(uuid, list(arrays), timeout=_deadline(timeout_s))
        return uuid

    def offer_ipc(self, arrays: list, timeout_s: float) -> tuple[int, list[list]]:
        """Share `arrays` (single-device jax.Arrays on this device) through CUDA IPC -> (uuid, [[handle hex,
        offset, bytes]]); kept until `release(uuid)` or their expiry (ipc.IpcShare.offer)."""
        uuid = next(self._uuids)
        return uuid, self.ipc.offer(uuid, arrays, timeout_s)

    def release(self, uuid: int) -> None:
        if self.ipc is not None:
            self.ipc.release(uuid)

    def pull(self, address: str, uuid: int, specs: list[tuple[tuple[int, ...], str]], timeout_s: float,
             ipc: dict | None = None) -> list:
        """The arrays `uuid` offered at the server `address`, on this process's device (waits until they are
        here). specs: [(shape, numpy dtype name)] in offer order; ipc: the PULL frame's CUDA IPC names
        ({"dev": device key, "handles": [[handle hex, offset, bytes]]}) when they were shared that way.
        Raises PullError."""
        import jax
        import numpy as np
        if ipc is not None:
            return self._copy_in(address, ipc, specs)
        sharding = jax.sharding.SingleDeviceSharding(self.device)
        try:
            xs = self._connect(address).pull(
                uuid, [jax.ShapeDtypeStruct(tuple(s), np.dtype(d), sharding=sharding) for s, d in specs])
        except Exception as e:  # noqa: BLE001 - PJRT raises its own runtime errors
            self._drop(address)
            raise PullError(f"pull from {address} failed: {e}") from e
        deadline, step, next_probe = time.monotonic() + timeout_s, 5e-5, 0.0
        while not all(x.is_ready() for x in xs):
            now = time.monotonic()
            if now >= deadline:
                raise PullError(f"arrays {uuid} from {address} not pulled within {timeout_s:.1f}s")
            if now >= next_probe:
                if not listening(address):
                    self._drop(address)
                    raise PullError(f"pull from {address} failed: its transfer server is gone")
                next_probe = now + PROBE_S
            time.sleep(min(step, deadline - now))
            step = min(2 * step, POLL_MAX_S)
        try:
            jax.block_until_ready(xs)  # ready: returns at once, or raises the transfer's error
        except Exception as e:  # noqa: BLE001 - PJRT raises its own runtime errors
            self._drop(address)
            raise PullError(f"pull from {address} failed: {e}") from e
        return list(xs)

    def _copy_in(self, address: str, ipc: dict, specs: list) -> list:
        from .ipc import IpcError
        if self.ipc is None:
            raise PullError("this instance does not take CUDA IPC pulls")
        if ipc["dev"] != self.ipc.key:
            raise PullError(f"arrays shared from device {ipc['dev']}, this instance runs on {self.ipc.key}")
        try:
            return self.ipc.copy_in(address, ipc["handles"], specs, self.device)
        except (IpcError, RuntimeError) as e:  # RuntimeError: JAX's, on a view it cannot wrap or copy
            self.ipc.forget(address)
            raise PullError(f"CUDA IPC copy from {address} failed: {e}") from e

    def close(self) -> None:
        if self.ipc is not None:
            self.ipc.close()

    def _connect(self, address: str):
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self._server.connect(address)
            return conn

    def _drop(self, address: str) -> None:
        with self._lock:
            self._conns.pop(address, None)


def listening(address: str) -> bool:
    """Whether something still accepts connections at a transfer server's "host:port" (False only on a refusal:
    the process that served it is gone)."""
    host, _, port = address.rpartition(":")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_S).close()
    except ConnectionRefusedError:
        return False
    except OSError:  # unreachable or slow: undecided, the deadline still holds
        return True
    return True


def _deadline(timeout_s: float) -> datetime.datetime:
    return datetime.datetime.now() + datetime.timedelta(seconds=timeout_s)


class PullLink(TcpLink):
    """A TCP control link whose senders offer device arrays for the receiver to pull (KVSender.offer_arrays)."""

    def __init__(self, address, token: str, server: PullServer, offer_timeout_s: float = 30.0, ipc: bool = False,
                 **kw):
        """ipc: share the arrays through CUDA IPC (the receiver runs on this process's GPU; server.ipc set)."""
        if ipc and server.ipc is None:
            raise ValueError("a CUDA IPC link needs a PullServer with an IpcShare")
        self.server, self.offer_timeout_s, self.ipc = server, offer_timeout_s, ipc
        super().__init__(address, token, **kw)

    def offer(self, arrays: list) -> dict:
        """The PULL frame's meta naming `arrays` (single-device jax.Arrays): uuid, server address and, shared
        through CUDA IPC, the handles (arrays on this process's own device only: a tensor-parallel pool's parts on
        its other GPUs go through the transfer server)."""
        if self.ipc and all(x.devices() == {self.server.device} for x in arrays):
            try:
                uuid, handles = self.server.offer_ipc(arrays, self.offer_timeout_s)
            except ArenaFull as e:  # a staging arena with no room now: this offer goes through the transfer server
                log.info("CUDA IPC staging full (%s): %d arrays offered to the transfer server", e, len(arrays))
            else:
                return {"uuid": uuid, "addr": self.server.address,
                        "ipc": {"dev": self.server.ipc.key, "handles": handles}}
        return {"uuid": self.server.offer(arrays, self.offer_timeout_s), "addr": self.server.address}

    def release(self, meta: dict) -> None:
        """A PULL frame was acknowledged: its arrays are the receiver's now."""
        if "ipc" in meta:
            self.server.release(meta["uuid"])
