"""XLA flags jaxserve sets before JAX starts (imported by jaxserve/__init__.py, so before any module of the package
imports JAX).

XLA's CPU compiler emits its fusions through the MLIR fusion emitters by default; with the older LLVM emitters
the bundled Kimi Linear's step programs compile faster (`configs/colocated.yaml`'s warm-up, 21 programs on 2
cores: 75-81 s in three runs against 90 s) and `bench.offline`'s 32M Llama ran as fast (429 output tokens/s
against 389, medians of two passes). XLA reads XLA_FLAGS once, when its backend starts, and
aborts on a flag it does not know, so the flag is added only for the jaxlib this project pins (where it is known),
only if XLA_FLAGS does not name it already, and it changes nothing on an accelerator (an `xla_cpu_` flag).
"""

from __future__ import annotations

import os
from importlib import metadata

CPU_FLAGS = ("--xla_cpu_use_fusion_emitters=false",)
KNOWN_JAXLIB = ("0.10.",)  # the versions whose XLA takes CPU_FLAGS


def add_cpu_flags(env=os.environ) -> list[str]:
    """Append CPU_FLAGS to env's XLA_FLAGS where the installed jaxlib knows them -> the flags added."""
    try:
        version = metadata.version("jaxlib")
    except metadata.PackageNotFoundError:
        return []
    if not version.startswith(KNOWN_JAXLIB):
        return []
    have = env.get("XLA_FLAGS", "")
    added = [f for f in CPU_FLAGS if f.split("=")[0] not in have]
    if added:
        env["XLA_FLAGS"] = " ".join([have, *added]).strip()
    return added
