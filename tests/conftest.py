"""Shared fixtures: tiny random Hugging Face checkpoints of every family, written with save_pretrained.

Two fake CPU devices are configured before JAX starts so mesh / TP=2 tests run on any machine. XLA's
persistent compilation cache points at a directory fresh for each test session (the worker processes the
tests start inherit it through the environment), so the many engines the suite builds over the same tiny
models compile each program once. On a machine without a GPU the suite's programs compile with XLA's backend
optimisation off (`jax_disable_most_optimizations`, inherited by the worker processes through the environment as
well) and with XLA:CPU's older fusion code generator (`--xla_cpu_use_fusion_emitters=false` in XLA_FLAGS): for
the tiny models here compiling costs more than running; the first cuts the time of the tests that compile most
by about a quarter, the second their XLA compile time by some 40% more. The tests of the real model (those
using `smollm2_dir`) run long enough to compile with XLA's optimisation, as serving and the benchmarks do (the
fusion code generator is set per process, so they keep the older one).
"""

import gc
import importlib.metadata
import os
import shutil
import sys
import tempfile
import threading
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
_XLA_CACHE = None if "JAX_COMPILATION_CACHE_DIR" in os.environ else tempfile.mkdtemp(prefix="jaxserve-tests-xla-")
if _XLA_CACHE is not None:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "0")
# bounded, the cache reads and writes its entries under a file lock: the xdist workers share it (unbounded, one
# read an entry another was writing and crashed; engine/llm_engine.py use_compilation_cache)
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(32 << 30))
# on a GPU the suite compiles as served (the kernels, their self-test); decided in every process alike (the
# pytest-xdist workers inherit the controller's environment, so the variable alone cannot say it)
_LIGHT = shutil.which("nvidia-smi") is None
if _LIGHT:
    os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = "1"
    # XLA:CPU's older fusion code generator: the tiny models' programs compile in about 40% less time (XLA after
    # JAX 0.10.2 has no such flag, and an unknown flag stops the process)
    if tuple(int(p) for p in importlib.metadata.version("jaxlib").split(".")[:2]) <= (0, 10):
        os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_cpu_use_fusion_emitters=false".strip()

import jax  # noqa: E402

jax.config.update("jax_num_cpu_devices", 2)

from jaxserve.engine.xla_cache import cheap_eviction  # noqa: E402

cheap_eviction()  # the suite's cache holds thousands of entries: JAX lists them all on every write

import pytest  # noqa: E402

from tests.tiny_models import build_checkpoint  # noqa: E402


# threads of the project's own (engine, KV plane, worker output readers, control loops): none may outlive the
# test that started it
OWN_THREADS = ("jaxserve-engine", "kv-", "worker-", "router-control")
_exit = {"status": None}


def _leftover_threads(grace_s: float = 5.0) -> list[str]:
    deadline = time.monotonic() + grace_s  # a thread that is closing gets a moment to finish
    while True:
        left = [t.name for t in threading.enumerate() if t.name.startswith(OWN_THREADS)]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def pytest_sessionfinish(session, exitstatus):
    if _XLA_CACHE is not None:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)
    left = _leftover_threads() if exitstatus == 0 and session.testscollected > 0 else []
    if left:
        sys.stderr.write(f"threads of the project still running after the session: {sorted(left)}\n")
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    _exit["status"] = int(session.exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """The verdict is in (the summary printed, every other plugin unconfigured): leave without the interpreter's
    finalisation. Idle daemon threads of C++ libraries that stay for the process's life (gRPC's asyncio poller,
    XLA's) can abort it there (glibc's forced unwind through C++ frames: "FATAL: exception not rethrown") after
    every test passed; the project's own threads are checked above."""
    if _exit["status"] is None:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(_exit["status"])


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Before the test's fixtures: a test of the real model compiles with XLA's optimisation, in this process and
    in the workers it starts (it runs its programs for long; the others compile more than they run)."""
    if _LIGHT:
        light = "smollm2_dir" not in item.fixturenames
        os.environ["JAX_DISABLE_MOST_OPTIMIZATIONS"] = str(int(light))
        jax.config.update("jax_disable_most_optimizations", light)


# XLA:CPU maps each compiled object's code and data into three memory regions of its own (a small program: about 20),
# unmapped only once JAX's caches let its executable go. One process running tests/engine held 60,440 mappings,
# against the kernel's limit (vm.max_map_count, 65,530 by default); past it a mapping fails and XLA crashed the
# worker (a segmentation fault compiling or serialising a program). So after a test, a process holding many
# mappings empties JAX's caches (a live engine's programs compile again, from the persistent cache where it is on).
MAX_MAPS = 40_000


def _mappings() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if _mappings() > MAX_MAPS:
        jax.clear_caches()
        gc.collect()


FIRST = ("tests/test_soak.py",)  # the longest: under make test's two workers it runs beside the rest, not after


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: not item.nodeid.startswith(FIRST))  # a stable sort: the rest keep their order


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



@pytest.fixture(scope="session")
def smollm2_dir():
    """The checkpoint directory of SmolLM2-135M-Instruct (the packaged GGUF file, converted once and cached)."""
    from jaxserve.models import gguf
    return gguf.resolve(gguf.SMOLLM2, progress=False)
