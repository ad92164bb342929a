"""The bundled demo model: a small random Kimi Linear checkpoint (KDA + MLA layers, MoE) the project writes
itself, so `make serve` works on a fresh machine with no downloads: config.json, safetensors (written through
transformers' own Kimi Linear implementation, so the checkpoint is exactly what the hub format looks like), a
byte-level BPE `tokenizer.json` trained in-process, and a chat template. Its weights are random: the text it
writes is noise, but every cache group (full MLA, linear state) and code path is real.
"""

from __future__ import annotations

import json
import os

BUNDLED = "bundled"
MODEL_DIR = os.path.join("models", "bundled-kimi-linear")
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}</s>{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def resolve(path: str, progress: bool = True) -> str:
    """A model path from a config: 'bundled' is created on first use under ./models; a GGUF file (or 'smollm2',
    the packaged SmolLM2-135M-Instruct) is converted on first use into its checkpoint directory (models/gguf.py)."""
    from .models import gguf
    if gguf.is_gguf(path):
        return gguf.resolve(path, progress=progress)
    if path != BUNDLED:
        return path
    if not os.path.isfile(os.path.join(MODEL_DIR, "config.json")):
        if progress:
            print(f"creating the bundled demo model in {MODEL_DIR} (first run only) ...", flush=True)
        tmp = MODEL_DIR + ".partial"
        build(tmp)
        os.replace(tmp, MODEL_DIR)  # a half-written model is never mistaken for a finished one
    return os.path.abspath(MODEL_DIR)


def build(path: str) -> None:
    try:
        import torch
        import transformers
    except ImportError as e:
        raise RuntimeError(f"the bundled demo model is written through transformers and torch ({e}); install them "
                           f"(make install, or pip install -e '.[test]') or serve another model") from None
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
    specials = ["<pad>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=specials,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    text = ["Prefill and decode run in separate processes and the KV cache moves between them.",
            "Hybrid models keep a small recurrent state for linear attention layers.",
            "<|system|><|user|><|assistant|> Hello! How are you today? Tell me a story about a cache."] * 50
    tok.train_from_iterator(text, trainer)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>", "chat_template": CHAT_TEMPLATE}, f)
