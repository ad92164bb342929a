"""Attention over disjoint key parts merged with the partial-softmax rule equals attention over all keys."""

import jax.numpy as jnp
import numpy as np

from jaxserve.pallas_kernels.merge import add_sinks, merge_partials, normalize, ref_partial_attention


def _full(q, k, v, mask, scale, sinks=None):
    s = np.where(mask, np.einsum("qd,sd->qs", q, k) * scale, -np.inf)
    if sinks is not None:
        s = np.concatenate([s, sinks[:, None]], axis=1)
        v = np.concatenate([v, np.zeros((1, v.shape[1]))])
    p = np.exp(s - s.max(1, keepdims=True))
    return (p / p.sum(1, keepdims=True)) @ v


def test_merge_of_parts_equals_full_softmax():
    r = np.random.RandomState(0)
    Q, S, D, Dv = 5, 23, 8, 6
    q, k, v = r.randn(Q, D), r.randn(S, D), r.randn(S, Dv)
    mask = r.rand(Q, S) > 0.3
    mask[:, 0] = True
    part = r.randint(0, 4, S)  # four parts; part 3 then loses all its keys below
    mask[:, part == 3] = False
    triples = [ref_partial_attention(jnp.asarray(q), jnp.asarray(k[part == j]), jnp.asarray(v[part == j]),
                                     jnp.asarray(mask[:, part == j]), scale=0.4) for j in range(4)]
    o, m, l = (jnp.stack(x) for x in zip(*triples))
    merged = merge_partials(o, m, l)
    np.testing.assert_allclose(np.asarray(normalize(merged[0], merged[2])), _full(q, k, v, mask, 0.4), atol=1e-5)
    # associative: ((0, 1), (2, 3)) merges to the same triple
    left = merge_partials(o[:2], m[:2], l[:2])
    right = merge_partials(o[2:], m[2:], l[2:])
    again = merge_partials(*(jnp.stack(x) for x in zip(left, right)))
    np.testing.assert_allclose(np.asarray(normalize(again[0], again[2])),
                               np.asarray(normalize(merged[0], merged[2])), atol=1e-6)
    sinks = r.randn(Q)
    with_sinks = add_sinks(*merged, jnp.asarray(sinks))
    np.testing.assert_allclose(np.asarray(normalize(with_sinks[0], with_sinks[2])),
                               _full(q, k, v, mask, 0.4, sinks), atol=1e-5)
