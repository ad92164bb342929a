"""The suite's own setup (tests/conftest.py), as each pytest-xdist worker sees it: without a GPU, a test of a
tiny model compiles with XLA's backend optimisation off, a test of the real model (`smollm2_dir`) as served,
in this process and in the worker processes it starts (the environment they inherit)."""

import os
import shutil

import pytest
from jax._src import compiler

pytestmark = pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="on a GPU the suite compiles as served")


def test_a_tiny_models_test_compiles_light():
    assert compiler._DISABLE_MOST_OPTIMIZATIONS.value
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "1"


def test_a_real_models_test_compiles_as_served(smollm2_dir):
    assert not compiler._DISABLE_MOST_OPTIMIZATIONS.value
    assert os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] == "0"
