"""Flash attention (Pallas) for prefill, and its pure-jnp references.

Two entry points share one kernel:
  flash_attention(q, k, v, *, cu_seqlens, ...)       sequences packed along T (the varlen contract)
  batched_attention(q, k, v, q_pos, k_pos, k_valid, *, ...)
                                                     B rows of queries against a key cache with explicit
                                                     positions: the models' dense-cache path (full caches,
                                                     sliding-window rings, the MLA latent cache)
Compiled on a Hopper GPU, the packed entry point hands the calls flash_attention_hopper.py covers (causal, no
window or sinks, 16-bit, head dim a multiple of 64 up to 256) to that Mosaic GPU kernel (TMA, wgmma, warp
specialisation); this Triton kernel takes the rest, and the batched entry point.

The kernel sees every query and key as (segment, position). A key is visible to a query when the segments
match, k_pos <= q_pos (causal) and k_pos > q_pos - window (the window counts the query itself).

GQA without repeating K/V: the G = Hq / Hkv query heads of one KV head are laid out as G consecutive rows
per token, so a tile of `block_q` tokens is a [block_q * G, Dk] matrix multiplied against [block_k, Dk]
keys of that KV head, which are read straight from the [B, S, Hkv, D] array. Grid (B, Hkv, query tiles);
each program loops over key tiles with an online softmax in float32 (running max m, denominator l,
numerator acc). Sinks start (m, l) at (sink, 1): the sink's exp joins the denominator and adds no value.
The key-tile loop runs over [lo, hi) only: the tiles whose position/segment ranges can hold visible keys,
computed outside the kernel from per-tile min/max.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plt

NEG = -1e30  # finite "minus infinity": masked scores, and m before any key
BLOCK_Q_ROWS = 64  # query rows (tokens x G) per tile
BLOCK_K = 64  # keys per tile
GPU_LAUNCH = (4, 2)  # Triton warps and pipeline stages
GPU_MIN_DIM = 16  # Triton's smallest matmul dimension
_BIG = 2 ** 30


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def pad_group(x, axis: int):
    """x with a GQA group axis (the query heads of one KV head) at `axis` -> (x with that axis padded with zeros
    to a power of two, the group's size). Triton tiles have power-of-two dims, so a group of 3 (SmolLM2's 9
    query heads over 3 KV heads) runs as 4 rows, the fourth a zero query whose output is dropped."""
    G = x.shape[axis]
    pad = [(0, 0)] * x.ndim
    pad[axis] = (0, _pow2(G) - G)
    return jnp.pad(x, pad), G


def require_gpu_dims(what: str, **dims: int) -> None:
    """Compiled (not interpreted) kernels lower through Pallas' Triton backend: every array a kernel body
    touches has power-of-two dims, and a matmul's dims are at least GPU_MIN_DIM (smaller ones give wrong
    numbers). A ValueError names the dim that is not; the self-test (check.py) then runs the reference."""
    for name, n in dims.items():
        if n < GPU_MIN_DIM or n & (n - 1):
            raise ValueError(f"{what} compiled for the GPU needs {name} a power of two >= {GPU_MIN_DIM}, got {n}")


# ------------------------------------------------------------------------------------------------ kernel

def online_softmax_step(m, l, acc, s, mask, v):
    """One key tile of an online softmax, inside a kernel body: running max m [R], denominator l [R] and
    numerator acc [R, Dv] (float32) updated with scores s [R, K] float32, visibility mask [R, K] (or broadcastable)
    and values v [K, Dv]."""
    s = jnp.where(mask, s, NEG)
    m_new = jnp.maximum(m, s.max(axis=1))
    p = jnp.where(mask, jnp.exp(s - m_new[:, None]), 0.0)
    c = jnp.exp(m - m_new)
    return m_new, c * l + p.sum(axis=1), c[:, None] * acc + jnp.dot(p.astype(v.dtype), v,
                                                                    preferred_element_type=jnp.float32)


def _flash_kernel(lo_ref, hi_ref, q_ref, k_ref, v_ref, qpos_ref, qseg_ref, kpos_ref, kseg_ref, sink_ref, o_ref, *,
                  block_k: int, scale: float, causal: bool, window: int | None, has_sinks: bool):
    # lo_ref, hi_ref [NQ] int32; q_ref [R, Dk]; k_ref [Sp, Dk]; v_ref [Sp, Dv]; qpos_ref, qseg_ref [R];
    # kpos_ref, kseg_ref [Sp]; sink_ref [R] float32; o_ref [R, Dv]
    i = pl.program_id(2)
    q = q_ref[...]
    qpos, qseg = qpos_ref[...], qseg_ref[...]
    R, Dv = o_ref.shape
    m0 = sink_ref[...].astype(jnp.float32) if has_sinks else jnp.full((R,), NEG, jnp.float32)
    l0 = jnp.full((R,), 1.0 if has_sinks else 0.0, jnp.float32)

    def body(j, carry):
        m, l, acc = carry
        sl = pl.ds(j * block_k, block_k)
        k, v = k_ref[sl, :], v_ref[sl, :]
        kpos, kseg = kpos_ref[sl], kseg_ref[sl]
        s = jax.lax.dot_general(q, k, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32) * scale
        mask = qseg[:, None] == kseg[None, :]
        if causal:
            mask = mask & (kpos[None, :] <= qpos[:, None])
        if window is not None:
            mask = mask & (kpos[None, :] > qpos[:, None] - window)
        return online_softmax_step(m, l, acc, s, mask, v)

    m, l, acc = jax.lax.fori_loop(lo_ref[i], hi_ref[i], body, (m0, l0, jnp.zeros((R, Dv), jnp.float32)))
    out = acc / jnp.where(l > 0, l, 1.0)[:, None]
    o_ref[...] = out.astype(o_ref.dtype)


def _tile_ranges(q_pos, q_seg, k_pos, k_seg, bq: int, bk: int, causal: bool, window: int | None):
    """Key tiles each query tile must visit: (lo [B, NQ], hi [B, NQ]) int32, lo == hi when none.

    q_pos, q_seg [B, Tp]; k_pos, k_seg [B, Sp]; a negative segment marks padding."""
    B = q_pos.shape[0]

    def rng(x, valid, n):  # per-tile (min, max) over valid entries; (BIG, -BIG) for an empty tile
        lo = jnp.where(valid, x, _BIG).reshape(B, -1, n).min(-1)
        hi = jnp.where(valid, x, -_BIG).reshape(B, -1, n).max(-1)
        return lo, hi

    qv, kv = q_seg >= 0, k_seg >= 0
    qp0, qp1 = rng(q_pos, qv, bq)
    qs0, qs1 = rng(q_seg, qv, bq)
    kp0, kp1 = rng(k_pos, kv, bk)
    ks0, ks1 = rng(k_seg, kv, bk)
    need = (qs0[:, :, None] <= ks1[:, None, :]) & (ks0[:, None, :] <= qs1[:, :, None])
    if causal:
        need = need & (kp0[:, None, :] <= qp1[:, :, None])
    if window is not None:
        need = need & (kp1[:, None, :] > qp0[:, :, None] - window)
    nk = need.shape[-1]
    idx = jnp.arange(nk, dtype=jnp.int32)
    hi = jnp.where(need, idx + 1, 0).max(-1)
    lo = jnp.minimum(jnp.where(need, idx, nk).min(-1), hi)
    return lo.astype(jnp.int32), hi.astype(jnp.int32)


def triton_params(interpret: bool, num_warps: int | None, num_stages: int | None, default: tuple[int, int]):
    """pallas_call's compiler_params for the Triton lowering: the given warps and stages, each defaulting to
    `default` (the kernel's best on an H100 in bench/results/kernel_tune_h100.json); None when interpreting."""
    if interpret:
        return None
    return plt.CompilerParams(num_warps=num_warps or default[0], num_stages=num_stages or default[1])


@functools.partial(jax.jit, static_argnames=("scale", "causal", "window", "block_q", "block_k", "interpret",
                                             "num_warps", "num_stages"))
def _flash(q, k, v, q_pos, q_seg, k_pos, k_seg, sinks, *, scale: float, causal: bool, window: int | None,
           block_q: int, block_k: int, interpret: bool, num_warps: int | None = None, num_stages: int | None = None):
    """q [B, T, Hq, Dk]; k [B, S, Hkv, Dk]; v [B, S, Hkv, Dv]; q_pos, q_seg [B, T]; k_pos, k_seg [B, S] int32
    (segment < 0: padding); sinks [Hq] float32 or None; block_q tokens and block_k keys per tile
    -> [B, T, Hq, Dv] (zeros for queries that see no key)"""
    B, T, Hq, Dk = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    q, G_out = pad_group(q.reshape(B, T, Hkv, Hq // Hkv, Dk), 3)  # query rows of a power-of-two group
    Dv_out, G = Dv, q.shape[3]
    q = q.reshape(B, T, Hkv * G, Dk)
    if sinks is not None:
        sinks = pad_group(sinks.reshape(Hkv, G_out), 1)[0].reshape(Hkv * G)
    bq, bk = min(block_q, _pow2(T)), min(block_k, _pow2(S))
    if not interpret:  # Triton: power-of-two tiles of at least 16 rows and keys, head dims padded with zeros
        floor2 = lambda n: 1 << (n.bit_length() - 1)  # noqa: E731  (a block_q or block_k not a power of two)
        bq, bk = max(floor2(bq), -(-GPU_MIN_DIM // G)), max(floor2(bk), GPU_MIN_DIM)
        Dkp, Dvp = max(GPU_MIN_DIM, _pow2(Dk)), max(GPU_MIN_DIM, _pow2(Dv))
        q, k = (jnp.pad(x, [(0, 0)] * 3 + [(0, Dkp - Dk)]) for x in (q, k))
        v = jnp.pad(v, [(0, 0)] * 3 + [(0, Dvp - Dv)])
        Dk, Dv = Dkp, Dvp
    Tp, Sp = -(-T // bq) * bq, -(-S // bk) * bk
    pad_t, pad_s = [(0, 0), (0, Tp - T)], [(0, 0), (0, Sp - S)]
    q = jnp.pad(q, pad_t + [(0, 0), (0, 0)])
    q_pos, q_seg = jnp.pad(q_pos, pad_t), jnp.pad(q_seg, pad_t, constant_values=-2)
    k = jnp.pad(k, pad_s + [(0, 0), (0, 0)])
    v = jnp.pad(v, pad_s + [(0, 0), (0, 0)])
    k_pos, k_seg = jnp.pad(k_pos, pad_s), jnp.pad(k_seg, pad_s, constant_values=-1)
    lo, hi = _tile_ranges(q_pos, q_seg, k_pos, k_seg, bq, bk, causal, window)
    NQ, R = Tp // bq, bq * G
    # query rows: token-major, the G heads of one KV head consecutive
    qr = q.reshape(B, Tp, Hkv, G, Dk).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, Tp * G, Dk)
    qpos_r, qseg_r = jnp.repeat(q_pos, G, axis=1), jnp.repeat(q_seg, G, axis=1)
    sink_r = (jnp.tile(sinks.astype(jnp.float32).reshape(Hkv, G), (1, bq)) if sinks is not None
              else jnp.zeros((Hkv, R), jnp.float32))
    kernel = functools.partial(_flash_kernel, block_k=bk, scale=scale, causal=causal, window=window,
                               has_sinks=sinks is not None)
    out = pl.pallas_call(
        kernel,
        grid=(B, Hkv, NQ),
        in_specs=[
            pl.BlockSpec((None, NQ), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, NQ), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, None, R, Dk), lambda b, h, i: (b, h, i, 0)),
            pl.BlockSpec((None, Sp, None, Dk), lambda b, h, i: (b, 0, h, 0)),
            pl.BlockSpec((None, Sp, None, Dv), lambda b, h, i: (b, 0, h, 0)),
            pl.BlockSpec((None, R), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, R), lambda b, h, i: (b, i)),
            pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, Sp), lambda b, h, i: (b, 0)),
            pl.BlockSpec((None, R), lambda b, h, i: (h, 0)),
        ],
        out_specs=pl.BlockSpec((None, None, R, Dv), lambda b, h, i: (b, h, i, 0)),
        out_shape=jax.ShapeDtypeStruct((B, Hkv, Tp * G, Dv), q.dtype),
        interpret=interpret,
        compiler_params=triton_params(interpret, num_warps, num_stages, GPU_LAUNCH),
        name="flash_attention",
    )(lo, hi, qr, k, v, qpos_r, qseg_r, k_pos, k_seg, sink_r)
    out = out.reshape(B, Hkv, Tp, G, Dv)[:, :, :T, :G_out, :Dv_out]
    return out.transpose(0, 2, 1, 3, 4).reshape(B, T, Hq, Dv_out)


