"""`make serve` until the serving engine lands: a short offline generation on a small bundled hybrid model.

Creates `models/demo-kimi-linear` on first run (a small random Kimi Linear checkpoint: KDA + MLA layers,
MoE, with a byte-level BPE tokenizer trained in-process; no downloads), loads it with `LLM` and generates.
"""

from __future__ import annotations

import os
import time

MODEL_DIR = os.path.join("models", "demo-kimi-linear")


def build(path: str) -> None:
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers, decoders
    cfg = transformers.KimiLinearConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=8,
        num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2,
        kv_lora_rank=32, q_lora_rank=None, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32,
        linear_attn_config={"head_dim": 32, "num_heads": 4, "short_conv_kernel_size": 4},
        max_position_embeddings=4096, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(cfg).save_pretrained(path)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<pad>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["Prefill and decode run in separate processes and the KV cache moves between them.",
            "Hybrid models keep a small recurrent state for linear attention layers."] * 50
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))


def main() -> None:
    from jaxserve import LLM, SamplingParams
    if not os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        print(f"creating the bundled demo model in {MODEL_DIR} ...")
        build(MODEL_DIR)
    llm = LLM(MODEL_DIR, dtype="float32")
    spec = llm.cache_spec
    print("cache groups:", ", ".join(f"{g.kind} x{len(g.layers)}" for g in spec.groups))
    prompt = "Prefill and decode"
    t = time.time()
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0.8, seed=0))[0]
    print(f"prompt: {prompt!r}\ncompletion ({len(out.token_ids)} tokens, {time.time() - t:.1f}s incl. compile; "
          f"random weights, so the text is noise): {out.text!r}")
    print("The HTTP server arrives with the serving-engine issue; see README.md.")


if __name__ == "__main__":
    main()
