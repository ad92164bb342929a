"""Gated delta rule (Gated DeltaNet scalar decay, Kimi Delta Attention per-channel decay): pure-jnp references.

Recurrence per head, state S [Dk, Dv], for t = 1..T:
    S <- diag(exp(g_t)) S                     (g_t scalar or per key channel, log-space)
    S <- S + k_t (beta_t (v_t - S^T k_t))^T   (delta rule)
    o_t = S^T q_t                             (q scaled by Dk^-1/2, optionally after L2-normalising q and k)

`ref_chunk_gated_delta_rule` evaluates it chunk by chunk in the WY/UT form (intra-chunk work as small
matmuls and one unit-lower-triangular solve, inter-chunk state carried by `lax.scan`);
`ref_recurrent_gated_delta_rule` steps token by token (decode). Both follow the argument convention of
the transformers fallbacks; the Pallas kernel arrives behind the same signature.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
    B, T, H, Dk = q.shape
    Dv = v.shape[-1]
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
