"""The kernel self-test's passes, kept in a directory (the engine's compilation cache) so that a case checked once
on a device and software stack is not checked again at the next engine start. A check traces, lowers, compiles
and runs a kernel and its reference: about a second of a CPU worker's start for a model's few kernels, and
Triton compilations on a GPU, paid by every worker process of a cluster at every start.

A pass is stored under a hash of everything its outcome depends on: the mode, the case (with the functions
compared), the device's platform, kind and runtime version (on a GPU: CUDA's), JAX's and jaxlib's versions, this
package's sources (the Pallas kernels, their references, the native kernels' C++ and the check itself) and, for
the native kernels, the CPU they are built for. A failure is not stored: the next start checks again and says
why. One file per pass, written whole (a temporary file renamed into place), so processes sharing the directory
need no lock; anything unreadable counts as not checked.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
import os
import tempfile

import jax

SUBDIR = "jaxserve-kernel-checks"
_PACKAGE = os.path.dirname(os.path.abspath(__file__))


@functools.lru_cache(maxsize=1)
def _sources() -> str:
    """A hash of this package's files (Python and native sources), in path order."""
    h = hashlib.sha256()
    for root, dirs, files in os.walk(_PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".cc", ".h")):
                path = os.path.join(root, name)
                h.update(os.path.relpath(path, _PACKAGE).encode())
                with open(path, "rb") as f:
                    h.update(f.read())
    return h.hexdigest()


@functools.lru_cache(maxsize=None)
def _stack(mode: str) -> str:
    device = jax.devices()[0]
    runtime = getattr(getattr(device, "client", None), "platform_version", "")  # a GPU's: its CUDA and driver
    parts = [mode, device.platform, device.device_kind, runtime, jax.__version__,
             importlib.metadata.version("jaxlib"), _sources()]
    if mode == "native":
        from . import native
        parts.append(native.library_path())  # named by the sources, flags, CPU and JAX it is built for
    return "\n".join(parts)


def _path(store: str, mode: str, case) -> str:
    key = hashlib.sha256(f"{_stack(mode)}\n{case}".encode()).hexdigest()
    return os.path.join(store, SUBDIR, key[:32] + ".json")


def passed(store: str | None, mode: str, case) -> bool:
    """Whether `case` passed in `mode` on this device and stack before (False without a store)."""
    if not store:
        return False
    try:
        with open(_path(store, mode, case)) as f:
            return json.load(f).get("case") == str(case)
    except (OSError, ValueError, AttributeError):
        return False


def record_pass(store: str | None, mode: str, case) -> None:
    """Remember that `case` passed in `mode` here (nothing without a store; a write that fails is skipped)."""
    if not store:
        return
    path = _path(store, mode, case)
    tmp = None
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd, tmp = tempfile.mkstemp(suffix=".tmp", dir=os.path.dirname(path))
        with os.fdopen(fd, "w") as f:
            json.dump({"case": str(case), "mode": mode}, f)
        os.replace(tmp, path)
    except OSError:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
