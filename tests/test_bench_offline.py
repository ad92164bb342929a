"""bench/offline.py's token comparison: the transformers peer generates as jaxserve and vLLM do with EOS ignored
(the EOS token chosen like any other, generation going on), and a differing request is reported where it
parts."""

from __future__ import annotations

from bench import offline


def test_parting_names_the_first_differing_position_and_both_tokens():
    assert offline.parting(3, [5, 6, 7, 8], [5, 6, 9, 8], "vllm") == {"request": 3, "at": 2, "jaxserve": 7,
                                                                      "vllm": 9}
    # one sequence a prefix of the other: they part where the shorter ends
    assert offline.parting(0, [5, 6], [5, 6, 7], "transformers") == {"request": 0, "at": 2, "jaxserve": None,
                                                                     "transformers": 7}


def test_the_transformers_peer_generates_eos_when_it_is_the_greedy_choice(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from tests.tiny_models import COMMON, build_checkpoint
    # EOS is token 0; the final norm's weights zeroed make every logit 0, and greedy takes the first of tied
    # tokens: EOS at every step. With `min_new_tokens` forbidding EOS, the peer chose token 1 instead.
    build_checkpoint("llama", str(tmp_path), common=dict(COMMON, eos_token_id=0, pad_token_id=3))
    f = tmp_path / "model.safetensors"
    w = load_file(str(f))
    w["model.norm.weight"] = torch.zeros_like(w["model.norm.weight"])
    save_file(w, str(f), metadata={"format": "pt"})
    peer = offline.Transformers(str(tmp_path), max_tokens=5, batch=2)
    got = peer.run([[5, 6, 7], [8, 9, 10, 11, 12]])["tokens"]
    assert got == [[0] * 5, [0] * 5]


def test_a_built_shape_is_its_familys_checkpoint_built_once(tmp_path, monkeypatch):
    import json
    import os

    import tests.tiny_models as tiny
    built = []

    def build(family, path, common=None, overrides=None):  # writes the config only: the shape, not its weights
        built.append(family)
        os.makedirs(path)
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(common, f)
    monkeypatch.setattr(tiny, "build_checkpoint", build)
    path = offline.checkpoint(str(tmp_path), "qwen3-0.6b")
    assert path == str(tmp_path / "bench-qwen3-0.6b") and built == ["qwen3"]
    with open(os.path.join(path, "config.json")) as f:
        c = json.load(f)
    assert (c["num_hidden_layers"], c["hidden_size"], c["head_dim"], c["vocab_size"]) == (28, 1024, 128, 151936)
    assert offline.checkpoint(str(tmp_path), "qwen3-0.6b") == path and built == ["qwen3"]  # built once
    assert offline.checkpoint(str(tmp_path)) == str(tmp_path / "bench-llama-32m") and built == ["qwen3", "llama"]
