"""Device backend: decode pulls a request's staged KV arrays device to device through JAX's transfer server.

Each worker that uses it runs one `PullServer` (`jax.experimental.transfer`: PJRT moves device buffers
between processes over its own parallel sockets; on GPU / TPU the bytes go from device memory to device
memory without passing through Python or a host staging region of ours). The control path is the TCP link's
(tcp.py): the same authenticated connections carry the plan, the first-token record, acknowledgements,
refusals and aborts. `PullLink` is a `TcpLink` whose sender, instead of DATA frames, offers each layer
group's exported arrays to its server (`offer`: they stay there until pulled or until the transfer deadline)
and sends one payload-less PULL frame naming them (uuid, server address, staged array indices, bytes). The
receiving KV server checks the frame against the plan, `pull`s the arrays onto its own device, and
acknowledges; the arrays go to the import program as they are (no DLPack, no receive region).

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
import socket
import threading
import time

from .tcp import TcpLink

PROBE_S = 0.2  # while a pull waits: how often the peer's transfer server is checked for life


class PullError(RuntimeError):
    """The arrays did not arrive (peer gone, or not offered before the deadline)."""


class PullServer:
    def __init__(self, host: str = "127.0.0.1", connections: int = 4, piece_bytes: int = 4 << 20):
        """connections: the transport's parallel sockets; piece_bytes: its unit of transfer (PJRT's
        `transfer_size`; pieces pipeline, so one much smaller than a request's KV keeps every socket busy)."""
        import jax
        from jax.experimental import transfer
        self.device = jax.local_devices()[0]
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

    def pull(self, address: str, uuid: int, specs: list[tuple[tuple[int, ...], str]], timeout_s: float) -> list:
        """The arrays `uuid` offered at the server `address`, on this process's device (waits until they are
        here). specs: [(shape, numpy dtype name)] in offer order. Raises PullError."""
        import jax
        import numpy as np
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
                if not _listening(address):
                    self._drop(address)
                    raise PullError(f"pull from {address} failed: its transfer server is gone")
                next_probe = now + PROBE_S
            time.sleep(min(step, deadline - now))
            step = min(2 * step, 2e-3)
        try:
            jax.block_until_ready(xs)  # ready: returns at once, or raises the transfer's error
        except Exception as e:  # noqa: BLE001 - PJRT raises its own runtime errors
            self._drop(address)
            raise PullError(f"pull from {address} failed: {e}") from e
        return list(xs)

    def _connect(self, address: str):
        with self._lock:
            conn = self._conns.get(address)
            if conn is None:
                conn = self._conns[address] = self._server.connect(address)
            return conn

    def _drop(self, address: str) -> None:
        with self._lock:
            self._conns.pop(address, None)


def _listening(address: str) -> bool:
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

    def __init__(self, address, token: str, server: PullServer, offer_timeout_s: float = 30.0, **kw):
        self.server, self.offer_timeout_s = server, offer_timeout_s
        super().__init__(address, token, **kw)

    def offer(self, arrays: list) -> tuple[int, str]:
        """-> (uuid, server address) of `arrays` (single-device jax.Arrays)."""
        return self.server.offer(arrays, self.offer_timeout_s), self.server.address
