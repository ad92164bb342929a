"""Bench-size random checkpoints of every model family (the tests' tiny configs, scaled up so that prefill
time and KV size mean something on a CPU): built once with `transformers` + `save_pretrained` under a cache
directory. Sizes: hidden 256, 8 layers (Kimi Linear 8, its KDA:MLA pattern), 8 heads, vocab 1024."""

from __future__ import annotations

import os

from tests.tiny_models import COMMON, FAMILIES, build_checkpoint

BENCH_COMMON = dict(COMMON, vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=8,
                    num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=8192,
                    initializer_range=0.02)
MLA = dict(kv_lora_rank=64, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32)
SCALED: dict[str, dict] = {
    "llama": {}, "qwen3": dict(num_key_value_heads=2, head_dim=32),
    "deepseek_v3": dict(MLA, q_lora_rank=96, num_key_value_heads=8, moe_intermediate_size=128),
    "kimi_linear": dict(MLA, num_key_value_heads=8, moe_intermediate_size=128,
                        linear_attn_config={"head_dim": 32, "num_heads": 8, "short_conv_kernel_size": 4,
                                            "full_attn_layers": [4, 8], "kda_layers": [1, 2, 3, 5, 6, 7]}),
    "qwen3_next": dict(head_dim=32, linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=4,
                       linear_num_value_heads=8, moe_intermediate_size=128, shared_expert_intermediate_size=128),
    "gpt_oss": dict(head_dim=32, sliding_window=128),
    "mimo_v2_flash": dict(head_dim=48, v_head_dim=32, sliding_window=128, moe_intermediate_size=128,
                          layer_types=["full_attention"] + ["sliding_attention"] * 6 + ["full_attention"]),
}
NAMES = list(SCALED)


def checkpoint(name: str, root: str) -> str:
    """Path of the bench-size checkpoint of family `name` under `root` (built on first use)."""
    if name not in SCALED:
        raise ValueError(f"unknown family {name!r}; have {NAMES}")
    path = os.path.join(root, f"bench-{name}")
    if not os.path.isfile(os.path.join(path, "config.json")):
        model_type, tiny = FAMILIES[name]
        kw = {k: v for k, v in tiny.items() if k != "num_hidden_layers"}
        kw.update(SCALED[name])
        build_checkpoint(name, path + ".partial", common=BENCH_COMMON, overrides=kw)
        os.replace(path + ".partial", path)
    return path
