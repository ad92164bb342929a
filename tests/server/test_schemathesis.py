"""schemathesis against the server's own OpenAPI schema, in-process (ASGI), with the bundled model behind it.

Every operation but /debug/profile (it captures a JAX trace) gets generated requests, valid and invalid by the
schema (the body's `model` set to the served name, so valid bodies reach the engine). Checks: no 5xx; every
error answer is the OpenAI error shape; afterwards the engine holds no request and no block, its event loop and
engine thread are alive, and a valid completion still succeeds."""

from __future__ import annotations

import collections

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from tests.server.test_server import bundled_app, wait_idle

pytestmark = pytest.mark.slow
KEY = "sk-fuzz"


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    app, engine = bundled_app(tmp_path_factory, {"block_size": 16, "num_blocks": 32, "max_num_seqs": 4,
                                                 "chunk_size": 32, "max_num_batched_tokens": 64,
                                                 "max_model_len": 64},
                              {"api_keys": [KEY], "max_waiting": 8, "max_tokens_limit": 4, "max_n": 2,
                               "request_timeout_s": 60})
    yield app, engine
    engine.shutdown()


def test_generated_requests_get_no_server_error_and_leave_the_server_idle_and_serving(served):
    """One test: under pytest-xdist a second test reading what this one counted may run on another worker."""
    app, engine = served
    status: collections.Counter = collections.Counter()
    schema = schemathesis.openapi.from_asgi("/openapi.json", app, headers={"Authorization": f"Bearer {KEY}"})
    ops = [r.ok() for r in schema.get_all_operations()]
    ops = [op for op in ops if op.path != "/debug/profile"]
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/health", "/v1/models"}
    for op in ops:
        post = op.method.upper() == "POST"  # GETs take no input: nothing to make invalid
        for mode in list(schemathesis.GenerationMode) if post else [schemathesis.GenerationMode.POSITIVE]:
            examples = 60 if post else 5

            @given(case=op.as_strategy(generation_mode=mode))
            @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                      suppress_health_check=list(HealthCheck))
            def run(case):
                if isinstance(case.body, dict) and "model" in case.body:
                    case.body["model"] = "demo"
                resp = case.call(headers={"Authorization": f"Bearer {KEY}"}, timeout=120)  # first shapes compile
                status[resp.status_code] += 1
                case.validate_response(resp, checks=[not_a_server_error])
                if resp.status_code >= 400:  # the OpenAI error shape
                    err = resp.json()["error"]
                    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str), \
                        resp.text
            run()

    assert sum(status.values()) > 100 and not any(code >= 500 for code in status), status
    assert any(200 <= code < 300 for code in status) and any(400 <= code < 500 for code in status), status
    wait_idle(engine)
    from starlette.testclient import TestClient
    with TestClient(app) as client:
        r = client.post("/v1/completions", headers={"Authorization": f"Bearer {KEY}"},
                        json={"model": "demo", "prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
                              "ignore_eos": True})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    print(f"schemathesis: {sum(status.values())} requests, status codes {dict(sorted(status.items()))}")
