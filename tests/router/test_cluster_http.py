"""End to end over real processes: `jaxserve serve` of a disaggregated config (router in this process, a
prefill and a decode worker as child processes, KV over TCP) returns exactly the
tokens the colocated config returns, over HTTP, for a dense, an MLA and a hybrid model; the `jaxserve`
object names the prefill and the decode instance and the KV bytes the model's cache groups say the prompt
needs; no worker holds a block afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time

import pytest

from bench.clusters import unpinned
from jaxserve.config import parse
from jaxserve.models.cache_spec import cache_spec
from jaxserve.models.config import load_config
from jaxserve.router.serve import build
from jaxserve.worker.rpc import Client
from tests.http_server import running

pytestmark = pytest.mark.slow

BASE = [5, 7, 9, 11, 13, 2, 3, 4, 8, 10, 12, 14, 15, 6, 16, 17, 18, 19, 20, 21, 22]
PROMPTS = [BASE[:13], BASE[:3], [30, 31] + BASE[:11], BASE[:21]]
BS = 4
ENGINE = dict(block_size=BS, num_blocks=64, chunk_size=8, max_num_batched_tokens=16, max_prefill_seqs=2,
              max_num_seqs=4, num_snapshots=8, max_model_len=64, warmup=False, overlap=True)  # as on a GPU


def config(path: str, instances: list[dict], **sections) -> dict:
    # float32 on a GPU too (gpu_check runs the families' equals_colocated there): greedy answers compared exactly
    return {"model": {"path": path, "name": "m", "dtype": "float32"}, "engine": ENGINE,
            "clusters": [{"name": "c", "instances": instances}], **sections}


def disagg_config(path: str, extra_instances=(), **sections) -> dict:
    """p0 (prefill), the extra instances, d0 (decode), unpinned as every worker of the suite is but those of the
    tests of pinning (bench/clusters.py `unpinned`)."""
    return unpinned(config(path, [{"name": "p0", "role": "prefill"}, *extra_instances,
                                  {"name": "d0", "role": "decode"}],
                           transfer={"token": "tok", "connections": 2, "chunk_mb": 0.01, "layers_per_group": 2,
                                     "stream_min_tokens": 0, "deadline_s": 20.0},
                           router={"heartbeat_s": 0.5, "down_after_s": 3.0}, **sections))


@contextlib.contextmanager
def serving(cfg: dict, **build_kw):
    app, engine, _ = build(parse(cfg), progress=False, **build_kw)
    try:
        with running(app) as client:
            yield client, engine
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def complete(client, prompt, **kw) -> dict:
    body = {"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0,
            **kw}
    r = client.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def tokens(choice) -> list[int]:
    return [int(t) for t in choice["logprobs"]["tokens"]]  # no tokenizer: a token's text is its id


def worker_stats(workers) -> dict:
    """name -> engine stats, asked of each worker directly (its Health call)."""
    async def go():
        out = {}
        for w in workers:
            c = Client(w.address, "tok")
            try:
                out[w.name] = (await c.call("Health", {}, timeout=30))["stats"]
            finally:
                await c.close()
        return out
    return asyncio.run(go())


# dense GQA, and Kimi Linear: MLA and KDA layers in one model (every family runs disaggregated in-process:
# tests/disagg/test_inprocess.py); JAXSERVE_DISAGG_FAMILIES names others (bench/gpu_check.sh adds gpt-oss on a GPU)
@pytest.mark.parametrize("family", os.environ.get("JAXSERVE_DISAGG_FAMILIES", "llama,kimi_linear").split(","))
def test_disaggregated_http_equals_colocated(family, checkpoint_dir):
    path = checkpoint_dir(family)
    sampled = dict(temperature=0.8, top_k=20, seed=1234, n=2)
    with serving(config(path, [{"name": "solo", "role": "both"}])) as (client, _):
        want = [complete(client, p) for p in PROMPTS]
        want_sampled = complete(client, PROMPTS[0], **sampled)
    spec = cache_spec(load_config(path))
    with serving(disagg_config(path)) as (client, cluster):
        got = [complete(client, p) for p in PROMPTS]
        got_sampled = complete(client, PROMPTS[0], **sampled)
        with client.stream("POST", "/v1/completions", json={
                "model": "m", "prompt": PROMPTS[2], "max_tokens": 6, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        metrics = client.get("/metrics").text
        deadline = time.monotonic() + 10  # a heartbeat after the requests' steps (one taken after only the first
        while True:  # decode step, which dispatches and leaves its step in flight, has no device phase yet)
            health = client.get("/health").json()
            steps = {n: health["instances"][n]["steps"] for n in ("p0", "d0")}
            if steps["p0"].get("prefill") and "decode.device" in steps["d0"].get("decode", {}).get("phases_ms", {}) \
                    or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        stats = worker_stats(cluster.registry.workers.values())
    for p, w, g in zip(PROMPTS, want, got):
        assert tokens(g["choices"][0]) == tokens(w["choices"][0]), (family, p, tokens(w["choices"][0]),
                                                                    tokens(g["choices"][0]))
        meta = g["jaxserve"]
        assert meta["prefill_instance"] == "p0" and meta["decode_instance"] == "d0" and meta["route"] == "pd"
        assert 0 < meta["placed_s"] <= meta["ttft_s"], meta  # over HTTP too
        skip = meta["cached_tokens"] // BS  # prefix blocks decode already held are not sent
        assert meta["kv_bytes_transferred"] == spec.transfer_bytes(len(p), BS, 4, skip) > 0, (family, p, meta)
        assert w["jaxserve"]["kv_bytes_transferred"] == 0 and w["jaxserve"]["prefill_instance"] == "solo"
    assert got[0]["jaxserve"]["cached_tokens"] == 0
    # both workers on this host: the KV went through the decode worker's shared-memory receive pool, or on a GPU
    # (bench/gpu_check.sh runs this test there) device to device: CUDA IPC or JAX's transfer server
    import jax
    local = {"shm"} if jax.default_backend() == "cpu" else {"cuda_ipc", "device"}
    assert {g["jaxserve"]["kv_backend"] for g in got} <= local and want[0]["jaxserve"]["kv_backend"] is None, got
    # n = 2 with a seed: two sub-requests with seeds seed, seed + 1, as the colocated engine samples them
    assert [tokens(c) for c in got_sampled["choices"]] == [tokens(c) for c in want_sampled["choices"]]
    assert got_sampled["jaxserve"]["kv_bytes_transferred"] > 0
    # streaming: the same tokens; the final chunk carries the route
    streamed = [int(t) for e in events for t in (e["choices"][0]["logprobs"] or {}).get("tokens", [])]
    assert streamed == tokens(want[2]["choices"][0])
    assert events[-1]["jaxserve"]["decode_instance"] == "d0" and events[-1]["choices"][0]["finish_reason"] == "length"
    assert health["status"] == "ok" and health["instances"]["p0"]["up"] and health["instances"]["d0"]["role"] == "decode"
    # each worker's step times as of its last heartbeat (0.5 s apart): prefill steps on p0, decode steps on d0
    steps = {name: st["steps"] for name, st in health["instances"].items()}
    assert steps["p0"]["prefill"]["count"] >= 1 and "decode" not in steps["p0"], steps
    assert steps["d0"]["decode"]["phases_ms"]["decode.device"] > 0 and "prefill" not in steps["d0"], steps
    assert 'jaxserve_instance_up{instance="d0",role="decode"} 1.0' in metrics
    assert "jaxserve_kv_bytes_transferred" in metrics and "jaxserve_link_throughput_bytes_s" in metrics
    # decode's running updates left in its Updates stream's step messages (worker/fanout.py), not one per request
    assert stats["d0"]["updates_streamed"] >= len(PROMPTS) and stats["p0"]["updates_streamed"] == 0, stats
    for name, st in stats.items():  # nothing held once every request is done
        assert st["blocks_used"] == 0 and st["running"] == 0 and st["waiting"] == 0, (name, st)


def _trace_names(folder: str) -> set[str]:
    """The names of the events in a capture's Perfetto trace."""
    import glob
    import gzip
    (path,) = glob.glob(f"{folder}/**/perfetto_trace.json.gz", recursive=True)
    with gzip.open(path, "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return {e.get("name", "") for e in events}


def test_profile_traces_every_worker_of_a_disaggregated_cluster(checkpoint_dir, tmp_path):
    """POST /debug/profile on the router traces the router and each worker over the same window: the prefill
    worker's trace holds the prefill program, the KV export and its send; the decode worker's the KV import and
    the decode program; the router's holds neither (it runs no model). A second capture meanwhile is 409."""
    import httpx
    import threading
    cfg = disagg_config(checkpoint_dir("llama"), server={"profile_dir": str(tmp_path)})
    with serving(cfg) as (client, _):
        complete(client, PROMPTS[1])  # every program this test runs is compiled before the window
        got: dict = {}
        t = threading.Thread(target=lambda: got.update(
            r=httpx.post(f"{client.base_url}/debug/profile", json={"seconds": 3}, timeout=300)))
        t.start()
        time.sleep(0.5)
        busy = client.post("/debug/profile", json={"seconds": 1})
        meta = complete(client, [40 + i for i in range(15)])["jaxserve"]
        t.join()
    assert busy.status_code == 409 and busy.json()["error"]["code"] == "busy", busy.text
    r = got["r"]
    assert r.status_code == 200, r.text
    ans = r.json()
    assert meta["prefill_instance"] == "p0" and meta["kv_bytes_transferred"] > 0
    assert set(ans["instances"]) == {"p0", "d0"}, ans
    assert ans["trace_dir"].startswith(str(tmp_path)) and ans["trace_dir"].endswith("router")
    names = {n: _trace_names(i["trace_dir"]) for n, i in ans["instances"].items()}
    router = _trace_names(ans["trace_dir"])
    assert {"kv.export", "kv.send"} <= names["p0"] and "kv.import" in names["d0"], names
    assert "PjitFunction(prefill_fn)" in names["p0"] and "PjitFunction(step_fn)" in names["d0"], names
    assert not any(n.startswith(("kv.", "PjitFunction(")) for n in router), router
