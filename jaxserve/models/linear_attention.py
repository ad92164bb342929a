"""Linear-attention mixers with fixed-size per-request state: Gated DeltaNet (Qwen3-Next) and Kimi Delta
Attention (Kimi Linear). Both run a depthwise causal short convolution over the q/k/v channels and the
gated delta rule (pallas_kernels.gated_delta_rule).

Cache per layer: {"conv": [B, K-1, C] last K-1 conv inputs, "ssm": [B, H, Dk, Dv] float32 recurrent state}.
Padding tokens (beyond `lengths`) leave both untouched: their decay is 0 (exp 1) and their beta 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.pallas_kernels.select import select

from .batch import Batch
from .config import GDNSpec, KDASpec
from .modules import Linear, gated_rms_norm
from .params import ParamInfo, declare


def causal_conv(x, state, weight, lengths):
    """Depthwise causal conv + SiLU continuing from `state`.

    x [B, T, C]; state [B, K-1, C]; weight [C, 1, K]; lengths [B] -> (y [B, T, C], new state [B, K-1, C])
    """
    K = weight.shape[-1]
    T = x.shape[1]
    xf = jnp.concatenate([state.astype(x.dtype), x], axis=1)  # [B, K-1+T, C]
    w = weight[:, 0, :].astype(x.dtype)  # [C, K]
    y = sum(xf[:, j:j + T, :] * w[:, j] for j in range(K))
    idx = lengths[:, None] + jnp.arange(K - 1)[None, :]  # last K-1 inputs up to the valid length
    new_state = jnp.take_along_axis(xf, idx[:, :, None], axis=1)
    return jax.nn.silu(y), new_state.astype(state.dtype)


def delta_rule(q, k, v, g, beta, state, T: int, kernels: str):
    """Chunked form for prefill, recurrent step for decode (T == 1); returns (out, final state)."""
    fn = select("recurrent_gated_delta_rule" if T == 1 else "chunk_gated_delta_rule", kernels)
    return fn(q, k, v, g, beta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)


def _conv_weight(prefix, names, conv_dim, K, dtype, module):
    pieces = tuple((f"{prefix}.{n}.weight",) for n in names)
    declare(module, "conv_weight", (conv_dim, 1, K), dtype,
            ParamInfo(pieces, combine="concat0" if len(pieces) > 1 else "one"))


class GatedDeltaNet(nnx.Module):
    def __init__(self, prefix: str, hidden: int, spec: GDNSpec, eps: float, dtype, kernels: str = "reference"):
        self.spec, self.eps, self.kernels = spec, eps, kernels
        kd, vd = spec.num_k_heads * spec.head_k_dim, spec.num_v_heads * spec.head_v_dim
        self.in_proj_qkvz = Linear(f"{prefix}.in_proj_qkvz", hidden, 2 * kd + 2 * vd, dtype)
        self.in_proj_ba = Linear(f"{prefix}.in_proj_ba", hidden, 2 * spec.num_v_heads, dtype)
        _conv_weight(prefix, ("conv1d",), spec.conv_dim, spec.conv_kernel, dtype, self)
        declare(self, "dt_bias", (spec.num_v_heads,), dtype, ParamInfo(((f"{prefix}.dt_bias",),)), init=1.0)
        declare(self, "A_log", (spec.num_v_heads,), dtype, ParamInfo(((f"{prefix}.A_log",),)))
        declare(self, "norm_weight", (spec.head_v_dim,), dtype, ParamInfo(((f"{prefix}.norm.weight",),)), init=1.0)
        self.out_proj = Linear(f"{prefix}.out_proj", vd, hidden, dtype)

    def __call__(self, x, batch: Batch, cache: dict):  # x [B, T, hidden]
        s = self.spec
        B, T, _ = x.shape
        valid = batch.valid[..., None]
        x = jnp.where(valid, x, 0)
        Hk, Hv, Dk, Dv = s.num_k_heads, s.num_v_heads, s.head_k_dim, s.head_v_dim
        r = Hv // Hk
        qkvz = self.in_proj_qkvz(x).reshape(B, T, Hk, 2 * Dk + 2 * r * Dv)
        q, k = qkvz[..., :Dk], qkvz[..., Dk:2 * Dk]
        v, z = qkvz[..., 2 * Dk:2 * Dk + r * Dv], qkvz[..., 2 * Dk + r * Dv:]
        ba = self.in_proj_ba(x).reshape(B, T, Hk, 2 * r)
        b, a = ba[..., :r].reshape(B, T, Hv), ba[..., r:].reshape(B, T, Hv)
        mixed = jnp.concatenate([q.reshape(B, T, -1), k.reshape(B, T, -1), v.reshape(B, T, -1)], axis=-1)
        mixed, conv = causal_conv(mixed, cache["conv"], self.conv_weight[...], batch.lengths)
        q = mixed[..., :Hk * Dk].reshape(B, T, Hk, Dk)
        k = mixed[..., Hk * Dk:2 * Hk * Dk].reshape(B, T, Hk, Dk)
        v = mixed[..., 2 * Hk * Dk:].reshape(B, T, Hv, Dv)
        beta = jnp.where(batch.valid[..., None], jax.nn.sigmoid(b), 0)
        g = -jnp.exp(self.A_log[...].astype(jnp.float32)) * jax.nn.softplus(
            a.astype(jnp.float32) + self.dt_bias[...].astype(jnp.float32))
        g = jnp.where(batch.valid[..., None], g, 0.0)
        if r > 1:
            q, k = jnp.repeat(q, r, axis=2), jnp.repeat(k, r, axis=2)
        o, ssm = delta_rule(q, k, v, g, beta, cache["ssm"], T, self.kernels)
        o = gated_rms_norm(o, z.reshape(B, T, Hv, Dv), self.norm_weight[...], self.eps, "silu")
        return self.out_proj(o.reshape(B, T, Hv * Dv)), {"conv": conv, "ssm": ssm}


class KimiDeltaAttention(nnx.Module):
    def __init__(self, prefix: str, hidden: int, spec: KDASpec, eps: float, dtype, kernels: str = "reference"):
        self.spec, self.eps, self.kernels = spec, eps, kernels
        H, D = spec.num_heads, spec.head_dim
        for n in ("q_proj", "k_proj", "v_proj"):
            setattr(self, n, Linear(f"{prefix}.{n}", hidden, H * D, dtype))
        _conv_weight(prefix, ("q_conv1d", "k_conv1d", "v_conv1d"), spec.conv_dim, spec.conv_kernel, dtype, self)
        self.f_a_proj = Linear(f"{prefix}.f_a_proj", hidden, D, dtype)
        self.f_b_proj = Linear(f"{prefix}.f_b_proj", D, H * D, dtype)
        declare(self, "dt_bias", (H * D,), dtype, ParamInfo(((f"{prefix}.dt_bias",),), fp32=True))
        declare(self, "A_log", (1, 1, H, 1), dtype, ParamInfo(((f"{prefix}.A_log",),), fp32=True))
        self.b_proj = Linear(f"{prefix}.b_proj", hidden, H, dtype)
        self.g_a_proj = Linear(f"{prefix}.g_a_proj", hidden, D, dtype)
        self.g_b_proj = Linear(f"{prefix}.g_b_proj", D, H * D, dtype)
        declare(self, "o_norm_weight", (D,), dtype, ParamInfo(((f"{prefix}.o_norm.weight",),)), init=1.0)
        self.o_proj = Linear(f"{prefix}.o_proj", H * D, hidden, dtype)

    def __call__(self, x, batch: Batch, cache: dict):  # x [B, T, hidden]
        s = self.spec
        B, T, _ = x.shape
        H, D = s.num_heads, s.head_dim
        x = jnp.where(batch.valid[..., None], x, 0)
        mixed = jnp.concatenate([self.q_proj(x), self.k_proj(x), self.v_proj(x)], axis=-1)
        mixed, conv = causal_conv(mixed, cache["conv"], self.conv_weight[...], batch.lengths)
        q, k, v = (mixed[..., i * H * D:(i + 1) * H * D].reshape(B, T, H, D) for i in range(3))
        f = self.f_b_proj(self.f_a_proj(x)).astype(jnp.float32) + self.dt_bias[...]
        f = f.reshape(B, T, H, D)
        g = -jnp.exp(self.A_log[...].reshape(1, 1, H, 1)) * jnp.where(f > 20.0, f, jnp.log1p(jnp.exp(f)))
        g = jnp.where(batch.valid[:, :, None, None], g, 0.0)
        beta = jnp.where(batch.valid[..., None], jax.nn.sigmoid(self.b_proj(x)), 0)
        o, ssm = delta_rule(q, k, v, g, beta, cache["ssm"], T, self.kernels)
        gate = self.g_b_proj(self.g_a_proj(x)).reshape(B, T, H, D)
        o = gated_rms_norm(o, gate, self.o_norm_weight[...], self.eps, "sigmoid")
        return self.o_proj(o.reshape(B, T, H * D)), {"conv": conv, "ssm": ssm}
