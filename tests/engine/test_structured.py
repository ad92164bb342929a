"""Structured outputs in the engine (jaxserve/structured.py, the sampler's bitmask), with SmolLM2-135M-Instruct
and greedy decoding: constrained and free requests in one continuous batch, prompts longer than a chunk (chunked
prefill) sharing a prefix (prefix caching); every constrained answer parses and validates, the free rows'
tokens equal those of the same batch with no constrained neighbour; a tight cache pool (preemption and
recompute) and a resumed request (the matcher rebuilt from the tokens so far, as a decode instance does) give
the same constrained answers; n > 1 sampled answers all validate; a grammar that accepts nothing further ends
its request with "stop" without an end-of-sequence token; the grammar engine's checks and the bitmask itself
against a numpy reference."""

from __future__ import annotations

import json

import jax.numpy as jnp
import jsonschema
import numpy as np
import pytest

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import EngineConfig
from jaxserve.engine.sampler import SamplingTensors, sample, unpack
from jaxserve.structured import Grammars, Guided, GuidedError, json_object, words

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "languages"],
          "properties": {"name": {"type": "string", "maxLength": 40},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "languages": {"type": "array", "items": {"enum": ["English", "French", "German"]},
                                       "minItems": 1, "maxItems": 3}}}
ROOM = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=8, chunk_size=32, max_num_batched_tokens=64,
                    max_prefill_seqs=2, max_model_len=1024, num_snapshots=8)
SYSTEM = ("You are a helpful assistant who answers questions about people, places and numbers. Answer briefly "
          "and precisely, and when asked for JSON reply with JSON only.")


def chat(llm, text: str) -> list[int]:
    return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": text}]), add_special_tokens=False)


def greedy(max_tokens: int, guided=None, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, guided=guided, **kw)


def run(llm, requests: list[tuple[list[int], SamplingParams]]) -> list:
    """All requests queued at once (one continuous batch), stepped until done -> their sequences."""
    eng = llm.engine
    seqs = [eng.add_request(f"r{i}", p, sp)[0] for i, (p, sp) in enumerate(requests)]
    while eng.has_work:
        eng.step()
    for s in seqs:
        eng.release(s)
    eng.blocks.check()
    assert eng.blocks.num_referenced() == 0
    return seqs


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir, progress=False, engine=ROOM)


@pytest.fixture(scope="module")
def constrained(llm):
    """The mixed batch's sequences with a roomy pool (the answers the other runs must give)."""
    return run(llm, batch(llm, True))


def batch(llm, constrained: bool):
    json_g = Guided("json", json.dumps(PERSON))
    choice = Guided("choice", json.dumps(["Paris", "Lyon", "Marseille"]))
    regex = Guided("regex", r"[0-9]{3}-[0-9]{4}")
    asks = [("Write a short story about a cat.", 24, None),
            ("Describe Marie, a 34 year old engineer who speaks French and English, as JSON.", 60, json_g),
            ("What is the capital of France?", 8, choice),
            ("Give me a phone number.", 12, regex),
            ("List three colours.", 20, None),
            ('Reply with the JSON object {"ok": true}.', 24, json_object())]
    return [(chat(llm, q), greedy(n, g if constrained else None)) for q, n, g in asks]


def test_constrained_and_free_rows_in_one_batch(llm, constrained):
    seqs = constrained
    text = [s.detok.text for s in seqs]
    jsonschema.validate(json.loads(text[1]), PERSON)
    assert text[2] in ("Paris", "Lyon", "Marseille")
    assert seqs[2].finish_reason == "stop" and seqs[2].output[-1] not in llm.engine.eos  # the grammar ended it
    assert len(text[3]) == 8 and text[3][3] == "-" and text[3].replace("-", "").isascii()
    assert isinstance(json.loads(text[5]), dict)
    # the free rows decode exactly as they do beside the same requests unconstrained
    free = run(llm, batch(llm, False))
    assert [seqs[0].output, seqs[4].output] == [free[0].output, free[4].output]
    assert any(seqs[i].output != free[i].output for i in (1, 2, 3, 5))  # and the constraints did constrain


