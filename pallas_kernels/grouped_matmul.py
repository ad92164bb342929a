"""Grouped matrix products of mixture-of-experts layers: rows sorted by expert, each group of rows times its
expert's weight.

  x      [M, K]     rows sorted by group (token-expert pairs sorted by expert)
  w      [E, K, N]  one weight per group (expert), or [L, E, K, N] with `layer` (a layer's experts in the stack of
                    its layers, models/stack.py: read in place, not sliced out first)
  sizes  [E] int32  rows per group, in order; they sum to at most M (rows past the last group come out zero)
  layer  None, or a [] int32 index into w's leading axis (traced)
  ->     [M, N]     in x's dtype, accumulated in float32

`ref_grouped_matmul` is `lax.ragged_dot`, what XLA compiles on any backend; on a GPU it is the kernel. XLA's CPU
backend runs it as one dense product of every row with every expert's weight (each row placed in its expert's
slice of an [M, E * K] operand): E times the work, and the memory of that operand. On a random gpt-oss-shaped
layer (32 experts, hidden 1,024, 2,048 outputs, 2 cores) a 64-request decode step's 256 rows took 326 ms against
31 ms here, a 1,024-token prefill's 4,096 rows 4.0 s against 0.17 s.

On a CPU the "native" mode runs the C++ kernel (native.py `grouped_matmul`: each expert's weight read where it
lies, in chunks of 8 rows); where the library does not build, or for dtypes other than float32, it runs
`tiled_grouped_matmul` (pure jnp), which cuts each group's rows into tiles of T rows from the group's first row
on, and runs one product per tile: at most M / T + E of them, as many as the groups'
rows need (a loop whose trip count the device computes: groups without rows cost nothing). Each reads its
expert's weight once and T rows, so a decode step whose groups hold at most T rows reads the weight of each expert
its rows chose once, and a prefill's work is its rows' plus less than a tile per group. T follows the rows per
group (static: M and E), between 8 and 64. (Tiles cut from row 0 on, shared by the groups that meet in them, read
the weights of a decode step's experts up to twice: at gpt-oss-mini's experts, 32 of 512 x 512, 2 cores, the
192 rows of a 48-request step took 4.8 ms a product so against 3.6 ms.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

MIN_TILE, MAX_TILE = 8, 64


def check_grouped(x, w, sizes, layer) -> None:
    E, K = w.shape[-3:-1]
    if x.ndim != 2 or w.ndim != (3 if layer is None else 4) or sizes.shape != (E,) or x.shape[1] != K:
        raise ValueError(f"grouped_matmul: x [M, K], w [E, K, N] (or [L, E, K, N] with a layer) and sizes [E]; got "
                         f"{x.shape}, {w.shape} and {sizes.shape}")


def ref_grouped_matmul(x, w, sizes, *, layer=None):
    check_grouped(x, w, sizes, layer)
    if layer is not None:
        w = w[layer]
    return jax.lax.ragged_dot(x, w, sizes.astype(jnp.int32), preferred_element_type=jnp.float32).astype(x.dtype)


def tile_rows(M: int, E: int) -> int:
    """Rows per tile for M rows over E groups: the power of two at or below the rows of an even group, within
    MIN_TILE..MAX_TILE (measured on 2 cores: 16 rows best for 96 rows over 4 experts, 8 for 256 over 32, 64 for
    4,096 over 32 and, within 3%, for 2,048 over 4)."""
    per = max(1, M // E)
    return max(MIN_TILE, min(MAX_TILE, 1 << (per.bit_length() - 1)))


def tiled_grouped_matmul(x, w, sizes, *, layer=None):
    check_grouped(x, w, sizes, layer)
    M, _ = x.shape
    E, _, N = w.shape[-3:]
    expert = (lambda g: w[g]) if layer is None else (lambda g: w[layer, g])  # noqa: E731
    T = tile_rows(M, E)
    xp = jnp.pad(x, ((0, T), (0, 0)))  # a group's last tile may run past the rows
    sizes = sizes.astype(jnp.int32)
    ends = jnp.cumsum(sizes)
    starts = ends - sizes
    pairs = -(-sizes // T)  # [E] tiles of each group's rows (none for an empty group)
    pair_end = jnp.cumsum(pairs)
    P = M // T + E  # the most pairs there can be
    i = jnp.arange(P, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(pair_end, i, side="right", method="compare_all"), E - 1).astype(jnp.int32)
    row0 = starts[group] + (i - (pair_end[group] - pairs[group])) * T  # [P] pair i's first row
    rows = jnp.arange(T, dtype=jnp.int32)

    def pair(p, out):  # out [M + T, N] float32 += pair p's product: the rows of its tile that are its group's
        g, r0 = group[p], row0[p]
        y = jnp.dot(jax.lax.dynamic_slice_in_dim(xp, r0, T), expert(g), preferred_element_type=jnp.float32)
        cur = jax.lax.dynamic_slice_in_dim(out, r0, T)
        keep = (r0 + rows < ends[g])[:, None]
        return jax.lax.dynamic_update_slice_in_dim(out, cur + jnp.where(keep, y, 0.0), r0, 0)

    out = jax.lax.fori_loop(0, pair_end[-1], pair, jnp.zeros((M + T, N), jnp.float32))
    return out[:M].astype(x.dtype)
