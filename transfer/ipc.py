"""Device backend on one GPU: staged KV arrays shared between processes through CUDA IPC.

Where a prefill and a decode instance share a GPU (each with its share of the memory, `instance.device_memory`),
the device backend (pull.py) need not carry the KV over its sockets: the decode process maps the sender's
device memory into its own address space and copies the arrays from there, device to device, at the GPU's copy
rate. The sender (`offer`) waits until its export programs wrote the staged arrays, then names each by the IPC
handle of the allocation it lies in (XLA's allocator carves arrays out of larger allocations), its offset there
and its size; the handles ride in the PULL frame. The receiver (`copy_in`) maps each allocation once (kept while
used), wraps the array's bytes as a DLPack tensor on its own device (cuda.RawView: no copy) and copies them into
an array of its own, checked to lie inside the mapped allocation and to be the size the plan stages; when the
copies have completed it acknowledges the frame, and the acknowledgement releases the sender's arrays
(`release`). An offer never acknowledged (its transfer failed) is dropped after twice the transfer's deadline
plus a margin, so a receiver, which copies only within that deadline, never reads memory its sender freed.
Where the driver refuses handles for JAX's allocations but gives them for memory it allocates itself (seen on an
H200 VM: `cuIpcGetMemHandle` answered CUDA_ERROR_INVALID_VALUE for JAX's arrays under every allocator setting),
the sender stages each offered array in an arena of driver memory (`StagedCudaIpc`, arena.py) and names the copy;
an offer that finds the arena full goes through the transfer server (pull.PullLink.offer).

Which device: both ends compare the physical device's id (`key`, the GPU's UUID) before they choose this path;
the receiver checks it again on every PULL. Mappings of a peer whose transfer server stops answering (the
process is gone) are closed at once by a sweeper thread, and any mapping unused for IDLE_S: an importer's
mapping keeps the exporter's memory allocated, so a dead instance's memory is freed for its restart. A receiver
that cannot map a peer's allocation at all (processes in separate IPC namespaces, a driver that refuses) stops
offering the path (`advertised` None: the worker's registration then leaves it out, and its peers link through the
transfer server); the transfer that found it fails and is retried by the router.

The mechanism is pluggable (`CudaIpc` here; the tests' stand-in exports host buffers): `key`, `dl_device`,
`export(array) -> (handle, offset)`, `open(handle) -> (base, bytes)`, `close(base)`; a staging one also `staged`,
`settle()`, `unexport(handle, offset)` and `shutdown()`.
Concurrency: `offer`/`release` run on the prefill worker's feeder and link threads, `copy_in` on the KV
server's connection threads, the sweeper on its own; one lock guards the tables (never held across a copy or a
driver call), a second serializes the mapping calls.
"""

from __future__ import annotations

import logging
import threading
import time

import numpy as np

from .arena import Arena, ArenaFull  # noqa: F401 - ArenaFull: what StagedCudaIpc.export raises
from .cuda import KDL_CUDA, CudaError, Driver, RawView

log = logging.getLogger("jaxserve.transfer")
IDLE_S = 30.0  # a peer allocation mapped but unused this long is closed
SWEEP_S = 2.0  # how often the sweeper looks
EXPIRY_MARGIN_S = 10.0


class IpcError(RuntimeError):
    """A CUDA IPC copy could not be made (other device, bad handle, out of bounds)."""


class CudaIpc:
    """CUDA IPC on the device with CUDA ordinal `ordinal` (a jax.Device's local_hardware_id)."""

    def __init__(self, ordinal: int, driver: Driver | None = None):
        self.driver = driver or Driver(ordinal)
        self.key = self.driver.uuid
        self.dl_device = (KDL_CUDA, ordinal)

    def export(self, x) -> tuple[bytes, int]:
        """(IPC handle of the allocation single-device array `x` lies in, x's offset there). Asked of the driver
        each time (microseconds): an allocation the allocator freed and made again at the same address has a
        handle of its own."""
        ptr = x.unsafe_buffer_pointer()
        base, _ = self.driver.allocation(ptr)
        return self.driver.get_handle(base), ptr - base

    def open(self, handle: bytes) -> tuple[int, int]:
        base = self.driver.open_handle(handle)
        return base, self.driver.allocation(base)[1]

    def close(self, base: int) -> None:
        self.driver.close_handle(base)


