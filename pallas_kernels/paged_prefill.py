"""Paged prefill attention (Pallas, GPU): a prefill step's query tokens, each over its own row's blocks of the
pool in place, up to and including itself. The references (`ref_paged_prefill_attention`,
`ref_paged_mla_prefill_attention`) are in paged_attention.py, beside the decode kernels whose pool layout and
tile reads this shares; the CPU's native kernels of the same names are in native.py.

The engine's chunk after cached tokens attends with it (runner.inplace_prefill): no dense copy of the row's
table is gathered, and the chunk's cost follows the context it holds, not its table's width, so one program per
chunk bucket serves every context length (a table max_blocks_per_seq wide) instead of one per width bucket.

The tokens come packed, as the native kernels take them: q [N, Hq, Dk] with each token's row [N] and position
[N] (rows outside the table: padding, zeros out). Query rows are laid out as flash_attention.py's: token-major,
the G = Hq / Hkv query heads of one KV head consecutive (G padded to a power of two), a tile of `block_q` tokens
a [block_q * G, Dk] matrix. Grid (query tiles, Hkv). Program (i, h) walks the rows its tile holds (an engine's
[B, T] chunk, T a multiple of block_q, holds one; a packed step's tile may straddle rows), and for each row r
the key tiles of `pages_per_tile` blocks from the first its window reaches to the one holding its last query's
position, read through the row's block table; scores are masked to the row, causally and by the window, with an
online softmax in float32 carried across rows (a query of another row meets only masked keys: no change). Sinks
start (m, l) at (sink, 1), as in flash attention. The layer index may be traced (a layer-wise prefill's program
shared by the groups of a run): the pool is read as [num_blocks * layers, ...], block b of layer l at b * L + l.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .flash_attention import NEG, online_softmax_step, pad_group, require_gpu_dims, triton_params
from .paged_attention import _check_mla, _columns, _pow2_parts, mla_prefill_args, prefill_args, tile_pages

BLOCK_ROWS = 64  # query rows (tokens x G) per tile, as flash attention's
TILE_TOKENS = 64  # keys per tile: pages_per_tile = max(1, TILE_TOKENS // block_size)
GPU_LAUNCH = (4, 2)  # Triton warps and pipeline stages (flash attention's; not swept for this kernel yet)
MLA_BLOCK_ROWS = 32  # MLA: the 512-wide latent accumulator of every row lives in registers
MLA_TILE_TOKENS = 32
MLA_LAUNCH = (8, 1)


def _prefill_kernel(layer_ref, tbl_ref, rlo_ref, rhi_ref, qrow_ref, qpos_ref, q_ref, k_ref, v_ref, sink_ref, o_ref,
                    *, layers: int, num_blocks: int, width: int, block_size: int, ppt: int, k_parts: tuple, v_lo: int,
                    scale: float, window: int | None, has_sinks: bool):
    # layer_ref [1] int32; tbl_ref [B * width] int32 (each row's table, width a multiple of ppt); rlo_ref, rhi_ref
    # [NQ] int32 each tile's first and last row (rlo > rhi: none); qrow_ref, qpos_ref [R] int32; q_ref [R, Dk];
    # k_ref, v_ref [num_blocks * layers, bs, D]; sink_ref [R] float32; o_ref [R, Dv]
    i = pl.program_id(0)
    layer = layer_ref[0]
    rows, pos = qrow_ref[...], qpos_ref[...]
    qs = [q_ref[:, pl.ds(lo, w)] for lo, w in k_parts]
    R, Dv = o_ref.shape
    tk = ppt * block_size

    def key_tile(r, mine, j, carry):  # row r's key tile j against the tile's queries of that row (`mine`)
        ids = jnp.clip(tbl_ref[pl.ds(r * width + j * ppt, ppt)], 0, num_blocks - 1) * layers + layer
        ks = [_columns(k_ref, ids, lo, w, tk) for lo, w in k_parts]
        v = _columns(v_ref, ids, v_lo, Dv, tk)
        s = sum(jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for q, k in zip(qs, ks)) * scale
        kpos = j * tk + jax.lax.broadcasted_iota(jnp.int32, (1, tk), 1)
        mask = mine[:, None] & (kpos <= pos[:, None])
        if window is not None:
            mask = mask & (kpos > pos[:, None] - window)
        return online_softmax_step(*carry, s, mask, v)

    def row(r, carry):
        mine = rows == r
        last = jnp.max(jnp.where(mine, pos, -1))  # -1: no query of row r in this tile
        hi = jnp.minimum((last + tk) // tk, width // ppt)
        lo = 0
        if window is not None:
            first = jnp.min(jnp.where(mine, pos, jnp.int32(2 ** 30)))
            lo = jnp.minimum(jnp.maximum(first - window + 1, 0) // tk, hi)
        return jax.lax.fori_loop(lo, hi, functools.partial(key_tile, r, mine), carry)

    m0 = sink_ref[...] if has_sinks else jnp.full((R,), NEG, jnp.float32)
    l0 = jnp.full((R,), 1.0 if has_sinks else 0.0, jnp.float32)
    m, l, acc = jax.lax.fori_loop(rlo_ref[i], rhi_ref[i] + 1, row, (m0, l0, jnp.zeros((R, Dv), jnp.float32)))
    o_ref[...] = (acc / jnp.where(l > 0, l, 1.0)[:, None]).astype(o_ref.dtype)


@functools.partial(jax.jit, static_argnames=("k_dim", "v_entry", "v_lo", "v_hi", "scale", "window", "block_q", "ppt",
                                             "interpret", "num_warps", "num_stages", "launch"))
def _paged_prefill(q, pool, block_tables, rows, positions, layer, sinks, *, k_dim: int, v_entry: int, v_lo: int,
                   v_hi: int, scale: float, window: int | None, block_q: int, ppt: int, interpret: bool,
                   num_warps: int | None, num_stages: int | None, launch: tuple):
    """q [N, Hq, Dk]; pool [NB, L, E, bs, Hkv, D]; block_tables [B, W]; rows, positions [N]; layer [] int32;
    sinks [Hq] float32 or None -> [N, Hq, v_hi - v_lo] in q's dtype"""
    N, Hq, Dk = q.shape
    NB, L, E, bs, Hkv, D = pool.shape
    B, W = block_tables.shape
    qg, G_out = pad_group(q.reshape(N, Hkv, Hq // Hkv, Dk), 2)  # [N, Hkv, G, Dk]
    G, Dv = qg.shape[2], v_hi - v_lo
    bq = max(block_q // G, 1) if interpret else max(block_q // G, 1, -(-16 // G))  # Triton: >= 16 query rows
    R = bq * G
    k_parts = _pow2_parts(k_dim)
    if not interpret:
        require_gpu_dims("paged prefill attention", query_rows=R, tile_tokens=ppt * bs, value_width=Dv,
                         **{f"key_columns_{lo}_{lo + w}": w for lo, w in k_parts})
    Np = -(-N // bq) * bq
    NQ = Np // bq
    qg = jnp.pad(qg, [(0, Np - N), (0, 0), (0, 0), (0, 0)])
    rows = jnp.pad(rows.astype(jnp.int32), (0, Np - N), constant_values=B)
    positions = jnp.pad(positions.astype(jnp.int32), (0, Np - N))
    real = (rows >= 0) & (rows < B)
    r_lo = jnp.where(real, rows, B).reshape(NQ, bq).min(1)
    r_hi = jnp.where(real, rows, -1).reshape(NQ, bq).max(1)
    width = -(-W // ppt) * ppt
    table = jnp.pad(block_tables.astype(jnp.int32), [(0, 0), (0, width - W)]).reshape(B * width)
    qr = qg.transpose(1, 0, 2, 3).reshape(Hkv, Np * G, Dk)  # token-major rows, the G heads of one KV head together
    qrow, qpos = jnp.repeat(rows, G), jnp.repeat(positions, G)
    sink_r = (jnp.tile(pad_group(sinks.astype(jnp.float32).reshape(Hkv, G_out), 1)[0], (1, bq))
              if sinks is not None else jnp.zeros((Hkv, R), jnp.float32))
    flat = pool.reshape((NB * L,) + pool.shape[2:])  # [NB * L, E, bs, Hkv, D]: block b of layer l at b * L + l
    kernel = functools.partial(_prefill_kernel, layers=L, num_blocks=NB, width=width, block_size=bs, ppt=ppt,
                               k_parts=k_parts, v_lo=v_lo, scale=scale, window=window, has_sinks=sinks is not None)
    out = pl.pallas_call(
        kernel,
        grid=(NQ, Hkv),
        in_specs=[
            pl.BlockSpec((1,), lambda i, h: (0,)),
            pl.BlockSpec((B * width,), lambda i, h: (0,)),
            pl.BlockSpec((NQ,), lambda i, h: (0,)),
            pl.BlockSpec((NQ,), lambda i, h: (0,)),
            pl.BlockSpec((R,), lambda i, h: (i,)),
            pl.BlockSpec((R,), lambda i, h: (i,)),
            pl.BlockSpec((None, R, Dk), lambda i, h: (h, i, 0)),
            pl.BlockSpec((NB * L, None, bs, None, D), lambda i, h: (0, 0, 0, h, 0)),
            pl.BlockSpec((NB * L, None, bs, None, D), lambda i, h: (0, v_entry, 0, h, 0)),
            pl.BlockSpec((None, R), lambda i, h: (h, 0)),
        ],
        out_specs=pl.BlockSpec((None, R, Dv), lambda i, h: (h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((Hkv, Np * G, Dv), q.dtype),
        interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages, launch),
        name="paged_prefill_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), table, r_lo, r_hi, qrow, qpos, qr, flat, flat, sink_r)
    # padding tokens meet no row in the kernel: zeros out
    return out.reshape(Hkv, Np, G, Dv)[:, :N, :G_out].transpose(1, 0, 2, 3).reshape(N, Hq, Dv)


def paged_prefill_attention(q, pool, block_tables, rows, positions, *, layer, sliding_window=None, sinks=None,
                            scale=None, interpret=False, block_q=None, pages_per_tile=None, num_warps=None,
                            num_stages=None):
    """Prefill attention over the pool for packed tokens, read in place: q [N, Hq, Dk] the step's tokens (their
    own K/V already written into the pool); rows [N] int32 each token's block-table row (outside [0, B): padding,
    zeros out); positions [N] int32 each token's position (it sees its row's tokens up to and including it, the
    last `sliding_window` of them with a window); pool [NB, L, E, block_size, Hkv, D], block_tables [B, W];
    layer: index within the group (an int, or a traced int32 scalar); sinks [Hq] float32; scale defaults to
    Dk**-0.5; block_q: query rows (tokens x G) per tile (BLOCK_ROWS); pages_per_tile: blocks per key tile;
    num_warps, num_stages: the Triton launch (GPU_LAUNCH) -> [N, Hq, Dv] in q's dtype"""
    Dk, v_entry, v_lo, v_hi = prefill_args(q, pool, block_tables, rows, positions, layer, sliding_window, sinks)
    return _paged_prefill(q, pool, block_tables, rows, positions, jnp.asarray(layer, jnp.int32), sinks, k_dim=Dk,
                          v_entry=v_entry, v_lo=v_lo, v_hi=v_hi, scale=Dk ** -0.5 if scale is None else float(scale),
                          window=None if sliding_window is None else int(sliding_window),
                          block_q=block_q or BLOCK_ROWS, ppt=tile_pages(pool.shape[3], pages_per_tile, TILE_TOKENS),
                          interpret=bool(interpret), num_warps=num_warps, num_stages=num_stages, launch=GPU_LAUNCH)


def paged_mla_prefill_attention(q, pool, block_tables, rows, positions, *, layer, kv_lora_rank, scale,
                                interpret=False, block_q=None, pages_per_tile=None, num_warps=None, num_stages=None):
    """MLA prefill attention in the absorbed form over the latent pool, for packed tokens read in place: q
    [N, H, L + R] the tokens' absorbed queries (their own latents already written into the pool); rows, positions,
    block_tables, layer as in `paged_prefill_attention`; pool [NB, layers, 1, block_size, 1, L + R]; kv_lora_rank,
    scale as in `paged_mla_attention` -> [N, H, L] attended latent in q's dtype"""
    mla_prefill_args(q, pool, block_tables, rows, positions, layer, kv_lora_rank)
    _check_mla(q, pool, kv_lora_rank)
    return _paged_prefill(q, pool, block_tables, rows, positions, jnp.asarray(layer, jnp.int32), None,
                          k_dim=q.shape[2], v_entry=0, v_lo=0, v_hi=int(kv_lora_rank), scale=float(scale), window=None,
                          block_q=block_q or MLA_BLOCK_ROWS,
                          ppt=tile_pages(pool.shape[3], pages_per_tile, MLA_TILE_TOKENS),
                          interpret=bool(interpret), num_warps=num_warps, num_stages=num_stages, launch=MLA_LAUNCH)
