"""Every Pallas kernel a real architecture calls lowers for an NVIDIA GPU, checked on any machine.

JAX lowers for the "cuda" platform without a GPU, through Pallas' Triton lowering (check.gpu_lowering). Each
family is given its published checkpoint's head layout (heads, KV heads, head dims, MLA ranks, linear-attention
heads, windows), parsed by the engine's own config code; its kernel cases are what a GPU engine self-tests at
start-up. A kernel that does not lower there runs as its jnp reference, so a regression here is a silent loss
of speed on a GPU that no CPU test of numbers would see."""

import jax.numpy as jnp
import pytest
import transformers

from jaxserve.models.config import parse_config
from jaxserve.models.model import kernel_cases
from jaxserve.pallas_kernels import check
from jaxserve.pallas_kernels.select import KERNELS
from tests.tiny_models import COMMON, FAMILIES

MLA = dict(kv_lora_rank=512, qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
HEADS = {  # family -> the head layout of a published checkpoint (the rest stays tiny: it does not reach a kernel)
    "llama": dict(hidden_size=576, num_attention_heads=9, num_key_value_heads=3),  # SmolLM2-135M: groups of 3
    "qwen3": dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128),  # Qwen3-8B
    "deepseek_v3": dict(MLA, num_attention_heads=128, num_key_value_heads=128),  # DeepSeek-V3
    "kimi_linear": dict(MLA, num_attention_heads=32, num_key_value_heads=32,  # Kimi-Linear-48B-A3B
                        linear_attn_config={"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4}),
    "qwen3_next": dict(num_attention_heads=16, num_key_value_heads=2, head_dim=256, linear_key_head_dim=128,
                       linear_value_head_dim=128, linear_num_key_heads=16, linear_num_value_heads=32),  # 80B-A3B
    "gpt_oss": dict(num_attention_heads=64, num_key_value_heads=8, head_dim=64, sliding_window=128),  # 20b
    "mimo_v2_flash": dict(num_attention_heads=64, num_key_value_heads=4, head_dim=192, v_head_dim=128,
                          sliding_window=128),
}


def _cases(family):
    model_type, tiny = FAMILIES[family]
    kw = dict(COMMON, **tiny)
    kw.update(HEADS[family])
    cfg = parse_config(transformers.CONFIG_MAPPING[model_type](**kw).to_dict())
    return [c for c in kernel_cases(cfg, jnp.bfloat16, 16) if KERNELS[c.kernel][1] is not None]


@pytest.mark.parametrize("family", sorted(HEADS))
def test_the_kernels_of_a_real_head_layout_lower_for_the_gpu(family):
    cases = _cases(family)
    assert cases, f"{family} calls no Pallas kernel"
    failed = {str(case): why for case in cases for why in [check.gpu_lowering(case)] if why is not None}
    assert not failed, failed


def test_the_layouts_reach_the_cases_that_once_did_not_lower():
    """The cases this file exists for: a GQA group of 3 (SmolLM2, the model `make serve` runs), MLA's 576-column
    latent + rope key read as 512 + 64, K|V of different head dims (MiMo), and KDA's per-channel decay chunked."""
    by = {(f, c.kernel): dict(c.dims) for f in ("llama", "deepseek_v3", "mimo_v2_flash", "kimi_linear")
          for c in _cases(f)}
    assert by["kimi_linear", "chunk_gated_delta_rule"]["per_channel"] is True
    assert by["llama", "paged_attention"]["Hq"] == 9 and by["llama", "paged_attention"]["Hkv"] == 3
    assert (by["deepseek_v3", "paged_mla_attention"]["L"], by["deepseek_v3", "paged_mla_attention"]["R"]) == (512, 64)
    assert (by["mimo_v2_flash", "paged_attention"]["Dk"], by["mimo_v2_flash", "paged_attention"]["Dv"]) == (192, 128)


def test_a_refusal_is_reported_not_raised():
    """A case the Triton lowering refuses comes back as the reason (here a head dim below Triton's smallest
    matmul), and a kernel with no Pallas implementation says so."""
    why = check.gpu_lowering(check.Case.of("paged_attention", Hq=4, Hkv=2, Dk=8, Dv=8, dtype="bfloat16",
                                           block_size=16))
    assert why is not None and why.startswith("does not lower") and "power of two >= 16" in why
    assert check.gpu_lowering(check.Case.of("matmul", K=64, N=64, transposed=False, dtype="bfloat16")) == (
        "has no Pallas kernel")


@pytest.mark.parametrize("kernel", ["paged_attention", "paged_mla_attention", "paged_prefill_attention",
                                    "paged_mla_prefill_attention"])
def test_the_paged_kernels_lower_inside_a_scan_over_layers(kernel):
    """A run of identical layers scanned (engine.scan_layers, a GPU prefill instance's default) calls the paged
    kernels with the layer traced: such a scan lowers for the GPU to a while loop whose body holds the one
    Triton call (Llama-3.1-8B's heads, bf16; MLA: DeepSeek-V3's latent with 16 heads)."""
    import jax
    import numpy as np
    dims = dict(H=16, L=512, R=64, scale=0.1) if "mla" in kernel else dict(Hq=32, Hkv=8, Dk=128, Dv=128)
    args, kw = check.inputs(kernel, np.random.RandomState(0), dtype="bfloat16", block_size=16, **dims)
    kw.pop("layer")
    args = list(args)
    args[1] = jnp.zeros((args[1].shape[0], 4) + args[1].shape[2:], args[1].dtype)  # the pool: a group of 4 layers
    run = KERNELS[kernel][1]

    def layers(args):
        body = lambda c, layer: (c, run(*args, layer=layer, interpret=False, **kw))  # noqa: E731
        return jax.lax.scan(body, None, jnp.arange(4, dtype=jnp.int32))[1]
    shaped = [jax.ShapeDtypeStruct(x.shape, x.dtype) for x in args]
    text = check.cuda_text(jax.jit(layers), shaped)
    assert "stablehlo.while" in text
    assert check.triton_calls(text) == 1