def test_preemption_and_resume_keep_the_constrained_answer(llm, smollm2_dir, constrained):
    want = constrained
    tight = LLM(smollm2_dir, progress=False, engine=EngineConfig(
        block_size=16, num_blocks=12, max_num_seqs=6, chunk_size=32, max_num_batched_tokens=64, max_prefill_seqs=2,
        max_model_len=1024, num_snapshots=8, prefix_caching=False))
    got = run(tight, batch(tight, True))
    assert tight.engine.scheduler.num_preemptions > 0
    assert [s.output for s in got] == [s.output for s in want]
    # resumed after its first tokens (a decode instance's or a retried request's matcher is rebuilt from them)
    prompt, sp = batch(llm, True)[1]
    eng, k = llm.engine, 7
    (seq,) = eng.add_request("resumed", prompt, sp, output=want[1].output[:k])
    while eng.has_work:
        eng.step()
    eng.release(seq)
    assert seq.output == want[1].output


def test_sampled_answers_all_validate(llm):
    prompt = chat(llm, "Describe a person as JSON.")
    sp = SamplingParams(max_tokens=80, temperature=0.9, seed=7, n=3, guided=Guided("json", json.dumps(PERSON)))
    outs = llm.generate([prompt], sp)
    assert len(outs) == 3
    for o in outs:
        jsonschema.validate(json.loads(o.text), PERSON)


def test_bad_constraints_are_refused_naming_the_field(llm):
    from jaxserve.engine.client import RequestError
    cases = [(Guided("json", '{"type": "nonsense"}', "response_format"), "response_format"),
             (Guided("regex", "a(b", "guided_regex"), "guided_regex"),
             (Guided("grammar", "start: (", "guided_grammar"), "guided_grammar"),
             (Guided("choice", "[]", "guided_choice"), "guided_choice")]
    for g, param in cases:
        with pytest.raises(RequestError) as e:
            llm.engine.add_request("bad", [1, 2, 3], greedy(4, g))
        assert e.value.param == param
    with pytest.raises(GuidedError):
        Guided("xml", "<a/>")
    assert not llm.engine.requests


def test_bitmask_rows_and_the_sampler():
    """unpack is the bit layout llguidance writes; the sampler draws only allowed tokens (greedy: the best of
    them), and a row with every bit set samples as with no mask."""
    rng = np.random.default_rng(0)
    B, V = 3, 70
    allowed = np.zeros((B, words(V)), np.int32)
    picks = [[3, 31, 32, 69], [0], list(range(V))]
    for i, toks in enumerate(picks):
        for t in toks:
            allowed[i, t // 32] |= np.int32(np.uint32(1 << (t % 32)).view(np.int32))
    bits = np.asarray(unpack(jnp.asarray(allowed), V))
    assert [list(np.nonzero(r)[0]) for r in bits] == picks
    logits = rng.normal(size=(B, V)).astype(np.float32)
    zeros = jnp.zeros((B, V), bool), jnp.zeros((B, V), jnp.int32)
    for temperature in (0.0, 1.0):
        st = SamplingTensors.from_params([SamplingParams(temperature=temperature, seed=s) for s in range(B)],
                                         [0] * B, B)
        tok = np.asarray(sample(jnp.asarray(logits), st, *zeros, jnp.asarray(allowed))[0])
        free = np.asarray(sample(jnp.asarray(logits), st, *zeros)[0])
        assert tok[0] in picks[0] and tok[1] == 0 and tok[2] == free[2]
        if temperature == 0:
            assert tok[0] == max(picks[0], key=lambda t: logits[0, t])


def test_the_grammar_engine_on_smollm2s_tokenizer(llm):
    """Grammars compiles a grammar once; guides are independent copies; a guide's row allows exactly the
    tokens that keep the output inside the grammar."""
    tok = llm.tokenizer
    g = Grammars(tok.to_json(), llm.engine.model_config.vocab_size, [2])
    spec = Guided("choice", json.dumps(["yes", "no"]))
    a, b = g.guide(spec), g.guide(spec)
    assert g.compiled == 1
    assert g.check(spec) is g.check(spec) and spec.grammar() is not spec.grammar()  # remembered, not re-built
    row = np.zeros(words(g.V), np.int32)
    a.fill(row)
    ok = np.nonzero(np.asarray(unpack(jnp.asarray(row[None]), g.V))[0])[0]
    assert ok.size and all("yes".startswith(tok.decode([int(t)])) or "no".startswith(tok.decode([int(t)]))
                           for t in ok)
    yes = tok.encode("yes", add_special_tokens=False)
    for t in yes:
        assert a.advance(t)
    assert a.done and not b.done  # b is a copy of its own
    with pytest.raises(GuidedError) as e:
        g.check(Guided("json", "{", "guided_json"))
    assert e.value.param == "guided_json"