# ------------------------------------------------------------------------------------------------ checks

def _check_qkv(q, k, v, sinks, lead: int):
    """Shapes of q [..., Tq, Hq, Dk], k [..., S, Hkv, Dk], v [..., S, Hkv, Dv] with `lead` leading dims."""
    if q.ndim != lead + 3 or k.ndim != lead + 3 or v.ndim != lead + 3:
        raise ValueError(f"q, k, v must have {lead + 3} dims, got {q.shape}, {k.shape}, {v.shape}")
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k {k.shape} and v {v.shape} differ before the head dim")
    if q.shape[:lead] != k.shape[:lead] or q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q {q.shape} and k {k.shape} disagree on batch or head dim")
    Hq, Hkv = q.shape[-2], k.shape[-2]
    if Hq % Hkv:
        raise ValueError(f"query heads {Hq} are not a multiple of KV heads {Hkv}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ: {q.dtype}, {k.dtype}, {v.dtype}")
    if sinks is not None and sinks.shape != (Hq,):
        raise ValueError(f"sinks must be [{Hq}], got {sinks.shape}")


def _check_window(sliding_window, causal=True):
    if sliding_window is not None:
        if int(sliding_window) < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        if not causal:
            raise ValueError("sliding_window needs causal=True")


def _packed_meta(T: int, cu_seqlens):
    """Segment of each packed token (-1 past cu_seqlens[-1]) and its position: ([T], [T]) int32."""
    t = jnp.arange(T, dtype=jnp.int32)
    seg = jnp.searchsorted(cu_seqlens[1:], t, side="right").astype(jnp.int32)
    return jnp.where(t < cu_seqlens[-1], seg, -1), t


