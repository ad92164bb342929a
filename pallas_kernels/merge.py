"""Attention computed in parts, merged exactly (BanaServe eqs. 6-10).

Split the keys of one query into disjoint parts j (on different devices, or different tiles of a kernel).
Each part returns the triple of eqs. 6-9 before normalisation, kept stable by its own running max m_j:
    S_j = q K_j^T * scale                    (6)
    A_j = exp(S_j - m_j),  m_j = max S_j     (7, shifted)
    l_j = sum_i A_j,i                        (8, the partial denominator)
    O_j = A_j V_j                            (9, the unnormalised numerator)
and the merge rescales every part to the common max m = max_j m_j before summing (10):
    l = sum_j exp(m_j - m) l_j,   O = sum_j exp(m_j - m) O_j / l.
Dividing each O_j by the global l, not by its partial l_j, is what makes the sum equal the softmax over all
keys. A part with no keys has (O, m, l) = (0, NEG, 0) and drops out; an attention sink is a part with no
value: (0, sink, 1). Merging is associative, so `merge_partials` results merge again.
"""

from __future__ import annotations

import jax.numpy as jnp

NEG = -1e30


def ref_partial_attention(q, k, v, mask, *, scale: float):
    """One part: q [..., Q, D]; k [..., S, D]; v [..., S, Dv]; mask [..., Q, S] bool
    -> (O [..., Q, Dv] float32 unnormalised, m [..., Q] float32, l [..., Q] float32)"""
    s = jnp.einsum("...qd,...sd->...qs", q, k, preferred_element_type=jnp.float32) * scale
    s = jnp.where(mask, s, NEG)
    m = s.max(-1)
    p = jnp.where(mask, jnp.exp(s - m[..., None]), 0.0)
    return jnp.einsum("...qs,...sd->...qd", p.astype(v.dtype), v, preferred_element_type=jnp.float32), m, p.sum(-1)


def merge_partials(o, m, l, axis: int = 0):
    """Merge parts stacked on `axis`: o [..., P, ..., Dv] (unnormalised), m and l [..., P, ...]
    -> the merged unnormalised triple (o [..., Dv], m, l)."""
    m_all = m.max(axis=axis)
    w = jnp.exp(m - jnp.expand_dims(m_all, axis))  # [..., P, ...]
    return (w[..., None] * o).sum(axis=axis), m_all, (w * l).sum(axis=axis)


def add_sinks(o, m, l, sinks):
    """Join per-head sink logits (shape of m) to a merged triple: a part with no value."""
    sinks = sinks.astype(jnp.float32)
    m_all = jnp.maximum(m, sinks)
    w = jnp.exp(m - m_all)
    return w[..., None] * o, m_all, w * l + jnp.exp(sinks - m_all)


def normalize(o, l):
    """The attention output O / l (zeros where no key was visible): o [..., Dv], l [...] -> [..., Dv] float32."""
    return o / jnp.where(l > 0, l, 1.0)[..., None]
