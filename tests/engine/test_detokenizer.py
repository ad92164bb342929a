"""The engine's incremental detokenizer: text held back for stop strings and partial characters is shown in full
when the request ends, and a stop token (never added) takes no text with it."""

import json

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers

from jaxserve.engine.detokenizer import Detokenizer
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


def test_a_long_output_costs_the_same_per_token_and_reads_as_its_whole_decode(smollm2_dir):
    """SmolLM2's byte-level BPE over text with multi-byte characters: after every token the committed text is the
    whole decode of the ids so far (up to a character still incomplete), at the end exactly it; each token decodes
    a window of a few ids, however long the output (the whole output, each token, would be quadratic)."""
    tok = Tokenizer(smollm2_dir)
    ids = tok.encode("Le café coûte 3 €, naïve 你好世界 🙂 — ok. " * 60, add_special_tokens=False)
    assert len(ids) > 1000
    windows = []
    decode = tok.decode
    tok.decode = lambda xs, **kw: (windows.append(len(xs)), decode(xs, **kw))[1]
    d = Detokenizer(tok, stop=("STOP",))
    for i, t in enumerate(ids):
        assert not d.add(t)
        if i % 97 == 0:
            whole = decode(ids[:i + 1])
            assert whole.startswith(d.full) and len(whole.rstrip("\ufffd")) - len(d.full) <= 2
    assert max(windows) <= 12 and len(windows) == 2 * len(ids)
    d.finish()
    assert d.text == decode(ids) == d.full


def test_a_stop_string_across_tokens_cuts_at_its_start(smollm2_dir):
    tok = Tokenizer(smollm2_dir)
    ids = tok.encode("one two three four five six seven", add_special_tokens=False)
    d = Detokenizer(tok, stop=("ee fo", "xyz"))
    n = next(i for i, t in enumerate(ids) if d.add(t))  # the engine ends the request there
    assert d.stopped and d.text == "one two thr" and n < len(ids) - 2
    d.finish()
    assert d.text == "one two thr"
