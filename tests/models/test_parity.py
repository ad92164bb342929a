"""Every family against the transformers implementation on tiny random checkpoints, float32.

score(): prefill logits at every position within 1e-4 of the transformers forward.
generate(): 16 greedy tokens identical to transformers generate(do_sample=False), for a batch of prompts
of different lengths (longer than the sliding windows of gpt-oss and MiMo), decoded together.
"""

import numpy as np
import pytest
import torch

from jaxserve import LLM, SamplingParams
from tests.tiny_models import FAMILIES

PROMPTS = [list(np.random.RandomState(s).randint(3, 256, size=n)) for s, n in ((0, 19), (1, 7), (2, 12))]


@pytest.fixture(scope="module")
def llms(checkpoint_dir):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = LLM(checkpoint_dir(name), dtype="float32", progress=False)
        return cache[name]

    return get


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_score_matches_transformers(name, llms, checkpoint_dir, hf_model):
    llm = llms(name)
    hf = hf_model(checkpoint_dir(name))
    for ids in PROMPTS[:2]:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        got = llm.score(ids)
        assert got.shape == ref.shape
        assert np.abs(ref).max() > 1.0  # logits of order 1, so the tolerance means something
        np.testing.assert_allclose(got, ref, atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_greedy_generate_matches_transformers(name, llms, checkpoint_dir, hf_model):
    llm = llms(name)
    hf = hf_model(checkpoint_dir(name))
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    for ids, out in zip(PROMPTS, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(ids):].tolist()
        assert out.token_ids == ref
        assert out.finish_reason == "length"


def test_generate_stops_on_eos(llms):
    llm = llms("llama")
    ref = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    stop = ref.token_ids[3]
    out = llm.generate([PROMPTS[0]], SamplingParams(max_tokens=8, temperature=0.0, stop_token_ids=[stop]))[0]
    assert out.token_ids == ref.token_ids[:ref.token_ids.index(stop) + 1]
    assert out.finish_reason == "stop"


def test_seeded_sampling_is_reproducible(llms):
    llm = llms("qwen3")
    p = SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9, top_k=50, seed=7, ignore_eos=True)
    a = llm.generate([PROMPTS[1]], p)[0].token_ids
    b = llm.generate([PROMPTS[1]], p)[0].token_ids
    assert a == b and len(a) == 10


@pytest.mark.parametrize("name", ["llama", "deepseek_v3", "kimi_linear", "gpt_oss"])
def test_bfloat16_stays_close_to_float32(name, checkpoint_dir):
    """bf16 weights and activations against float32, per position (max over the vocabulary).

    Measured (32 tokens, |logits| up to ~4): dense and MLA families within 0.14 everywhere; MoE / hybrid
    medians <= 0.13, with isolated positions up to ~2 where bf16 rounding flips an expert choice at a near
    tie (transformers' own bf16 forward deviates 1.3 on the same Kimi checkpoint).
    """
    ids = list(np.random.RandomState(0).randint(3, 256, size=32))
    f32 = LLM(checkpoint_dir(name), dtype="float32", progress=False).score(ids)
    bf16 = LLM(checkpoint_dir(name), dtype="bfloat16", progress=False).score(ids)
    assert bf16.dtype == np.float32 and bf16.shape == f32.shape
    err = np.abs(bf16 - f32).max(-1)
    assert np.median(err) < 0.2, err
    assert (bf16.argmax(-1) == f32.argmax(-1)).mean() >= 0.85
    if name in ("llama", "deepseek_v3"):
        assert err.max() < 0.2, err
