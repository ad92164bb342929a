"""Faults over real processes: the router with two prefill workers (p0, p1, core 0) and one decode worker
(d0, core 1), the dense tiny model. p1 is not launched by the router: it joins the way a worker on another
host does (`jaxserve worker --router HOST:PORT`); a worker presenting the wrong cluster token is refused and
exits. Each fault is a real killed worker process (SIGSTOP first, so the kill
lands while the request is in the middle of that worker's part, deterministically, then SIGKILL):

1. p0 killed during its Prefill call: the router places the request again (a fresh reservation on d0, the
   old one freed at once) and prefills on p1; the client gets the full answer, equal to the colocated one.
2. d0 killed while it streams tokens: the router marks d0 down and resumes the request where the client's
   stream stopped, whole on p1 (local prefill fallback, no decode instance left) with the tokens streamed so
   far: the client gets every token once, equal to the colocated answer. The next request does not go to d0
   either.
3. d0 started again: the global KV index counts nothing of the killed process's cache (a new event epoch),
   takes the new process's full state and follows it from there.
After each fault, no surviving worker holds a cache block or a request.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import yaml

from jaxserve import LLM, SamplingParams
from jaxserve.engine.llm_engine import EngineConfig
from tests.router.test_cluster_http import BASE, ENGINE, complete, disagg_config, serving, tokens, worker_stats

pytestmark = pytest.mark.slow


def wait_for(cond, timeout=120.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.002)


def freeze_then_kill(cluster, name):
    child = cluster.launcher.children[name]
    os.kill(child.pid, signal.SIGSTOP)  # the worker stops where it is
    cluster.launcher.kill(name)  # SIGKILL: its sockets are reset


def join(cfg: dict, tmp_path, name: str, router: str) -> subprocess.Popen:
    """Start `jaxserve worker` for `name` the way an operator on another host would."""
    f = tmp_path / f"{name}-{cfg['transfer']['token']}.yaml"
    f.write_text(yaml.safe_dump(cfg))
    return subprocess.Popen([sys.executable, "-m", "jaxserve.cli", "worker", "--config", str(f), "--instance", name,
                             "--router", router], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def faulty(checkpoint_dir, tmp_path_factory):
    path = checkpoint_dir("llama")
    cfg = disagg_config(path, [{"name": "p1", "role": "prefill", "launch": False}])
    tmp = tmp_path_factory.mktemp("join")
    with serving(cfg) as (client, cluster):
        assert "p1" not in cluster.registry.workers  # serve waited only for the workers it launched
        # a worker with the wrong cluster token is refused and exits with a clear message
        bad = join({**cfg, "transfer": {**cfg["transfer"], "token": "wrong"}}, tmp, "p1", cluster.address)
        out, _ = bad.communicate(timeout=300)
        assert bad.returncode == 2 and "refused this worker: wrong cluster token" in out, out
        p1 = join(cfg, tmp, "p1", cluster.address)
        try:
            wait_for(lambda: "p1" in cluster.registry.workers or p1.poll() is not None, 300, "p1 to join")
            assert p1.poll() is None, p1.stdout.read()
            yield path, client, cluster
        finally:
            p1.terminate()
            p1.wait(30)


def reference(path, prompt, max_tokens):
    engine = EngineConfig(**{k: v for k, v in ENGINE.items() if k != "warmup"})
    out = LLM(path, progress=False, engine=engine).generate(
        [prompt], SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True))
    return out[0].token_ids


def check_no_leak(cluster):
    for name, st in worker_stats(cluster.registry.up()).items():
        assert st["blocks_used"] == 0 and st["running"] == 0 and st["waiting"] == 0, (name, st)


def test_prefill_killed_mid_request_is_retried_on_another_prefill(faulty):
    path, client, cluster = faulty
    prompt = BASE[:17]
    want = reference(path, prompt, 6)
    p0 = cluster.registry.workers["p0"]
    box = {}
    t = threading.Thread(target=lambda: box.update(r=client.post("/v1/completions", json={
        "model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "logprobs": 0})))
    t.start()
    wait_for(lambda: p0.inflight == 1, what="p0's Prefill call")  # least loaded, then by name: p0 first
    freeze_then_kill(cluster, "p0")
    t.join(120)
    r = box["r"]
    assert r.status_code == 200, r.text
    body = r.json()
    assert tokens(body["choices"][0]) == want
    meta = body["jaxserve"]
    assert meta["prefill_instance"] == "p1" and meta["decode_instance"] == "d0" and meta["kv_bytes_transferred"] > 0
    health = client.get("/health").json()
    assert not health["instances"]["p0"]["up"] and health["instances"]["p1"]["up"]
    assert cluster.retries >= 1
    check_no_leak(cluster)


def test_decode_killed_mid_stream_is_resumed_and_avoided(faulty):
    path, client, cluster = faulty
    prompt = BASE[:9]
    events, first = [], threading.Event()

    def stream():
        with client.stream("POST", "/v1/completions", json={
                "model": "m", "prompt": prompt, "max_tokens": 40, "temperature": 0, "ignore_eos": True,
                "stream": True, "logprobs": 0}) as r:
            for line in r.iter_lines():
                if line.startswith("data: {"):
                    events.append(json.loads(line[6:]))
                    if events[-1].get("choices") and events[-1]["choices"][0].get("logprobs"):
                        first.set()
    t = threading.Thread(target=stream)
    t.start()
    assert first.wait(120), f"no token arrived: {events}"
    pid = cluster.launcher.children["d0"].pid
    assert [n for n in os.listdir("/dev/shm") if n.startswith(f"jaxserve-kv-{pid}-")]  # its receive pool
    freeze_then_kill(cluster, "d0")
    # the killed worker could not remove its shared-memory receive pool: the launcher did
    assert not [n for n in os.listdir("/dev/shm") if n.startswith(f"jaxserve-kv-{pid}-")]
    t.join(120)
    assert not t.is_alive()
    assert "error" not in events[-1], events[-1]
    got = [t for e in events if e.get("choices") and e["choices"][0].get("logprobs")
           for t in tokens(e["choices"][0])]
    assert got == reference(path, prompt, 40)  # every token once, as if nothing had happened
    meta = events[-1]["jaxserve"]
    assert meta["decode_instance"] == meta["prefill_instance"] == "p1"
    health = client.get("/health").json()
    assert not health["instances"]["d0"]["up"] and health["status"] == "ok"  # p1 can still serve whole requests
    # the next request does not go to d0: it runs whole on the surviving prefill instance
    want = reference(path, prompt, 6)
    r = client.post("/v1/completions", json={"model": "m", "prompt": prompt, "max_tokens": 6, "temperature": 0,
                                             "ignore_eos": True, "logprobs": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    assert tokens(body["choices"][0]) == want
    assert body["jaxserve"]["prefill_instance"] == body["jaxserve"]["decode_instance"] == "p1"
    assert body["jaxserve"]["kv_bytes_transferred"] == 0
    check_no_leak(cluster)


def test_killed_worker_restarted_holds_nothing_in_the_index(faulty):
    """d0 was killed above while it held the prompt's prefix. Started again (a new process, a new cache-event
    epoch) it counts for nothing of the old process's cache: the global KV index takes the new process's full
    state, which holds none of the prompt, and then follows what the new process caches."""
    path, client, cluster = faulty
    prompt = BASE[:9]
    old = cluster.registry.workers["d0"].pid
    cluster.launcher.start_one("d0")
    d0 = lambda: cluster.registry.workers["d0"]  # noqa: E731
    wait_for(lambda: d0().pid != old and cluster.registry.is_up(d0()), 300, "d0 to come back")
    wait_for(lambda: cluster.index.want("d0") is not None, 30, "d0's full cache state")
    assert "d0" not in cluster.index.match(prompt)
    body = complete(client, prompt)
    assert tokens(body["choices"][0]) == reference(path, prompt, 6)
    assert body["jaxserve"]["decode_instance"] == "d0"
    wait_for(lambda: cluster.index.match(prompt).get("d0") == 8, 30, "the index to see d0's new blocks")
    check_no_leak(cluster)
