"""Raw device memory, for CUDA IPC (ipc.py): the CUDA driver API through ctypes, and a DLPack view of a pointer.

`Driver` binds the few calls IPC needs from the driver library every NVIDIA machine has (libcuda.so.1, no
CUDA toolkit, no extra package): the allocation a pointer lies in, an IPC handle for it, opening a peer's
handle, closing it, the device's UUID; and, for a staging arena of its own (arena.py), allocating and freeing
device memory and copying device to device on a stream of its own. Each call first makes the device's primary
context (the one XLA's client runs in) current on the calling thread. Errors raise `CudaError` with the driver's
error name.

`RawView` is an array-like with `__dlpack__` / `__dlpack_device__` over memory this process did not allocate
through JAX (a mapped peer allocation, or any host buffer on a CPU): `jax.dlpack.from_dlpack` wraps it without
a copy. Its DLPack structures live until the consumer's deleter call; the memory's owner must outlive every JAX
array made from it.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np

KDL_CPU, KDL_CUDA = 1, 2  # DLDeviceType
_KDL_INT, _KDL_UINT, _KDL_FLOAT, _KDL_BFLOAT, _KDL_BOOL = 0, 1, 2, 4, 6
HANDLE_BYTES = 64  # CUipcMemHandle
_LAZY_PEER_ACCESS = 1  # CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS
_STREAM_NON_BLOCKING = 1  # CU_STREAM_NON_BLOCKING: no implicit order with the legacy default stream


class CudaError(RuntimeError):
    """A CUDA driver call failed (or the driver is not there)."""


class _Handle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * HANDLE_BYTES)]  # (c_char would cut the bytes at a NUL)


class Driver:
    """The CUDA driver calls IPC needs, on one device (the CUDA ordinal JAX calls its local hardware id)."""

    def __init__(self, ordinal: int, lib: str = "libcuda.so.1"):
        try:
            self._cu = ctypes.CDLL(lib)
        except OSError as e:
            raise CudaError(f"no CUDA driver ({lib}): {e}") from None
        u64, p = ctypes.c_uint64, ctypes.POINTER
        for name, args in (("cuInit", [ctypes.c_uint]), ("cuDeviceGet", [p(ctypes.c_int), ctypes.c_int]),
                           ("cuDevicePrimaryCtxRetain", [p(ctypes.c_void_p), ctypes.c_int]),
                           ("cuCtxSetCurrent", [ctypes.c_void_p]),
                           ("cuGetErrorName", [ctypes.c_int, p(ctypes.c_char_p)]),
                           ("cuMemGetAddressRange_v2", [p(u64), p(ctypes.c_size_t), u64]),
                           ("cuIpcGetMemHandle", [p(_Handle), u64]),
                           ("cuIpcOpenMemHandle_v2", [p(u64), _Handle, ctypes.c_uint]),
                           ("cuIpcOpenMemHandle", [p(u64), _Handle, ctypes.c_uint]),
                           ("cuIpcCloseMemHandle", [u64]),
                           ("cuMemAlloc_v2", [p(u64), ctypes.c_size_t]), ("cuMemFree_v2", [u64]),
                           ("cuStreamCreate", [p(ctypes.c_void_p), ctypes.c_uint]),
                           ("cuStreamSynchronize", [ctypes.c_void_p]),
                           ("cuMemcpyDtoDAsync_v2", [u64, u64, ctypes.c_size_t, ctypes.c_void_p]),
                           ("cuDeviceGetUuid_v2", [p(ctypes.c_ubyte * 16), ctypes.c_int]),
                           ("cuDeviceGetUuid", [p(ctypes.c_ubyte * 16), ctypes.c_int])):
            fn = getattr(self._cu, name, None)
            if fn is not None:  # (the _v2 names are missing from old drivers, the plain ones may go from new ones)
                fn.argtypes, fn.restype = args, ctypes.c_int
        self._call("cuInit", 0)
        dev = ctypes.c_int()
        self._call("cuDeviceGet", ctypes.byref(dev), ordinal)
        self._ctx = ctypes.c_void_p()
        self._call("cuDevicePrimaryCtxRetain", ctypes.byref(self._ctx), dev)
        self._current = threading.local()
        self._stream: ctypes.c_void_p | None = None  # copy(): one non-blocking stream of ours, made on first use
        self._stream_lock = threading.Lock()
        uuid = (ctypes.c_ubyte * 16)()
        self._call("cuDeviceGetUuid_v2" if hasattr(self._cu, "cuDeviceGetUuid_v2") else "cuDeviceGetUuid",
                   ctypes.byref(uuid), dev)
        self.uuid = "GPU-" + bytes(uuid).hex()  # the physical device, whatever ordinal a process sees it at

    def _call(self, name: str, *args) -> None:
        rc = getattr(self._cu, name)(*args)
        if rc != 0:
            text = ctypes.c_char_p()
            self._cu.cuGetErrorName(rc, ctypes.byref(text))
            raise CudaError(f"{name}: {(text.value or b'').decode() or rc}")

    def _enter(self) -> None:
        if not getattr(self._current, "set", False):
            self._call("cuCtxSetCurrent", self._ctx)
            self._current.set = True

    def allocation(self, ptr: int) -> tuple[int, int]:
        """(base, bytes) of the allocation device pointer `ptr` lies in."""
        self._enter()
        base, size = ctypes.c_uint64(), ctypes.c_size_t()
        self._call("cuMemGetAddressRange_v2", ctypes.byref(base), ctypes.byref(size), ptr)
        return base.value, size.value

    def get_handle(self, base: int) -> bytes:
        """The IPC handle of the allocation at `base` (the 64 bytes another process opens)."""
        self._enter()
        h = _Handle()
        self._call("cuIpcGetMemHandle", ctypes.byref(h), base)
        return bytes(h.reserved)

    def alloc(self, nbytes: int) -> int:
        """Device memory of the driver's own (cuMemAlloc, outside JAX's allocator) -> its pointer."""
        self._enter()
        ptr = ctypes.c_uint64()
        self._call("cuMemAlloc_v2", ctypes.byref(ptr), nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self._enter()
        self._call("cuMemFree_v2", ptr)

    def copy(self, dst: int, src: int, nbytes: int) -> None:
        """Enqueue a device-to-device copy on this driver's stream (`sync` waits for every copy enqueued)."""
        self._enter()
        with self._stream_lock:
            if self._stream is None:
                stream = ctypes.c_void_p()
                self._call("cuStreamCreate", ctypes.byref(stream), _STREAM_NON_BLOCKING)
                self._stream = stream
        self._call("cuMemcpyDtoDAsync_v2", dst, src, nbytes, self._stream)

    def sync(self) -> None:
        if self._stream is not None:
            self._enter()
            self._call("cuStreamSynchronize", self._stream)

    def own_memory_refused(self, nbytes: int = 1 << 21) -> str | None:
        """Whether the driver shares memory it allocates itself (cuMemAlloc): None where it does, else why not. Tells
        an allocator that cannot share (JAX's) from a machine where IPC is off altogether."""
        try:
            ptr = self.alloc(nbytes)
        except CudaError as e:
            return str(e)
        try:
            self.get_handle(ptr)
            return None
        except CudaError as e:
            return str(e)
        finally:
            self.free(ptr)

    def open_handle(self, handle: bytes) -> int:
        """Map a peer's allocation into this process -> its base pointer here."""
        if len(handle) != HANDLE_BYTES:
            raise CudaError(f"an IPC handle is {HANDLE_BYTES} bytes, got {len(handle)}")
        self._enter()
        h, ptr = _Handle(), ctypes.c_uint64()
        ctypes.memmove(h.reserved, handle, HANDLE_BYTES)
        name = "cuIpcOpenMemHandle_v2" if hasattr(self._cu, "cuIpcOpenMemHandle_v2") else "cuIpcOpenMemHandle"
        self._call(name, ctypes.byref(ptr), h, _LAZY_PEER_ACCESS)
        return ptr.value

    def close_handle(self, base: int) -> None:
        self._enter()
        self._call("cuIpcCloseMemHandle", base)


