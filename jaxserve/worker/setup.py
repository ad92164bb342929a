"""What a worker process does before and while its engine is built: pin itself (cores, devices, its share of the
devices' memory) before JAX is imported, since JAX sizes its thread pools, devices and allocator at import; then
build the engine on a mesh over its own devices. Also the line a ready worker prints and the refusal a router
answers."""

from __future__ import annotations

import dataclasses
import os
import sys

from ..config import Config, InstanceSection

READY = "JAXSERVE_WORKER_READY"


class Refused(RuntimeError):
    """The router does not accept this worker (not in its config, wrong role or token)."""


def pin(inst: InstanceSection, device_share: float | None = None) -> None:
    """CPU affinity, device count and the share of the devices' memory (Config.device_share; None: JAX's
    default) for this process; must run before `import jax`. An XLA_PYTHON_CLIENT_MEM_FRACTION already in the
    environment wins."""
    if "jax" in sys.modules:
        raise RuntimeError("pin() must run before JAX is imported")
    if inst.cpus:
        have = os.sched_getaffinity(0)
        if not set(inst.cpus) <= have:
            from ..config import ConfigFileError
            raise ConfigFileError(f"clusters.instances[{inst.name}].cpus: {inst.cpus} but this process may run "
                                  f"only on cores {sorted(have)}")
        os.sched_setaffinity(0, set(inst.cpus))
    os.environ.setdefault("CUDA_VISIBLE_DEVICES", ",".join(str(d) for d in inst.devices))
    if device_share is not None:
        os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{device_share:.4f}")
    n = max(len(inst.devices), inst.tp // inst.hosts)  # this host's devices
    if n > 1:
        flags = os.environ.get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def build_engine(cfg: Config, inst: InstanceSection, progress: bool = False):
    """The instance's LLMEngine on a mesh over its devices (a multi-host group's: every process's)."""
    from ..bundled import resolve
    from ..engine.llm_engine import LLMEngine
    from ..server.serve import make_mesh
    path = resolve(cfg.model.path, progress)
    print(f"{inst.name}: loading {path} ({inst.role}, cores {sorted(os.sched_getaffinity(0))})", flush=True)
    engine = LLMEngine(path, cfg.model.dtype, engine_settings(cfg, inst), make_mesh(inst, local=True), progress)
    print(f"{inst.name}: {engine.cache_line}", flush=True)
    return engine


def engine_settings(cfg: Config, inst: InstanceSection):
    """The instance's EngineConfig: the engine section with its own cache size and spill tier; a prefill
    instance scans its layers unless engine.scan_layers says otherwise (its start waits on compiling, and its
    layer groups then share programs; decode instances keep the accelerator default, layers unrolled)."""
    ecfg = cfg.engine.engine_config(cfg.server.max_waiting)
    if inst.kv_blocks is not None:
        ecfg = dataclasses.replace(ecfg, num_blocks=inst.kv_blocks)
    if ecfg.scan_layers is None and inst.role == "prefill":
        ecfg = dataclasses.replace(ecfg, scan_layers=True)
    if inst.spill_mb is not None:
        ecfg = dataclasses.replace(ecfg, spill_dir=inst.spill_path(), spill_mb=inst.spill_mb)
    return ecfg
