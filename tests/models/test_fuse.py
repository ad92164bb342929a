"""Projections fused at load (models/fuse.py): one product gives each part's output, also tensor-parallel, where
each device's shard of the fused weight holds its own shards of the parts; the engine fuses every GQA layer's
Q/K/V and every dense MLP's gate/up, and its logits are the checkpoint's (tests/models/test_parity.py compares the
fused engine with transformers for every family)."""

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxserve import LLM
from jaxserve.models.fuse import Fused


class Part:
    def __init__(self, w, b=None):
        self.weight, self.kernels, self.has_bias = _Ref(w), "reference", b is not None
        if b is not None:
            self.bias = _Ref(b)


class _Ref:
    def __init__(self, a):
        self.a = a
        self.shape = a.shape

    def __getitem__(self, _):
        return self.a


def test_one_product_gives_every_part_also_tensor_parallel():
    r = np.random.default_rng(0)
    x = jnp.asarray(r.normal(size=(3, 5, 8)), jnp.float32)
    ws = [r.normal(size=(8, n)).astype(np.float32) for n in (8, 4, 4)]
    bs = [r.normal(size=(n,)).astype(np.float32) for n in (8, 4, 4)]
    want = [x @ w + b for w, b in zip(ws, bs)]
    got = Fused([Part(jnp.asarray(w), jnp.asarray(b)) for w, b in zip(ws, bs)], 1)(x)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:2])
    col = NamedSharding(mesh, P(None, "tp"))
    parts = [Part(jax.device_put(jnp.asarray(w), col)) for w in ws]
    shards = [[np.asarray(s.data) for s in p.weight.a.addressable_shards] for p in parts]
    f = Fused(parts, 2)
    assert f.weight[...].sharding.is_equivalent_to(col, 2)
    for d, s in enumerate(f.weight[...].addressable_shards):  # device d: its shard of q, then of k, then of v
        np.testing.assert_array_equal(s.data, np.concatenate([p[d] for p in shards], axis=1))
    got = jax.jit(f.__call__)(x)
    for g, w in zip(got, [x @ w for w in ws]):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
    assert all(p.weight.a.is_deleted() for p in parts)  # the parts' memory is freed


def test_the_engine_fuses_gqa_and_dense_mlp_layers(checkpoint_dir):
    llama = LLM(checkpoint_dir("llama"), progress=False)
    assert llama.engine.fused == 2 * 4  # Q/K/V and gate/up in each of its 4 layers
    structure = str(llama.graphdef)  # names the fused products, not the parts
    assert "qkv" in structure and "gate_up" in structure and "q_proj" not in structure
    deepseek = LLM(checkpoint_dir("deepseek_v3"), progress=False)
    assert deepseek.engine.fused == 1  # MLA attention, MoE but for the first (dense) layer's MLP
