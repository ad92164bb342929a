"""bench/paged_candidates.py: the candidate designs of paged decode attention give the product reference's numbers
on every case of the product kernel's test (interpret mode here, compiled on a GPU), and lower for CUDA to one
Triton kernel at the benchmark's head layout."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import paged_candidates as pc
from jaxserve.pallas_kernels import check
from jaxserve.pallas_kernels.paged_attention import ref_paged_attention
from tests.pallas_kernels.conftest import INTERPRET, close, randn
from tests.pallas_kernels.test_paged_attention import CASES, _tables

DESIGNS = [dict(prefetch=True), dict(fused=True), dict(prefetch=True, fused=True), dict(heads=True),
           dict(heads=True, prefetch=True), dict(heads=True, fused=True)]


@pytest.mark.parametrize("design", DESIGNS, ids=lambda d: "+".join(d))
@pytest.mark.parametrize("case", CASES)
def test_candidate_matches_reference(case, design):
    dtype, E, Hq, Hkv, Dk, D, bs, lengths, window, use_sinks, ppt, ppp = case
    r = np.random.RandomState(bs + Hq)
    B, NB = len(lengths), 40
    W = -(-max(lengths) // bs)
    pool, q = randn(r, (NB, 3, E, bs, Hkv, D), dtype), randn(r, (B, Hq, Dk), dtype)
    table, lens = _tables(r, B, W, NB), jnp.asarray(lengths, jnp.int32)
    sinks = randn(r, (Hq,)) if use_sinks else None
    kw = dict(layer=1, sliding_window=window, sinks=sinks, pages_per_tile=ppt,
              pages_per_partition=None if design.get("fused") else ppp)
    if design.get("fused") and use_sinks:
        with pytest.raises(ValueError, match="sinks"):
            pc.paged_attention(q, pool, table, lens, interpret=INTERPRET, **kw, **design)
        kw["sinks"] = None
    got = jax.jit(functools.partial(pc.paged_attention, interpret=INTERPRET, **kw, **design))(q, pool, table, lens)
    assert got.shape == (B, Hq, D if E == 2 else D - Dk) and got.dtype == dtype
    close(got, ref_paged_attention(q, pool, table, lens, **kw), dtype)
    if lengths[0] == 0:
        assert not np.asarray(got[0], np.float32).any()


def test_fused_needs_one_partition():
    pool, q = jnp.zeros((8, 1, 2, 4, 2, 8)), jnp.zeros((2, 4, 8))
    table, lens = jnp.zeros((2, 4), jnp.int32), jnp.ones(2, jnp.int32)
    with pytest.raises(ValueError, match="must cover the table"):
        pc.paged_attention(q, pool, table, lens, layer=0, fused=True, pages_per_tile=1, pages_per_partition=2)


@pytest.mark.parametrize("design", [{}] + DESIGNS, ids=lambda d: "+".join(d) or "product")
def test_candidate_lowers_to_one_triton_kernel(design):
    """The benchmark's head layout (bench/kernels.py's GPU case, fewer requests and blocks): Pallas' Triton
    lowering takes every design (tile rules, the carried prefetch) without a GPU."""
    B, Hq, Hkv, D, bs, W, NB = 2, 32, 8, 128, 16, 8, 32
    spec = jax.ShapeDtypeStruct
    args = (spec((B, Hq, D), jnp.bfloat16), spec((NB, 1, 2, bs, Hkv, D), jnp.bfloat16), spec((B, W), jnp.int32),
            spec((B,), jnp.int32))
    fn = jax.jit(functools.partial(pc.paged_attention, layer=0, pages_per_tile=2, num_warps=4, **design))
    assert check.triton_calls(check.cuda_text(fn, *args)) == 1
