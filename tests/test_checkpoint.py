"""Orbax conversion (CLI) and restore straight into a TP=2 mesh of fake CPU devices; tokenizers."""

import json
import os
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from jaxserve import LLM, SamplingParams
from jaxserve.checkpoint import is_orbax


def _add_tokenizer(d: str, vocab_size: int = 256):
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<pad>", "<s>", "</s>", "<unk>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["the quick brown fox jumps over the lazy dog " * 3, "hello world, hello jax"] * 20,
                            trainer)
    tok.save(os.path.join(d, "tokenizer.json"))
    with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>",
                   "chat_template": "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                                    "{% if add_generation_prompt %}assistant:{% endif %}"}, f)


@pytest.fixture(scope="module")
def kimi_with_tokenizer(checkpoint_dir, tmp_path_factory):
    d = str(tmp_path_factory.mktemp("kimi_tok") / "m")
    shutil.copytree(checkpoint_dir("kimi_linear"), d)
    _add_tokenizer(d)
    return d


def test_text_prompts_and_output_text(kimi_with_tokenizer):
    llm = LLM(kimi_with_tokenizer, progress=False)
    ids = llm.tokenizer.encode("hello world")
    a = llm.generate(["hello world"], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    b = llm.generate([ids], SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True))[0]
    assert a.prompt_token_ids == ids and a.token_ids == b.token_ids
    assert a.text == llm.tokenizer.decode(a.token_ids) and isinstance(a.text, str)
    chat = llm.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<s>user: hi\nassistant:"


def test_convert_cli_and_restore_into_tp2_mesh(kimi_with_tokenizer, tmp_path):
    assert len(jax.devices()) >= 2
    out = str(tmp_path / "orbax")
    r = subprocess.run([sys.executable, "-m", "jaxserve.cli", "convert", kimi_with_tokenizer, out,
                        "--dtype", "float32"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert is_orbax(out) and os.path.isfile(os.path.join(out, "tokenizer.json"))
    ref = LLM(kimi_with_tokenizer, progress=False)
    tp = LLM(out, tp=2, progress=False)
    # weights landed sharded over the two devices (expert intermediate dim), others replicated
    rest, stacks = tp.engine.runner.params
    at = tp.engine.runner.stack.locate(1)  # layer 1's weights, stacked on a leading axis when in a run or class
    q = (stacks[at[0]] if at else rest["layers"][1])["mlp"]["w_gate"][...]
    lead = 1 if at else 0
    assert q.sharding.spec[2 + lead] == "tp" and len(q.sharding.device_set) == 2
    assert {s.data.shape for s in q.addressable_shards} == {q.shape[:2 + lead] + (q.shape[2 + lead] // 2,)}
    ids = [5, 9, 200, 17, 3, 44, 61]
    np.testing.assert_allclose(tp.score(ids), ref.score(ids), atol=1e-4, rtol=0)
    p = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    assert tp.generate(["hello world"], p)[0].token_ids == ref.generate(["hello world"], p)[0].token_ids


def test_convert_to_bfloat16_and_refuse_nonempty(kimi_with_tokenizer, tmp_path):
    from jaxserve.checkpoint import convert
    from jaxserve.models.config import load_config
    out = str(tmp_path / "bf16")
    convert(kimi_with_tokenizer, out, load_config(kimi_with_tokenizer), "bfloat16", progress=False)
    llm = LLM(out, dtype="bfloat16", progress=False)
    ids = [5, 9, 200, 17]
    ref = LLM(kimi_with_tokenizer, dtype="bfloat16", progress=False).score(ids)
    np.testing.assert_allclose(llm.score(ids), ref, atol=1e-6)
    with pytest.raises(FileExistsError):
        convert(kimi_with_tokenizer, out, load_config(kimi_with_tokenizer), "bfloat16", progress=False)


def test_a_checkpoint_of_another_state_layout_is_refused(tmp_path):
    """An Orbax checkpoint written before linear weights were kept [in, out] (no `layout` in its marker) is
    refused with what to do, not restored into transposed weights."""
    from jaxserve.checkpoint import LAYOUT, MARKER, restore
    from jaxserve.models.safetensors_io import CheckpointError
    (tmp_path / MARKER).write_text(json.dumps({"format": "orbax", "dtype": "float32"}))
    with pytest.raises(CheckpointError, match=f"state layout 1.*reads layout {LAYOUT}: convert the source"):
        restore(str(tmp_path), None, jnp.float32)
