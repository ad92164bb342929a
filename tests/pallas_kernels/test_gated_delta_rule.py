"""The jnp gated-delta-rule references against transformers' torch fallbacks on random inputs, and the
Pallas kernels (interpret mode, jitted) against the references."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from jaxserve.pallas_kernels.gated_delta_rule import (chunk_gated_delta_rule, recurrent_gated_delta_rule,
                                             ref_chunk_gated_delta_rule, ref_recurrent_gated_delta_rule)
from tests.pallas_kernels.conftest import INTERPRET, close


def _inputs(per_channel: bool, T=37, B=2, H=3, Dk=8, Dv=6, seed=0):
    r = np.random.RandomState(seed)
    q, k = r.randn(B, T, H, Dk).astype(np.float32), r.randn(B, T, H, Dk).astype(np.float32)
    v = r.randn(B, T, H, Dv).astype(np.float32)
    g = -np.abs(r.randn(*((B, T, H, Dk) if per_channel else (B, T, H)))).astype(np.float32) * 0.5
    beta = (1 / (1 + np.exp(-r.randn(B, T, H)))).astype(np.float32)
    s0 = r.randn(B, H, Dk, Dv).astype(np.float32) * 0.1
    return q, k, v, g, beta, s0


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("chunk_size", [8, 16])
def test_chunk_reference_matches_transformers(per_channel, chunk_size):
    q, k, v, g, beta, s0 = _inputs(per_channel)
    tt = [torch.tensor(x) for x in (q, k, v, g, beta, s0)]
    fn = chunk_kimi_delta_attention if per_channel else torch_chunk_gated_delta_rule
    ref_o, ref_s = fn(*tt[:5], chunk_size=chunk_size, initial_state=tt[5], output_final_state=True,
                      use_qk_l2norm_in_kernel=True)
    o, s = ref_chunk_gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)), chunk_size=chunk_size,
                                      initial_state=jnp.asarray(s0), output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(np.asarray(o), ref_o.numpy(), atol=2e-5)
    np.testing.assert_allclose(np.asarray(s), ref_s.numpy(), atol=2e-5)
    o2, s2 = ref_recurrent_gated_delta_rule(*map(jnp.asarray, (q, k, v, g, beta)), initial_state=jnp.asarray(s0),
                                            output_final_state=True, use_qk_l2norm_in_kernel=True)
    np.testing.assert_allclose(np.asarray(o2), ref_o.numpy(), atol=2e-5)
    np.testing.assert_allclose(np.asarray(s2), ref_s.numpy(), atol=2e-5)


KERNEL_CASES = [  # per_channel, T, chunk, dtype, initial state, decay scale, l2norm
    (False, 37, 16, jnp.float32, True, 1.0, True),  # ragged: 2 chunks + a partial one
    (True, 37, 16, jnp.float32, True, 1.0, True),
    (True, 32, 32, jnp.bfloat16, False, 1.0, True),  # exactly one chunk
    (False, 1, 16, jnp.bfloat16, True, 1.0, False),  # length 1
    (True, 40, 32, jnp.float32, True, 40.0, True),  # strong decay: exponents far below float32 range
    (True, 64, 64, jnp.float32, False, 1.0, True),  # the default chunk size
]


@pytest.mark.parametrize("case", KERNEL_CASES)
def test_chunk_kernel_matches_reference(case):
    per_channel, T, C, dtype, with_state, decay, l2 = case
    q, k, v, g, beta, s0 = _inputs(per_channel, T=T, seed=T)
    q, k, v = (jnp.asarray(x, dtype) for x in (q, k, v))
    g, beta = jnp.asarray(g * decay), jnp.asarray(beta, dtype)
    s0 = jnp.asarray(s0) if with_state else None
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=l2)
    o, s = jax.jit(functools.partial(chunk_gated_delta_rule, chunk_size=C, interpret=INTERPRET, **kw))(q, k, v, g, beta)
    ro, rs = ref_chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=C, **kw)
    assert o.shape == v.shape and o.dtype == dtype and s.dtype == jnp.float32
    assert np.isfinite(np.asarray(s)).all()
    close(o, ro, dtype)
    close(s, rs, dtype)


@pytest.mark.parametrize("per_channel,dtype", [(False, jnp.float32), (True, jnp.bfloat16)])
def test_recurrent_kernel_matches_reference(per_channel, dtype):
    q, k, v, g, beta, s0 = _inputs(per_channel, T=3)
    q, k, v, beta = (jnp.asarray(x, dtype) for x in (q, k, v, beta))
    kw = dict(initial_state=jnp.asarray(s0), output_final_state=True, use_qk_l2norm_in_kernel=True)
    run = jax.jit(functools.partial(recurrent_gated_delta_rule, interpret=INTERPRET, **kw))
    o, s = run(q, k, v, jnp.asarray(g), beta)
    ro, rs = ref_recurrent_gated_delta_rule(q, k, v, jnp.asarray(g), beta, **kw)
    close(o, ro, dtype)
    close(s, rs, dtype)


def test_kernel_rejects_bad_shapes():
    q, k, v, g, beta, _ = map(jnp.asarray, _inputs(False, T=4))
    with pytest.raises(ValueError, match="g must be"):
        chunk_gated_delta_rule(q, k, v, g[..., None], beta)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=24)
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=jnp.zeros((1, 1, 1, 1)))
