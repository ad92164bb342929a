"""Whether a compiled program updates arrays in place: each is donated and aliased to an output, and no copy of
one is made (read from XLA's optimized HLO text as XLA compiles it for serving)."""

from __future__ import annotations

import re

import jax


def _shapes(text: str) -> list[tuple[int, ...]]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in re.findall(r"\w+\[([\d,]*)\]", text)]


def check(fn, args: tuple, static: dict, arrays) -> tuple[bool, list]:
    """fn (jitted) compiled for args and static, with the optimizations serving uses; arrays: the pytree of the
    arguments meant to be updated in place -> (every one of them aliased to an output, the shapes of theirs XLA
    copies)."""
    light = jax.config.read("jax_disable_most_optimizations")  # the suite's setting (tests/conftest.py)
    jax.config.update("jax_disable_most_optimizations", False)
    try:
        text = fn.lower(*args, **static).compile().as_text()
    finally:
        jax.config.update("jax_disable_most_optimizations", light)
    want = [tuple(a.shape) for a in jax.tree.leaves(arrays)]
    params = _shapes(re.search(r"entry_computation_layout=\{\((.*?)\)->", text).group(1))
    alias = re.search(r"input_output_alias=\{(.*?)\}, entry", text)
    aliased = [params[int(i)] for i in re.findall(r": \((\d+),", alias.group(1) if alias else "")]
    copies = _shapes(" ".join(re.findall(r"= (\w+\[[\d,]*\])\S* copy(?:-start)?\(", text)))
    return all(aliased.count(s) >= want.count(s) for s in want), sorted(set(copies) & set(want))
