"""A class-stacked model's layers scanned over their periods (models/stack.py `class_period`, models/model.py
`_period_layers`) against switch mode and the unrolled model: the same logits and caches, and a program without
the conditional switch mode runs."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxserve.models.stack import LayerStack, class_period


def classes_of(kinds: str) -> tuple[tuple[int, ...], ...]:
    """Layer classes (in order of their first layer) from one letter a layer."""
    order = list(dict.fromkeys(kinds))
    return tuple(tuple(i for i, k in enumerate(kinds) if k == c) for c in order)


@pytest.mark.parametrize("kinds,period", [
    ("sf" * 12, 2),  # gpt-oss-20b: sliding and full attention alternating
    ("lllf" * 12, 4),  # Qwen3-Next: three linear-attention layers, one full
    ("ddd" + "m" * 58, 61),  # DeepSeek-V3: three dense layers, then MoE: the model is one period
    ("a" + "bbc" + "bbbc" * 11, None),  # Kimi Linear: a first layer of its own, then three KDA, one MLA
    ("fssfss", 3),  # runs of one class inside the period
    ("sfsfsf" + "ss", None),
    ("sfs" * 2, None),  # the sliding layers in two runs of the period: they would compile twice
])
def test_class_period(kinds, period):
    assert class_period(classes_of(kinds)) == period


@pytest.mark.parametrize("family", ["gpt_oss", "qwen3_next", "kimi_linear", "mimo_v2_flash"])
def test_period_scan_matches_switch_mode_and_the_unrolled_model(checkpoint_dir, family):
    from jaxserve.checkpoint import load_any
    from jaxserve.models.batch import Batch
    from jaxserve.models.cache_spec import init_dense_cache
    from jaxserve.models.config import load_config
    from jaxserve.models.model import make_forward, model_graphdef
    from jaxserve.models.stack import layer_classes

    path = checkpoint_dir(family)
    cfg = load_config(path)
    _, state = load_any(path, cfg, "float32", None, False)
    graphdef = model_graphdef(cfg, jnp.float32, "reference")
    classes = layer_classes(cfg)
    assert class_period(classes) is not None
    ids = list(range(3, 22))
    batch = Batch(jnp.asarray([ids + [0] * 5], jnp.int32), jnp.zeros(1, jnp.int32),
                  jnp.asarray([len(ids)], jnp.int32))
    cache = init_dense_cache(cfg, 1, 32, jnp.float32)
    idx = jnp.arange(len(ids), dtype=jnp.int32)[None]
    outs, programs = {}, {}
    for name, stack in (("unrolled", None), ("switch", LayerStack((), classes, periods=False)),
                        ("periods", LayerStack((), classes))):
        params = state if stack is None else stack.stack(state)
        fn = jax.jit(make_forward(graphdef, stack))
        programs[name] = fn.lower(params, batch, cache, idx).compile().as_text()
        outs[name] = fn(params, batch, cache, idx)
    assert "conditional" in programs["switch"] and "conditional" not in programs["periods"]
    for name in ("switch", "periods"):
        jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=1e-5),
                     outs[name], outs["unrolled"])
