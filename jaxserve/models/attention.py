"""Softmax attention layers (GQA and MLA) over a dense per-request cache, pure jnp reference path.

Cache layouts (one dict per layer):
  full GQA     {"k": [B, S, Hkv, Dk], "v": [B, S, Hkv, Dv]}   position p lives at index p
  sliding GQA  {"k": [B, W, Hkv, Dk], "v": [B, W, Hkv, Dv]}   ring: position p lives at slot p % W
  full MLA     {"kv": [B, S, 1, L + R]}                        compressed latent (L) + rope key (R)
MLA runs in the absorbed form: queries are projected into the latent space, attention is multi-query
over the latent cache, and the value up-projection is applied to the attended latent.
In engine decode a layer gets a `PagedKV` view of the block pool instead (models/paged.py; a sliding layer's
ring as one block of `window` tokens, cache/layout.py `ring_table`).
Attention itself comes from pallas_kernels: `batched_attention` over dense caches, `paged_attention` /
`paged_mla_attention` over the pool, and in an engine prefill that reads the pool in place (`PagedKV.inplace`)
`paged_prefill_attention` / `paged_mla_prefill_attention`; the jnp reference, the Pallas kernel or the native
one, as the model's `kernels` mode selects (pallas_kernels/select.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxserve.pallas_kernels.select import mode_of, select

from .batch import Batch
from .config import GQASpec, MLASpec
from .modules import Linear, RMSNorm
from .paged import PagedKV
from .params import ParamInfo, declare
from .rope import apply_rope
from .split import split_attention

def write_full(cache, new, batch: Batch):
    """Write new entries [B, T, ...] at their positions into a full cache [B, S, ...]; padding is dropped."""
    S = cache.shape[1]
    idx = jnp.where(batch.valid, batch.positions, S)
    return cache.at[jnp.arange(cache.shape[0])[:, None], idx].set(new.astype(cache.dtype), mode="drop")


def fit(x, S: int):
    """x [B, T, ...] cut or zero-padded along T to S."""
    T = x.shape[1]
    return x[:, :S] if T >= S else jnp.pad(x, [(0, 0), (0, S - T)] + [(0, 0)] * (x.ndim - 2))


def full_positions(S: int, batch: Batch):
    k_pos = jnp.broadcast_to(jnp.arange(S, dtype=jnp.int32)[None, :], (batch.start.shape[0], S))
    return k_pos, k_pos < batch.end[:, None]


def ring_positions(start, W: int):
    """Position held by each slot of a ring of W slots after `start` tokens: ([B, W] pos, [B, W] valid)."""
    last = (start - 1)[:, None]
    pos = last - jnp.mod(last - jnp.arange(W, dtype=jnp.int32)[None, :], W)
    return pos, pos >= 0


def ring_update(ring, new, batch: Batch):
    """Ring [B, W, ...] after appending `new` [B, T, ...]: each slot keeps the newest position mapping to it."""
    W, T = ring.shape[1], new.shape[1]
    pos, _ = ring_positions(batch.end, W)
    from_new = pos >= batch.start[:, None]
    t = jnp.clip(pos - batch.start[:, None], 0, T - 1)
    picked = jnp.take_along_axis(new, t.reshape(t.shape + (1,) * (new.ndim - 2)), axis=1)
    mask = from_new.reshape(from_new.shape + (1,) * (new.ndim - 2))
    return jnp.where(mask, picked.astype(ring.dtype), ring)


def kv_attention(q, k_new, v_new, cache: dict, batch: Batch, *, scale, window, sinks=None, kernels="reference"):
    """Append this step's K/V to the layer cache and attend. Returns (out [B, T, Hq, Dv], new cache)."""
    if isinstance(cache, PagedKV):
        cache = cache.write(PagedKV.pack(k_new, v_new, cache.pool.shape[2]), batch)
        if cache.dense and cache.inplace:  # prefill, each token over its row's blocks in place
            B, T = q.shape[:2]
            rows, pos = PagedKV.packed(batch)
            out = select("paged_prefill_attention", kernels)(q.reshape((B * T,) + q.shape[2:]), cache.pool,
                                                             cache.table, rows, pos, layer=cache.layer,
                                                             sliding_window=window, sinks=sinks, scale=scale)
            return out.reshape((B, T) + out.shape[1:]), cache
        if cache.dense:  # prefill: the chunk's own keys (first chunk), or the layer's blocks with them written
            if batch.fresh:
                k, v = k_new.astype(cache.pool.dtype), v_new.astype(cache.pool.dtype)
            else:
                k, v = PagedKV.unpack(cache.view(), k_new.shape[-1])
            return _attend_full(q, k, v, batch, scale, sinks, kernels), cache
        if cache.split is not None:  # some heads' older positions are on a helper instance
            k, v = PagedKV.unpack(cache.view(), k_new.shape[-1])
            out = split_attention(q[:, 0], k, v, PagedKV.lengths(batch), cache.since, cache.split_key(), cache.gidx,
                                  cache.split, scale=scale, sinks=sinks)
            return out[:, None], cache
        out = select("paged_attention", kernels)(q[:, 0], cache.pool, cache.table, PagedKV.lengths(batch),
                                                 layer=cache.layer, sliding_window=window, sinks=sinks, scale=scale,
                                                 total_blocks=cache.total_blocks)
        return out[:, None], cache
    attend = select("batched_attention", kernels)
    if window is None:
        if batch.fresh:  # nothing cached: the keys are this step's, token t at position t (the view goes unread)
            k, v = (fit(x.astype(c.dtype), c.shape[1]) for x, c in ((k_new, cache["k"]), (v_new, cache["v"])))
        else:
            k = write_full(cache["k"], k_new, batch)
            v = write_full(cache["v"], v_new, batch)
        return _attend_full(q, k, v, batch, scale, sinks, kernels), {"k": k, "v": v}
    new_cache = {"k": ring_update(cache["k"], k_new, batch), "v": ring_update(cache["v"], v_new, batch)}
    if mode_of("paged_prefill_attention", kernels) == "native":
        return ring_prefill(q, k_new, v_new, cache, batch, scale=scale, window=window, sinks=sinks,
                            kernels=kernels), new_cache
    W = cache["k"].shape[1]
    r_pos, r_valid = ring_positions(batch.start, W)
    k_all = jnp.concatenate([cache["k"], k_new.astype(cache["k"].dtype)], axis=1)
    v_all = jnp.concatenate([cache["v"], v_new.astype(cache["v"].dtype)], axis=1)
    k_pos = jnp.concatenate([r_pos, batch.positions], axis=1)
    k_valid = jnp.concatenate([r_valid, batch.valid], axis=1)
    out = attend(q, k_all, v_all, batch.positions, k_pos, k_valid, scale=scale, window=window, sinks=sinks)
    return out, new_cache


