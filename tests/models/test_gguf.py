"""GGUF checkpoints: the packaged SmolLM2-135M-Instruct (Q4_1) converted by models/gguf.py against transformers'
own GGUF loading of the same file (its dequantisation, its q/k un-permutation, its tokenizer), and clear errors
for what is not supported."""

import os

import numpy as np
import pytest

from jaxserve.models import gguf

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = ["Hello, world!", "In 2024 there were 31,536,000 seconds.", "naïve café — 東京 🙂",
         "<|im_start|>user\nhi<|im_end|>\n", "  two  spaces\tand\ttabs\n\n"]


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    return gguf.resolve(gguf.SMOLLM2, cache=str(tmp_path_factory.mktemp("gguf")), progress=False)


@pytest.fixture(scope="module")
def hf_smollm2():
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    f = gguf.smollm2_path()
    d, name = os.path.dirname(f), os.path.basename(f)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=name, dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d, gguf_file=name)


def test_conversion_is_cached_and_keyed_by_the_file(smollm2, monkeypatch):
    assert sorted(os.listdir(smollm2)) == ["config.json", "model.safetensors", "tokenizer.json",
                                          "tokenizer_config.json"]
    cache = os.path.dirname(smollm2)
    assert not [n for n in os.listdir(cache) if ".partial" in n]

    def convert_again(*args):
        raise AssertionError("converted a second time")
    monkeypatch.setattr(gguf, "convert", convert_again)
    assert gguf.resolve(gguf.SMOLLM2, cache=cache, progress=False) == smollm2


@pytest.mark.slow
def test_smollm2_matches_transformers_gguf_loading(smollm2, hf_smollm2):
    import torch

    from jaxserve.engine.llm_engine import EngineConfig
    from jaxserve.llm import LLM
    from jaxserve.sampling import SamplingParams
    hf, hf_tok = hf_smollm2
    llm = LLM(smollm2, engine=EngineConfig(max_num_seqs=2, num_blocks=64), progress=False)
    tok = llm.tokenizer
    for text in TEXTS:
        assert tok.encode(text) == hf_tok(text)["input_ids"], text
        assert tok.decode(tok.encode(text), skip_special_tokens=False) == text
    prompt = tok.apply_chat_template(MESSAGES)
    assert prompt == hf_tok.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(prompt)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].numpy()
        hf_out = hf.generate(torch.tensor([ids]), max_new_tokens=16, do_sample=False)[0, len(ids):].tolist()
    got = llm.score(ids)
    np.testing.assert_allclose(got, want, atol=2e-3 * np.abs(want).max(), rtol=0)
    assert (got.argmax(-1) == want.argmax(-1)).all()
    out = llm.generate([ids], SamplingParams(max_tokens=16, temperature=0))[0]
    assert out.token_ids == hf_out
    assert "Paris" in out.text and out.text == tok.decode(out.token_ids)  # English, to the last token


def _write_gguf(path: str, arch: str, rows: int, **kv) -> str:
    """A GGUF file of one zero embedding of `rows` tokens; kv: GGUFWriter.add_<key>(value) calls."""
    from gguf import GGUFWriter
    w = GGUFWriter(path, arch)
    for key, value in kv.items():
        getattr(w, f"add_{key}")(value)
    w.add_tensor("token_embd.weight", np.zeros((rows, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_unsupported_gguf_is_a_clear_error(tmp_path):
    path = _write_gguf(str(tmp_path / "tiny-falcon.gguf"), "falcon", 4)
    with pytest.raises(ValueError, match="architecture 'falcon' is not supported"):
        gguf.resolve(path, cache=str(tmp_path / "cache"), progress=False)
    assert not (tmp_path / "cache").exists() or not os.listdir(tmp_path / "cache")  # nothing half-written left
    from gguf import GGUFReader
    # a pre-tokenizer other than GPT-2's split: refused rather than tokenised wrongly
    path = _write_gguf(str(tmp_path / "tiny-qwen2-tokenizer.gguf"), "llama", 3, tokenizer_model="gpt2",
                       tokenizer_pre="qwen2", token_list=["a", "b", "ab"], token_merges=["a b"])
    with pytest.raises(ValueError, match="pre-tokenizer 'qwen2' is not supported"):
        gguf.read_tokenizer(GGUFReader(path))
    with pytest.raises(FileNotFoundError, match="no such GGUF file"):
        gguf.resolve(str(tmp_path / "missing.gguf"), cache=str(tmp_path / "cache"), progress=False)
