"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics, profile,
and the admin route that changes an emulated link's bandwidth.

Requests pass the gate first (gate.py: API keys, rate limits, the body limit), are validated (protocol.py),
tokenized, and queued on the EngineClient (engine/client.py); responses are plain JSON or server-sent events.
Every error is an OpenAI-shaped body with a 4xx status (503 when the engine cannot take work). A streaming
client that disconnects aborts its request, which releases its slot and blocks; a non-streaming one is checked
for disconnection while it waits. Concurrency: asyncio on the server's event loop; JSON parsing and validation
of a body, tokenising and chat templating run on a small thread pool (`_work`) so a large request does not hold
the loop that streams other requests' tokens; the engine runs on its own thread (engine/async_engine.py) or in
worker processes behind the router.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from .. import trace
from ..config import Config
from ..engine.client import EngineClient, EngineUnavailable, QueueFull, RequestError, Update
from ..structured import Grammars, Guided, GuidedError
from . import tools as toolcalls
from .gate import Gate
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, LinkUpdate, MigrateRequest, RoleUpdate

_work = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="http-work")


async def _off_loop(fn, *args):
    """fn(*args) on the request-work pool (parsing, tokenising), not on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_work, fn, *args)


def _validation_error(errs: list) -> APIError:
    """The first pydantic error as a 400 naming the field."""
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    param = ".".join(loc) or None
    return APIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)


def _body_schema(model) -> dict:
    """OpenAPI for a route that parses its own body (off the loop): the model's schema as the request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def _logprobs_block(u: Update, start: int, tokenizer, chat: bool):
    items = u.logprobs[start:]
    toks = u.token_ids[start:start + len(items)]

    def piece(t):
        return tokenizer.decode([t], skip_special_tokens=False) if tokenizer is not None else str(t)
    if chat:
        return {"content": [{"token": piece(t), "logprob": lp, "bytes": None,
                             "top_logprobs": [{"token": piece(i), "logprob": v} for i, v in top]}
                            for t, (lp, top) in zip(toks, items)]}
    return {"tokens": [piece(t) for t in toks], "token_logprobs": [lp for lp, _ in items],
            "top_logprobs": [{piece(i): v for i, v in top} for _, top in items], "text_offset": []}


