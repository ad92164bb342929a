"""The OpenAI-compatible server over real HTTP against uvicorn on a local port, with the bundled model
(a random Kimi Linear checkpoint with a BPE tokenizer and chat template, built in a temporary directory)."""

import json
import threading
import time

import httpx
import numpy as np
import pytest

from jaxserve import bundled
from jaxserve.config import parse
from jaxserve.router.serve import build
from tests.http_server import running

KEY = "sk-test"


def bundled_app(tmp_path_factory, engine: dict, server: dict):
    """The app and engine serving a fresh copy of the bundled model as "demo" (no warm-up compiles)."""
    path = str(tmp_path_factory.mktemp("bundled") / "model")
    bundled.build(path)
    cfg = parse({"model": {"path": path, "name": "demo"}, "engine": {**engine, "warmup": False},
                 "server": {**server, "profile_dir": str(tmp_path_factory.mktemp("profiles"))}})
    app, eng, _ = build(cfg, progress=False)
    return app, eng


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    app, engine = bundled_app(tmp_path_factory, {"block_size": 16, "num_blocks": 64, "max_num_seqs": 4,
                                                 "chunk_size": 64, "max_num_batched_tokens": 128,
                                                 "max_model_len": 256},
                              {"api_keys": [KEY], "max_waiting": 2, "max_tokens_limit": 200, "max_n": 2})
    with running(app, {"Authorization": f"Bearer {KEY}"}) as client:
        yield client, engine
    engine.shutdown()


