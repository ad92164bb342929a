"""Shared building blocks: linear layers, RMSNorm variants, SwiGLU MLP, mixture of experts.

All modules are Flax NNX modules whose weights are loaded by checkpoint name (params.py); linear layers keep
their weights [in, out], transposed from the Hugging Face [out, in] at load (XLA's CPU products read [in, out]
weights faster at a decode step's few rows), experts [E, in, out] for `lax.ragged_dot`. Shapes in
comments: B batch, T tokens, H hidden, I intermediate, E experts, K top-k.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.pallas_kernels.select import select

from .config import MLPSpec, MoESpec
from .params import ParamInfo, declare


class Linear(nnx.Module):
    """y = x @ W (+ b) with W [in, out] (checkpoints store W.T: ParamInfo.perm transposes it at load).

    tp: "col" shards the output features, "row" the input features, None replicates. kernels: the model's kernel
    mode (pallas_kernels/select.py): the product is its "matmul" (natively on a CPU for a decode step's few rows).
    """

    def __init__(self, prefix: str, d_in: int, d_out: int, dtype, bias: bool = False, tp: str | None = None,
                 kernels="reference"):
        tp_axis = {"col": 1, "row": 0, None: None}[tp]
        declare(self, "weight", (d_in, d_out), dtype,
                ParamInfo(((f"{prefix}.weight",),), perm=(1, 0), tp_axis=tp_axis))
        self.has_bias, self.kernels = bias, kernels
        if bias:
            declare(self, "bias", (d_out,), dtype,
                    ParamInfo(((f"{prefix}.bias",),), tp_axis=0 if tp == "col" else None))

    def __call__(self, x):  # x [..., in] -> [..., out]
        y = select("matmul", self.kernels)(x, self.weight[...])
        return y + self.bias[...] if self.has_bias else y


def rms_norm(x, weight, eps: float, plus_one: bool = False):
    """RMSNorm in float32; the scale multiplies after casting back (transformers' Llama convention)."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if plus_one:  # Qwen3-Next: output = norm(x) * (1 + w), all in float32
        return (xf * (1.0 + weight.astype(jnp.float32))).astype(dtype)
    return weight * xf.astype(dtype)


class RMSNorm(nnx.Module):
    def __init__(self, prefix: str, dim: int, eps: float, dtype, plus_one: bool = False):
        declare(self, "weight", (dim,), dtype, ParamInfo(((f"{prefix}.weight",),)), init=0.0 if plus_one else 1.0)
        self.eps, self.plus_one = eps, plus_one

    def __call__(self, x):  # [..., dim]
        return rms_norm(x, self.weight[...], self.eps, self.plus_one)


def gated_rms_norm(x, gate, weight, eps: float, activation: str):
    """Norm(x) * w * act(gate) in float32 (Qwen3-Next: silu, Kimi: sigmoid). x, gate [..., D]; weight [D]."""
    dtype = x.dtype
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    if activation == "silu":  # Qwen3-Next casts the normalised x to the model dtype before the weight
        xf = weight * xf.astype(dtype)
    else:
        xf = weight.astype(jnp.float32) * xf
    act = jax.nn.silu if activation == "silu" else jax.nn.sigmoid
    return (xf * act(gate.astype(jnp.float32))).astype(dtype)


class MLP(nnx.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, prefix: str, hidden: int, spec: MLPSpec, dtype, names=("gate_proj", "up_proj", "down_proj"),
                 kernels="reference"):
        g, u, d = names
        I = spec.intermediate_size
        self.gate_proj = Linear(f"{prefix}.{g}", hidden, I, dtype, spec.bias, tp="col", kernels=kernels)
        self.up_proj = Linear(f"{prefix}.{u}", hidden, I, dtype, spec.bias, tp="col", kernels=kernels)
        self.down_proj = Linear(f"{prefix}.{d}", I, hidden, dtype, spec.bias, tp="row", kernels=kernels)

    def __call__(self, x):  # [..., H] -> [..., H]
        g, u = self.gate_up(x) if hasattr(self, "gate_up") else (self.gate_proj(x), self.up_proj(x))  # models/fuse.py
        return self.down_proj(jax.nn.silu(g) * u)


class MoE(nnx.Module):
    """Routed experts (+ optional shared expert), dispatched by sorting token-expert pairs by expert and
    running grouped matmuls (the "grouped_matmul" kernel: `lax.ragged_dot`, on a CPU the native kernel), so compute
    scales with top-k, not with the expert count; the pairs' outputs come back to their tokens by a gather (the
    inverse of the sort), weighted and summed in float32.

    Routers: "sigmoid_group" (DeepSeek-V3 noaux: sigmoid scores + correction bias, group-limited top-k),
    "softmax" (Qwen: softmax then top-k), "topk_softmax" (gpt-oss: top-k logits then softmax).
    """

    def __init__(self, prefix: str, hidden: int, spec: MoESpec, dtype, *, router_name="gate",
                 expert_names=("gate_proj", "up_proj", "down_proj"), shared_name="shared_experts", kernels="reference"):
        self.spec, self.kernels = spec, kernels
        self.stack_at = None  # inside a scan: the layer's index in its stack, its experts left whole (models/stack.py)
        E, I = spec.num_experts, spec.intermediate_size

        def alts(suffix):
            return (f"{prefix}.{suffix}",)

        rw = ParamInfo((alts(f"{router_name}.weight"),), fp32=spec.router == "sigmoid_group")
        declare(self, "router_weight", (E, hidden), dtype, rw)
        if spec.router == "sigmoid_group":
            declare(self, "router_bias", (E,), dtype,
                    ParamInfo((alts(f"{router_name}.e_score_correction_bias"),), fp32=True))
        elif spec.router == "topk_softmax":
            declare(self, "router_bias", (E,), dtype, ParamInfo((alts(f"{router_name}.bias"),)))
        if spec.expert_style == "gpt_oss":  # fused, already [E, in, out], gate/up interleaved on the last axis
            declare(self, "w_gate_up", (E, hidden, 2 * I), dtype, ParamInfo((alts("experts.gate_up_proj"),), tp_axis=2))
            declare(self, "b_gate_up", (E, 2 * I), dtype, ParamInfo((alts("experts.gate_up_proj_bias"),), tp_axis=1))
            declare(self, "w_down", (E, I, hidden), dtype, ParamInfo((alts("experts.down_proj"),), tp_axis=1))
            declare(self, "b_down", (E, hidden), dtype, ParamInfo((alts("experts.down_proj_bias"),)))
        else:
            g, u, d = expert_names

            def stacked(n, tp_axis):
                return ParamInfo(tuple(alts(f"experts.{e}.{n}.weight") for e in range(E)), combine="stack",
                                 perm=(1, 0), tp_axis=tp_axis)

            # tensor parallel inside each expert: gate/up split their outputs, down its inputs
            declare(self, "w_gate", (E, hidden, I), dtype, stacked(g, 2))
            declare(self, "w_up", (E, hidden, I), dtype, stacked(u, 2))
            declare(self, "w_down", (E, I, hidden), dtype, stacked(d, 1))
        self.has_shared = spec.shared_intermediate_size > 0
        if self.has_shared:
            self.shared = MLP(f"{prefix}.{shared_name}", hidden, MLPSpec(spec.shared_intermediate_size), dtype,
                              kernels=kernels)
        if spec.shared_expert_gate:
            self.shared_gate = Linear(f"{prefix}.shared_expert_gate", hidden, 1, dtype)

    def route(self, x):  # x [N, H] -> weights [N, K] float32, experts [N, K] int32
        s = self.spec
        if s.router == "sigmoid_group":
            logits = x.astype(jnp.float32) @ self.router_weight[...].astype(jnp.float32).T
            scores = jax.nn.sigmoid(logits)
            choice = scores + self.router_bias[...]
            N = x.shape[0]
            grouped = choice.reshape(N, s.n_group, s.num_experts // s.n_group)
            group_scores = jax.lax.top_k(grouped, 2)[0].sum(-1)  # [N, G]
            _, gidx = jax.lax.top_k(group_scores, s.topk_group)
            gmask = jnp.zeros_like(group_scores).at[jnp.arange(N)[:, None], gidx].set(1.0)
            emask = jnp.repeat(gmask, s.num_experts // s.n_group, axis=1) > 0
            choice = jnp.where(emask, choice, -jnp.inf)
            _, idx = jax.lax.top_k(choice, s.top_k)
            w = jnp.take_along_axis(scores, idx, axis=1)
            if s.norm_topk_prob:
                w = w / (w.sum(-1, keepdims=True) + 1e-20)
            return w * s.routed_scaling_factor, idx
        xf = x.astype(jnp.float32)  # routing decisions in float32 whatever the model dtype
        if s.router == "softmax":
            logits = xf @ self.router_weight[...].astype(jnp.float32).T
            probs = jax.nn.softmax(logits, axis=-1)
            w, idx = jax.lax.top_k(probs, s.top_k)
            if s.norm_topk_prob:
                w = w / w.sum(-1, keepdims=True)
            return w, idx
        logits = xf @ self.router_weight[...].astype(jnp.float32).T + self.router_bias[...].astype(jnp.float32)
        top, idx = jax.lax.top_k(logits, s.top_k)
        return jax.nn.softmax(top, axis=-1), idx

    def experts(self, x, weights, idx):  # x [N, H], weights/idx [N, K] -> [N, H] float32
        s = self.spec
        N, H = x.shape
        K = idx.shape[1]
        gmm = functools.partial(select("grouped_matmul", self.kernels), layer=self.stack_at)
        flat = idx.reshape(-1)
        order = jnp.argsort(flat)  # [N*K] the token-expert pairs sorted by expert
        xs = x[order // K]  # [N*K, H]
        sizes = (flat[:, None] == jnp.arange(s.num_experts, dtype=flat.dtype)).sum(0, dtype=jnp.int32)  # [E]
        if s.expert_style == "gpt_oss":
            expert_of = flat[order]
            gu = gmm(xs, self.w_gate_up[...], sizes) + self.b_gate_up[...][expert_of]
            gate, up = gu[:, ::2], gu[:, 1::2]
            gate = jnp.minimum(gate, s.swiglu_limit)
            up = jnp.clip(up, -s.swiglu_limit, s.swiglu_limit)
            h = (up + 1) * (gate * jax.nn.sigmoid(gate * s.swiglu_alpha))
            y = gmm(h, self.w_down[...], sizes) + self.b_down[...][expert_of]
        else:
            h = jax.nn.silu(gmm(xs, self.w_gate[...], sizes)) * gmm(xs, self.w_up[...], sizes)
            y = gmm(h, self.w_down[...], sizes)
        y = y[jnp.argsort(order)].reshape(N, K, H)  # each pair back at its token (a gather, no scatter)
        return jnp.einsum("nkh,nk->nh", y.astype(jnp.float32), weights.astype(jnp.float32))

    def __call__(self, x):  # [B, T, H] -> [B, T, H]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        w, idx = self.route(x2)
        out = self.experts(x2, w, idx)
        if self.has_shared:
            sh = self.shared(x2)
            if self.spec.shared_expert_gate:
                sh = jax.nn.sigmoid(self.shared_gate(x2)) * sh
            out = out + sh
        return out.reshape(shape).astype(x.dtype)
