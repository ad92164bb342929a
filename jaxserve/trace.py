"""Profiler captures (POST /debug/profile): a JAX trace of this process over a window of seconds.

A capture writes TensorBoard's profile files (`plugins/profile/<run>/*.xplane.pb`) and a Perfetto trace
(`perfetto_trace.json.gz`, for ui.perfetto.dev) under its folder: the device's programs and kernels, the host's
Python and the engine's annotations (`kv.export`, `kv.send`, `kv.import`). The colocated server captures its own
process; a cluster's router captures itself and asks every worker for the same window (the worker's `Profile`
call), each into `<profile_dir>/<stamp>/<instance>`.

One capture at a time per process (JAX's profiler holds one session): a second raises Busy. Concurrency:
asyncio, on the process's serving loop; the trace's files are written on a thread, so the loop keeps serving.
"""

from __future__ import annotations

import asyncio
import os
import re
import time

STAMP = re.compile(r"^[0-9A-Za-z_.-]{1,64}$")  # a capture's folder name: never a path
MAX_SECONDS = 300.0
_active = False


class Busy(RuntimeError):
    """A capture is already running in this process."""


def stamp() -> str:
    """A fresh capture's folder name (local time, to the second)."""
    return time.strftime("%Y%m%d-%H%M%S")


def folder(base: str, name: str, instance: str | None = None) -> str:
    """The absolute folder of capture `name` (and of one instance of a cluster in it)."""
    if not STAMP.match(name):
        raise ValueError(f"a capture's name is letters, digits, '_', '.' and '-' only, got {name!r}")
    return os.path.abspath(os.path.join(base, name, *([instance] if instance else [])))


def start(out: str, host_only: bool = False) -> None:
    """Start tracing this process into folder `out`. Raises Busy while another capture runs. host_only: a
    process that runs no model (a cluster's router, which imports JAX only here): JAX, if it has not started, starts
    on the CPU, so the capture never takes an accelerator's memory from the workers (a JAX process on a GPU claims
    75% of it)."""
    global _active
    if _active:
        raise Busy("a profile is already being captured")
    import jax
    if host_only:
        from jax._src import xla_bridge
        if not xla_bridge.backends_are_initialized():
            jax.config.update("jax_platforms", "cpu")
    try:
        jax.profiler.start_trace(out, create_perfetto_trace=True)
    except RuntimeError as e:  # a trace this module did not start (jax.profiler.trace in user code)
        raise Busy(f"a profile is already being captured ({e})") from None
    _active = True


async def stop() -> None:
    """End the capture `start` began and write its files (on a thread: the loop keeps serving)."""
    global _active
    import jax
    try:
        await asyncio.to_thread(jax.profiler.stop_trace)
    finally:
        _active = False


async def capture(out: str, seconds: float) -> str:
    """Trace this process for `seconds` into folder `out` -> out. Raises Busy while another capture runs."""
    if not 0 < seconds <= MAX_SECONDS:
        raise ValueError(f"seconds must be in (0, {MAX_SECONDS:g}], got {seconds}")
    start(out)
    try:
        await asyncio.sleep(seconds)  # the window the caller asked for
    finally:
        await stop()
    return out
