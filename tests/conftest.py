"""Shared fixtures: tiny random Hugging Face checkpoints of every family, written with save_pretrained.

Two fake CPU devices are configured before JAX starts so mesh / TP=2 tests run on any machine.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

import pytest  # noqa: E402

from tests.tiny_models import build_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def checkpoint_dir(tmp_path_factory):
    """checkpoint_dir(name) -> path of the tiny checkpoint `name` (see tests/tiny_models.py), built once."""
    built = {}

    def get(name: str) -> str:
        if name not in built:
            path = str(tmp_path_factory.mktemp(name))
            build_checkpoint(name, path)
            built[name] = path
        return built[name]

    return get


@pytest.fixture(scope="session")
def hf_model():
    """hf_model(path) -> the transformers model of a checkpoint directory, float32, eval mode."""
    cache = {}

    def get(path: str):
        if path not in cache:
            import torch
            from transformers import AutoModelForCausalLM
            cache[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        return cache[path]

    return get

