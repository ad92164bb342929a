"""XLA's persistent compilation cache (engine.compilation_cache): an engine restarted on the same model and
config compiles nothing (nor checks its kernels again), its entries read and written under JAX's file lock
(processes share it), and a cache JAX was already given is kept."""

import json
import os
import subprocess
import sys

from jaxserve.engine.xla_cache import use_compilation_cache

RUN = r"""
import json, sys
from jax import monitoring
counts = {"requests": 0, "hits": 0}
def on(event, **kw):
    if event == "/jax/compilation_cache/compile_requests_use_cache":
        counts["requests"] += 1
    elif event == "/jax/compilation_cache/cache_hits":
        counts["hits"] += 1
monitoring.register_event_listener(on)
from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import EngineConfig
cfg = EngineConfig(block_size=4, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_num_seqs=4,
                   num_snapshots=8, compilation_cache=sys.argv[2])
llm = LLM(sys.argv[1], progress=False, engine=cfg)
out = llm.generate([[5, 7, 9, 11, 13], [3, 4]], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
print(json.dumps({**counts, "tokens": [o.token_ids for o in out], "dir": llm.engine.compilation_cache}))
"""


def test_a_restarted_engine_compiles_nothing(checkpoint_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_COMPILATION_CACHE")
           and not k.startswith("JAX_PERSISTENT_CACHE")}
    env["PYTHONPATH"] = os.getcwd()
    cache = str(tmp_path / "xla")

    def run():
        out = subprocess.run([sys.executable, "-c", RUN, checkpoint_dir("llama"), cache], env=env, check=True,
                             capture_output=True, text=True, timeout=600)
        return json.loads(out.stdout.strip().splitlines()[-1])
    first, second = run(), run()
    assert first["dir"] == second["dir"] == cache and os.listdir(cache)
    # bounded, so JAX reads and writes the entries under its file lock (processes sharing a cache)
    assert ".lockfile" in os.listdir(cache) and any(n.endswith("-cache") for n in os.listdir(cache))
    assert first["requests"] > 0 and first["hits"] < first["requests"]  # the first start compiles
    # the restart compiles none, and checks no kernel: the self-test's passes are kept in the same directory (where
    # the native kernels build: else there is no self-test, and the restart asks for the same programs)
    assert 0 < second["hits"] == second["requests"] <= first["requests"]
    if "jaxserve-kernel-checks" in os.listdir(cache):
        assert second["requests"] < first["requests"]
    assert second["tokens"] == first["tokens"]


def test_a_cache_jax_already_has_is_kept(tmp_path):
    # the test session's conftest gave JAX a cache directory through JAX_COMPILATION_CACHE_DIR
    assert use_compilation_cache(str(tmp_path / "other")) == os.environ["JAX_COMPILATION_CACHE_DIR"]
    assert not (tmp_path / "other").exists()
