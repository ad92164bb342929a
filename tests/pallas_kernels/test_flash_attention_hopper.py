"""The Hopper (Mosaic GPU) flash attention: its key-tile ranges against a brute-force count, its lowering for
CUDA (on any machine), which calls it takes, and on a Hopper GPU its numbers against the reference."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.pallas_kernels import flash_attention_hopper as fh
from jaxserve.pallas_kernels.flash_attention import flash_attention, ref_flash_attention

from .conftest import randn

LAYOUTS = [[1, 7, 130, 64, 200, 3], [300, 77, 129], [250, 6], [128, 128, 128], [100], [64], [1]]


def _cu(lens):
    return jnp.asarray(np.concatenate([[0], np.cumsum(lens)]), jnp.int32)


@pytest.mark.parametrize("bkv", [64, 128])
@pytest.mark.parametrize("lens,T", [(lens, sum(lens) + pad) for lens in LAYOUTS for pad in (0, 37)]
                         + [([5, 9], 384), ([200, 56], 256)])
def test_ranges_match_a_brute_force_count(lens, T, bkv):
    """Per compute tile: [lo, hi) is exactly the key tiles holding a key some row of the tile sees, [mlo, mhi)
    exactly those every (real) row sees all of; a tile with no real row passes over its program's range; a
    program streams the union of its two tiles' ranges."""
    bq = 64
    Tp = -(-T // 128) * 128
    rng, prg, start = (np.asarray(x) for x in fh._ranges(_cu(lens), Tp, bq, bkv))
    total = sum(lens)
    seg = np.repeat(np.arange(len(lens)), lens)
    t = np.arange(Tp)
    np.testing.assert_array_equal(start[:total], np.concatenate([[0], np.cumsum(lens)])[seg])
    assert (start[total:] == fh._NO_ROW).all()
    sees = np.zeros((Tp, Tp), bool)  # sees[t, u]: row t sees key u
    sees[:total, :total] = (seg[:, None] == seg[None, :]) & (t[None, :total] <= t[:total, None])
    for i in range(Tp // bq):
        rows = [r for r in range(i * bq, (i + 1) * bq) if r < total]
        lo, mlo, mhi, hi = rng[i]
        plo, phi = prg[i // 2]
        if not rows:
            assert lo == mlo == mhi == hi == plo
            continue
        tiles = sees[rows].reshape(len(rows), -1, bkv)
        some = np.nonzero(tiles.any(axis=(0, 2)))[0]
        every = np.nonzero(tiles.all(axis=(0, 2)))[0]
        assert (lo, hi) == (some.min(), some.max() + 1)
        assert list(range(mlo, mhi)) == list(every), (i, rng[i], every)
        assert lo <= mlo <= mhi <= hi and plo <= lo and hi <= phi
    for p in range(Tp // (2 * bq)):
        real = [rng[2 * p + w] for w in range(2) if 2 * p * bq + w * bq < total]
        if real:
            assert tuple(prg[p]) == (min(r[0] for r in real), max(r[3] for r in real))


@pytest.mark.parametrize("D,Hq,Hkv,dtype", [(128, 8, 2, jnp.bfloat16), (64, 16, 2, jnp.bfloat16),
                                            (256, 4, 1, jnp.float16)])
def test_lowers_for_cuda(D, Hq, Hkv, dtype):
    """The kernel traces and lowers to a Mosaic GPU custom call on a machine without a GPU (so an API change
    in Pallas shows here, not first on a GPU)."""
    text = fh.lower_for_cuda(T=300, Hq=Hq, Hkv=Hkv, D=D, dtype=dtype)
    assert "mosaic_gpu" in text


def test_which_calls_it_takes():
    r = np.random.RandomState(0)
    q, k = randn(r, (64, 4, 128), jnp.bfloat16), randn(r, (64, 2, 128), jnp.bfloat16)
    ok = dict(causal=True, sliding_window=None, sinks=None)
    assert fh.unsupported(q, k, k, **ok) is None
    assert "window" in fh.unsupported(q, k, k, **{**ok, "sliding_window": 16})
    assert "sinks" in fh.unsupported(q, k, k, **{**ok, "sinks": jnp.zeros(4)})
    assert "bfloat16" in fh.unsupported(q.astype(jnp.float32), k.astype(jnp.float32), k.astype(jnp.float32), **ok)
    assert "head dims" in fh.unsupported(q[..., :96], k[..., :96], k[..., :96], **ok)
    assert "head dims" in fh.unsupported(q, k, k[..., :64], **ok)


@pytest.mark.skipif(fh.is_hopper(), reason="on a Hopper GPU the kernel runs")
def test_asking_for_it_elsewhere_is_refused():
    r = np.random.RandomState(0)
    q = randn(r, (64, 4, 128), jnp.bfloat16)
    with pytest.raises(ValueError, match="not a Hopper GPU"):
        flash_attention(q, q, q, cu_seqlens=_cu([64]), hopper=True)


@pytest.mark.skipif(not fh.is_hopper(), reason="needs a Hopper GPU (H100, H200)")
@pytest.mark.parametrize("lens,pad,Hq,Hkv,D,dtype", [
    ([300, 77, 129], 6, 16, 2, 64, jnp.bfloat16), ([250, 6], 0, 4, 1, 256, jnp.float16),
    ([1, 7, 130, 64, 200, 3], 0, 8, 2, 128, jnp.bfloat16), ([1024, 2048, 512, 512], 0, 32, 8, 128, jnp.bfloat16),
    ([358, 396, 253, 157, 399, 51, 69], 23, 8, 2, 64, jnp.bfloat16), ([87], 13, 8, 2, 256, jnp.bfloat16),
    ([128, 128, 128], 0, 8, 8, 128, jnp.float16)])
def test_matches_the_reference_on_hopper(lens, pad, Hq, Hkv, D, dtype):
    """Segments starting inside a key tile (rows whose first tiles are all masked), padding rows, GQA groups
    of 1 to 8, head dims 64 / 128 / 256: the same numbers as the reference, zeros past the last sequence."""
    r = np.random.RandomState(1)
    T = sum(lens) + pad
    q, k, v = (randn(r, (T, h, D), dtype) * 0.5 for h in (Hq, Hkv, Hkv))
    got = flash_attention(q, k, v, cu_seqlens=_cu(lens), hopper=True)
    want = ref_flash_attention(q, k, v, cu_seqlens=_cu(lens))
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32), atol=3e-2, rtol=0)
    assert not np.asarray(got[sum(lens):], np.float32).any()