def create_app(config: Config, engine: EngineClient, model_name: str, metrics: Metrics, lifespan=None) -> FastAPI:
    """engine: the colocated AsyncEngine or a cluster's router (the same protocol over workers).
    lifespan: FastAPI lifespan (the cluster's worker start-up and shutdown)."""
    app = FastAPI(title="jaxserve", version="0.1.0", lifespan=lifespan)
    tok = engine.tokenizer
    srv = config.server
    app.state.grammars = None
    instance = config.instances()[0].name
    cluster = config.cluster_of(instance)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return await _api_error(request, _validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        return await _api_error(request, APIError(e.status_code, str(e.detail),
                                                  "not_found_error" if e.status_code == 404 else "invalid_request_error"))

    app.add_middleware(Gate, api_keys=list(srv.api_keys), max_body=int(srv.max_request_mb * (1 << 20)),
                       rate=srv.rate_limit_rps, burst=srv.rate_limit_burst,
                       on_refused=lambda status: metrics.errors.labels(str(status)).inc())

    def openapi():
        if app.openapi_schema is None:
            from fastapi.openapi.utils import get_openapi
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            comps = schema.setdefault("components", {}).setdefault("schemas", {})
            for model in (CompletionRequest, ChatRequest, LinkUpdate, RoleUpdate, MigrateRequest):
                js = model.model_json_schema(ref_template="#/components/schemas/{model}")
                comps.update(js.pop("$defs", {}))
                comps[model.__name__] = js
            app.openapi_schema = schema
        return app.openapi_schema
    app.openapi = openapi

    async def parse(request: Request, model):
        """The request's body as `model`, parsed and validated off the loop (the gate bounded its size)."""
        raw = await request.body()
        try:
            return await _off_loop(model.model_validate_json, raw)
        except ValidationError as e:
            raise _validation_error(e.errors()) from None

    # ---- helpers
    def check_model(name: str):
        if name != model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def sampling(body, logprobs):
        max_tokens = body.max_tokens
        if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = 16 if isinstance(body, CompletionRequest) else min(srv.max_tokens_limit, 256)
        if max_tokens > srv.max_tokens_limit:
            raise APIError(400, f"max_tokens ({max_tokens}) exceeds this server's limit {srv.max_tokens_limit}",
                           param="max_tokens")
        if body.n > srv.max_n:
            raise APIError(400, f"n ({body.n}) exceeds this server's limit {srv.max_n}", param="n")
        if body.stream and body.n > 1:
            raise APIError(400, "stream with n > 1 is not supported", param="n")
        try:
            params = body.params(max_tokens, logprobs, srv.json_whitespace == "flexible")
            if params.guided is not None:
                grammars().check(params.guided)
            tools = getattr(body, "tools", None) or []
            for i, t in enumerate(tools):  # every tool's schema, whichever is called
                if t.function.parameters is not None:
                    grammars().check(Guided("json", json.dumps(toolcalls.parameters(tools, i)),
                                            f"tools[{i}].function.parameters"))
            return params
        except GuidedError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def grammars() -> Grammars:
        """A grammar engine to check constraints with before any is queued (the engine compiles its own)."""
        if tok is None:
            raise GuidedError("structured outputs need the model's tokenizer", "response_format")
        if app.state.grammars is None:
            app.state.grammars = Grammars(tok.to_json(), tok.vocab_size, [])
        return app.state.grammars

    async def submit(prompt, params):
        rid = uuid.uuid4().hex
        try:
            limit = engine.max_model_len
            if isinstance(prompt, list) and limit is not None and len(prompt) > limit:
                raise RequestError(f"prompt of {len(prompt)} tokens exceeds the maximum context length {limit}",
                                   "prompt")
            ids = await _off_loop(engine.encode, prompt)
            q = await engine.add(rid, ids, params)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry later", "rate_limit_exceeded", code="queue_full") from None
        except EngineUnavailable as e:
            raise APIError(503, f"no capacity: {e}", "server_error", code="unavailable") from None
        return rid, ids, q

    async def collect(request: Request, rid: str, q: asyncio.Queue, n: int):
        final: dict[int, Update] = {}
        deadline = time.monotonic() + srv.request_timeout_s
        try:
            while len(final) < n:
                try:
                    u = await asyncio.wait_for(q.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected")
                    if time.monotonic() > deadline:
                        raise APIError(408, f"request timed out after {srv.request_timeout_s}s", "timeout")
                    continue
                if u.finished:
                    final[u.index] = u
        except BaseException:
            engine.abort(rid)
            raise
        errors = [u.error for u in final.values() if u.error]
        if errors:
            raise APIError(503, f"the engine failed: {errors[0]}", "server_error", code="engine_error")
        return [final[i] for i in range(n)]

    def meta(updates: list[Update]):
        """The response's `jaxserve` object: where the request ran and what its prefill reused."""
        ttft = [u.ttft_s for u in updates if u.ttft_s is not None]
        route = updates[0].route or {"route": "colocated", "prefill_instance": instance, "decode_instance": instance,
                                     "prefill_cluster": cluster, "decode_cluster": cluster,
                                     "prefix_source": instance if updates[0].cached_tokens else None}
        kv = sum((u.route or {}).get("kv_bytes_transferred", 0) for u in updates)
        cached = max(u.cached_tokens for u in updates)
        moves = [m for u in updates for m in u.migrations or ()]
        return {"route": route["route"], "prefill_instance": route["prefill_instance"],
                "decode_instance": route["decode_instance"], "prefill_cluster": route.get("prefill_cluster"),
                "decode_cluster": route.get("decode_cluster"), "kv_backend": route.get("kv_backend"),
                "cached_tokens": cached, "uncached_tokens": updates[0].prompt_tokens - cached,
                "prefix_source": route.get("prefix_source"), "prefix_move": route.get("prefix_move"),
                "kv_bytes_transferred": kv, "ttft_s": round(min(ttft), 6) if ttft else None,
                "placed_s": route.get("placed_s"), "migrations": [m for i, m in enumerate(moves) if m not in moves[:i]]}

    def usage(updates: list[Update]):
        p = updates[0].prompt_tokens
        c = sum(len(u.token_ids) for u in updates)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": max(u.cached_tokens for u in updates)}}

    def token_ids(body, ids, updates: list[Update], out: dict) -> dict:
        """return_token_ids (vLLM's extension): the prompt's ids and each choice's generated ids."""
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
            for c, u in zip(out["choices"], updates):
                c["token_ids"] = u.token_ids
        return out

    async def stream(rid, q, chat: bool, body, ids):
        obj = "chat.completion.chunk" if chat else "text_completion"
        created, sent_text, sent_lp, sent_ids = int(time.time()), "", 0, 0
        want_lp = bool(body.logprobs) if chat else body.logprobs is not None
        # chat: what of the text goes out as content and as tool-call deltas (server/tools.py)
        ts = toolcalls.ToolStream(body.tools or [], body.choice, srv.tool_call_parser,
                                  body.parallel_tool_calls) if chat else None

        def chunk(delta_text, finish, u=None, extra=None, delta=None):
            if chat:
                choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
            else:
                choice = {"index": 0, "text": delta_text, "finish_reason": finish, "logprobs": None}
            if u is not None and want_lp and len(u.logprobs) > sent_lp:
                choice["logprobs"] = _logprobs_block(u, sent_lp, tok, chat)
            if body.return_token_ids:
                choice["token_ids"] = u.token_ids[sent_ids:] if u is not None else []
            d = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [choice]}
            if body.return_token_ids and sent_ids == 0 and not sent_text:
                d["prompt_token_ids"] = ids
            if extra:
                d.update(extra)
            return f"data: {json.dumps(d)}\n\n"

        try:
            if chat:
                d = {"id": rid, "object": obj, "created": created, "model": model_name,
                     "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
                yield f"data: {json.dumps(d)}\n\n"
            deadline = time.monotonic() + srv.request_timeout_s
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    yield f"data: {json.dumps(APIError(408, 'request timed out', 'timeout').body())}\n\n"
                    break
                try:
                    u = await asyncio.wait_for(q.get(), timeout=remaining)
                except asyncio.TimeoutError:
                    continue
                if u.error:
                    yield f"data: {json.dumps(APIError(503, u.error, 'server_error').body())}\n\n"
                    break
                text = u.text if tok is not None else ""
                delta = text[len(sent_text):]
                if u.finished:
                    extra = {"jaxserve": meta([u])}
                    finish = u.finish_reason
                    if chat:
                        last, called = ts.end(text)
                        finish = "tool_calls" if called and finish == "stop" else finish
                        yield chunk("", finish, u, extra, last)
                    else:
                        yield chunk(delta, finish, u, extra)
                    if body.stream_options is not None and body.stream_options.include_usage:
                        d = {"id": rid, "object": obj, "created": created, "model": model_name, "choices": [],
                             "usage": usage([u])}
                        yield f"data: {json.dumps(d)}\n\n"
                    break
                out = ts.delta(text) if chat else None
                if (out if chat else delta) or (want_lp and len(u.logprobs) > sent_lp) or (
                        body.return_token_ids and len(u.token_ids) > sent_ids):
                    yield chunk(delta, None, u, delta=out)
                    sent_text, sent_lp, sent_ids = text, len(u.logprobs), len(u.token_ids)
            yield "data: [DONE]\n\n"
        finally:
            engine.abort(rid)  # no-op when finished; frees the slot when the client went away

    # ---- routes
    @app.get("/health")
    async def health():
        body = engine.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": 0, "owned_by": "jaxserve",
                                            "max_model_len": engine.max_model_len}]}

    @app.get("/metrics")
    async def prom():
        return Response(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.post("/v1/completions", openapi_extra=_body_schema(CompletionRequest))
    async def completions(request: Request):
        body = await parse(request, CompletionRequest)
        check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "a list of several prompts is not supported; send one request per prompt",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str) and tok is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        params = sampling(body, body.logprobs)
        rid, ids, q = await submit(prompt, params)
        if body.stream:
            return StreamingResponse(stream(rid, q, False, body, ids), media_type="text/event-stream")
        ups = await collect(request, rid, q, params.n)
        choices = [{"index": u.index, "text": u.text, "finish_reason": u.finish_reason,
                    "logprobs": _logprobs_block(u, 0, tok, False) if body.logprobs is not None else None}
                   for u in ups]
        return token_ids(body, ids, ups, {
            "id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": model_name,
            "choices": choices, "usage": usage(ups), "jaxserve": meta(ups)})

    @app.post("/v1/chat/completions", openapi_extra=_body_schema(ChatRequest))
    async def chat(request: Request):
        body = await parse(request, ChatRequest)
        check_model(body.model)
        if tok is None or not tok.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            prompt = await _off_loop(lambda: tok.apply_chat_template([m.template_dict() for m in body.messages],
                                                                     tools=tools))
        except Exception as e:  # noqa: BLE001 - the template raised on these messages (jinja2 errors)
            raise APIError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                           param="messages") from None
        params = sampling(body, (body.top_logprobs or 0) if body.logprobs else None)
        rid, ids, q = await submit(prompt, params)
        if body.stream:
            return StreamingResponse(stream(rid, q, True, body, ids), media_type="text/event-stream")
        ups = await collect(request, rid, q, params.n)
        choices = []
        for u in ups:
            message, finish = {"role": "assistant", "content": u.text}, u.finish_reason
            try:
                content, calls = toolcalls.calls_of(u.text, body.tools or [], body.choice, srv.tool_call_parser,
                                                    body.parallel_tool_calls)
            except (ValueError, KeyError, TypeError):  # a constrained call cut short (max_tokens): its text
                content, calls = u.text, []
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": u.index, "message": message, "finish_reason": finish,
                            "logprobs": _logprobs_block(u, 0, tok, True) if body.logprobs else None})
        return token_ids(body, ids, ups, {
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": model_name, "choices": choices, "usage": usage(ups), "jaxserve": meta(ups)})

    @app.post("/admin/links", openapi_extra=_body_schema(LinkUpdate))
    async def admin_links(request: Request):
        """Change an emulated inter-cluster link's bandwidth now (stages a bandwidth drop on a live cluster)."""
        body = await parse(request, LinkUpdate)
        try:
            return await engine.set_link(body.src, body.dst, body.bandwidth_gbps)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None

    @app.post("/admin/roles", openapi_extra=_body_schema(RoleUpdate))
    async def admin_roles(request: Request):
        """Change an instance's role in place: it drains, compiles what the new role runs, and switches."""
        body = await parse(request, RoleUpdate)
        try:
            return await engine.set_role(body.instance, body.role)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), "server_error", code="unavailable") from None

    @app.post("/admin/migrate", openapi_extra=_body_schema(MigrateRequest))
    async def admin_migrate(request: Request):
        """Move part of the decode work of the requests running on src to dst (the KV of some heads, or a range
        of layers); answers once the move is done."""
        body = await parse(request, MigrateRequest)
        try:
            return await engine.migrate(body.kind, body.src, body.dst, body.heads, body.layers)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), "server_error", code="unavailable") from None

    @app.post("/debug/profile")
    async def profile(request: Request):
        """A JAX profiler trace of every process that runs the model (jaxserve/trace.py)."""
        try:
            body = await request.json() if await request.body() else {}
        except json.JSONDecodeError:
            raise APIError(400, "the request body is not valid JSON") from None
        seconds = body.get("seconds", 5) if isinstance(body, dict) else None
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds <= 300:
            raise APIError(400, "seconds must be a number in (0, 300]", param="seconds")
        try:
            return await engine.profile(float(seconds), srv.profile_dir)
        except trace.Busy as e:
            raise APIError(409, str(e), code="busy") from None

    return app