def wait_idle(engine, timeout=60):
    """Until the engine holds no request and no block (polls a condition; fails on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        st = engine.engine.stats()
        if st["running"] == 0 and st["waiting"] == 0 and st["blocks_used"] == 0:
            engine.engine.blocks.check()
            return
        assert time.monotonic() < deadline, f"engine still busy: {st}"
        time.sleep(0.02)


def sse(resp) -> list[dict]:
    events = []
    for line in resp.iter_lines():
        if line.startswith("data: "):
            events.append(line[6:])
    assert events[-1] == "[DONE]"
    return [json.loads(e) for e in events[:-1]]


def test_completion_matches_offline_greedy(server):
    client, engine = server
    llm = engine.engine
    prompt = llm.tokenizer.encode("Prefill and decode run in separate processes. " * 5)
    assert len(prompt) > 32
    r = client.post("/v1/completions", json={"model": "demo", "prompt": prompt, "max_tokens": 12,
                                             "temperature": 0, "ignore_eos": True, "logprobs": 2})
    assert r.status_code == 200, r.text
    body = r.json()
    # reference: greedy over the plain prefill path of the same weights
    from jaxserve.models.batch import Batch
    from jaxserve.models.cache_spec import init_dense_cache
    from jaxserve.models.model import jit_forward
    import jax.numpy as jnp
    fwd = jit_forward(llm.graphdef, llm.runner.stack)
    ids, ref = list(prompt), []
    for _ in range(12):
        cache = init_dense_cache(llm.model_config, 1, 128, llm.dtype)
        tokens = jnp.asarray([ids + [0] * (128 - len(ids))], jnp.int32)
        logits, _ = fwd(llm.runner.params, Batch(tokens, jnp.zeros(1, jnp.int32), jnp.asarray([len(ids)], jnp.int32)),
                        cache, jnp.asarray([[len(ids) - 1]], jnp.int32))
        ref.append(int(np.asarray(logits)[0, 0].argmax()))
        ids.append(ref[-1])
    ch = body["choices"][0]
    assert ch["text"] == llm.tokenizer.decode(ref) and ch["finish_reason"] == "length"
    assert len(ch["logprobs"]["token_logprobs"]) == 12 and all(len(t) <= 2 for t in ch["logprobs"]["top_logprobs"])
    assert body["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": 12,
                             "total_tokens": len(prompt) + 12, "prompt_tokens_details": {"cached_tokens": 0}}
    js = body["jaxserve"]
    assert js["route"] == "colocated" and js["prefill_instance"] == js["decode_instance"] == "local-0"
    assert js["kv_bytes_transferred"] == 0 and js["ttft_s"] > 0 and js["placed_s"] is None
    # the same prompt again reuses its cached prefix (blocks + linear-state snapshot at the last boundary)
    again = client.post("/v1/completions", json={"model": "demo", "prompt": prompt + prompt, "max_tokens": 4,
                                                 "temperature": 0}).json()
    cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert cached == (len(prompt) - 1) // 16 * 16 and again["jaxserve"]["cached_tokens"] == cached
    wait_idle(engine)


def test_stream_equals_non_stream_and_chat(server):
    client, engine = server
    req = {"model": "demo", "prompt": "Hybrid models keep", "max_tokens": 10, "temperature": 0.7, "seed": 5}
    full = client.post("/v1/completions", json=req).json()["choices"][0]["text"]
    with client.stream("POST", "/v1/completions", json=dict(req, stream=True,
                                                            stream_options={"include_usage": True})) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        events = sse(r)
    text = "".join(e["choices"][0]["text"] for e in events if e["choices"])
    assert text == full
    assert events[-2]["choices"][0]["finish_reason"] in ("stop", "length") and "jaxserve" in events[-2]
    assert events[-1]["usage"]["completion_tokens"] >= 1
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello!"}]
    chat = client.post("/v1/chat/completions", json={"model": "demo", "messages": msgs, "max_tokens": 6,
                                                     "temperature": 0, "ignore_eos": True}).json()
    prompt = engine.engine.tokenizer.apply_chat_template(msgs)
    assert prompt.endswith("<|assistant|>")
    assert chat["usage"]["prompt_tokens"] == len(engine.engine.tokenizer.encode(prompt))
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["role"] == "assistant"
    with client.stream("POST", "/v1/chat/completions", json={"model": "demo", "messages": msgs, "max_tokens": 6,
                                                             "temperature": 0, "ignore_eos": True,
                                                             "stream": True}) as r:
        events = sse(r)
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    streamed = "".join(e["choices"][0]["delta"].get("content", "") for e in events)
    assert streamed == chat["choices"][0]["message"]["content"]
    two = client.post("/v1/completions", json=dict(req, n=2)).json()
    assert [c["index"] for c in two["choices"]] == [0, 1]
    wait_idle(engine)


def test_return_token_ids(server):
    """vLLM's extension: the prompt's token ids and each choice's generated ids, streamed or not."""
    client, engine = server
    tok = engine.engine.tokenizer
    req = {"model": "demo", "prompt": "Agents continue by ids", "max_tokens": 5, "temperature": 0,
           "ignore_eos": True, "return_token_ids": True}
    body = client.post("/v1/completions", json=req).json()
    ids = tok.encode("Agents continue by ids")
    ch = body["choices"][0]
    assert body["prompt_token_ids"] == ids and len(ch["token_ids"]) == body["usage"]["completion_tokens"] == 5
    with client.stream("POST", "/v1/completions", json=dict(req, stream=True)) as r:
        events = sse(r)
    assert events[0]["prompt_token_ids"] == ids and all("prompt_token_ids" not in e for e in events[1:])
    assert sum((e["choices"][0]["token_ids"] for e in events), []) == ch["token_ids"]
    plain = client.post("/v1/completions", json=dict(req, return_token_ids=False)).json()
    assert "prompt_token_ids" not in plain and "token_ids" not in plain["choices"][0]
    msgs = [{"role": "user", "content": "Hello!"}]
    chat = client.post("/v1/chat/completions", json={"model": "demo", "messages": msgs, "max_tokens": 3,
                                                     "temperature": 0, "ignore_eos": True,
                                                     "return_token_ids": True}).json()
    assert chat["prompt_token_ids"] == tok.encode(tok.apply_chat_template(msgs))
    assert len(chat["choices"][0]["token_ids"]) == 3
    wait_idle(engine)


def test_models_health_metrics_profile(server):
    client, engine = server
    health = client.get("/health").json()
    assert health["status"] == "ok" and set(health) == {"status", "steps"}
    steps = health["steps"]  # the module's earlier requests' steps
    assert steps["decode"]["count"] > 0 and all(v["ms"] > 0 for v in steps.values()), health
    m = client.get("/v1/models").json()
    assert m["data"][0]["id"] == "demo"
    text = client.get("/metrics").text
    for name in ("jaxserve_requests_total", "jaxserve_time_to_first_token_seconds_bucket", "jaxserve_waiting",
                 "jaxserve_blocks_used", "jaxserve_prefix_hit_rate", "jaxserve_compiled_programs",
                 "jaxserve_time_per_output_token_seconds_count"):
        assert name in text
    programs = [ln for ln in text.splitlines() if ln.startswith("jaxserve_compiled_programs ")]
    assert float(programs[0].split()[1]) >= 2
    r = client.post("/debug/profile", json={"seconds": 0.2})
    assert r.status_code == 200, r.text
    import os
    trace = r.json()["trace_dir"]
    assert any(files for _, _, files in os.walk(trace))