# ------------------------------------------------------------------------------------------------ public

def flash_attention(q, k, v, *, cu_seqlens, causal=True, sliding_window=None, sinks=None, scale=None,
                    interpret=False, block_q: int = BLOCK_Q_ROWS, block_k: int = BLOCK_K, num_warps=None,
                    num_stages=None, hopper: bool | None = None):
    """Prefill attention over sequences packed along T.

    q [T, Hq, Dk]; k [T, Hkv, Dk]; v [T, Hkv, Dv]; cu_seqlens [B+1] int32 (sequence b is tokens
    cu_seqlens[b]:cu_seqlens[b+1]); sliding_window: a query sees the last `sliding_window` positions including
    itself; sinks [Hq] float32 per-head logits joining the softmax denominator; scale defaults to Dk**-0.5
    -> out [T, Hq, Dv] (zeros for tokens past cu_seqlens[-1]). block_q counts query rows (tokens x G);
    num_warps, num_stages: the Triton launch parameters on a GPU (None: GPU_LAUNCH, tuned on an H100).
    hopper: compiled on a Hopper GPU, the calls flash_attention_hopper.py covers run its Mosaic GPU kernel
    (None or True; True refuses a call it does not cover), False keeps the Triton kernel.
    """
    _check_qkv(q, k, v, sinks, 0)
    _check_window(sliding_window, causal)
    if cu_seqlens.ndim != 1 or cu_seqlens.shape[0] < 2:
        raise ValueError(f"cu_seqlens must be [B+1] with B >= 1, got {cu_seqlens.shape}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q has {q.shape[0]} tokens and k {k.shape[0]}; packed attention needs the same T")
    T, Hq, Dk = q.shape
    if not interpret and hopper is not False:
        from . import flash_attention_hopper as fh
        why = fh.unsupported(q, k, v, causal=causal, sliding_window=sliding_window, sinks=sinks)
        if why is None and fh.is_hopper():
            return fh.hopper_flash_attention(q, k, v, cu_seqlens, scale=Dk ** -0.5 if scale is None else float(scale))
        if hopper:
            raise ValueError(f"the Hopper flash attention compiled for the GPU cannot take this call: "
                             f"{why or 'not a Hopper GPU'}")
    G = Hq // k.shape[1]
    seg, pos = _packed_meta(T, cu_seqlens.astype(jnp.int32))
    q_seg = jnp.where(seg >= 0, seg, -2)  # padding queries match no key
    scale = Dk ** -0.5 if scale is None else float(scale)
    out = _flash(q[None], k[None], v[None], pos[None], q_seg[None], pos[None], seg[None], sinks, scale=scale,
                 causal=bool(causal), window=None if sliding_window is None else int(sliding_window),
                 block_q=max(1, block_q // _pow2(G)), block_k=block_k, interpret=bool(interpret), num_warps=num_warps,
                 num_stages=num_stages)
    return out[0]


def ref_flash_attention(q, k, v, *, cu_seqlens, causal=True, sliding_window=None, sinks=None, scale=None,
                        interpret=False, block_q: int = BLOCK_Q_ROWS, block_k: int = BLOCK_K, num_warps=None,
                        num_stages=None, hopper: bool | None = None):
    """Dense-mask reference of `flash_attention`, same arguments and result."""
    del interpret, block_q, block_k, num_warps, num_stages, hopper
    _check_qkv(q, k, v, sinks, 0)
    _check_window(sliding_window, causal)
    T, Hq, Dk = q.shape
    Hkv = k.shape[1]
    seg, pos = _packed_meta(T, cu_seqlens.astype(jnp.int32))
    mask = (seg[:, None] == seg[None, :]) & (seg[:, None] >= 0)
    if causal:
        mask = mask & (pos[None, :] <= pos[:, None])
    if sliding_window is not None:
        mask = mask & (pos[None, :] > pos[:, None] - sliding_window)
    scale = Dk ** -0.5 if scale is None else scale
    kr = jnp.repeat(k, Hq // Hkv, axis=1).astype(jnp.float32)
    vr = jnp.repeat(v, Hq // Hkv, axis=1)
    s = jnp.einsum("thd,shd->hts", q.astype(jnp.float32), kr) * scale
    s = jnp.where(mask[None], s, -jnp.inf)
    m = jnp.max(s, axis=-1, keepdims=True)
    if sinks is not None:
        m = jnp.maximum(m, sinks.astype(jnp.float32)[:, None, None])
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    p = jnp.exp(s - m)
    denom = p.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sinks.astype(jnp.float32)[:, None, None] - m)
    p = p / jnp.where(denom > 0, denom, 1.0)
    out = jnp.einsum("hts,shd->thd", p.astype(v.dtype), vr, preferred_element_type=jnp.float32)
    return out.astype(q.dtype)


def batched_attention(q, k, v, q_pos, k_pos, k_valid, *, scale: float, window: int | None = None, sinks=None,
                      interpret=False, block_q: int = BLOCK_Q_ROWS, block_k: int = BLOCK_K, num_warps=None,
                      num_stages=None, aligned: bool = False):
    """Causal attention of B query rows over their key caches, keys placed by explicit positions.

    q [B, T, Hq, Dk]; k [B, S, Hkv, Dk]; v [B, S, Hkv, Dv]; q_pos [B, T] int32; k_pos [B, S] int32;
    k_valid [B, S] bool; window as in `flash_attention`; sinks [Hq]; aligned: a promise that q_pos[b, t] == t
    and k_pos[b, s] == s (a prefill with nothing cached), which the reference uses to skip the key tiles above
    the diagonal (the kernel finds them from the positions) -> [B, T, Hq, Dv] in q's dtype
    """
    del aligned
    _check_qkv(q, k, v, sinks, 1)
    _check_window(window)
    G = q.shape[2] // k.shape[2]
    B, T = q.shape[:2]
    k_seg = jnp.where(k_valid, 0, -1).astype(jnp.int32)
    return _flash(q, k, v, q_pos.astype(jnp.int32), jnp.zeros((B, T), jnp.int32), k_pos.astype(jnp.int32), k_seg,
                  sinks, scale=float(scale), causal=True, window=None if window is None else int(window),
                  block_q=max(1, block_q // _pow2(G)), block_k=block_k, interpret=bool(interpret), num_warps=num_warps,
                  num_stages=num_stages)


REF_QUERY_TILE = 256  # the reference computes long prompts this many query rows at a time
REF_ALIGNED_TILE = 64  # aligned: query tiles of this many rows, each against the keys up to its end


def ref_batched_attention(q, k, v, q_pos, k_pos, k_valid, *, scale: float, window: int | None = None, sinks=None,
                          interpret=False, block_q: int = BLOCK_Q_ROWS, block_k: int = BLOCK_K, num_warps=None,
                          num_stages=None, aligned: bool = False):
    """Pure-jnp `batched_attention` (GQA by grouping, no K/V repeat), softmax in float32; queries that see
    no key give zeros, as in the kernel. Prompts longer than REF_QUERY_TILE (a multiple of it) are computed a
    tile of query rows at a time (`lax.map`), so the score matrix held at once is [tile, S], not [T, S]:
    the same numbers, a fraction of the memory (and of the fresh pages each program run touches). aligned:
    query tile i (REF_ALIGNED_TILE rows) meets only keys [0, (i + 1) * tile), the rest being in its future: about
    half the products and softmax work of a long fresh prompt."""
    del interpret, block_q, block_k, num_warps, num_stages
    B, T = q.shape[:2]
    n, S = T // REF_ALIGNED_TILE, k.shape[1]
    if aligned and n > 1 and T % REF_ALIGNED_TILE == 0 and window is None:
        outs = []
        for i in range(n):
            qs, e = slice(i * REF_ALIGNED_TILE, (i + 1) * REF_ALIGNED_TILE), min(S, (i + 1) * REF_ALIGNED_TILE)
            outs.append(_ref_rows(q[:, qs], k[:, :e], v[:, :e], q_pos[:, qs], k_pos[:, :e], k_valid[:, :e], scale,
                                  None, sinks))
        return jnp.concatenate(outs, axis=1)
    n = T // REF_QUERY_TILE
    if n > 1 and T % REF_QUERY_TILE == 0:
        def tile(xs):
            return _ref_rows(xs[0], k, v, xs[1], k_pos, k_valid, scale, window, sinks)
        qs = jnp.moveaxis(q.reshape((B, n, REF_QUERY_TILE) + q.shape[2:]), 1, 0)
        ps = jnp.moveaxis(q_pos.reshape(B, n, REF_QUERY_TILE), 1, 0)
        out = jax.lax.map(tile, (qs, ps))  # [n, B, tile, Hq, Dv]
        return jnp.moveaxis(out, 0, 1).reshape((B, T) + out.shape[3:])
    return _ref_rows(q, k, v, q_pos, k_pos, k_valid, scale, window, sinks)


def _ref_rows(q, k, v, q_pos, k_pos, k_valid, scale, window, sinks):
    B, T, Hq, Dk = q.shape
    Hkv = k.shape[2]
    G = Hq // Hkv
    qg = q.reshape(B, T, Hkv, G, Dk)
    s = jnp.einsum("btkgd,bskd->bkgts", qg, k, preferred_element_type=jnp.float32) * scale
    mask = k_valid[:, None, :] & (k_pos[:, None, :] <= q_pos[:, :, None])  # [B, T, S]
    if window is not None:
        mask = mask & (k_pos[:, None, :] > q_pos[:, :, None] - window)
    s = jnp.where(mask[:, None, None], s, NEG)
    m = s.max(-1, keepdims=True)
    if sinks is not None:
        sk = sinks.astype(jnp.float32).reshape(1, Hkv, G, 1, 1)
        m = jnp.maximum(m, sk)
    p = jnp.where(mask[:, None, None], jnp.exp(s - m), 0.0)
    denom = p.sum(-1, keepdims=True)
    if sinks is not None:
        denom = denom + jnp.exp(sk - m)
    p = (p / jnp.where(denom > 0, denom, 1.0)).astype(v.dtype)
    out = jnp.einsum("bkgts,bskd->btkgd", p, v, preferred_element_type=jnp.float32)
    return out.reshape(B, T, Hq, v.shape[-1]).astype(q.dtype)
