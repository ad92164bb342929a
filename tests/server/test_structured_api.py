"""Structured outputs and tool calling through the official `openai` SDK, against the server on a local port with
SmolLM2-135M-Instruct, greedy: JSON schemas (nested objects, arrays, enums, bounded numbers, required fields)
whose every answer parses and validates (jsonschema), json_object, a regex and a choice (vLLM's request fields),
a named and a required tool call whose arguments validate against the tool's schema, the same streamed with the
tool-call deltas reassembled, a tool's result sent back as a `role: tool` message; under `strict: true` (response
formats and functions) closed objects, compact JSON and answers that end (a bounded number, an integer bounded
below only); bad inputs are 400s naming the field; the OpenAPI schema lists the new fields. Then the same
constrained answers, strict ones included, from a disaggregated cluster (configs/local.yaml's one prefill and one
decode worker): prefill samples the first token under the grammar, decode rebuilds the matcher from it. The
tool-call parsers and the streaming split without a model."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from jaxserve.config import parse
from jaxserve.server import tools as toolcalls
from jaxserve.server.protocol import ChatRequest
from jaxserve.router.serve import build
from tests.http_server import running

ENGINE = {"block_size": 16, "num_blocks": 256, "max_num_seqs": 8, "chunk_size": 256, "max_num_batched_tokens": 512,
          "max_model_len": 1024, "warmup": False}
SCHEMAS = {
    "city": {"type": "object", "additionalProperties": False, "required": ["city", "country", "population"],
             "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                            "population": {"type": "integer", "minimum": 0, "maximum": 50000000}}},
    "book": {"type": "object", "additionalProperties": False, "required": ["title", "author", "year", "genres"],
             "properties": {"title": {"type": "string"},
                            "author": {"type": "object", "additionalProperties": False, "required": ["first", "last"],
                                       "properties": {"first": {"type": "string"}, "last": {"type": "string"}}},
                            "year": {"type": "integer", "minimum": 1000, "maximum": 2030},
                            "genres": {"type": "array", "minItems": 1, "maxItems": 3,
                                       "items": {"enum": ["novel", "poetry", "history", "science"]}}}},
    "measure": {"type": "object", "additionalProperties": False, "required": ["value", "unit", "exact"],
                "properties": {"value": {"type": "number", "minimum": -100, "maximum": 100},
                               "unit": {"enum": ["celsius", "fahrenheit"]}, "exact": {"type": "boolean"}}},
}
QUESTIONS = {"city": "Tell me about Paris as JSON.", "book": "Describe the novel Les Miserables as JSON.",
             "measure": "What temperature does water freeze at? Answer as JSON."}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather of a city",
    "parameters": {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                   "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}}}}}
CLOCK = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "required": ["timezone"],
                                       "properties": {"timezone": {"type": "string"}}}}}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
# the schemas of the strict-outputs issue, as a user wrote them: no additionalProperties in the first, a population
# bounded below only in the second (neither tuned to the model)
STRICT = {
    "verdict": ("Is the sky blue?", {"type": "object", "required": ["answer", "confidence"], "properties": {
        "answer": {"type": "boolean"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1}}}),
    "place": ("Tell me about Paris.", {"type": "object", "additionalProperties": False,
                                       "required": ["city", "country", "population"],
                                       "properties": {"city": {"type": "string"}, "country": {"type": "string"},
                                                      "population": {"type": "integer", "minimum": 0}}})}
STRICT_CLOCK_PARAMS = {"type": "object", "required": ["timezone"], "properties": {
    "timezone": {"type": "string"}, "format": {"type": "object", "properties": {"hours": {"enum": [12, 24]}}}}}
STRICT_CLOCK = {"type": "function", "function": {"name": "get_time", "strict": True, "parameters": STRICT_CLOCK_PARAMS}}
# the same, closed by hand: the answers' oracle, independent of jaxserve/schema.py
CLOSED = {"verdict": {**STRICT["verdict"][1], "additionalProperties": False}, "place": STRICT["place"][1],
          "get_time": {**STRICT_CLOCK_PARAMS, "additionalProperties": False, "properties": {
              **STRICT_CLOCK_PARAMS["properties"], "format": {**STRICT_CLOCK_PARAMS["properties"]["format"],
                                                              "additionalProperties": False}}}}


def sdk(client) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{client.base_url}/v1", api_key="none", max_retries=0)


@pytest.fixture(scope="module")
def api(smollm2_dir):
    app, engine, _ = build(parse({"model": {"path": smollm2_dir, "name": "m"}, "engine": ENGINE}), progress=False)
    with running(app) as client:
        yield sdk(client), client
    engine.shutdown()


def ask(c, name: str, **kw):
    return c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": QUESTIONS[name]}], temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": SCHEMAS[name],
                                                                "strict": True}}, **kw)


def ask_strict(c, name: str):
    question, schema = STRICT[name]
    return c.chat.completions.create(
        model="m", messages=[{"role": "user", "content": question}], temperature=0, max_tokens=120,
        response_format={"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}})


def constrained_answers(c) -> dict:
    """The answers the disaggregated cluster must reproduce: a JSON schema (the shortest answer: what crosses is
    the first token and the matcher rebuilt from it, not the schema's features), a strict one, a choice, a named
    tool call and a strict one."""
    out = {"city": ask(c, "city").choices[0].message.content,
           "strict": ask_strict(c, "verdict").choices[0].message.content}
    out["choice"] = c.completions.create(model="m", prompt="The capital of Italy is", max_tokens=8, temperature=0,
                                         extra_body={"guided_choice": ["Rome", "Milan", "Naples"]}).choices[0].text
    call = c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK], temperature=0, max_tokens=60,
                                     tool_choice={"type": "function", "function": {"name": "get_weather"}})
    out["tool"] = call.choices[0].message.tool_calls[0].function.arguments
    call = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
                                     tools=[STRICT_CLOCK], temperature=0, max_tokens=60,
                                     tool_choice={"type": "function", "function": {"name": "get_time"}})
    out["strict_tool"] = call.choices[0].message.tool_calls[0].function.arguments
    return out


def test_json_schemas_regex_and_choice(api):
    c, _ = api
    answers = {}
    for name, schema in SCHEMAS.items():
        r = ask(c, name)
        assert r.choices[0].finish_reason == "stop"
        answers[name] = r.choices[0].message.content
        jsonschema.validate(json.loads(answers[name]), schema)
    # any object: nothing but its numbers is bounded, so an answer of open-ended keys may run to max_tokens (as
    # "Describe a dog" does, counting in an array); this one closes
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Describe a cat as JSON."}],
                                  temperature=0, max_tokens=80, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason == "stop" and isinstance(json.loads(r.choices[0].message.content), dict)
    r = c.completions.create(model="m", prompt="My phone number is", max_tokens=12, temperature=0,
                             extra_body={"structured_outputs": {"regex": "[0-9]{3}-[0-9]{4}"}})
    text = r.choices[0].text
    assert len(text) == 8 and text[3] == "-" and text.replace("-", "").isdigit() and text.isascii()
    r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "Is the sky blue?"}],
                                  temperature=0, max_tokens=8, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no") and r.choices[0].finish_reason == "stop"
    # streamed: the same answer, chunk by chunk
    s = c.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS["book"]}],
                                  temperature=0, max_tokens=120, stream=True, response_format={
                                      "type": "json_schema", "json_schema": {"name": "b", "schema": SCHEMAS["book"]}})
    text = "".join(ch.choices[0].delta.content or "" for ch in s if ch.choices)
    assert text == answers["book"]
    jsonschema.validate(json.loads(text), SCHEMAS["book"])


def compact(text: str) -> bool:
    """No whitespace outside string values."""
    outside, in_string, escaped = [], False, False
    for ch in text:
        if in_string:
            in_string = escaped or ch != '"'
            escaped = not escaped and ch == "\\"
        elif ch == '"':
            in_string = True
        else:
            outside.append(ch)
    return not any(ch.isspace() for ch in outside)


def test_strict_schemas_answer_closed_compact_and_ended(api):
    """strict: true closes the objects (no invented keys), the JSON is compact, and the answers end: the number
    in [0, 1] and the integer bounded only below stop by themselves, within max_tokens 120."""
    c, _ = api
    for name in STRICT:
        r = ask_strict(c, name)
        text = r.choices[0].message.content
        assert r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 120, (name, text)
        jsonschema.validate(json.loads(text), CLOSED[name])
        assert compact(text) and "\n" not in text, text
    population = json.loads(ask_strict(c, "place").choices[0].message.content)["population"]
    assert 0 <= population < 2 ** 63


def test_a_strict_tool_has_its_arguments_closed(api):
    c, _ = api
    for choice in ({"type": "function", "function": {"name": "get_time"}}, "required"):
        r = c.chat.completions.create(model="m", messages=[{"role": "user", "content": "What time is it in Tokyo?"}],
                                      tools=[STRICT_CLOCK, WEATHER], tool_choice=choice, temperature=0,
                                      max_tokens=120)
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        for call in r.choices[0].message.tool_calls:
            args = json.loads(call.function.arguments)
            if call.function.name == "get_time":
                jsonschema.validate(args, CLOSED["get_time"])
            assert compact(call.function.arguments)


def test_flexible_whitespace_is_a_switch():
    body = ChatRequest.model_validate({"model": "m", "messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "v", "schema": STRICT["verdict"][1], "strict": True}}})
    tight, loose = body.params(8, None).guided, body.params(8, None, flexible_json=True).guided
    assert "x-guidance" not in json.loads(tight.spec) and json.loads(tight.spec) == CLOSED["verdict"]
    assert json.loads(loose.spec)["x-guidance"]["whitespace_flexible"] is True
    assert json.loads(loose.spec)["additionalProperties"] is False  # still strict
    assert parse({"server": {"json_whitespace": "flexible"}}).server.json_whitespace == "flexible"
    # strict: false (or absent) keeps JSON Schema's own meaning; a strict function's parameters are closed
    open_ = ChatRequest.model_validate({"model": "m", "messages": ASK, "response_format": {
        "type": "json_schema", "json_schema": {"name": "v", "schema": STRICT["verdict"][1]}}})
    assert json.loads(open_.params(8, None).guided.spec) == STRICT["verdict"][1]
    tools = ChatRequest.model_validate({"model": "m", "messages": ASK, "tools": [STRICT_CLOCK, CLOCK]}).tools
    assert toolcalls.parameters(tools, 0) == CLOSED["get_time"] and toolcalls.parameters(tools, 1) == CLOCK[
        "function"]["parameters"]


def test_tool_calls_named_required_streamed_and_answered(api):
    c, _ = api
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named,
                                  temperature=0, max_tokens=60)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    # required, among closed tools (an open one lets this model add keys until max_tokens)
    r = c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, STRICT_CLOCK], tool_choice="required",
                                  temperature=0, max_tokens=120, parallel_tool_calls=False)
    (req,) = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls"
    schema = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, STRICT_CLOCK)}[req.function.name]
    jsonschema.validate(json.loads(req.function.arguments), schema)
    # streamed: the SDK's deltas reassemble into the same call
    calls: dict = {}
    finish = None
    for ch in c.chat.completions.create(model="m", messages=ASK, tools=[WEATHER, CLOCK], tool_choice=named,
                                        temperature=0, max_tokens=60, stream=True):
        if not ch.choices:
            continue
        for d in ch.choices[0].delta.tool_calls or ():
            e = calls.setdefault(d.index, {"id": "", "name": "", "arguments": ""})
            e["id"] += d.id or ""
            e["name"] += (d.function.name or "") if d.function else ""
            e["arguments"] += (d.function.arguments or "") if d.function else ""
        finish = ch.choices[0].finish_reason or finish
    assert finish == "tool_calls" and list(calls) == [0]
    assert calls[0]["name"] == "get_weather" and calls[0]["arguments"] == call.function.arguments
    # the tool's result goes back through the chat template as a `role: tool` message
    history = ASK + [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": "18 degrees and sunny"}]
    r = c.chat.completions.create(model="m", messages=history, tools=[WEATHER], temperature=0, max_tokens=20)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls


def test_bad_inputs_are_400_naming_the_field(api):
    c, client = api
    cases = [
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}),
         "response_format"),
        (dict(extra_body={"guided_regex": "a(b"}), "guided_regex"),
        (dict(extra_body={"guided_regex": "a", "guided_choice": ["b"]}), "guided_choice"),
        (dict(tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}]),
         "tools[1].function.parameters"),
        (dict(tool_choice="required"), "tool_choice"),
        (dict(tools=[WEATHER], tool_choice="required", response_format={"type": "json_object"}), "response_format"),
        # strict cannot close an allOf of objects exactly: refused, not served as something else
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]}}}), "response_format"),
        (dict(tools=[{"type": "function", "function": {"name": "f", "strict": True, "parameters": {
            "allOf": [{"type": "object", "properties": {"a": {"type": "string"}}}]}}}]),
         "tools[0].function.parameters")]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as e:
            c.chat.completions.create(model="m", messages=ASK, max_tokens=5, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    schema = client.get("/openapi.json").json()["components"]["schemas"]
    for field in ("response_format", "structured_outputs", "guided_json", "guided_regex", "guided_choice",
                  "guided_grammar", "tools", "tool_choice", "parallel_tool_calls"):
        assert field in schema["ChatRequest"]["properties"], field
    assert "response_format" in schema["CompletionRequest"]["properties"]


def test_tool_call_parsers_and_the_streaming_split():
    req = ChatRequest.model_validate({"model": "m", "messages": ASK, "tools": [WEATHER, CLOCK]})
    text = ('Let me check. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n'
            '</tool_call>\n<tool_call>{"name": "get_time", "arguments": {"timezone": "CET"}}</tool_call>')
    content, calls = toolcalls.calls_of(text, req.tools, "auto", "hermes")
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("get_time", {"timezone": "CET"})]
    assert len(toolcalls.calls_of(text, req.tools, "auto", "hermes", parallel=False)[1]) == 1
    # a call of no such tool, or not JSON: text
    for odd in ('<tool_call>{"name": "launch", "arguments": {}}</tool_call>', "<tool_call>not json</tool_call>"):
        assert toolcalls.calls_of(odd, req.tools, "auto", "hermes") == (odd, [])
    assert toolcalls.calls_of("plain", req.tools, "auto", "hermes") == ("plain", [])
    _, calls = toolcalls.calls_of('{"name": "get_time", "parameters": {"timezone": "UTC"}}', req.tools, "auto",
                                  "llama3_json")
    assert calls[0]["function"]["name"] == "get_time"
    # streaming auto: text before a call goes out, a possible start of one is held back, the calls come at the end
    ts = toolcalls.ToolStream(req.tools, "auto", "hermes", True)
    assert ts.delta("Let me check. <tool") == {"content": "Let me check. "}
    assert ts.delta(text[:40]) is None
    last, called = ts.end(text)
    assert called and [c["function"]["name"] for c in last["tool_calls"]] == ["get_weather", "get_time"]
    assert [c["index"] for c in last["tool_calls"]] == [0, 1] and "content" not in last
    plain = toolcalls.ToolStream(req.tools, "auto", "hermes", True)
    assert plain.delta("Sunny <to") == {"content": "Sunny "} and plain.end("Sunny <today>") == (
        {"content": "<today>"}, False)


@pytest.mark.slow
def test_disaggregated_answers_equal_colocated(api, smollm2_dir):
    from bench.clusters import unpinned
    from tests.router.test_cluster_http import serving
    c, _ = api
    want = constrained_answers(c)
    import importlib.resources

    import yaml
    # the embedded default: one prefill and one decode worker (unpinned here), KV over TCP, layer-wise; the
    # engine sized as the colocated server's (no warm-up: the programs compile as the requests need them)
    cfg = unpinned(yaml.safe_load(importlib.resources.files("jaxserve").joinpath("configs/local.yaml").read_text()))
    cfg["model"].update(path=smollm2_dir, name="m")
    cfg["engine"] = {**cfg["engine"], **ENGINE}
    with serving(cfg) as (client, _):
        d = sdk(client)
        got = constrained_answers(d)
        r = d.chat.completions.create(model="m", messages=[{"role": "user", "content": QUESTIONS["city"]}],
                                      temperature=0, max_tokens=120, response_format={"type": "json_object"})
        assert r.model_extra["jaxserve"]["prefill_instance"] == "local-p0"
        assert r.model_extra["jaxserve"]["decode_instance"] == "local-d0"
    assert got == want
