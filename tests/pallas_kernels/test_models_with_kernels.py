"""Every family gives the same logits with the Pallas kernels (interpret mode) as with the references: a
chunked prefill of two ragged sequences, then decode steps, through the dense-cache path."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.batch import Batch
from jaxserve.models.cache_spec import init_dense_cache
from jaxserve.models.config import load_config
from jaxserve.models.loader import load_state
from jaxserve.models.model import jit_forward, kernel_cases, model_graphdef
from jaxserve.pallas_kernels import check
from tests.pallas_kernels.conftest import MODE
from tests.tiny_models import FAMILIES


def _run(fwd, state, cfg, ids, lens):
    """Prefill 6 then 7 tokens, then 3 single steps; logits of every valid token, per sequence."""
    cache = init_dense_cache(cfg, 2, 32, jnp.float32)
    pos = np.zeros(2, np.int32)
    got = [[], []]
    for T in (6, 7, 1, 1, 1):
        n = np.minimum(T, lens - pos).astype(np.int32)
        tok = np.zeros((2, T), np.int32)
        for b in range(2):
            tok[b, :n[b]] = ids[b, pos[b]:pos[b] + n[b]]
        logits, cache = fwd(state, Batch(jnp.asarray(tok), jnp.asarray(pos), jnp.asarray(n)), cache,
                            jnp.broadcast_to(jnp.arange(T), (2, T)))
        for b in range(2):
            got[b].extend(np.asarray(logits[b, :n[b]]))
        pos = pos + n
    return [np.stack(g) for g in got]


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_same_logits_with_kernels_on_and_off(name, checkpoint_dir):
    d = checkpoint_dir(name)
    cfg = load_config(d)
    graphdef, state = load_state(d, cfg, jnp.float32, progress=False)
    ids = np.random.RandomState(5).randint(3, 256, size=(2, 16)).astype(np.int32)
    lens = np.array([16, 11])
    # on a GPU the engine's path: kernels where they pass the self-test, references where not
    kernels = MODE if MODE == "interpret" else check.plan("auto", kernel_cases(cfg, jnp.float32, 16))[0]
    ref_fwd, ker_fwd = jit_forward(graphdef), jit_forward(model_graphdef(cfg, jnp.float32, kernels))
    # the kernel graph really runs Pallas kernels (prefill and decode shapes), the reference graph none
    for T in (6, 1):
        args = (state, Batch(jnp.zeros((2, T), jnp.int32), jnp.zeros(2, jnp.int32), jnp.full(2, T, jnp.int32)),
                init_dense_cache(cfg, 2, 32, jnp.float32), jnp.zeros((2, 1), jnp.int32))
        assert "pallas_call" in str(jax.make_jaxpr(ker_fwd)(*args))
        assert "pallas_call" not in str(jax.make_jaxpr(ref_fwd)(*args))
    ref = _run(ref_fwd, state, cfg, ids, lens)
    ker = _run(ker_fwd, state, cfg, ids, lens)
    for b in range(2):
        assert ref[b].shape == (lens[b], cfg.vocab_size)
        np.testing.assert_allclose(ker[b], ref[b], atol=2e-4, rtol=0)


def test_kernel_mode_is_validated():
    from jaxserve.pallas_kernels.select import resolve, select
    with pytest.raises(ValueError, match="kernels must be one of"):
        resolve("cuda")
    assert resolve("auto") == ("native" if MODE == "interpret" else "pallas")  # Pallas on GPU, C++ on CPU
    from jaxserve.pallas_kernels.flash_attention import ref_flash_attention
    assert select("flash_attention", "reference") is ref_flash_attention
    assert select("flash_attention", "interpret").keywords == {"interpret": True}
