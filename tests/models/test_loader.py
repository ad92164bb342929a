"""Checkpoint loading: sharded checkpoints, clear errors for bad ones, config parsing."""

import json
import os
import shutil

import numpy as np
import pytest
from safetensors.numpy import load_file, save_file

from jaxserve import LLM
from jaxserve.models.config import SUPPORTED_MODEL_TYPES, ConfigError, load_config
from jaxserve.models.safetensors_io import CheckpointError


def _copy(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_loads_identically(checkpoint_dir, tmp_path):
    src = checkpoint_dir("qwen3")
    d = str(tmp_path / "sharded")
    os.makedirs(d)
    shutil.copy(os.path.join(src, "config.json"), d)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for fname, ns in shards.items():
        save_file({n: tensors[n] for n in ns}, os.path.join(d, fname))
        weight_map.update({n: fname for n in ns})
    with open(os.path.join(d, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    ids = [5, 9, 200, 17, 3]
    np.testing.assert_array_equal(LLM(d, progress=False).score(ids), LLM(src, progress=False).score(ids))


def test_unknown_model_type_lists_supported(checkpoint_dir, tmp_path):
    d = _copy(checkpoint_dir("llama"), str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["model_type"] = "mamba9"
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError) as e:
        load_config(d)
    msg = str(e.value)
    assert "mamba9" in msg and "config.json" in msg
    for mt in SUPPORTED_MODEL_TYPES:
        assert mt in msg


def test_missing_tensor_is_named(checkpoint_dir, tmp_path):
    d = _copy(checkpoint_dir("llama"), str(tmp_path / "m"))
    p = os.path.join(d, "model.safetensors")
    t = load_file(p)
    del t["model.layers.1.self_attn.k_proj.weight"]
    save_file(t, p)
    with pytest.raises(CheckpointError, match=r"missing tensor 'model\.layers\.1\.self_attn\.k_proj\.weight'"):
        LLM(d, progress=False)


def test_shape_mismatch_names_tensor_and_shapes(checkpoint_dir, tmp_path):
    d = _copy(checkpoint_dir("deepseek_v3"), str(tmp_path / "m"))
    p = os.path.join(d, "model.safetensors")
    t = load_file(p)
    name = "model.layers.2.mlp.experts.3.up_proj.weight"
    t[name] = np.zeros((31, 64), np.float32)
    save_file(t, p)
    with pytest.raises(CheckpointError) as e:
        LLM(d, progress=False)
    msg = str(e.value)
    assert name in msg and "[31, 64]" in msg and "[32, 64]" in msg


def test_missing_files_are_named(tmp_path, checkpoint_dir):
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_config(str(tmp_path))
    d = _copy(checkpoint_dir("llama"), str(tmp_path / "m"))
    os.remove(os.path.join(d, "model.safetensors"))
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        LLM(d, progress=False)
    llm = LLM(checkpoint_dir("llama"), progress=False)
    with pytest.raises(ValueError, match="tokenizer.json"):
        llm.generate(["hello"])


def test_bad_config_field_is_named(checkpoint_dir, tmp_path):
    d = _copy(checkpoint_dir("llama"), str(tmp_path / "m"))
    cfg = json.load(open(os.path.join(d, "config.json")))
    cfg["num_key_value_heads"] = 3
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        load_config(d)
    cfg["num_key_value_heads"] = 2
    cfg["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 1e4}
    json.dump(cfg, open(os.path.join(d, "config.json"), "w"))
    with pytest.raises(ConfigError, match="longrope"):
        load_config(d)


def test_bad_inputs(checkpoint_dir):
    llm = LLM(checkpoint_dir("llama"), progress=False)
    with pytest.raises(ValueError, match="empty prompt"):
        llm.score([])
    with pytest.raises(ValueError, match="out of range"):
        llm.score([1, 256])
    with pytest.raises(ValueError, match="dtype"):
        LLM(checkpoint_dir("llama"), dtype="float16")