RING_BLOCK = 16  # tokens per block of `ring_prefill`'s scratch pool


def ring_prefill(q, k_new, v_new, cache: dict, batch: Batch, *, scale, window, sinks, kernels):
    """A chunk's sliding-window attention with paged prefill attention (on a CPU the native kernel, which reads
    only each query's window) -> out [B, T, Hq, Dv]. q [B, T, Hq, Dk], k_new [B, T, Hkv, Dk], v_new [B, T, Hkv, Dv]
    the chunk's; cache the layer's rings {"k": [B, W, Hkv, Dk], "v": [B, W, Hkv, Dv]} before it.

    The dense path attends every query over the whole ring and chunk ([T, W + T] scores a head, most of them
    masked); the chunk cannot be written into the ring first, as its later tokens would overwrite keys its earlier
    ones see. So each row's ring and chunk are laid out in position order in a scratch pool of RING_BLOCK-token
    blocks, from position base = max(start - W, 0) on (the ring holds start - W..start - 1), and the queries
    attend there with their positions less base: attention depends on positions only through the window, and
    RoPE was applied before."""
    B, T, Hq, _ = q.shape
    W = cache["k"].shape[1]
    nb = -(-(W + T) // RING_BLOCK)
    base = jnp.maximum(batch.start - W, 0)  # [B] position of each row's first scratch slot
    pos = base[:, None] + jnp.arange(nb * RING_BLOCK, dtype=jnp.int32)[None, :]  # [B, S] each slot's position
    chunk = (pos >= batch.start[:, None])[..., None, None]
    t = jnp.clip(pos - batch.start[:, None], 0, T - 1)[..., None, None]

    def fill(ring, new):  # -> [B, S, Hkv, D]: the ring's tokens, then the chunk's
        return jnp.where(chunk, jnp.take_along_axis(new.astype(ring.dtype), t, axis=1),
                         jnp.take_along_axis(ring, (pos % W)[..., None, None], axis=1))
    k, v = fill(cache["k"], k_new), fill(cache["v"], v_new)
    x = PagedKV.pack(k, v, 2 if k.shape[-1] == v.shape[-1] else 1)  # [B, S, E, Hkv, D]
    x = x.reshape((B, nb, RING_BLOCK) + x.shape[2:]).swapaxes(2, 3)  # [B, nb, E, bs, Hkv, D]
    pool = x.reshape((B * nb, 1) + x.shape[2:])
    table = jnp.arange(B * nb, dtype=jnp.int32).reshape(B, nb)
    rows, positions = PagedKV.packed(batch)
    out = select("paged_prefill_attention", kernels)(q.reshape((B * T,) + q.shape[2:]), pool, table, rows,
                                                     positions - jnp.repeat(base, T), layer=0,
                                                     sliding_window=window, sinks=sinks, scale=scale)
    return out.reshape((B, T) + out.shape[1:])


def paged_prefill(q, k_new, v_new, cache: PagedKV, batch: Batch, *, scale, window, sinks, kernels):
    """A packed prefill step's full attention over the pool: q [N, Hq, Dk], k_new [N, Hkv, Dk], v_new [N, Hkv, Dv]
    the packed tokens' -> (out [N, Hq, Dv], cache with the step's K/V written)."""
    rows, pos = batch.packed_rows, batch.packed_positions
    cache = cache.write_packed(PagedKV.pack(k_new[None], v_new[None], cache.pool.shape[2])[0], rows, pos)
    out = select("paged_prefill_attention", kernels)(q, cache.pool, cache.table, rows, pos, layer=cache.layer,
                                                     sliding_window=window, sinks=sinks, scale=scale)
    return out, cache


def _attend_full(q, k, v, batch: Batch, scale, sinks, kernels):
    """Attention of q [B, T, Hq, Dk] over a full cache k [B, S, Hkv, Dk], v [B, S, Hkv, Dv] holding position p at
    index p (a first chunk's keys are its own tokens: aligned with the queries)."""
    k_pos, k_valid = full_positions(k.shape[1], batch)
    return select("batched_attention", kernels)(q, k, v, batch.positions, k_pos, k_valid, scale=scale, sinks=sinks,
                                                aligned=batch.fresh)


class GQAAttention(nnx.Module):
    """Grouped-query attention: Llama/Qwen3 (q/k norm), Qwen3-Next (output gate), gpt-oss and MiMo (sinks,
    sliding window, separate value head dim, value scale)."""

    def __init__(self, prefix: str, hidden: int, spec: GQASpec, eps: float, dtype, norm_plus_one=False,
                 kernels: str = "reference"):
        self.spec, self.kernels = spec, kernels
        H, Hkv, D, Dv = spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.v_head_dim
        q_out = H * D * (2 if spec.output_gate else 1)
        self.q_proj = Linear(f"{prefix}.q_proj", hidden, q_out, dtype, spec.qkv_bias, tp="col",
                             kernels=kernels)
        self.k_proj = Linear(f"{prefix}.k_proj", hidden, Hkv * D, dtype, spec.qkv_bias, tp="col",
                             kernels=kernels)
        self.v_proj = Linear(f"{prefix}.v_proj", hidden, Hkv * Dv, dtype, spec.qkv_bias, tp="col",
                             kernels=kernels)
        self.o_proj = Linear(f"{prefix}.o_proj", H * Dv, hidden, dtype, spec.o_bias, tp="row",
                             kernels=kernels)
        if spec.qk_norm:
            self.q_norm = RMSNorm(f"{prefix}.q_norm", D, eps, dtype, norm_plus_one)
            self.k_norm = RMSNorm(f"{prefix}.k_norm", D, eps, dtype, norm_plus_one)
        if spec.sinks:
            declare(self, "sinks", (H,), dtype, ParamInfo(((f"{prefix}.{spec.sinks_name}",),), tp_axis=0))

    packed_input = True  # takes a packed batch's [1, N, hidden] (models/batch.py): projections on real tokens only

    def __call__(self, x, batch: Batch, cache: dict):  # x [B, T, hidden], or [1, N, hidden] packed
        s = self.spec
        B, T, _ = x.shape
        if hasattr(self, "qkv"):  # fused at load (models/fuse.py)
            q, k, v = self.qkv(x)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        gate = None
        if s.output_gate:
            q, gate = jnp.split(q.reshape(B, T, s.num_heads, 2 * s.head_dim), 2, axis=-1)
            gate = gate.reshape(B, T, -1)
        q = q.reshape(B, T, s.num_heads, s.head_dim)
        k = k.reshape(B, T, s.num_kv_heads, s.head_dim)
        v = v.reshape(B, T, s.num_kv_heads, s.v_head_dim)
        if s.v_scale != 1.0:
            v = v * jnp.asarray(s.v_scale, v.dtype)
        if s.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if s.rope is not None:
            pos = batch.pack(batch.positions)
            q, k = apply_rope(q, pos, s.rope), apply_rope(k, pos, s.rope)
        sinks = self.sinks[...] if s.sinks else None
        if isinstance(cache, PagedKV) and not cache.dense and batch.packed is not None:  # paged prefill
            out, cache = paged_prefill(q[0], k[0], v[0], cache, batch, scale=s.scale, window=s.window, sinks=sinks,
                                       kernels=self.kernels)
        else:
            out, cache = kv_attention(batch.unpack(q), batch.unpack(k), batch.unpack(v), cache, batch,
                                      scale=s.scale, window=s.window, sinks=sinks, kernels=self.kernels)
            out = batch.pack(out)
        out = out.reshape(B, T, -1)
        if gate is not None:
            out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out), cache


