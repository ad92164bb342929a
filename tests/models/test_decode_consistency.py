"""The cache path against the no-cache path: prefilling in chunks then decoding must reproduce the logits of
one prefill over the whole sequence (full KV, sliding-window rings, MLA latents, linear states)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.batch import Batch
from jaxserve.models.cache_spec import init_dense_cache
from jaxserve.models.config import load_config
from jaxserve.models.loader import load_state
from jaxserve.models.model import jit_forward


@pytest.mark.parametrize("name", ["gpt_oss", "kimi_linear", "qwen3_next", "mimo_v2_flash", "deepseek_v3"])
def test_chunked_prefill_and_decode_match_full_prefill(name, checkpoint_dir):
    d = checkpoint_dir(name)
    cfg = load_config(d)
    graphdef, state = load_state(d, cfg, jnp.float32, progress=False)
    fwd = jit_forward(graphdef)
    ids = np.random.RandomState(3).randint(3, 256, size=(2, 24)).astype(np.int32)
    lens = np.array([24, 17])
    S = 32
    full, _ = fwd(state, Batch(jnp.asarray(ids), jnp.zeros(2, jnp.int32), jnp.asarray(lens, jnp.int32)),
                  init_dense_cache(cfg, 2, S, jnp.float32), jnp.broadcast_to(jnp.arange(24), (2, 24)))
    full = np.asarray(full)
    # chunks of 9 tokens (longer than every window) for sequence 0 and 5 for sequence 1, then single steps
    cache = init_dense_cache(cfg, 2, S, jnp.float32)
    pos = np.zeros(2, np.int32)
    got = [[], []]
    for step in [(9, 5), (9, 5), (1, 5), (1, 1), (1, 1), (1, 0), (1, 0), (1, 0)]:
        T = max(step)
        tok = np.zeros((2, T), np.int32)
        n = np.minimum(np.array(step), lens - pos)
        for b in range(2):
            tok[b, :n[b]] = ids[b, pos[b]:pos[b] + n[b]]
        logits, cache = fwd(state, Batch(jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(n, jnp.int32)), cache,
                            jnp.broadcast_to(jnp.arange(T), (2, T)))
        for b in range(2):
            got[b].extend(np.asarray(logits[b, :n[b]]))
        pos = pos + n
    assert list(pos) == [24, 17]
    for b in range(2):
        np.testing.assert_allclose(np.stack(got[b]), full[b, :lens[b]], atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["llama", "qwen3_next", "deepseek_v3"])
def test_packed_batch_matches_padded(name, checkpoint_dir):
    """A batch whose residual stream holds only its real tokens (packed, with padding after them) gives the
    padded batch's logits and caches: only the mixers see the [B, T] layout."""
    d = checkpoint_dir(name)
    cfg = load_config(d)
    graphdef, state = load_state(d, cfg, jnp.float32, progress=False)
    fwd = jit_forward(graphdef)
    r = np.random.RandomState(5)
    lens = np.array([13, 0, 4, 16])
    B, T = 4, 16
    ids = np.zeros((B, T), np.int32)
    for b, n in enumerate(lens):
        ids[b, :n] = r.randint(3, 256, size=n)
    packed = np.full(40, B * T, np.int32)  # 33 real tokens, 7 of padding
    packed[:lens.sum()] = np.concatenate([b * T + np.arange(n) for b, n in enumerate(lens)])
    idx = jnp.broadcast_to(jnp.arange(T), (B, T))
    out = []
    for p in (None, jnp.asarray(packed)):
        batch = Batch(jnp.asarray(ids), jnp.asarray([0, 0, 3, 0], jnp.int32), jnp.asarray(lens, jnp.int32), p)
        logits, cache = fwd(state, batch, init_dense_cache(cfg, B, 32, jnp.float32), idx)
        out.append((np.asarray(logits), cache))
    (want, want_cache), (got, got_cache) = out
    for b, n in enumerate(lens):
        np.testing.assert_allclose(got[b, :n], want[b, :n], atol=1e-4, rtol=0)
    for b, n in enumerate(lens):  # the caches the rows wrote
        for x, y in zip(jax.tree.leaves(got_cache), jax.tree.leaves(want_cache)):
            np.testing.assert_allclose(np.asarray(x)[b], np.asarray(y)[b], atol=1e-4, rtol=0)
