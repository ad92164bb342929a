"""Decode attention split between this instance and a helper holding some heads' older KV (BanaServe's
attention-level migration, section 4.1, eqs. 6-10).

After an attention-level migration the helper instance holds, for each full-attention layer, the KV of some
cache heads (`HeadSplit.kv_heads`; MLA: the latent, which every query head reads) at the positions before
`since` [B], each request's length when it moved. Each decode step this instance still writes the new token's
K/V for every head into its own pool (the pool stays whole: prefix caching, preemption and hand-offs read it as
always), then for every query head:
  moved heads  part 1 here, over positions since..p; part 2 on the helper, over 0..since-1 (`io_callback` to the
               helper: the query of the moved heads goes there, the unnormalised triple (O, m, l) comes back)
  other heads  part 1 here, over 0..p; no part 2
and the parts merge by the partial-softmax rule (pallas_kernels/merge.py), which gives the softmax over all
positions. The helper's reply is looked up by the migration's id (`key`), so one compiled program serves every
migration of the same heads.

`remote_partial` is the host function the program calls; the migration client (engine/migration.py) installs
what it calls through `install`. Pure jnp otherwise; the dense view of the layer's blocks is what the local part
reads (the migrated path is a correctness path first: the usual decode program runs the paged kernels).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import io_callback

from jaxserve.pallas_kernels.merge import NEG, add_sinks, merge_partials, normalize, ref_partial_attention

_REMOTES: dict[int, object] = {}  # migration id -> its client: `partial(group, layer, q, gidx) -> (o, m, l)`


@dataclass(frozen=True)
class HeadSplit:
    """Which query heads compute their older positions on the helper, as (cache head, query group) pairs:
    kv_heads the cache heads the helper holds, q_groups the query heads within each of them (index in the
    group of G query heads sharing a cache head). GQA moves whole cache heads (every q_group); MLA has one cache
    head (the latent) and moves query heads (kv_heads (0,))."""
    kv_heads: tuple[int, ...]
    q_groups: tuple[int, ...]

    @staticmethod
    def of(heads: list[int], num_heads: int, num_kv_heads: int, latent: bool) -> "HeadSplit":
        """heads: the cache heads to move (GQA), or the query heads (MLA: `latent`)."""
        if latent:
            return HeadSplit((0,), tuple(sorted(heads)))
        return HeadSplit(tuple(sorted(heads)), tuple(range(num_heads // num_kv_heads)))


def install(mid: int, client) -> None:
    _REMOTES[mid] = client


def uninstall(mid: int) -> None:
    _REMOTES.pop(mid, None)


def registered(mid: int):
    """The client installed for migration `mid`, or None."""
    return _REMOTES.get(mid)


def remote_partial(key, q, gidx, *, dv: int):
    """Host side of the split (called by the program): key [3] int32 (migration id, cache group, layer in the
    group); q [B, Hh, Gh, D] the moved heads' queries; gidx [B] each row's index in the helper's group (-1:
    padding) -> (o [B, Hh, Gh, Dv] float32, m, l [B, Hh, Gh] float32). A migration that is gone or whose
    helper fails answers an empty part (the client records the failure; the engine redoes the step)."""
    mid, group, layer = (int(x) for x in np.asarray(key))
    client = _REMOTES.get(mid)
    if client is not None:
        got = client.partial(group, layer, np.asarray(q), np.asarray(gidx))
        if got is not None:
            return got
    B, Hh, Gh = q.shape[:3]
    return (np.zeros((B, Hh, Gh, dv), np.float32), np.full((B, Hh, Gh), NEG, np.float32),
            np.zeros((B, Hh, Gh), np.float32))


def split_attention(q, k, v, lengths, since, key, gidx, split: HeadSplit, *, scale: float, sinks=None):
    """One decode step's attention with the moved heads' older positions on the helper.

    q [B, Hq, Dk]; k [B, S, Hkv, Dk], v [B, S, Hkv, Dv] the layer's cache, position p at index p, this step's token
    written; lengths [B] tokens to attend over (0: padding row); since [B] positions before it are on the helper
    for the moved heads; key [3] int32 and gidx [B] int32 for `remote_partial`; sinks [Hq] or None
    -> [B, Hq, Dv] in q's dtype."""
    B, Hq, D = q.shape
    S, Hkv, Dv = k.shape[1], k.shape[2], v.shape[-1]
    G = Hq // Hkv
    qg = q.reshape(B, Hkv, G, D)
    moved = np.zeros((Hkv, G), bool)
    moved[np.ix_(split.kv_heads, split.q_groups)] = True
    pos = jnp.arange(S, dtype=jnp.int32)
    valid = pos[None, :] < lengths[:, None]  # [B, S]
    local = valid[:, None, None, :] & (~jnp.asarray(moved)[None, :, :, None] | (pos >= since[:, None])[:, None, None, :])
    o1, m1, l1 = ref_partial_attention(qg, jnp.swapaxes(k, 1, 2), jnp.swapaxes(v, 1, 2), local, scale=scale)
    kh, qh = np.asarray(split.kv_heads), np.asarray(split.q_groups)
    q_r = qg[:, kh][:, :, qh]  # [B, Hh, Gh, D]
    Hh, Gh = len(kh), len(qh)
    shapes = (jax.ShapeDtypeStruct((B, Hh, Gh, Dv), jnp.float32), jax.ShapeDtypeStruct((B, Hh, Gh), jnp.float32),
              jax.ShapeDtypeStruct((B, Hh, Gh), jnp.float32))
    o_r, m_r, l_r = io_callback(functools.partial(remote_partial, dv=Dv), shapes, key, q_r, gidx, ordered=False)
    at = (slice(None), kh[:, None], qh[None, :])
    o2 = jnp.zeros_like(o1).at[at].set(o_r)
    m2 = jnp.full_like(m1, NEG).at[at].set(m_r)
    l2 = jnp.zeros_like(l1).at[at].set(l_r)
    o, m, l = merge_partials(jnp.stack([o1, o2]), jnp.stack([m1, m2]), jnp.stack([l1, l2]))
    if sinks is not None:
        o, m, l = add_sinks(o, m, l, jnp.broadcast_to(sinks.reshape(Hkv, G), m.shape))
    return normalize(o, l).reshape(B, Hq, Dv).astype(q.dtype)


def held_partial(q, k, v, since, gidx, *, scale: float):
    """The helper's part: q [B, Hh, Gh, D]; k [Bg, S, Hh, Dk], v [Bg, S, Hh, Dv] the held positions of its group's
    Bg requests; since [Bg] how many each holds; gidx [B] the group row of each query row (-1: none)
    -> (o [B, Hh, Gh, Dv], m, l [B, Hh, Gh]) float32."""
    rows = jnp.maximum(gidx, 0)
    n = jnp.where(gidx >= 0, since[rows], 0)
    mask = jnp.arange(k.shape[1])[None, :] < n[:, None]  # [B, S]
    mask = jnp.broadcast_to(mask[:, None, None, :], q.shape[:3] + mask.shape[1:])
    return ref_partial_attention(q, jnp.swapaxes(k[rows], 1, 2), jnp.swapaxes(v[rows], 1, 2), mask, scale=scale)
