"""Paged decode attention (Pallas) over the engine's block pool, GQA and MLA, with pure-jnp references.

The pool (jaxserve/cache/layout.py) keeps one array per full-attention cache group,
    pool [num_blocks, layers_in_group, E, block_size, kv_heads, D]   (block-major: a block holds every layer)
E = 2: K in entry 0 and V in entry 1 (D = Dk = Dv); E = 1: K and V concatenated on D (K = [..., :Dk],
V = [..., Dk:]); MLA: E = 1, one "head" holding the latent (kv_lora_rank) and the rope key, values are the
latent itself. A request's tokens live in the blocks of its block-table row: token t in block
table[t // block_size] at offset t % block_size. The kernels read blocks in place: no gather of the pool.

Grid (B, Hkv, P): program (b, h, p) takes the G = Hq / Hkv query heads of KV head h as a [G, Dk] matrix and
walks partition p of the block table in tiles of `pages_per_tile` blocks (online softmax in float32). GQA
decode prefetches: each program loads the next tile's K and V before it attends over the current one (they ride
in the loop's carry), with one page per tile and one warp (the design that won bench/paged_candidates.py's
sweep on an H200: 2.84 against 2.57 TB/s at 32 requests x 2K, 3.65 against 3.44 at 64 x 8K,
`../shared/gpu/h200-2026-11-28/kernel_tune_candidates.json`); MLA's wide latent keeps its 64-token tiles without
the prefetch (its tile would not fit the carry's registers). A request's own tiles (those its length fills) are
split into up to MAX_PARTITIONS partitions of equal counts, so a table wider than its request (the engine's
tables, as wide as the longest context: one decode program per batch bucket) adds no work and loses no
parallelism (with a window, the tiles it covers are split); an explicit pages_per_partition splits the table's
pages instead (the launch sweeps). The partitions are the split-KV ("flash decoding") form: each returns an
unnormalised (O, m, l) triple and merge.py combines them (BanaServe eqs. 6-10); sinks join the merge as a part
with no value. With a sliding window, tiles wholly before the window are skipped. Slots with length 0 give
zeros. The pool is read as [num_blocks * layers, ...] (block b of layer l at b * L + l) and the layer comes in as
an int32 argument, so it may be traced: one kernel for every layer of a group, and a scan over a run of layers
(models/stack.py) runs it.

The references gather the blocks and attend with jnp. Given `total_blocks` (a static bound on the blocks the
batch holds, sum of ceil(lengths / block_size)), they gather only those, as one ragged list over the batch,
and reduce per request with segment sums: work in proportion to the tokens in the batch, not to B times the
longest request (what the engine runs where the kernels do not compile, e.g. on a CPU). The kernels read the
blocks in place and ignore it.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .flash_attention import NEG, online_softmax_step, pad_group, ref_batched_attention, require_gpu_dims, triton_params
from .merge import add_sinks, merge_partials, normalize

TILE_TOKENS = 16  # GQA decode's keys per tile: pages_per_tile = max(1, TILE_TOKENS // block_size)
MLA_TILE_TOKENS = 64  # MLA's
MAX_PARTITIONS = 4
GPU_LAUNCH = (1, 1)  # GQA decode's Triton warps and pipeline stages (bench/kernel_tune.py --sweeps candidates)
MLA_LAUNCH = (2, 1)  # MLA's
GRID_ORDER = "bph"  # the grid's axes in order (b requests, h KV heads, p partitions); the first varies fastest


def _pow2_parts(n: int) -> tuple:
    """[0, n) as runs of power-of-two widths, widest first: ((lo, width), ...). Triton tiles have power-of-two
    dims, so a key of 576 columns (MLA: latent 512 + rope 64) is read and multiplied as 512 + 64."""
    parts, lo = [], 0
    for bit in reversed(range(n.bit_length())):
        if n >> bit & 1:
            parts.append((lo, 1 << bit))
            lo += 1 << bit
    return tuple(parts)


def _columns(ref, ids, lo: int, width: int, tk: int):
    """Columns [lo, lo + width) of the blocks `ids` of a [NB, bs, D] ref, as [tk, width]: read through the ref
    (a column slice of a loaded tile does not lower to Triton)."""
    if lo == 0 and width == ref.shape[-1]:
        return ref[ids].reshape(tk, width)
    return ref[ids, :, pl.ds(lo, width)].reshape(tk, width)


def split_tiles(n, tok_lo, tk: int, parts: int, p):
    """Partition p of `parts` over the key tiles of tk tokens that a request of n tokens sees from position
    tok_lo on: (first tile, one past its last). The partitions take equal counts, in order; an empty one starts
    and ends at a tile inside the request's table (the prefetching kernel loads its first tile before the loop),
    tile 0 for an empty request."""
    first, tiles = tok_lo // tk, (n + tk - 1) // tk
    per = (tiles - first + parts - 1) // parts
    lo = first + p * per
    hi = jnp.minimum(lo + per, tiles)
    empty = hi <= lo
    lo = jnp.where(empty, jnp.maximum(tiles - 1, 0), lo)
    return lo, jnp.where(empty, lo, hi)


def program_tiles(len_ref, grid_order: str, *, block_size: int, ppt: int, ppp: int | None, window: int | None,
                  parts: int = 1):
    """Inside a paged decode program: (its request's length, the first key position it sees, the first and
    one-past-last tile of its partition that hold keys it sees). ppp: pages per partition; None: the tiles the
    request sees (its window's, with one) split into `parts` partitions of equal counts (a table's width then
    costs nothing)."""
    b, p = pl.program_id(grid_order.index("b")), pl.program_id(grid_order.index("p"))
    n = len_ref[b]
    tok_lo = 0 if window is None else jnp.maximum(n - window, 0)
    if ppp is None:
        return (n, tok_lo) + split_tiles(n, tok_lo, ppt * block_size, parts, p)
    page_lo = jnp.maximum(p * ppp, tok_lo // block_size)
    page_hi = jnp.minimum((p + 1) * ppp, (n + block_size - 1) // block_size)
    tile_lo = page_lo // ppt
    return n, tok_lo, tile_lo, jnp.where(page_hi > page_lo, (page_hi + ppt - 1) // ppt, tile_lo)


def _paged_kernel(layer_ref, len_ref, tbl_ref, q_ref, k_ref, v_ref, o_ref, m_ref, l_ref, *, layers: int,
                  block_size: int, ppt: int, ppp: int | None, parts: int, k_parts: tuple, v_lo: int, v_hi: int,
                  scale: float, window: int | None, grid_order: str, prefetch: bool):
    # layer_ref [1] int32; len_ref [B] int32; tbl_ref [Wp] int32; q_ref [G, Dk];
    # k_ref, v_ref [NB * layers, bs, D] (block b of layer l at b * layers + l); o_ref [G, Dv] float32;
    # m_ref, l_ref [G] float32
    n, tok_lo, tile_lo, tile_hi = program_tiles(len_ref, grid_order, block_size=block_size, ppt=ppt, ppp=ppp,
                                                window=window, parts=parts)
    G, Dv = o_ref.shape
    qs = [q_ref[:, pl.ds(lo, w)] for lo, w in k_parts]
    tk = ppt * block_size
    layer = layer_ref[0]

    def load(j):  # tile j's key column parts [tk, w] and values [tk, Dv]
        ids = tbl_ref[pl.ds(j * ppt, ppt)] * layers + layer
        return tuple(_columns(k_ref, ids, lo, w, tk) for lo, w in k_parts), _columns(v_ref, ids, v_lo, Dv, tk)

    def attend(j, carry, tile):
        ks, v = tile
        s = sum(jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
                for q, k in zip(qs, ks)) * scale
        pos = j * tk + jax.lax.broadcasted_iota(jnp.int32, (1, tk), 1)
        mask = (pos < n) & (pos >= tok_lo)  # [1, tk]
        return online_softmax_step(*carry, s, mask, v)

    init = (jnp.full((G,), NEG, jnp.float32), jnp.zeros((G,), jnp.float32), jnp.zeros((G, Dv), jnp.float32))
    if prefetch:  # the next tile's loads issued before this tile's products (the last reloads its own: L2)
        def body(j, carry):
            ahead = load(jnp.minimum(j + 1, tile_hi - 1))
            return attend(j, carry[:3], carry[3]) + (ahead,)
        m, l, acc, _ = jax.lax.fori_loop(tile_lo, tile_hi, body, init + (load(tile_lo),))
    else:
        m, l, acc = jax.lax.fori_loop(tile_lo, tile_hi, lambda j, c: attend(j, c, load(j)), init)
    o_ref[...], m_ref[...], l_ref[...] = acc, m, l


def tile_pages(block_size: int, pages_per_tile: int | None, tile_tokens: int) -> int:
    """Blocks per key tile: pages_per_tile as given, else enough for tile_tokens (at least one)."""
    return pages_per_tile or max(1, tile_tokens // block_size)


def _pages(block_size: int, W: int, pages_per_tile: int | None, pages_per_partition: int | None,
           tile_tokens: int = TILE_TOKENS):
    ppt = tile_pages(block_size, pages_per_tile, tile_tokens)
    if pages_per_partition is None:
        tiles = -(-W // ppt)
        pages_per_partition = -(-tiles // min(tiles, MAX_PARTITIONS)) * ppt
    if pages_per_partition % ppt:
        raise ValueError(f"pages_per_partition {pages_per_partition} must be a multiple of pages_per_tile {ppt}")
    return ppt, pages_per_partition


def _partitions(block_size: int, W: int, pages_per_tile: int | None, pages_per_partition: int | None,
                tile_tokens: int = TILE_TOKENS) -> tuple[int, int | None, int]:
    """(pages per tile, pages per partition or None, partitions): given pages_per_partition, the table's pages
    in partitions of that many; otherwise (None) each request's own tiles split into up to MAX_PARTITIONS of
    equal counts, so a table wider than its requests (an engine's full tables) adds no work and loses no
    parallelism."""
    if pages_per_partition is not None:
        ppt, ppp = _pages(block_size, W, pages_per_tile, pages_per_partition, tile_tokens)
        return ppt, ppp, -(-W // ppp)
    ppt = tile_pages(block_size, pages_per_tile, tile_tokens)
    return ppt, None, min(-(-W // ppt), MAX_PARTITIONS)


@functools.partial(jax.jit, static_argnames=("k_dim", "v_entry", "v_lo", "v_hi", "scale", "window", "ppt",
                                             "ppp", "parts", "interpret", "num_warps", "num_stages", "grid_order",
                                             "prefetch", "launch"))
def _paged(q, pool, block_tables, lengths, sinks, layer, *, k_dim: int, v_entry: int, v_lo: int, v_hi: int,
           scale: float, window: int | None, ppt: int, ppp: int | None, parts: int, interpret: bool,
           num_warps: int | None = None, num_stages: int | None = None, grid_order: str = GRID_ORDER,
           prefetch: bool = True, launch: tuple = GPU_LAUNCH):
    """q [B, Hq, Dk]; pool [NB, L, E, bs, Hkv, D]; block_tables [B, W]; lengths [B]; sinks [Hq] or None;
    layer [] int32 (traced or not: one kernel for every layer of the group) -> [B, Hq, v_hi - v_lo] in q's dtype"""
    B, Hq, Dk = q.shape
    NB, L, _, bs, Hkv, D = pool.shape
    qg, G_out = pad_group(q.reshape(B, Hkv, Hq // Hkv, Dk), 2)  # [B, Hkv, G, Dk], G a power of two
    G, Dv = qg.shape[2], v_hi - v_lo
    W = block_tables.shape[1]
    P = parts
    Wp = P * ppp if ppp is not None else -(-W // ppt) * ppt  # the table padded to whole partitions, or tiles
    k_parts = _pow2_parts(k_dim)
    if not interpret:
        require_gpu_dims("paged attention", tile_tokens=ppt * bs, value_width=Dv,
                         **{f"key_columns_{lo}_{lo + w}": w for lo, w in k_parts})
    table = jnp.pad(block_tables.astype(jnp.int32), [(0, 0), (0, Wp - W)])
    flat = pool.reshape((NB * L,) + pool.shape[2:])  # [NB * L, E, bs, Hkv, D]: block b of layer l at b * L + l
    if sorted(grid_order) != ["b", "h", "p"]:
        raise ValueError(f"grid_order must order the letters b, h and p, got {grid_order!r}")
    kernel = functools.partial(_paged_kernel, layers=L, block_size=bs, ppt=ppt, ppp=ppp, parts=P, k_parts=k_parts,
                               v_lo=v_lo, v_hi=v_hi, scale=scale, window=window, grid_order=grid_order,
                               prefetch=prefetch)

    def at(f):  # an index map over (b, h, p) as one over the grid's axes
        return lambda *ids: f(*(ids[grid_order.index(c)] for c in "bhp"))
    o, m, l = pl.pallas_call(
        kernel,
        grid=tuple({"b": B, "h": Hkv, "p": P}[c] for c in grid_order),
        in_specs=[
            pl.BlockSpec((1,), at(lambda b, h, p: (0,))),
            pl.BlockSpec((B,), at(lambda b, h, p: (0,))),
            pl.BlockSpec((None, Wp), at(lambda b, h, p: (b, 0))),
            pl.BlockSpec((None, None, G, Dk), at(lambda b, h, p: (b, h, 0, 0))),
            pl.BlockSpec((NB * L, None, bs, None, D), at(lambda b, h, p: (0, 0, 0, h, 0))),
            pl.BlockSpec((NB * L, None, bs, None, D), at(lambda b, h, p: (0, v_entry, 0, h, 0))),
        ],
        out_specs=[
            pl.BlockSpec((None, None, None, G, Dv), at(lambda b, h, p: (b, h, p, 0, 0))),
            pl.BlockSpec((None, None, None, G), at(lambda b, h, p: (b, h, p, 0))),
            pl.BlockSpec((None, None, None, G), at(lambda b, h, p: (b, h, p, 0))),
        ],
        out_shape=[jax.ShapeDtypeStruct((B, Hkv, P, G, Dv), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hkv, P, G), jnp.float32),
                   jax.ShapeDtypeStruct((B, Hkv, P, G), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages, launch),
        name="paged_attention",
    )(jnp.reshape(layer, (1,)).astype(jnp.int32), lengths.astype(jnp.int32), table, qg, flat, flat)
    o, m, l = merge_partials(o[..., :G_out, :], m[..., :G_out], l[..., :G_out], axis=2)  # [B, Hkv, G_out, (Dv)]
    if sinks is not None:
        o, m, l = add_sinks(o, m, l, sinks.reshape(1, Hkv, G_out))
    return normalize(o, l).reshape(B, Hq, Dv).astype(q.dtype)


def _views(q, pool, block_tables, lengths, layer):
    """Validate and return (E, Dk, D)."""
    if pool.ndim != 6:
        raise ValueError(f"pool must be [num_blocks, layers, E, block_size, kv_heads, D], got {pool.shape}")
    if q.ndim != 3:
        raise ValueError(f"q must be [B, Hq, Dk], got {q.shape}")
    B = q.shape[0]
    if block_tables.ndim != 2 or block_tables.shape[0] != B or lengths.shape != (B,):
        raise ValueError(f"block_tables must be [{B}, W] and lengths [{B}], got {block_tables.shape}, {lengths.shape}")
    if isinstance(layer, int) and not 0 <= layer < pool.shape[1]:  # a traced index (a scan over layers): unchecked
        raise ValueError(f"layer {layer} outside the group's {pool.shape[1]} layers")
    if q.dtype != pool.dtype:
        raise ValueError(f"q dtype {q.dtype} differs from the pool's {pool.dtype}")
    if q.shape[1] % pool.shape[4]:
        raise ValueError(f"query heads {q.shape[1]} are not a multiple of KV heads {pool.shape[4]}")
    return pool.shape[2], q.shape[2], pool.shape[5]


def _gqa_layout(E: int, Dk: int, D: int):
    """(v_entry, v_lo, v_hi) of a GQA group."""
    if E == 2:
        if Dk != D:
            raise ValueError(f"q head dim {Dk} differs from the pool's {D}")
        return 1, 0, D
    if E == 1 and Dk < D:
        return 0, Dk, D
    raise ValueError(f"a GQA pool has E=2, or E=1 with K|V concatenated on D; got E={E}, D={D}, Dk={Dk}")


def gqa_args(q, pool, block_tables, lengths, layer, sliding_window, sinks):
    """Validate a GQA paged-attention call (every kernel's) -> (Dk, v_entry, v_lo, v_hi)."""
    E, Dk, D = _views(q, pool, block_tables, lengths, layer)
    if sinks is not None and sinks.shape != (q.shape[1],):
        raise ValueError(f"sinks must be [{q.shape[1]}], got {sinks.shape}")
    if sliding_window is not None and int(sliding_window) < 1:
        raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
    return (Dk,) + _gqa_layout(E, Dk, D)


def paged_attention(q, pool, block_tables, lengths, *, layer, sliding_window=None, sinks=None, scale=None,
                    interpret=False, pages_per_tile=None, pages_per_partition=None, num_warps=None, num_stages=None,
                    total_blocks=None, grid_order=GRID_ORDER):
    """Decode attention, one query token per request, K/V read through block tables.

    q [B, Hq, Dk]; pool [NB, L, E, block_size, Hkv, D] one full group of the engine's pool; block_tables [B, W]
    int32; lengths [B] int32 tokens in the cache including the query's own (it sits at position lengths - 1;
    0 marks an empty slot); layer: index within the group (an int, or a traced int32 scalar: a scan over the
    group's layers); sliding_window: the query sees the last `sliding_window` positions including itself;
    sinks [Hq] float32; scale defaults to Dk**-0.5;
    num_warps, num_stages: the Triton launch parameters on a GPU (None: GPU_LAUNCH, swept on an H200);
    grid_order: the order of the launch grid's axes (GRID_ORDER); total_blocks: read by the reference only (see
    the module docstring)
    -> [B, Hq, Dv] in q's dtype
    """
    del total_blocks
    Dk, v_entry, v_lo, v_hi = gqa_args(q, pool, block_tables, lengths, layer, sliding_window, sinks)
    ppt, ppp, parts = _partitions(pool.shape[3], block_tables.shape[1], pages_per_tile, pages_per_partition)
    return _paged(q, pool, block_tables, lengths, sinks, jnp.asarray(layer, jnp.int32), k_dim=Dk, v_entry=v_entry,
                  v_lo=v_lo, v_hi=v_hi, scale=Dk ** -0.5 if scale is None else float(scale),
                  window=None if sliding_window is None else int(sliding_window), ppt=ppt, ppp=ppp, parts=parts,
                  interpret=bool(interpret), num_warps=num_warps, num_stages=num_stages, grid_order=grid_order)


def _dense_view(pool, block_tables, lengths, layer):
    """Reference gather: pool blocks -> ([B, W*bs, E, Hkv, D], k_pos [B, W*bs])."""
    B, W = block_tables.shape
    bs = pool.shape[3]
    x = pool[block_tables, layer]  # [B, W, E, bs, Hkv, D]
    x = jnp.swapaxes(x, 2, 3).reshape((B, W * bs) + x.shape[2:3] + pool.shape[4:])
    return x, jnp.broadcast_to(jnp.arange(W * bs, dtype=jnp.int32), (B, W * bs))


def _ragged_view(pool, block_tables, lengths, layer, total_blocks: int, parts):
    """Ragged reference gather: the first ceil(lengths[b] / bs) blocks of every row, in row order, into one
    list of `total_blocks` (padded). parts: (entry, lo, hi) column ranges to gather, each kept in the pool's
    token-major order (no transposes: the products below take every head against every key of a block)
    -> ([x [M, bs * Hkv, hi - lo] per part], row [M] int32, k_pos [M, bs], k_valid [M, bs])."""
    B, W = block_tables.shape
    bs, Hkv = pool.shape[3], pool.shape[4]
    counts = (lengths + bs - 1) // bs
    ends = jnp.cumsum(counts)
    j = jnp.arange(total_blocks, dtype=jnp.int32)
    row = jnp.minimum(jnp.searchsorted(ends, j, side="right"), B - 1).astype(jnp.int32)
    k = j - (ends - counts)[row]  # block index within its row
    blk = block_tables[row, jnp.clip(k, 0, W - 1)]
    xs = [pool[blk, layer, e, :, :, lo:hi].reshape(total_blocks, bs * Hkv, hi - lo) for e, lo, hi in parts]
    k_pos = k[:, None] * bs + jnp.arange(bs, dtype=jnp.int32)[None, :]
    return xs, row, k_pos, (j < ends[-1])[:, None] & (k_pos < lengths[row][:, None])


def _ragged_attend(q, k, v, row, k_pos, k_valid, lengths, *, scale, window, sinks):
    """q [B, Hq, Dk]; k [M, bs * Hkv, Dk], v [M, bs * Hkv, Dv] the ragged blocks of rows `row` [M] (token-major,
    heads inner); k_pos, k_valid [M, bs] -> [B, Hq, Dv] in q's dtype (softmax in float32 per request over its
    blocks). Every query head meets every key of its block and the other heads' keys are masked: Hkv times
    the products' work, which on a CPU costs less than the transposes that a per-head product needs."""
    B, Hq, Dk = q.shape
    bs = k_pos.shape[1]
    Hkv = k.shape[1] // bs
    # each block's query row by a one-hot product, not a gather: XLA fuses a gather with q's producers (rope's
    # sin and cos) and computes them again for every block
    one_hot = (row[:, None] == jnp.arange(B, dtype=row.dtype)[None, :]).astype(q.dtype)  # [M, B]
    q_blocks = jnp.einsum("mb,bqd->mqd", one_hot, q, precision=jax.lax.Precision.HIGHEST)  # exact: a copy
    s = jnp.einsum("mqd,mnd->mqn", q_blocks, k, preferred_element_type=jnp.float32) * scale  # [M, Hq, bs * Hkv]
    valid = k_valid
    if window is not None:
        valid = valid & (k_pos > (lengths - 1 - window)[row][:, None])
    own = (jnp.arange(Hq)[:, None] // (Hq // Hkv)) == (jnp.arange(bs * Hkv)[None, :] % Hkv)  # [Hq, bs * Hkv]
    mask = own[None] & jnp.repeat(valid, Hkv, axis=1)[:, None, :]
    s = jnp.where(mask, s, NEG)
    m = jax.ops.segment_max(s.max(-1), row, B, indices_are_sorted=True)  # [B, Hq]
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32))
    p = jnp.where(mask, jnp.exp(s - m[row][..., None]), 0.0)
    den = jax.ops.segment_sum(p.sum(-1), row, B, indices_are_sorted=True)
    if sinks is not None:
        den = den + jnp.exp(sinks.astype(jnp.float32) - m)
    o = jax.ops.segment_sum(jnp.einsum("mqn,mnd->mqd", p.astype(v.dtype), v, preferred_element_type=jnp.float32),
                            row, B, indices_are_sorted=True)  # [B, Hq, Dv]
    return (o / jnp.where(den > 0, den, 1.0)[..., None]).astype(q.dtype)


def ref_paged_attention(q, pool, block_tables, lengths, *, layer, sliding_window=None, sinks=None, scale=None,
                        interpret=False, pages_per_tile=None, pages_per_partition=None, num_warps=None,
                        num_stages=None, total_blocks=None, grid_order=GRID_ORDER):
    """Gather-then-attend reference of `paged_attention`, same arguments and result (ragged with total_blocks)."""
    del interpret, pages_per_tile, pages_per_partition, num_warps, num_stages, grid_order
    E, Dk, D = _views(q, pool, block_tables, lengths, layer)
    v_entry, v_lo, v_hi = _gqa_layout(E, Dk, D)
    scale = Dk ** -0.5 if scale is None else scale
    if total_blocks is not None:
        (k, v), row, k_pos, k_valid = _ragged_view(pool, block_tables, lengths, layer, int(total_blocks),
                                                   [(0, 0, Dk), (v_entry, v_lo, v_hi)])
        return _ragged_attend(q, k, v, row, k_pos, k_valid, lengths, scale=scale, window=sliding_window, sinks=sinks)
    x, k_pos = _dense_view(pool, block_tables, lengths, layer)
    k, v = x[:, :, 0, :, :Dk], x[:, :, v_entry, :, v_lo:v_hi]
    out = ref_batched_attention(q[:, None], k, v, (lengths - 1)[:, None], k_pos, k_pos < lengths[:, None],
                                scale=scale, window=sliding_window, sinks=sinks)
    return out[:, 0]


def _per_row(q, block_tables, rows, positions):
    """Check a paged prefill call's tokens -> (q as one token per table row [B, ...], lengths [B]): what the
    decode checks (_views) take to check the pool and the table."""
    N = q.shape[0] if q.ndim == 3 else -1
    if rows.shape != (N,) or positions.shape != (N,):
        raise ValueError(f"rows and positions must be [{N}] (one per query token), got {rows.shape}, {positions.shape}")
    B = block_tables.shape[0]
    return jnp.zeros((B,) + q.shape[1:], q.dtype), jnp.zeros((B,), jnp.int32)


def prefill_args(q, pool, block_tables, rows, positions, layer, sliding_window, sinks):
    """Validate a paged prefill call -> (Dk, v_entry, v_lo, v_hi)."""
    q1, lengths = _per_row(q, block_tables, rows, positions)
    return gqa_args(q1, pool, block_tables, lengths, layer, sliding_window, sinks)


def mla_prefill_args(q, pool, block_tables, rows, positions, layer, kv_lora_rank) -> None:
    """Validate a paged MLA prefill call."""
    q1, lengths = _per_row(q, block_tables, rows, positions)
    _views(q1, pool, block_tables, lengths, layer)
    _check_mla(q, pool, kv_lora_rank)


def ref_paged_prefill_attention(q, pool, block_tables, rows, positions, *, layer, sliding_window=None, sinks=None,
                                scale=None):
    """Prefill attention over the pool for a packed step: q [N, Hq, Dk] the step's tokens (their own K/V already
    written into the pool), rows [N] int32 each token's block-table row (outside [0, B): padding, zeros out),
    positions [N] int32 each token's position (it sees its row's tokens up to and including it, the last
    `sliding_window` of them with a window); pool, block_tables [B, W], layer, sinks, scale as in
    `paged_attention` -> [N, Hq, Dv] in q's dtype. Gathers each token's row of the dense view: a reference for
    tests, [N, W * block_size] keys."""
    Dk, v_entry, v_lo, v_hi = prefill_args(q, pool, block_tables, rows, positions, layer, sliding_window, sinks)
    return _ref_prefill(q, pool, block_tables, rows, positions, layer, Dk, v_entry, v_lo, v_hi,
                        Dk ** -0.5 if scale is None else scale, sliding_window, sinks)


def ref_paged_mla_prefill_attention(q, pool, block_tables, rows, positions, *, layer, kv_lora_rank, scale):
    """MLA prefill attention in the absorbed form over the latent pool, for packed tokens: q [N, H, L + R] the
    tokens' absorbed queries (their own latents already written into the pool); rows [N], positions [N] as in
    `paged_prefill_attention` (padding: zeros out); pool, block_tables [B, W], layer, kv_lora_rank, scale as in
    `paged_mla_attention` -> [N, H, L] attended latent in q's dtype. Gathers each token's row of the dense view:
    a reference for tests."""
    mla_prefill_args(q, pool, block_tables, rows, positions, layer, kv_lora_rank)
    return _ref_prefill(q, pool, block_tables, rows, positions, layer, pool.shape[5], 0, 0, int(kv_lora_rank),
                        scale, None, None)


def _ref_prefill(q, pool, block_tables, rows, positions, layer, Dk, v_entry, v_lo, v_hi, scale, window, sinks):
    """The prefill references' attention: K the first Dk columns of entry 0, V columns v_lo:v_hi of v_entry."""
    B = block_tables.shape[0]
    x, k_pos = _dense_view(pool, block_tables, None, layer)  # [B, S, E, Hkv, D]
    real = (rows >= 0) & (rows < B)
    r = jnp.clip(rows, 0, B - 1)
    k, v = x[r, :, 0, :, :Dk], x[r, :, v_entry, :, v_lo:v_hi]  # [N, S, Hkv, *]
    out = ref_batched_attention(q[:, None], k, v, positions[:, None], k_pos[r], k_pos[r] <= positions[:, None],
                                scale=scale, window=window, sinks=sinks)
    return jnp.where(real[:, None, None], out[:, 0], 0).astype(q.dtype)


def _check_mla(q, pool, kv_lora_rank):
    if pool.shape[2] != 1 or pool.shape[4] != 1:
        raise ValueError(f"an MLA pool has E=1 and one head, got {pool.shape}")
    if q.shape[2] != pool.shape[5] or not 0 < kv_lora_rank < pool.shape[5]:
        raise ValueError(f"q width {q.shape[2]} must equal the pool's latent+rope width {pool.shape[5]}, "
                         f"with kv_lora_rank {kv_lora_rank} inside it")


def paged_mla_attention(q, pool, block_tables, lengths, *, layer, kv_lora_rank, scale, interpret=False,
                        pages_per_tile=None, pages_per_partition=None, total_blocks=None):
    """MLA decode attention in the absorbed form over the latent cache.

    q [B, H, L + R]: the query projected into the latent space (q_nope @ W_UK) followed by its rope part;
    pool [NB, layers, 1, block_size, 1, L + R] latent (L = kv_lora_rank) + rope key per token; block_tables,
    lengths, layer, total_blocks as in `paged_attention`; scale: the model's softmax scale (of the unabsorbed head
    dim) -> [B, H, L] attended latent in q's dtype (the value up-projection W_UV is applied by the caller)
    """
    del total_blocks
    _views(q, pool, block_tables, lengths, layer)
    _check_mla(q, pool, kv_lora_rank)
    ppt, ppp, parts = _partitions(pool.shape[3], block_tables.shape[1], pages_per_tile, pages_per_partition,
                                  MLA_TILE_TOKENS)
    return _paged(q, pool, block_tables, lengths, None, jnp.asarray(layer, jnp.int32), k_dim=q.shape[2], v_entry=0,
                  v_lo=0, v_hi=int(kv_lora_rank), scale=float(scale), window=None, ppt=ppt, ppp=ppp, parts=parts,
                  interpret=bool(interpret), grid_order="bhp", prefetch=False, launch=MLA_LAUNCH)


def ref_paged_mla_attention(q, pool, block_tables, lengths, *, layer, kv_lora_rank, scale, interpret=False,
                            pages_per_tile=None, pages_per_partition=None, total_blocks=None):
    """Gather-then-attend reference of `paged_mla_attention`, same arguments and result (ragged with
    total_blocks)."""
    del interpret, pages_per_tile, pages_per_partition
    _views(q, pool, block_tables, lengths, layer)
    _check_mla(q, pool, kv_lora_rank)
    if total_blocks is not None:
        (kv, v), row, k_pos, k_valid = _ragged_view(pool, block_tables, lengths, layer, int(total_blocks),
                                                    [(0, 0, pool.shape[5]), (0, 0, int(kv_lora_rank))])
        return _ragged_attend(q, kv, v, row, k_pos, k_valid, lengths, scale=scale, window=None, sinks=None)
    x, k_pos = _dense_view(pool, block_tables, lengths, layer)
    kv = x[:, :, 0]  # [B, S, 1, L + R]
    out = ref_batched_attention(q[:, None], kv, kv[..., :kv_lora_rank], (lengths - 1)[:, None], k_pos,
                                k_pos < lengths[:, None], scale=scale)
    return out[:, 0]
