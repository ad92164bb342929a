"""Gated delta rule (Gated DeltaNet scalar decay, Kimi Delta Attention per-channel decay): pure-jnp references.

Recurrence per head, state S [Dk, Dv], for t = 1..T:
    S <- diag(exp(g_t)) S                     (g_t scalar or per key channel, log-space)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   (delta rule)
    o_t = S^T q_t                             (q scaled by Dk^-1/2, optionally after L2-normalising q and k)

`ref_chunk_gated_delta_rule` evaluates it chunk by chunk in the WY/UT form (intra-chunk work as small
matmuls and one unit-lower-triangular solve, inter-chunk state carried by `lax.scan`);
`ref_recurrent_gated_delta_rule` steps token by token (decode). Both follow the argument convention of
the transformers fallbacks.

The Pallas kernels `chunk_gated_delta_rule` and `recurrent_gated_delta_rule` take the same arguments. Grid
(B, H): one program per sequence and head keeps the state S [Dk, Dv] in float32 and walks the chunks (or
tokens) in order, reading q/k/v/g/beta in place from the [B, T, H, D] inputs. Per chunk of C tokens, with
G the in-chunk cumulative log decay:
    KK_ij = sum_d (beta_i k_id) k_jd exp(G_id - G_jd)   (j < i),   QK_ij likewise with q_i (j <= i)
    T = (I + KK)^-1  (nilpotent product),  U = T (beta v),  W = T (beta k exp(G))
    v' = U - W S,  o = (q exp(G)) S + QK v',  S <- exp(G_C) S + (k exp(G_C - G))^T v'
Per-channel decay (KDA) runs in chunks of SUB tokens and computes KK and QK directly from the
[SUB, SUB, Dk] exponent differences G_i - G_j, each <= 0 where it is kept (the decay is non-increasing), so
nothing overflows for any decay strength.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from .flash_attention import require_gpu_dims, triton_params

SUB = 16  # chunk of the per-channel decay kernel (Triton's smallest matmul dimension)
GPU_LAUNCH = (4, 1)  # Triton warps and pipeline stages: one stage keeps a chunk's tiles within shared memory
_HI = jax.lax.Precision.HIGHEST


def _prep(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel):
    """float32 inputs, optional L2 norm, q scaled by Dk^-1/2, g as [B, T, H, Dg], and the initial state."""
    B, T, H, Dk = q.shape
    S0 = (jnp.zeros((B, H, Dk, v.shape[-1]), jnp.float32) if initial_state is None
          else initial_state.astype(jnp.float32))
    q, k = q.astype(jnp.float32), k.astype(jnp.float32)
    if use_qk_l2norm_in_kernel:
        q = q * jax.lax.rsqrt(jnp.sum(q * q, -1, keepdims=True) + 1e-6)
        k = k * jax.lax.rsqrt(jnp.sum(k * k, -1, keepdims=True) + 1e-6)
    q = q * (q.shape[-1] ** -0.5)
    g = g.astype(jnp.float32)
    if g.ndim == 3:
        g = g[..., None]  # scalar decay broadcast over key channels: [B, T, H, 1]
    return q, k, v.astype(jnp.float32), g, beta.astype(jnp.float32), S0


def _unit_lower_inverse(A):
    """(I + A)^-1 for strictly lower-triangular A [..., C, C]: A is nilpotent, so the inverse is exactly
    prod_k (I + (-A)^(2^k)) over 2^k < C; log2(C) matmuls, which partition like any matmul under SPMD."""
    C = A.shape[-1]
    eye = jnp.eye(C, dtype=A.dtype)
    N, inv, p = -A, eye + -A, 1
    while 2 * p < C:
        N = N @ N
        inv = inv @ (eye + N)
        p *= 2
    return inv


def ref_chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_size=64, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, interpret=False):
    """q, k [B, T, H, Dk]; v [B, T, H, Dv]; g [B, T, H] or [B, T, H, Dk]; beta [B, T, H];
    initial_state [B, H, Dk, Dv] -> (out [B, T, H, Dv], final_state [B, H, Dk, Dv] float32 or None)"""
    del interpret
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
    out_dtype = v.dtype
    q, k, v, g, beta, S0 = _prep(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
    C = chunk_size
    pad = (-T) % C
    if pad:
        padt = lambda x: jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        q, k, v, g, beta = map(padt, (q, k, v, g, beta))
    N = (T + pad) // C

    def chunks(x):  # [B, N*C, H, ...] -> [N, B, H, C, ...]
        x = x.reshape((B, N, C, H) + x.shape[3:])
        return jnp.moveaxis(x, (1, 3), (0, 2))

    qs, ks, vs, gs, bs = map(chunks, (q, k, v, g, beta))
    incl = jnp.tril(jnp.ones((C, C), bool))
    strict = jnp.tril(jnp.ones((C, C), bool), -1)

    def step(S, xs):  # S [B, H, Dk, Dv]
        qc, kc, vc, gc, bc = xs  # [B, H, C, Dk], .., [B, H, C, Dv], [B, H, C, Dg], [B, H, C]
        G = jnp.cumsum(gc, axis=2)
        diff = G[:, :, :, None, :] - G[:, :, None, :, :]  # [B, H, C_i, C_j, Dg]
        decay = jnp.where(incl[:, :, None], jnp.exp(jnp.where(incl[:, :, None], diff, 0.0)), 0.0)
        kb = kc * bc[..., None]
        if G.shape[-1] == 1:
            kk = jnp.einsum("bhid,bhjd->bhij", kb, kc) * decay[..., 0]
            qk = jnp.einsum("bhid,bhjd->bhij", qc, kc) * decay[..., 0]
        else:
            kk = jnp.einsum("bhid,bhjd,bhijd->bhij", kb, kc, decay)
            qk = jnp.einsum("bhid,bhjd,bhijd->bhij", qc, kc, decay)
        rhs = jnp.concatenate([vc * bc[..., None], kb * jnp.exp(G)], axis=-1)
        X = jnp.einsum("bhij,bhjd->bhid", _unit_lower_inverse(jnp.where(strict, kk, 0.0)), rhs)
        U, W = X[..., :Dv], X[..., Dv:]
        v_new = U - jnp.einsum("bhck,bhkv->bhcv", W, S)
        o = jnp.einsum("bhck,bhkv->bhcv", qc * jnp.exp(G), S) + jnp.einsum("bhij,bhjv->bhiv", qk, v_new)
        G_last = G[:, :, -1:, :]  # [B, H, 1, Dg]
        S = jnp.exp(G_last[:, :, 0, :])[..., None] * S + jnp.einsum(
            "bhck,bhcv->bhkv", kc * jnp.exp(G_last - G), v_new)
        return S, o

    S, o = jax.lax.scan(step, S0, (qs, ks, vs, gs, bs))  # o [N, B, H, C, Dv]
    o = jnp.moveaxis(o, (0, 2), (1, 3)).reshape(B, N * C, H, Dv)[:, :T]
    return o.astype(out_dtype), (S if output_final_state else None)


def ref_recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state=False,
                                   use_qk_l2norm_in_kernel=False, interpret=False):
    """Token-by-token form; same arguments and results as `ref_chunk_gated_delta_rule` (no chunk_size)."""
    del interpret
    out_dtype = v.dtype
    q, k, v, g, beta, S0 = _prep(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)

    def step(S, xs):
        qt, kt, vt, gt, bt = xs  # [B, H, Dk], [B, H, Dk], [B, H, Dv], [B, H, Dg], [B, H]
        S = S * jnp.exp(gt)[..., None]
        delta = (vt - jnp.einsum("bhkv,bhk->bhv", S, kt)) * bt[..., None]
        S = S + kt[..., None] * delta[:, :, None, :]
        return S, jnp.einsum("bhkv,bhk->bhv", S, qt)

    tm = lambda x: jnp.moveaxis(x, 1, 0)
    S, o = jax.lax.scan(step, S0, tuple(map(tm, (q, k, v, g, beta))))
    return tm(o).astype(out_dtype), (S if output_final_state else None)


# ------------------------------------------------------------------------------------------------ Pallas

def _dot(a, b, trans_b=False):
    dims = (((1,), (1 if trans_b else 0,)), ((), ()))
    return jax.lax.dot_general(a, b, dims, precision=_HI, preferred_element_type=jnp.float32)


def _decayed_products(x, k, G):
    """sum_d x_id k_jd exp(G_id - G_jd) for j <= i (zero above): x, k [C, Dk]; G [C, Dk] non-increasing
    -> [C, C], from the [C, C, Dk] exponent differences, each <= 0 where it is kept. The kernel takes
    per-channel decay in chunks of SUB tokens, so this is [SUB, SUB, Dk] and no chunk is sliced (a slice of
    a value does not lower to Triton)."""
    C = x.shape[0]
    incl = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0) >= jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    e = jnp.exp(jnp.where(incl[:, :, None], G[:, None, :] - G[None, :, :], 0.0))
    return jnp.where(incl, jnp.sum(x[:, None, :] * k[None, :, :] * e, axis=-1), 0.0)


def _chunk_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, s_ref, *, chunk: int):
    # q_ref, k_ref [Tp, Dk]; v_ref [Tp, Dv]; g_ref [Tp, Dg]; b_ref [Tp]; s0_ref, s_ref [Dk, Dv] float32;
    # o_ref [Tp, Dv]  (inputs already float32, q scaled, padding rows zero)
    C = chunk
    row = jax.lax.broadcasted_iota(jnp.int32, (C, C), 0)
    col = jax.lax.broadcasted_iota(jnp.int32, (C, C), 1)
    incl, strict = row >= col, row > col
    tril = incl.astype(jnp.float32)

    def body(n, S):
        sl = pl.ds(n * C, C)
        q, k, v, g = q_ref[sl, :], k_ref[sl, :], v_ref[sl, :], g_ref[sl, :]
        beta = b_ref[sl][:, None]  # [C, 1]
        G = _dot(tril, g)  # in-chunk cumulative decay [C, Dg]
        kb = k * beta
        if G.shape[1] == 1:
            diff = G - G.T  # [C, C]
            decay = jnp.where(incl, jnp.exp(jnp.where(incl, diff, 0.0)), 0.0)
            kk, qk = _dot(kb, k, trans_b=True) * decay, _dot(q, k, trans_b=True) * decay
        else:
            kk, qk = _decayed_products(kb, k, G), _decayed_products(q, k, G)
        inv = _unit_lower_inverse(jnp.where(strict, kk, 0.0))
        eG = jnp.exp(G)
        v_new = _dot(inv, v * beta) - _dot(_dot(inv, kb * eG), S)
        o_ref[sl, :] = (_dot(q * eG, S) + _dot(jnp.where(incl, qk, 0.0), v_new)).astype(o_ref.dtype)
        G_last = jnp.sum(g, axis=0, keepdims=True)  # [1, Dg] the chunk's total decay: G's last row
        kd = k * jnp.exp(G_last - G)  # [C, Dk]
        upd = jax.lax.dot_general(kd, v_new, (((0,), (0,)), ((), ())), precision=_HI,
                                  preferred_element_type=jnp.float32)
        return jnp.exp(G_last).reshape(-1, 1) * S + upd

    s_ref[...] = jax.lax.fori_loop(0, q_ref.shape[0] // C, body, s0_ref[...])


def _recurrent_kernel(q_ref, k_ref, v_ref, g_ref, b_ref, s0_ref, o_ref, s_ref):
    # same refs as _chunk_kernel with T in place of Tp
    def body(t, S):
        sl = pl.ds(t, 1)
        q, k, v, g = q_ref[sl, :], k_ref[sl, :], v_ref[sl, :], g_ref[sl, :]  # [1, D*]
        S = S * jnp.exp(g).reshape(-1, 1)
        delta = (v - _dot(k, S)) * b_ref[sl][:, None]
        S = S + jax.lax.dot_general(k, delta, (((0,), (0,)), ((), ())), precision=_HI,
                                    preferred_element_type=jnp.float32)
        o_ref[sl, :] = _dot(q, S).astype(o_ref.dtype)
        return S

    s_ref[...] = jax.lax.fori_loop(0, q_ref.shape[0], body, s0_ref[...])


def _check(q, k, v, g, beta, initial_state):
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must be [B, T, H, Dk] alike, got {q.shape}, {k.shape}")
    B, T, H, Dk = q.shape
    if v.ndim != 4 or v.shape[:3] != (B, T, H):
        raise ValueError(f"v must be [{B}, {T}, {H}, Dv], got {v.shape}")
    if g.shape not in ((B, T, H), (B, T, H, Dk)):
        raise ValueError(f"g must be [{B}, {T}, {H}] (scalar decay) or [{B}, {T}, {H}, {Dk}] (per channel), "
                         f"got {g.shape}")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [{B}, {T}, {H}], got {beta.shape}")
    if initial_state is not None and initial_state.shape != (B, H, Dk, v.shape[-1]):
        raise ValueError(f"initial_state must be [{B}, {H}, {Dk}, {v.shape[-1]}], got {initial_state.shape}")


@functools.partial(jax.jit, static_argnames=("chunk", "out_dtype", "interpret"))
def _run(q, k, v, g, beta, S0, *, chunk: int | None, out_dtype, interpret: bool):
    """Prepared float32 inputs -> (out [B, T, H, Dv], final state [B, H, Dk, Dv]); chunk None: recurrent."""
    B, T, H, Dk = q.shape
    Dv, Dg = v.shape[-1], g.shape[-1]
    if chunk is not None and Dg > 1:
        chunk = min(chunk, SUB)  # per-channel decay: chunks of SUB tokens (_decayed_products)
    if not interpret:
        require_gpu_dims("the gated delta rule", Dk=Dk, Dv=Dv, **({} if chunk is None else {"chunk_size": chunk}))
    if chunk is not None:
        pad = (-T) % chunk
        q, k, v, g = (jnp.pad(x, [(0, 0), (0, pad), (0, 0), (0, 0)]) for x in (q, k, v, g))
        beta = jnp.pad(beta, [(0, 0), (0, pad), (0, 0)])
        kernel = functools.partial(_chunk_kernel, chunk=chunk)
    else:
        kernel = _recurrent_kernel
    Tp = q.shape[1]
    seq = lambda d: pl.BlockSpec((None, Tp, None, d), lambda b, h: (b, 0, h, 0))  # noqa: E731
    state = pl.BlockSpec((None, None, Dk, Dv), lambda b, h: (b, h, 0, 0))
    o, S = pl.pallas_call(
        kernel,
        grid=(B, H),
        in_specs=[seq(Dk), seq(Dk), seq(Dv), seq(Dg), pl.BlockSpec((None, Tp, None), lambda b, h: (b, 0, h)), state],
        out_specs=[seq(Dv), state],
        out_shape=[jax.ShapeDtypeStruct((B, Tp, H, Dv), out_dtype), jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)],
        interpret=interpret,
        compiler_params=triton_params(interpret, None, None, GPU_LAUNCH),
        name="gated_delta_rule" if chunk is None else "chunk_gated_delta_rule",
    )(q, k, v, g, beta, S0)
    return o[:, :T], S


def chunk_gated_delta_rule(q, k, v, g, beta, *, chunk_size=64, initial_state=None, output_final_state=False,
                           use_qk_l2norm_in_kernel=False, interpret=False):
    """Pallas chunked gated delta rule (prefill). q, k [B, T, H, Dk]; v [B, T, H, Dv]; g [B, T, H] or
    [B, T, H, Dk] log-space decay; beta [B, T, H]; initial_state [B, H, Dk, Dv]
    -> (out [B, T, H, Dv] in v's dtype, final_state [B, H, Dk, Dv] float32 or None)"""
    _check(q, k, v, g, beta, initial_state)
    if chunk_size < 1 or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size must be a power of two, got {chunk_size}")
    out_dtype = v.dtype
    q, k, v, g, beta, S0 = _prep(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
    o, S = _run(q, k, v, g, beta, S0, chunk=int(chunk_size), out_dtype=out_dtype, interpret=bool(interpret))
    return o, (S if output_final_state else None)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, initial_state=None, output_final_state=False,
                               use_qk_l2norm_in_kernel=False, interpret=False):
    """Pallas token-by-token gated delta rule (decode); arguments and results as `ref_recurrent_gated_delta_rule`."""
    _check(q, k, v, g, beta, initial_state)
    out_dtype = v.dtype
    q, k, v, g, beta, S0 = _prep(q, k, v, g, beta, initial_state, use_qk_l2norm_in_kernel)
    o, S = _run(q, k, v, g, beta, S0, chunk=None, out_dtype=out_dtype, interpret=bool(interpret))
    return o, (S if output_final_state else None)
