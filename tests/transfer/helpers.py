"""A small hybrid cache layout (full + sliding + linear groups) and numpy export for host-side transfer tests."""

from __future__ import annotations

import numpy as np

from jaxserve.cache.layout import PoolLayout
from jaxserve.models.cache_spec import CacheGroup, CacheSpec
from jaxserve.transfer.plan import Staging

SPEC = CacheSpec((
    CacheGroup("full", (0, 2, 4), kv_heads=2, k_dim=8, v_dim=8),
    CacheGroup("sliding", (1,), kv_heads=2, k_dim=8, v_dim=8, window=4),
    CacheGroup("linear", (3,), conv_shape=(3, 16), ssm_shape=(2, 4, 4)),
))


def layout(num_blocks: int = 32, block_size: int = 4, slots: int = 2) -> PoolLayout:
    return PoolLayout.build(SPEC, block_size, num_blocks, slots, 0)


def random_pool(lay: PoolLayout, seed: int = 0) -> list:
    rng = np.random.default_rng(seed)
    out = []
    for s in lay.shapes(np.float32):
        if isinstance(s, dict):
            out.append({k: rng.standard_normal(v.shape).astype(np.float32) for k, v in s.items()})
        else:
            out.append(rng.standard_normal(s.shape).astype(np.float32))
    return out


def export(lay: PoolLayout, pool: list, st: Staging, blocks: list[int], row: int) -> list[np.ndarray]:
    """What prefill hands the sender, computed with numpy: staged arrays from a pool (head parts sliced out of
    the whole arrays)."""
    out = []
    for w, parts in st.logical:
        arr = pool[w.group]
        if w.kind == "blocks":
            x = np.zeros(w.shape, np.float32)
            x[:w.rows] = arr[w.span_of(blocks)][:, w.j0:w.j1]
        elif w.kind == "ring":
            x = arr[row, w.j0:w.j1]
        else:
            x = arr[w.kind][row, w.j0:w.j1]
        h = w.shape[-2] // len(parts) if len(parts) > 1 else None
        out += [np.ascontiguousarray(x[..., p.part * h:(p.part + 1) * h, :] if h else x) for p in parts]
    return out