class MLAAttention(nnx.Module):
    """Multi-head latent attention (DeepSeek-V3, Kimi Linear), absorbed form over the latent cache."""

    def __init__(self, prefix: str, hidden: int, spec: MLASpec, eps: float, dtype, kernels: str = "reference"):
        self.spec, self.kernels = spec, kernels
        H, nope, rope, L = spec.num_heads, spec.qk_nope_head_dim, spec.qk_rope_head_dim, spec.kv_lora_rank
        qk = nope + rope
        if spec.q_lora_rank is None:
            self.q_proj = Linear(f"{prefix}.q_proj", hidden, H * qk, dtype, tp="col")
        else:
            self.q_a_proj = Linear(f"{prefix}.q_a_proj", hidden, spec.q_lora_rank, dtype, spec.attention_bias)
            self.q_a_layernorm = RMSNorm(f"{prefix}.q_a_layernorm", spec.q_lora_rank, 1e-6, dtype)
            self.q_b_proj = Linear(f"{prefix}.q_b_proj", spec.q_lora_rank, H * qk, dtype, tp="col")
        self.kv_a_proj_with_mqa = Linear(f"{prefix}.kv_a_proj_with_mqa", hidden, L + rope, dtype, spec.attention_bias)
        self.kv_a_layernorm = RMSNorm(f"{prefix}.kv_a_layernorm", L, 1e-6, dtype)
        self.kv_b_proj = Linear(f"{prefix}.kv_b_proj", L, H * (nope + spec.v_head_dim), dtype, tp="col")
        self.o_proj = Linear(f"{prefix}.o_proj", H * spec.v_head_dim, hidden, dtype, spec.attention_bias, tp="row")

    def __call__(self, x, batch: Batch, cache: dict):  # x [B, T, hidden]
        s = self.spec
        B, T, _ = x.shape
        H, nope, L = s.num_heads, s.qk_nope_head_dim, s.kv_lora_rank
        if s.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.reshape(B, T, H, nope + s.qk_rope_head_dim)
        q_nope, q_rot = q[..., :nope], q[..., nope:]
        ckv = self.kv_a_proj_with_mqa(x)
        c, k_rot = self.kv_a_layernorm(ckv[..., :L]), ckv[..., L:]
        k_rot = k_rot[:, :, None, :]
        if s.rope is not None:
            q_rot, k_rot = apply_rope(q_rot, batch.positions, s.rope), apply_rope(k_rot, batch.positions, s.rope)
        kv_new = jnp.concatenate([c[:, :, None, :], k_rot], axis=-1)  # [B, T, 1, L + R]
        w = self.kv_b_proj.weight[...].reshape(L, H, nope + s.v_head_dim)
        q_lat = jnp.einsum("bthn,lhn->bthl", q_nope, w[..., :nope])
        qf = jnp.concatenate([q_lat, q_rot], axis=-1)  # absorbed query [B, T, H, L + R]
        if isinstance(cache, PagedKV) and not cache.dense and cache.split is not None:  # heads on a helper
            cache = cache.write(kv_new[:, :, None], batch)
            kv = cache.view()[:, 0]  # [B, S, 1, L + R]
            out_lat = split_attention(qf[:, 0], kv, kv[..., :L], PagedKV.lengths(batch), cache.since,
                                      cache.split_key(), cache.gidx, cache.split, scale=s.scale)[:, None]
        elif isinstance(cache, PagedKV) and cache.inplace:  # prefill, each token over its row's blocks in place
            cache = cache.write(kv_new[:, :, None], batch)
            rows, pos = PagedKV.packed(batch)
            out_lat = select("paged_mla_prefill_attention", self.kernels)(
                qf.reshape(B * T, H, qf.shape[-1]), cache.pool, cache.table, rows, pos, layer=cache.layer,
                kv_lora_rank=L, scale=s.scale).reshape(B, T, H, L)
        elif isinstance(cache, PagedKV) and not cache.dense:
            cache = cache.write(kv_new[:, :, None], batch)
            out_lat = select("paged_mla_attention", self.kernels)(
                qf[:, 0], cache.pool, cache.table, PagedKV.lengths(batch), layer=cache.layer, kv_lora_rank=L,
                scale=s.scale, total_blocks=cache.total_blocks)[:, None]
        else:
            if isinstance(cache, PagedKV):  # prefill: the layer's blocks with the chunk written
                cache = cache.write(kv_new[:, :, None], batch)
                kv = kv_new.astype(cache.pool.dtype) if batch.fresh else cache.view()[:, 0]
            else:
                kv = write_full(cache["kv"], kv_new, batch)
                cache = {"kv": kv}
            k_pos, k_valid = full_positions(kv.shape[1], batch)
            out_lat = select("batched_attention", self.kernels)(qf, kv, kv[..., :L], batch.positions, k_pos, k_valid,
                                                                scale=s.scale)
        out = jnp.einsum("bthl,lhv->bthv", out_lat, w[..., nope:]).reshape(B, T, H * s.v_head_dim)
        return self.o_proj(out), cache