# ---- DLPack (dlpack.h, the unversioned structures every consumer takes)
class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [("data", ctypes.c_void_p), ("device", _DLDevice), ("ndim", ctypes.c_int32),
                ("dtype", _DLDataType), ("shape", ctypes.POINTER(ctypes.c_int64)),
                ("strides", ctypes.POINTER(ctypes.c_int64)), ("byte_offset", ctypes.c_uint64)]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]
# views handed to a consumer, by their DLManagedTensor's address: each stays alive until the consumer's deleter
# call (JAX may call it on one of its threads after the array's last use), never before
_CONSUMED: dict[int, "RawView"] = {}
_CONSUMED_LOCK = threading.Lock()


@_DELETER
def _release(mt) -> None:  # the memory is not the consumer's to free: only the view's structures go
    with _CONSUMED_LOCK:
        _CONSUMED.pop(ctypes.cast(mt, ctypes.c_void_p).value, None)

_CAPSULE_NAME = b"dltensor"
# a function object of its own: ctypes.pythonapi's is shared, and other libraries set its argtypes their way
_new_capsule = ctypes.PYFUNCTYPE(ctypes.py_object, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)(
    ("PyCapsule_New", ctypes.pythonapi))


def dl_dtype(dtype) -> tuple[int, int]:
    """(DLPack type code, bits) of a numpy dtype (bfloat16 included)."""
    dt = np.dtype(dtype)
    if dt.name == "bfloat16":
        return _KDL_BFLOAT, 16
    code = {"f": _KDL_FLOAT, "i": _KDL_INT, "u": _KDL_UINT, "b": _KDL_BOOL}.get(dt.kind)
    if code is None:
        raise TypeError(f"no DLPack type for {dt}")
    return code, dt.itemsize * 8


class RawView:
    """A C-contiguous array of `shape` and `dtype` at address `ptr` on a DLPack device (KDL_CUDA with its ordinal,
    or KDL_CPU), for jax.dlpack.from_dlpack. Producer-side stream synchronization is the caller's: the bytes must
    be written before the view is taken."""

    def __init__(self, ptr: int, shape: tuple[int, ...], dtype, device_type: int, device_id: int = 0):
        self.device = (device_type, device_id)
        self._shape = (ctypes.c_int64 * max(len(shape), 1))(*shape)
        self._mt = _DLManagedTensor()
        t = self._mt.dl_tensor
        t.data, t.ndim, t.shape, t.strides, t.byte_offset = ptr, len(shape), self._shape, None, 0
        t.device = _DLDevice(device_type, device_id)
        code, bits = dl_dtype(dtype)
        t.dtype = _DLDataType(code, bits, 1)
        self._mt.manager_ctx, self._mt.deleter = None, _release

    def __dlpack_device__(self) -> tuple[int, int]:
        return self.device

    def __dlpack__(self, stream=None, **_):
        with _CONSUMED_LOCK:
            _CONSUMED[ctypes.addressof(self._mt)] = self
        return _new_capsule(ctypes.addressof(self._mt), _CAPSULE_NAME, None)
