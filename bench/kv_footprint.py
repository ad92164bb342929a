"""KV bytes per request by architecture, from real models' config values (no weights).

For each family, the cache groups of the model's published config give the bytes decode needs after a
prefill of L tokens (full-attention KV grows with L, sliding-window KV stops at the window, linear state
is fixed), at L = 1K, 8K, 32K, 128K, in bf16. The dense-GQA baselines (Qwen3-235B, MiniMax-M2.5) are computed the same way in the same
run; `ratio_vs_dense[d]` = dense model d's bytes / family bytes (the PrfaaS document's Table 3 argument: hybrids are an
order of magnitude smaller at 32K).

    python -m bench.kv_footprint --json bench/results/kv_footprint.json
"""

from __future__ import annotations

import argparse

from jaxserve.models.cache_spec import cache_spec
from jaxserve.models.config import parse_config

LENGTHS = (1024, 8192, 32768, 131072)
DENSE = ("qwen3-235b-a22b", "minimax-m2.5")  # the two dense-GQA models of the PrfaaS document's Table 3

# config.json values of public checkpoints (only the fields the cache depends on, plus what parsing needs)
_MOE = dict(moe_intermediate_size=1536, num_experts=128, num_experts_per_tok=8)
CONFIGS = {
    "qwen3-235b-a22b": dict(model_type="qwen3", vocab_size=151936, hidden_size=4096, intermediate_size=12288,
                            num_hidden_layers=94, num_attention_heads=64, num_key_value_heads=4, head_dim=128,
                            rope_theta=1e6, max_position_embeddings=131072),
    # MiniMax-M2.5 is a dense-GQA MoE model; only its attention dims matter for the cache, parsed as GQA here
    "minimax-m2.5": dict(model_type="llama", vocab_size=200064, hidden_size=3072, intermediate_size=1536,
                         num_hidden_layers=62, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                         rope_theta=5e6, max_position_embeddings=196608),
    "llama-3.1-70b": dict(model_type="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672,
                          num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          max_position_embeddings=131072,
                          rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                        "high_freq_factor": 4.0, "original_max_position_embeddings": 8192},
                          rope_theta=500000.0),
    "deepseek-v3": dict(model_type="deepseek_v3", vocab_size=129280, hidden_size=7168, intermediate_size=18432,
                        moe_intermediate_size=2048, num_hidden_layers=61, num_attention_heads=128,
                        num_key_value_heads=128, n_routed_experts=256, n_shared_experts=1, num_experts_per_tok=8,
                        n_group=8, topk_group=4, first_k_dense_replace=3, kv_lora_rank=512, q_lora_rank=1536,
                        qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, max_position_embeddings=163840,
                        rope_scaling={"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                                      "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}),
    "kimi-linear-48b-a3b": dict(model_type="kimi_linear", vocab_size=163840, hidden_size=2304,
                                intermediate_size=9216, moe_intermediate_size=1024, num_hidden_layers=27,
                                num_attention_heads=32, num_key_value_heads=32, num_experts=256,
                                num_experts_per_token=8, num_shared_experts=1, kv_lora_rank=512, q_lora_rank=None,
                                qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128, first_k_dense_replace=1,
                                model_max_length=1048576,
                                linear_attn_config={"head_dim": 128, "num_heads": 32, "short_conv_kernel_size": 4,
                                                    "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
                                                    "kda_layers": [i for i in range(1, 28)
                                                                   if i not in (4, 8, 12, 16, 20, 24, 27)]}),
    "qwen3-next-80b-a3b": dict(model_type="qwen3_next", vocab_size=151936, hidden_size=2048,
                               intermediate_size=5120, num_hidden_layers=48, num_attention_heads=16,
                               num_key_value_heads=2, head_dim=256, linear_conv_kernel_dim=4,
                               linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=16,
                               linear_num_value_heads=32, num_experts=512, num_experts_per_tok=10,
                               moe_intermediate_size=512, shared_expert_intermediate_size=512,
                               full_attention_interval=4, partial_rotary_factor=0.25, rope_theta=1e7,
                               max_position_embeddings=262144),
    "gpt-oss-120b": dict(model_type="gpt_oss", vocab_size=201088, hidden_size=2880, intermediate_size=2880,
                         num_hidden_layers=36, num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                         sliding_window=128, num_local_experts=128, num_experts_per_tok=4,
                         max_position_embeddings=131072),
    "mimo-v2-flash": dict(model_type="mimo_v2_flash", vocab_size=152576, hidden_size=4096, intermediate_size=16384,
                          num_hidden_layers=48, num_attention_heads=64, num_key_value_heads=4, head_dim=192,
                          v_head_dim=128, sliding_window_size=128, n_routed_experts=256, num_experts_per_tok=8,
                          moe_intermediate_size=2048, max_position_embeddings=262144),
}


def run() -> dict:
    itemsize = 2  # bfloat16 cache
    rows = {}
    for name, raw in CONFIGS.items():
        spec = cache_spec(parse_config(raw, f"{name} config"))
        rows[name] = {
            "model_type": raw["model_type"],
            "groups": [{"kind": g.kind, "layers": len(g.layers), "window": g.window,
                        "token_bytes_per_layer": g.token_bytes(itemsize),
                        "state_bytes_per_layer": g.state_bytes(itemsize)} for g in spec.groups],
            "kv_bytes": {str(L): spec.bytes_for(L, itemsize) for L in LENGTHS},
        }
    for r in rows.values():
        r["ratio_vs_dense"] = {d: {L: round(rows[d]["kv_bytes"][L] / r["kv_bytes"][L], 2) for L in r["kv_bytes"]}
                               for d in DENSE}
    return {"benchmark": "kv_footprint", "dtype": "bfloat16", "dense_baseline": DENSE,
            "measures": "KV bytes per request that decode needs after a prefill of L tokens, from cache groups",
            "lengths": list(LENGTHS), "models": rows}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", default="bench/results/kv_footprint.json")
    args = ap.parse_args(argv)
    out = run()
    from bench.stamp import write
    write(args.json, out, indent=1)
    print(f"{'model':22s} " + " ".join(f"{L // 1024:>7d}K" for L in LENGTHS) + "   smaller than " + " / ".join(DENSE) + " @32K")
    for name, r in out["models"].items():
        mib = " ".join(f"{r['kv_bytes'][str(L)] / 2**20:8.1f}" for L in LENGTHS)
        ratios = " / ".join(f"{r['ratio_vs_dense'][d]['32768']:.1f}x" for d in DENSE)
        print(f"{name:22s} {mib}   {ratios}")
    print(f"(MiB per request, bf16; wrote {args.json})")


if __name__ == "__main__":
    main()