class StagedCudaIpc(CudaIpc):
    """CUDA IPC where JAX's allocations cannot be shared but the driver's own can: each offered array is copied,
    device to device on a stream of ours, into a place in an arena of driver memory (arena.py), and named by that
    chunk's handle and the place's offset. `settle` waits for an offer's copies; the place goes back to the arena
    when the peer acknowledges (or the offer expires), so the array itself need not be kept. One device copy
    more than sharing arrays in place; the arena's memory is outside JAX's share of the device."""

    staged = True

    def __init__(self, ordinal: int, driver: Driver | None = None, chunk_bytes: int = 64 << 20,
                 limit_bytes: int = 4 << 30):
        super().__init__(ordinal, driver)
        self.arena = Arena(self.driver.alloc, self.driver.free, chunk_bytes, limit_bytes)
        self._handles: dict[int, bytes] = {}  # chunk base -> its IPC handle (the chunks live as long as we do)
        self._bases: dict[bytes, int] = {}

    def export(self, x) -> tuple[bytes, int]:
        """Raises ArenaFull where the arena has no room (the caller offers the array another way)."""
        base, offset = self.arena.take(x.nbytes)
        try:
            handle = self._handles.get(base)
            if handle is None:
                handle = self._handles[base] = self.driver.get_handle(base)
                self._bases[handle] = base
            self.driver.copy(base + offset, x.unsafe_buffer_pointer(), x.nbytes)
        except BaseException:
            self.arena.give(base, offset)
            raise
        return handle, offset

    def settle(self) -> None:
        self.driver.sync()

    def unexport(self, handle: bytes, offset: int) -> None:
        self.arena.give(self._bases[handle], offset)

    def shutdown(self) -> None:
        self.driver.sync()
        self.arena.close()


def cuda_share(device, alive=None, driver: Driver | None = None) -> "IpcShare":
    """An IpcShare on `device` (a GPU jax.Device), checked by exporting a small array of its own; where JAX's
    allocations cannot be shared but the driver's own memory can, one that stages the arrays there
    (StagedCudaIpc). Raises cuda.CudaError where no memory can be shared (saying why)."""
    import jax
    import jax.numpy as jnp
    mech = CudaIpc(device.local_hardware_id, driver)
    probe = jax.device_put(jnp.zeros((256,), jnp.float32), device)
    try:
        mech.export(probe.block_until_ready())
    except CudaError as e:  # say whose memory cannot be shared: JAX's allocator's, or any on this machine
        own = mech.driver.own_memory_refused()
        if own is not None:
            raise CudaError(f"JAX's arrays cannot be shared ({e}); memory the driver allocates itself "
                            f"cannot either ({own})") from None
        log.info("JAX's arrays cannot be shared through CUDA IPC (%s): offers are staged in driver memory", e)
        return IpcShare(StagedCudaIpc(device.local_hardware_id, mech.driver), alive)
    return IpcShare(mech, alive)


