"""The one place that decides kernel or reference.

Every kernel is registered here with its pure-jnp twin (same signature). `select(name, mode)` returns the
callable for a mode:
  reference   the jnp references (what XLA compiles on any backend)
  pallas      the Pallas kernels, compiled (GPU)
  interpret   the Pallas kernels in interpret mode: the kernel bodies evaluated on the CPU (tests)
  native      the CPU kernels compiled from C++ (native.py) where one exists and the library builds (the
              grouped products of experts: a jnp form for the CPU), the references for the others
  auto        pallas on GPU, native on CPU, reference elsewhere
A `KernelPlan` is a resolved mode with exceptions: the kernels named in its `reference` run as their
references (check.py puts there those that fail their self-test on this device). Models take a mode or a plan
at construction (`CausalLM(..., kernels=...)`), the engine from its config (`engine.kernels`, through
check.plan); nothing reads the environment.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Literal

import jax

from . import native
from .flash_attention import batched_attention, flash_attention, ref_batched_attention, ref_flash_attention
from .gated_delta_rule import (chunk_gated_delta_rule, recurrent_gated_delta_rule, ref_chunk_gated_delta_rule,
                               ref_recurrent_gated_delta_rule)
from .grouped_matmul import ref_grouped_matmul
from .matmul import ref_matmul
from .paged_attention import (paged_attention, paged_mla_attention, ref_paged_attention, ref_paged_mla_attention,
                              ref_paged_mla_prefill_attention, ref_paged_prefill_attention)
from .paged_prefill import paged_mla_prefill_attention, paged_prefill_attention

Mode = Literal["auto", "reference", "pallas", "interpret", "native"]
MODES: tuple[str, ...] = ("auto", "reference", "pallas", "interpret", "native")

KERNELS = {  # name -> (reference, Pallas kernel or None: native only)
    "flash_attention": (ref_flash_attention, flash_attention),
    "batched_attention": (ref_batched_attention, batched_attention),
    "paged_attention": (ref_paged_attention, paged_attention),
    "paged_mla_attention": (ref_paged_mla_attention, paged_mla_attention),
    "paged_prefill_attention": (ref_paged_prefill_attention, paged_prefill_attention),
    "paged_mla_prefill_attention": (ref_paged_mla_prefill_attention, paged_mla_prefill_attention),
    "chunk_gated_delta_rule": (ref_chunk_gated_delta_rule, chunk_gated_delta_rule),
    "recurrent_gated_delta_rule": (ref_recurrent_gated_delta_rule, recurrent_gated_delta_rule),
    "matmul": (ref_matmul, None),
    "grouped_matmul": (ref_grouped_matmul, None),
}


@dataclasses.dataclass(frozen=True)
class KernelPlan:
    """mode ("pallas", "interpret" or "native") for every kernel but those named in `reference`."""
    mode: str
    reference: frozenset = frozenset()


def auto_mode() -> str:
    """What 'auto' means on this machine: the Pallas kernels on a GPU, the native kernels on a CPU, the
    references elsewhere."""
    return {"gpu": "pallas", "cpu": "native"}.get(jax.default_backend(), "reference")


def resolve(mode):
    """'auto' -> auto_mode(); other modes are returned after validation, a KernelPlan as it is."""
    if isinstance(mode, KernelPlan):
        return mode
    if mode not in MODES:
        raise ValueError(f"kernels must be one of {', '.join(MODES)}; got {mode!r}")
    return auto_mode() if mode == "auto" else mode


def mode_of(name: str, mode) -> str:
    """"reference", "pallas", "interpret" or "native": how kernel `name` runs under `mode` (a mode name or a
    KernelPlan). Under native, a kernel with no native implementation, or a library that does not build, runs
    as its reference; under pallas and interpret, one with no Pallas kernel."""
    if name not in KERNELS:
        raise KeyError(f"no kernel {name!r}; known: {', '.join(KERNELS)}")
    mode = resolve(mode)
    if isinstance(mode, KernelPlan):
        mode = "reference" if name in mode.reference else mode.mode
    if mode == "native" and (name not in native.KERNELS
                             or (name not in native.LIBRARY_FREE and not native.available()[0])):
        return "reference"
    if mode in ("pallas", "interpret") and KERNELS[name][1] is None:
        return "reference"
    return mode


def select(name: str, mode):
    """The implementation of kernel `name` for `mode` (a mode name or a KernelPlan)."""
    mode = mode_of(name, mode)
    ref, kernel = KERNELS[name]
    if mode == "reference":
        return ref
    if mode == "native":
        return native.KERNELS[name]
    return functools.partial(kernel, interpret=mode == "interpret")
