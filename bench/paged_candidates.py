"""Candidate designs of paged decode attention's Triton kernel, timed against the former product design on a GPU.

On an H200 the former product kernel (64-token tiles, two warps, grid b-h-p) read K/V at 59-62% of HBM bandwidth
and no launch parameter moved it (bench/results/kernel_tune_h200.json). Three changes of design, alone and in
pairs, for `python -m bench.kernel_tune --sweeps candidates` to time in one run beside that design (the
defaults: all off). `prefetch` with one page per tile and one warp won on both of the sweep's shapes
(`../shared/gpu/h200-2026-11-28/kernel_tune_candidates.json`) and is now the product kernel's design
(pallas_kernels/paged_attention.py); the others stay here to be measured again:

  prefetch  each program loads the next key tile's K and V before it attends over the current one (they ride
            in the loop's carry), so a tile's loads are in flight while the previous tile is computed. Triton's
            own pipelining (num_stages > 1) goes through shared memory and was slower for these gathered
            pages. The last iteration reloads its own tile (clamped index; read from L2);
  fused     one partition per (request, KV head) and the output normalised in the kernel, in q's dtype: no
            merge of partials, so the call is one kernel launch instead of the kernel and the merge's XLA
            fusions (a few microseconds each beside a ~90 us call). Fewer programs (B x Hkv);
  heads     one program per (request, partition) for every KV head: a block's rows of all heads are one
            contiguous run of the pool (bs x Hkv x D), read whole, where a per-head program reads D-wide pieces
            Hkv x D apart. All Hq query rows meet all the tile's keys and a row keeps only its own head's
            columns: Hkv times the products' work, which the tensor cores have to spare in a memory-bound call.

The function takes `paged_attention`'s arguments (and returns its result) so the sweep and the tests use the
product's reference, cases and tolerance. Sinks are not supported with `fused` (a ValueError); compiled, `heads`
needs KV heads x the (padded) group a power of two. Nothing in the product imports this module.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from jaxserve.pallas_kernels.flash_attention import NEG, online_softmax_step, pad_group, require_gpu_dims, triton_params
from jaxserve.pallas_kernels.merge import add_sinks, merge_partials, normalize
from jaxserve.pallas_kernels.paged_attention import _pages, _pow2_parts, gqa_args, program_tiles

GPU_LAUNCH, GRID_ORDER, TILE_TOKENS = (2, 1), "bhp", 64  # the former product design, the sweep's baseline


def _columns(ref, ids, lo: int, width: int):
    """Columns [lo, lo + width) of the blocks `ids` of a [NB, bs, D] or [NB, bs, Hkv, D] ref, as [rows, width]
    (token-major, heads inner), read through the ref (a column slice of a loaded tile does not lower to
    Triton)."""
    if lo == 0 and width == ref.shape[-1]:
        return ref[ids].reshape(-1, width)
    return ref[(ids,) + (slice(None),) * (ref.ndim - 2) + (pl.ds(lo, width),)].reshape(-1, width)


def _kernel(len_ref, tbl_ref, q_ref, k_ref, v_ref, *out_refs, block_size: int, ppt: int, ppp: int, k_parts: tuple,
            v_lo: int, v_hi: int, scale: float, window: int | None, grid_order: str, prefetch: bool, fused: bool,
            heads: int):
    # len_ref [B] int32; tbl_ref [Wp] int32; q_ref [R, Dk]; k_ref, v_ref [NB, bs, D], or [NB, bs, heads, D] with
    # heads > 1 (R = heads x G query rows, head-major); out_refs: fused, o_ref [R, Dv] in q's dtype; else
    # o_ref [R, Dv], m_ref [R], l_ref [R] float32
    n, tok_lo, tile_lo, tile_hi = program_tiles(len_ref, grid_order, block_size=block_size, ppt=ppt, ppp=ppp,
                                                window=window)
    R, Dv = out_refs[0].shape
    qs = [q_ref[:, pl.ds(lo, w)] for lo, w in k_parts]
    tk = ppt * block_size
    col = jax.lax.broadcasted_iota(jnp.int32, (1, tk * heads), 1)  # a tile's columns: token-major, heads inner
    if heads > 1:  # a query row keeps its own head's columns: [R, tk x heads]
        own = jax.lax.broadcasted_iota(jnp.int32, (R, 1), 0) // (R // heads) == col % heads

    def load(j):  # tile j's key column parts and values
        ids = tbl_ref[pl.ds(j * ppt, ppt)]
        return tuple(_columns(k_ref, ids, lo, w) for lo, w in k_parts), _columns(v_ref, ids, v_lo, Dv)

    def attend(j, carry, tile):
        ks, v = tile
        s = sum(jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for q, k in zip(qs, ks)) * scale
        pos = j * tk + col // heads
        mask = (pos < n) & (pos >= tok_lo)
        return online_softmax_step(*carry, s, mask & own if heads > 1 else mask, v)

    init = (jnp.full((R,), NEG, jnp.float32), jnp.zeros((R,), jnp.float32), jnp.zeros((R, Dv), jnp.float32))
    if prefetch:
        def body(j, carry):
            ahead = load(jnp.minimum(j + 1, tile_hi - 1))  # issued before this tile's products
            return attend(j, carry[:3], carry[3]) + (ahead,)
        m, l, acc, _ = jax.lax.fori_loop(tile_lo, tile_hi, body, init + (load(tile_lo),))
    else:
        m, l, acc = jax.lax.fori_loop(tile_lo, tile_hi, lambda j, c: attend(j, c, load(j)), init)
    if fused:
        inv = jnp.where(l > 0, 1.0 / jnp.where(l > 0, l, 1.0), 0.0)
        out_refs[0][...] = (acc * inv[:, None]).astype(out_refs[0].dtype)
    else:
        out_refs[0][...], out_refs[1][...], out_refs[2][...] = acc, m, l


@functools.partial(jax.jit, static_argnames=("layer", "k_dim", "v_entry", "v_lo", "v_hi", "scale", "window", "ppt",
                                             "ppp", "interpret", "num_warps", "num_stages", "grid_order", "prefetch",
                                             "fused", "heads"))
def _call(q, pool, block_tables, lengths, sinks, *, layer: int, k_dim: int, v_entry: int, v_lo: int, v_hi: int,
          scale: float, window: int | None, ppt: int, ppp: int, interpret: bool, num_warps: int | None,
          num_stages: int | None, grid_order: str, prefetch: bool, fused: bool, heads: bool):
    """q [B, Hq, Dk]; pool [NB, L, E, bs, Hkv, D]; block_tables [B, W]; lengths [B]; sinks [Hq] or None
    -> [B, Hq, v_hi - v_lo] in q's dtype"""
    B, Hq, Dk = q.shape
    NB, _, _, bs, Hkv, D = pool.shape
    qg, G_out = pad_group(q.reshape(B, Hkv, Hq // Hkv, Dk), 2)  # [B, Hkv, G, Dk]
    G, Dv = qg.shape[2], v_hi - v_lo
    H, R = (1, Hkv * G) if heads else (Hkv, G)  # the grid's head axis, a program's query rows
    P = -(-block_tables.shape[1] // ppp)
    k_parts = _pow2_parts(k_dim)
    if not interpret:
        require_gpu_dims("paged attention", tile_tokens=ppt * bs, value_width=Dv,
                         **{f"key_columns_{lo}_{lo + w}": w for lo, w in k_parts})
        if R & (R - 1):
            raise ValueError(f"heads: paged attention compiled for the GPU needs KV heads x group a power of two, "
                             f"got {Hkv} x {G}")
    table = jnp.pad(block_tables.astype(jnp.int32), [(0, 0), (0, P * ppp - block_tables.shape[1])])
    kernel = functools.partial(_kernel, block_size=bs, ppt=ppt, ppp=ppp, k_parts=k_parts, v_lo=v_lo, v_hi=v_hi,
                               scale=scale, window=window, grid_order=grid_order, prefetch=prefetch, fused=fused,
                               heads=Hkv if heads else 1)

    def at(f):  # an index map over (b, h, p) as one over the grid's axes
        return lambda *ids: f(*(ids[grid_order.index(c)] for c in "bhp"))
    if fused:
        out_specs = [pl.BlockSpec((None, None, R, Dv), at(lambda b, h, p: (b, h, 0, 0)))]
        out_shape = [jax.ShapeDtypeStruct((B, H, R, Dv), q.dtype)]
    else:
        out_specs = [pl.BlockSpec((None, None, None, R, Dv), at(lambda b, h, p: (b, h, p, 0, 0))),
                     pl.BlockSpec((None, None, None, R), at(lambda b, h, p: (b, h, p, 0))),
                     pl.BlockSpec((None, None, None, R), at(lambda b, h, p: (b, h, p, 0)))]
        out_shape = [jax.ShapeDtypeStruct((B, H, P, R, Dv), jnp.float32),
                     jax.ShapeDtypeStruct((B, H, P, R), jnp.float32),
                     jax.ShapeDtypeStruct((B, H, P, R), jnp.float32)]
    kv_block = (NB, None, None, bs, Hkv if heads else None, D)
    outs = pl.pallas_call(
        kernel,
        grid=tuple({"b": B, "h": H, "p": P}[c] for c in grid_order),
        in_specs=[
            pl.BlockSpec((B,), at(lambda b, h, p: (0,))),
            pl.BlockSpec((None, P * ppp), at(lambda b, h, p: (b, 0))),
            pl.BlockSpec((None, None, R, Dk), at(lambda b, h, p: (b, h, 0, 0))),
            pl.BlockSpec(kv_block, at(lambda b, h, p: (0, layer, 0, 0, h, 0))),
            pl.BlockSpec(kv_block, at(lambda b, h, p: (0, layer, v_entry, 0, h, 0))),
        ],
        out_specs=out_specs,
        out_shape=out_shape,
        interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages, GPU_LAUNCH),
        name="paged_attention_candidate",
    )(lengths.astype(jnp.int32), table, qg.reshape(B, H, R, Dk), pool, pool)
    if fused:
        return outs[0].reshape(B, Hkv, G, Dv)[:, :, :G_out].reshape(B, Hq, Dv)
    if heads:  # [B, 1, P, Hkv x G, ...] -> [B, Hkv, P, G, ...]
        outs = [jnp.moveaxis(x.reshape((B, P, Hkv, G) + x.shape[4:]), 2, 1) for x in outs]
    o, m, l = merge_partials(outs[0][..., :G_out, :], outs[1][..., :G_out], outs[2][..., :G_out], axis=2)
    if sinks is not None:
        o, m, l = add_sinks(o, m, l, sinks.reshape(1, Hkv, G_out))
    return normalize(o, l).reshape(B, Hq, Dv).astype(q.dtype)


def paged_attention(q, pool, block_tables, lengths, *, layer, sliding_window=None, sinks=None, scale=None,
                    interpret=False, pages_per_tile=None, pages_per_partition=None, num_warps=None, num_stages=None,
                    total_blocks=None, grid_order=GRID_ORDER, prefetch=False, fused=False, heads=False):
    """`pallas_kernels.paged_attention.paged_attention` with the candidate designs (module docstring): prefetch,
    fused (one partition: pages_per_partition, if given, must cover the table), heads."""
    del total_blocks
    Dk, v_entry, v_lo, v_hi = gqa_args(q, pool, block_tables, lengths, layer, sliding_window, sinks)
    W = block_tables.shape[1]
    if fused:
        if sinks is not None:
            raise ValueError("fused: sinks are not supported")
        if pages_per_partition is not None and pages_per_partition < W:
            raise ValueError(f"fused: pages_per_partition {pages_per_partition} must cover the table's {W} blocks")
    ppt, ppp = _pages(pool.shape[3], W, pages_per_tile, None if fused else pages_per_partition, TILE_TOKENS)
    if fused:  # one partition: the table's tiles
        ppp = -(-W // ppt) * ppt
    if sorted(grid_order) != ["b", "h", "p"]:
        raise ValueError(f"grid_order must order the letters b, h and p, got {grid_order!r}")
    return _call(q, pool, block_tables, lengths, sinks, layer=int(layer), k_dim=Dk, v_entry=v_entry, v_lo=v_lo,
                 v_hi=v_hi, scale=Dk ** -0.5 if scale is None else float(scale),
                 window=None if sliding_window is None else int(sliding_window), ppt=ppt, ppp=ppp,
                 interpret=bool(interpret), num_warps=num_warps, num_stages=num_stages, grid_order=grid_order,
                 prefetch=bool(prefetch), fused=bool(fused), heads=bool(heads))
