"""The jnp gated-delta-rule references against transformers' torch fallbacks, on random inputs."""

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

from pallas_kernels.gated_delta_rule import ref_chunk_gated_delta_rule, ref_recurrent_gated_delta_rule


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
