"""The engine's incremental detokenizer: text held back for stop strings and partial characters is shown in full
when the request ends, and a stop token (never added) takes no text with it."""

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from jaxserve.engine.llm_engine import Detokenizer
from jaxserve.tokenizer import Tokenizer

VOCAB = ["<eos>", "The", "Ġcapital", "Ġis", "ĠParis", "."]


def tokenizer(tmp_path) -> Tokenizer:
    tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(VOCAB)}, []))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<eos>"])
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<eos>"}))
    return Tokenizer(str(tmp_path))


def test_finish_shows_the_last_token_before_a_stop_token(tmp_path):
    d = Detokenizer(tokenizer(tmp_path), stop=())
    for t in (1, 2, 3, 4, 5):
        assert not d.add(t)
    assert d.text == "The capital is Paris."
    d.finish()  # the request ended on <eos>, which the engine does not add
    assert d.text == "The capital is Paris."


def test_finish_releases_text_held_back_for_a_stop_string(tmp_path):
    d = Detokenizer(tokenizer(tmp_path), stop=("Paris!",))
    for t in (1, 2, 3, 4, 5):
        assert not d.add(t)
    assert d.text == "The capital is P"  # the last len("Paris!") - 1 characters are held back
    d.finish()
    assert d.text == "The capital is Paris."
    d = Detokenizer(tokenizer(tmp_path), stop=(" is",))
    assert not d.add(1) and not d.add(2)
    assert d.add(3) and d.text == "The capital"  # cut before the stop string, and kept at finish
    d.finish()
    assert d.text == "The capital"
