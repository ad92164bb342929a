"""Matrix products of linear layers and the LM head: the jnp reference of the native CPU kernel (native.py,
native/matmul.cc) that runs a decode step's few rows. There is no Pallas kernel: on a GPU XLA's dot is the
kernel.

  x    [..., K]
  w    [K, N] (a linear layer's [in, out] weight), or [N, K] when `transposed` (a tied embedding as the LM head)
  ->   [..., N] in x's dtype
"""

from __future__ import annotations

import jax.numpy as jnp


def check_matmul(x, w, transposed: bool) -> None:
    if w.ndim != 2 or x.shape[-1] != w.shape[1 if transposed else 0]:
        raise ValueError(f"matmul: x [..., K] and w {'[N, K]' if transposed else '[K, N]'}; got {x.shape} and "
                         f"{w.shape}")


def ref_matmul(x, w, *, transposed: bool = False):
    check_matmul(x, w, transposed)
    return jnp.einsum("...k,nk->...n" if transposed else "...k,kn->...n", x, w)