@pytest.mark.parametrize("body,status,param", [
    ({"model": "demo", "prompt": "a", "max_tokens": -1}, 400, "max_tokens"),
    ({"model": "demo", "prompt": "a", "max_tokens": 10**9}, 400, "max_tokens"),
    ({"model": "demo", "prompt": "a", "max_tokens": "ten"}, 400, "max_tokens"),
    ({"model": "demo", "prompt": "a", "temperature": "hot"}, 400, "temperature"),
    ({"model": "demo", "prompt": "a", "bogus_field": 1}, 400, "bogus_field"),
    ({"model": "nope", "prompt": "a"}, 404, "model"),
    ({"model": "demo", "prompt": ""}, 400, "prompt"),
    ({"model": "demo", "prompt": []}, 400, "prompt"),
    ({"model": "demo", "prompt": [1, 99999]}, 400, "prompt"),
    ({"model": "demo", "prompt": [1, -3]}, 400, "prompt"),
    ({"model": "demo", "prompt": [5] * 250}, 400, "max_tokens"),  # with the default 16: over the context
    ({"model": "demo", "prompt": [5] * 300}, 400, "prompt"),  # alone over the context
    ({"model": "demo", "prompt": "a", "n": 3}, 400, "n"),
    ({"model": "demo", "prompt": "a", "logprobs": 21}, 400, "logprobs"),
    ({"model": "demo", "prompt": "a", "stop": [""]}, 400, "stop"),
    ({"model": "demo"}, 400, "prompt"),
    ({"model": "demo", "prompt": [5] * 100_000}, 400, "prompt"),  # refused before tokenising: over the context
    ({"model": "demo", "prompt": "a", "stop_token_ids": [1] * 1000}, 400, "stop_token_ids"),
    ({"model": "demo", "prompt": "a", "user": "u" * 1000}, 400, "user"),
    # found by schemathesis: values past the engine's int32 / float32 tensors were a 503 or an overflow
    ({"model": "demo", "prompt": "a", "top_k": 2**40}, 400, "top_k"),
    ({"model": "demo", "prompt": "a", "repetition_penalty": 1e300}, 400, "repetition_penalty"),
    ({"model": "demo", "prompt": "a", "stop_token_ids": [2**40]}, 400, "stop_token_ids.0"),
])
def test_bad_input_gets_openai_errors(server, body, status, param):
    client, engine = server
    r = client.post("/v1/completions", json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param


def test_bad_json_keys_and_chat_errors(server):
    client, engine = server
    r = client.post("/v1/completions", content=b"{not json", headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"model": "demo", "messages": []})
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    r = client.post("/v1/chat/completions", json={"model": "demo", "messages": [{"role": "robot", "content": "x"}]})
    assert r.status_code == 400
    r = client.post("/v1/chat/completions", json={"model": "demo", "messages": [{"role": "user", "content": "x"}],
                                                  "top_logprobs": 50, "logprobs": True})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    for headers in ({"Authorization": "Bearer wrong"}, {"Authorization": ""}):
        r = httpx.get(f"{client.base_url}/v1/models", headers=headers)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    assert httpx.get(f"{client.base_url}/health").status_code == 200  # health needs no key
    wait_idle(engine)


def test_a_huge_body_is_refused_before_it_is_read_and_the_server_goes_on(server):
    """A 100 MB body (a prompt of 24M token ids) is 413 at once (server.max_request_mb), not parsed; the next
    valid request is served."""
    client, engine = server
    body = b'{"model": "demo", "prompt": [' + b"1," * (50 << 20) + b'1]}'
    r = client.post("/v1/completions", content=body, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    r = client.post("/v1/completions", json={"model": "demo", "prompt": "Prefill", "max_tokens": 2})
    assert r.status_code == 200, r.text
    wait_idle(engine)


def test_disconnect_mid_stream_frees_slot_and_blocks(server):
    client, engine = server
    with client.stream("POST", "/v1/completions", json={"model": "demo", "prompt": "Prefill", "max_tokens": 200,
                                                        "ignore_eos": True, "stream": True}) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and '"text"' in line:
                break  # one token arrived; leave mid-stream
    wait_idle(engine)


def test_beyond_capacity_queues_then_refuses_with_429(server):
    client, engine = server
    base = str(client.base_url)
    results = []

    def one():
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {KEY}"}, timeout=120) as c:
            results.append(c.post("/v1/completions", json={"model": "demo", "prompt": "Hybrid", "max_tokens": 120,
                                                           "ignore_eos": True}))
    threads = [threading.Thread(target=one) for _ in range(9)]  # 4 slots + 2 queued + refused
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 6 and 429 in codes, codes
    refused = next(r for r in results if r.status_code == 429).json()["error"]
    assert refused["type"] == "rate_limit_exceeded" and "busy" in refused["message"]
    wait_idle(engine)