class IpcShare:
    def __init__(self, mech, alive=None, idle_s: float = IDLE_S):
        """mech: the mechanism (CudaIpc); alive(owner) -> False once a peer's transfer server refuses
        connections (its mappings are closed then; None: idle expiry only)."""
        self.mech, self.alive, self.idle_s = mech, alive, idle_s
        self.key = mech.key
        self._offers: dict[int, tuple[list, float]] = {}  # uuid -> (arrays kept alive, drop time)
        self._maps: dict[tuple[str, bytes], list] = {}  # (owner, handle) -> [base, bytes, last used, copies in flight]
        self._lock = threading.Lock()
        self._open_lock = threading.Lock()  # held across the driver's map and unmap calls; taken before _lock
        self._stop = threading.Event()
        self._sweeper: threading.Thread | None = None
        self.broken: str | None = None  # why a peer's allocation could not be mapped, once that happened

    @property
    def advertised(self) -> str | None:
        """The device key peers may share through (None once mapping failed: they use the transfer server)."""
        return None if self.broken else self.key

    @property
    def staged(self) -> bool:
        """Offers are copies in an arena of driver memory (StagedCudaIpc), not the arrays in place."""
        return getattr(self.mech, "staged", False)

    # ---- sender
    def offer(self, uuid: int, arrays: list, timeout_s: float) -> list[list]:
        """Keep `arrays` (single-device jax.Arrays, this share's device), or their staged copies, for a peer to
        copy -> [[handle hex, offset, bytes]] per array. Waits until they are computed and any staging copies made
        (the peer reads them through no stream of ours). Raises arena.ArenaFull where a staging arena has no
        room (nothing of this offer is kept)."""
        import jax
        jax.block_until_ready(arrays)
        places = []
        try:
            for x in arrays:
                places.append(self.mech.export(x))
            if self.staged:
                self.mech.settle()
        except BaseException:
            self._unexport(places)
            raise
        entries = [[h.hex(), int(off), int(x.nbytes)] for (h, off), x in zip(places, arrays)]
        kept = places if self.staged else list(arrays)
        now = time.monotonic()
        with self._lock:
            expired = [u for u, (_, drop) in self._offers.items() if drop <= now]
            gone = [self._offers.pop(u)[0] for u in expired]  # never acknowledged: failed or abandoned
            self._offers[uuid] = (kept, now + 2 * timeout_s + EXPIRY_MARGIN_S)
        for k in gone:
            self._unexport(k)
        return entries

    def _unexport(self, kept: list) -> None:
        if self.staged:
            for handle, offset in kept:
                self.mech.unexport(handle, offset)

    def release(self, uuid: int) -> None:
        """The peer acknowledged its copies of offer `uuid`: its arrays (or staging places) may go."""
        with self._lock:
            kept = self._offers.pop(uuid, (None,))[0]
        if kept is not None:
            self._unexport(kept)

    def offered(self) -> int:
        with self._lock:
            return len(self._offers)

    # ---- receiver
    def copy_in(self, owner: str, entries: list, specs: list, device) -> list:
        """Copies on `device` of the peer `owner`'s offered arrays. entries: [[handle hex, offset, bytes]] (PULL
        frame); specs: [(shape, numpy dtype name)] in the same order. Raises IpcError."""
        import jax
        if len(entries) != len(specs):
            raise IpcError(f"{len(entries)} IPC handles for {len(specs)} arrays")
        views, out, opened = [], [], []
        try:
            for (hexh, offset, sent), (shape, dtype) in zip(entries, specs):
                nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
                if sent != nbytes:
                    raise IpcError(f"an array of {sent} bytes offered where the plan stages {shape} {dtype}")
                handle = bytes.fromhex(hexh)
                base, size = self._map(owner, handle)
                opened.append((owner, handle))
                if not 0 <= offset <= size - nbytes:
                    raise IpcError(f"array of {nbytes} bytes at offset {offset} of an allocation of {size}")
                view = jax.dlpack.from_dlpack(RawView(base + offset, tuple(shape), dtype, *self.mech.dl_device))
                views.append(view)
                out.append(jax.device_put(view, device, may_alias=False))
            jax.block_until_ready(out)  # copied: the sender may free its arrays once this is acknowledged
            return out
        finally:
            for v in views:
                v.delete()
            self._done(opened)

    def _map(self, owner: str, handle: bytes) -> tuple[int, int]:
        with self._open_lock:  # one mapping per handle: the driver may refuse to map a handle twice
            with self._lock:
                m = self._maps.get((owner, handle))
                if m is not None:
                    m[2], m[3] = time.monotonic(), m[3] + 1
                    return m[0], m[1]
            try:
                base, size = self.mech.open(handle)
            except Exception as e:  # noqa: BLE001 - the driver's error, or a forged handle
                if self.broken is None:
                    log.warning("cannot map %s's device memory (%s): CUDA IPC no longer offered to peers", owner, e)
                self.broken = f"{type(e).__name__}: {e}"
                raise IpcError(f"cannot map {owner}'s allocation: {e}") from e
            with self._lock:
                self._maps[(owner, handle)] = [base, size, time.monotonic(), 1]
        self._start_sweeper()
        return base, size

    def _done(self, opened: list) -> None:
        with self._lock:
            for key in opened:
                m = self._maps.get(key)
                if m is not None:
                    m[3] -= 1

    def forget(self, owner: str) -> int:
        """Close every mapping of `owner`'s memory not being copied from -> how many."""
        return self._close(lambda o, m: o == owner)

    def mapped(self) -> int:
        with self._lock:
            return len(self._maps)

    def _close(self, which) -> int:
        with self._open_lock:  # (a handle being closed is not mapped again meanwhile)
            with self._lock:
                gone = [(k, m) for k, m in self._maps.items() if m[3] == 0 and which(k[0], m)]
                for k, _ in gone:
                    del self._maps[k]
            for (owner, _), m in gone:
                try:
                    self.mech.close(m[0])
                except Exception as e:  # noqa: BLE001 - nothing left to do with it
                    log.warning("closing a mapping of %s failed: %s", owner, e)
        return len(gone)

    def _start_sweeper(self) -> None:
        with self._lock:
            if self._sweeper is not None or self._stop.is_set():
                return
            self._sweeper = threading.Thread(target=self._sweep, name="ipc-sweeper", daemon=True)
        self._sweeper.start()

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_S):
            now = time.monotonic()
            with self._lock:
                owners = {o for o, _ in self._maps}
            dead = {o for o in owners if self.alive is not None and not self.alive(o)}
            n = self._close(lambda o, m: o in dead or now - m[2] > self.idle_s)
            if n:
                log.info("closed %d IPC mappings (%s)", n, "peers gone: " + ", ".join(sorted(dead)) if dead else "idle")

    def close(self) -> None:
        self._stop.set()
        self._close(lambda o, m: True)
        with self._lock:
            self._offers.clear()
        if self.staged:
            self.mech.shutdown()
