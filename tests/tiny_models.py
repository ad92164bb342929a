"""Tiny random configs of every supported family (and variants: GQA ratios, RoPE scalings, windows).

Initialiser ranges are raised from the default 0.02 so logits come out of order 1, making the
absolute-tolerance comparison with transformers meaningful.
"""

from __future__ import annotations

COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.12,
              bos_token_id=1, eos_token_id=2, pad_token_id=0)

MLA = dict(kv_lora_rank=16, q_lora_rank=24, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16)

FAMILIES: dict[str, tuple[str, dict]] = {
    # dense GQA, ratio 2, llama3 rope scaling
    "llama": ("llama", dict(rope_parameters={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                             "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
                                             "rope_theta": 10000.0})),
    # MHA (ratio 1), linear rope scaling, tied embeddings, attention bias
    "llama_mha_tied": ("llama", dict(num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                                     rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    # ratio 4 (MQA), q/k norm, explicit head_dim
    "qwen3": ("qwen3", dict(num_key_value_heads=1, head_dim=32)),
    # MLA + MoE with group-limited noaux routing, first layer dense, YaRN with mscale
    "deepseek_v3": ("deepseek_v3", dict(MLA, num_key_value_heads=4, n_routed_experts=8, n_group=2, topk_group=1,
                                        num_experts_per_tok=2, first_k_dense_replace=1, moe_intermediate_size=32,
                                        rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                         "original_max_position_embeddings": 128,
                                                         "mscale": 1.0, "mscale_all_dim": 1.0,
                                                         "beta_fast": 32, "beta_slow": 1})),
    # KDA + MLA (3:1 after the first full layer pattern), MoE with shared expert
    "kimi_linear": ("kimi_linear", dict(MLA, num_hidden_layers=5, num_key_value_heads=4, num_local_experts=4,
                                        num_experts_per_tok=2, moe_intermediate_size=32, q_lora_rank=None,
                                        linear_attn_config={"head_dim": 16, "num_heads": 4,
                                                            "short_conv_kernel_size": 4})),
    # Gated DeltaNet + gated full attention (3:1), MoE with gated shared expert, value heads 2x key heads
    "qwen3_next": ("qwen3_next", dict(num_experts=4, num_experts_per_tok=2, head_dim=16, linear_key_head_dim=8,
                                      linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
                                      moe_intermediate_size=32, shared_expert_intermediate_size=32)),
    # SWA (window 4) alternating with full attention, sinks, YaRN, MoE with clamped SwiGLU
    "gpt_oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, head_dim=16, sliding_window=4)),
    # SWA (window 5, 2x KV heads, sinks) 5:1 with full attention, v_head_dim != head_dim, partial rope
    "mimo_v2_flash": ("mimo_v2_flash", dict(num_hidden_layers=6, n_routed_experts=4, num_experts_per_tok=2,
                                            head_dim=24, v_head_dim=16, sliding_window=5, moe_intermediate_size=32,
                                            layer_types=["full_attention"] + ["sliding_attention"] * 4
                                            + ["full_attention"])),
}


def build_checkpoint(name: str, path: str, seed: int = 0, common: dict | None = None,
                     overrides: dict | None = None) -> None:
    """Save a random checkpoint of family `name` (common / overrides: other sizes, e.g. bench/families.py)."""
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    model_type, tiny = FAMILIES[name]
    kw = dict(COMMON if common is None else common)
    kw.update(tiny if overrides is None else overrides)
    cfg = transformers.CONFIG_MAPPING[model_type](**kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():  # random (not zero/one) norms, biases and gates so every parameter matters
        for n, p in model.named_parameters():
            if n.endswith("norm.weight") or "layernorm" in n:
                # Qwen3-Next norms scale by (1 + w), the others by w
                offset = 0.0 if model_type == "qwen3_next" else 1.0
                p.copy_(offset + 0.2 * torch.randn_like(p))
            elif n.endswith("bias") or "sinks" in n or "dt_bias" in n:
                p.copy_(0.5 * torch.randn_like(p))
        for n, b in model.named_buffers():
            if "e_score_correction_bias" in n:
                b.copy_(0.1 * torch.randn_like(b))
    model.save_pretrained(path)
