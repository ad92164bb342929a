"""The OpenAI-compatible API's handlers (`Api`, registered as routes by app.py): completions, chat completions,
models, health, metrics, the admin operations and profiles, and what they share: parsing a body off the loop,
sampling parameters checked against the server's limits, submitting to the EngineClient, collecting its updates,
the `jaxserve` object and usage of an answer. Streaming answers are streaming.py's.

Concurrency: the handlers run on the server's event loop; JSON parsing and validation of a body, tokenising and
chat templating run on a small thread pool (`_work`) so a large request does not hold the loop that streams other
requests' tokens.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import time
import uuid

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError

from .. import trace
from ..config import Config
from ..engine.client import EngineClient, EngineUnavailable, QueueFull, RequestError, Update
from ..structured import Grammars, Guided, GuidedError
from . import tools as toolcalls
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, LinkUpdate, MigrateRequest, RoleUpdate
from .streaming import logprobs_block, stream

_work = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="http-work")
CHECK = object()  # put on a waiting request's queue once a second (`collect`)


async def _off_loop(fn, *args):
    """fn(*args) on the request-work pool (parsing, tokenising), not on the event loop."""
    return await asyncio.get_running_loop().run_in_executor(_work, fn, *args)


def validation_error(errs: list) -> APIError:
    """The first pydantic error as a 400 naming the field."""
    first = errs[0] if errs else {"loc": (), "msg": "invalid request"}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, "the request body is not valid JSON")
    param = ".".join(loc) or None
    return APIError(400, f"{param}: {first.get('msg')}" if param else str(first.get("msg")), param=param)


class Api:
    def __init__(self, config: Config, engine: EngineClient, model_name: str, metrics: Metrics):
        """engine: the colocated AsyncEngine or a cluster's router (the same protocol over workers)."""
        self.engine, self.model_name, self.metrics = engine, model_name, metrics
        self.tok = engine.tokenizer
        self.srv = config.server
        self.instance = config.instances()[0].name
        self.cluster = config.cluster_of(self.instance)
        self._grammars: Grammars | None = None

    async def parse(self, request: Request, model):
        """The request's body as `model`, parsed and validated off the loop (the gate bounded its size)."""
        raw = await request.body()
        try:
            return await _off_loop(model.model_validate_json, raw)
        except ValidationError as e:
            raise validation_error(e.errors()) from None

    def check_model(self, name: str):
        if name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def sampling(self, body, logprobs):
        max_tokens = body.max_tokens
        if isinstance(body, ChatRequest) and body.max_completion_tokens is not None:
            max_tokens = body.max_completion_tokens
        if max_tokens is None:
            max_tokens = 16 if isinstance(body, CompletionRequest) else min(self.srv.max_tokens_limit, 256)
        if max_tokens > self.srv.max_tokens_limit:
            raise APIError(400, f"max_tokens ({max_tokens}) exceeds this server's limit {self.srv.max_tokens_limit}",
                           param="max_tokens")
        if body.n > self.srv.max_n:
            raise APIError(400, f"n ({body.n}) exceeds this server's limit {self.srv.max_n}", param="n")
        if body.stream and body.n > 1:
            raise APIError(400, "stream with n > 1 is not supported", param="n")
        try:
            params = body.params(max_tokens, logprobs, self.srv.json_whitespace == "flexible")
            if params.guided is not None:
                self.grammars().check(params.guided)
            tools = getattr(body, "tools", None) or []
            for i, t in enumerate(tools):  # every tool's schema, whichever is called
                if t.function.parameters is not None:
                    self.grammars().check(Guided("json", json.dumps(toolcalls.parameters(tools, i)),
                                            f"tools[{i}].function.parameters"))
            return params
        except GuidedError as e:
            raise APIError(400, str(e), param=e.param) from None
        except ValueError as e:
            raise APIError(400, str(e)) from None

    def grammars(self) -> Grammars:
        """A grammar engine to check constraints with before any is queued (the engine compiles its own)."""
        if self.tok is None:
            raise GuidedError("structured outputs need the model's tokenizer", "response_format")
        if self._grammars is None:
            self._grammars = Grammars(self.tok.to_json(), self.tok.vocab_size, [])
        return self._grammars

    async def submit(self, prompt, params, stream: bool):
        rid = uuid.uuid4().hex
        try:
            limit = self.engine.max_model_len
            if isinstance(prompt, list) and limit is not None and len(prompt) > limit:
                raise RequestError(f"prompt of {len(prompt)} tokens exceeds the maximum context length {limit}",
                                   "prompt")
            ids = await _off_loop(self.engine.encode, prompt)
            q = await self.engine.add(rid, ids, params, final_only=not stream)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except QueueFull as e:
            raise APIError(429, f"server busy: {e}; retry later", "rate_limit_exceeded", code="queue_full") from None
        except EngineUnavailable as e:
            raise APIError(503, f"no capacity: {e}", "server_error", code="unavailable") from None
        return rid, ids, q

    async def collect(self, request: Request, rid: str, q: asyncio.Queue, n: int):
        """The request's n final updates. Once a second a timer puts CHECK on its queue: the client gone or the
        deadline past ends it (one timer a request, not a timeout per update: a running update costs the request
        its queue's wake-up)."""
        final: dict[int, Update] = {}
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.srv.request_timeout_s
        timer = None

        def check():
            nonlocal timer
            q.put_nowait(CHECK)
            timer = loop.call_later(1.0, check)
        timer = loop.call_later(1.0, check)
        try:
            while len(final) < n:
                u = await q.get()
                if u is CHECK:
                    if await request.is_disconnected():
                        raise APIError(499, "client disconnected")
                    if loop.time() > deadline:
                        raise APIError(408, f"request timed out after {self.srv.request_timeout_s}s", "timeout")
                elif u.finished:
                    final[u.index] = u
        except BaseException:
            self.engine.abort(rid)
            raise
        finally:
            timer.cancel()
        errors = [u.error for u in final.values() if u.error]
        if errors:
            raise APIError(503, f"the engine failed: {errors[0]}", "server_error", code="engine_error")
        return [final[i] for i in range(n)]

    def meta(self, updates: list[Update]):
        """The response's `jaxserve` object: where the request ran and what its prefill reused."""
        ttft = [u.ttft_s for u in updates if u.ttft_s is not None]
        here = self.instance
        route = updates[0].route or {"route": "colocated", "prefill_instance": here, "decode_instance": here,
                                     "prefill_cluster": self.cluster, "decode_cluster": self.cluster,
                                     "prefix_source": here if updates[0].cached_tokens else None}
        kv = sum((u.route or {}).get("kv_bytes_transferred", 0) for u in updates)
        cached = max(u.cached_tokens for u in updates)
        moves = [m for u in updates for m in u.migrations or ()]
        return {"route": route["route"], "prefill_instance": route["prefill_instance"],
                "decode_instance": route["decode_instance"], "prefill_cluster": route.get("prefill_cluster"),
                "decode_cluster": route.get("decode_cluster"), "kv_backend": route.get("kv_backend"),
                "cached_tokens": cached, "uncached_tokens": updates[0].prompt_tokens - cached,
                "prefix_source": route.get("prefix_source"), "prefix_move": route.get("prefix_move"),
                "kv_bytes_transferred": kv, "ttft_s": round(min(ttft), 6) if ttft else None,
                "placed_s": route.get("placed_s"), "prefill_ttft_s": route.get("prefill_ttft_s"),
                "migrations": [m for i, m in enumerate(moves) if m not in moves[:i]]}

    def usage(self, updates: list[Update]):
        p = updates[0].prompt_tokens
        c = sum(len(u.token_ids) for u in updates)
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
                "prompt_tokens_details": {"cached_tokens": max(u.cached_tokens for u in updates)}}

    def token_ids(self, body, ids, updates: list[Update], out: dict) -> dict:
        """return_token_ids (vLLM's extension): the prompt's ids and each choice's generated ids."""
        if body.return_token_ids:
            out["prompt_token_ids"] = ids
            for c, u in zip(out["choices"], updates):
                c["token_ids"] = u.token_ids
        return out

    # ---- the routes (app.py ROUTES)
    async def health(self):
        body = self.engine.health()
        return JSONResponse(body, status_code=200 if body["status"] == "ok" else 503)

    async def models(self):
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "jaxserve", "max_model_len": self.engine.max_model_len}]}

    async def prom(self):
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    async def completions(self, request: Request):
        body = await self.parse(request, CompletionRequest)
        self.check_model(body.model)
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise APIError(400, "a list of several prompts is not supported; send one request per prompt",
                               param="prompt")
            prompt = prompt[0]
        if isinstance(prompt, str) and self.tok is None:
            raise APIError(400, "this model has no tokenizer: send the prompt as token ids", param="prompt")
        params = self.sampling(body, body.logprobs)
        rid, ids, q = await self.submit(prompt, params, body.stream)
        if body.stream:
            return StreamingResponse(stream(self, rid, q, False, body, ids), media_type="text/event-stream")
        ups = await self.collect(request, rid, q, params.n)
        choices = [{"index": u.index, "text": u.text, "finish_reason": u.finish_reason,
                    "logprobs": logprobs_block(u, 0, self.tok, False) if body.logprobs is not None else None}
                   for u in ups]
        return self.token_ids(body, ids, ups, {
            "id": f"cmpl-{rid}", "object": "text_completion", "created": int(time.time()), "model": self.model_name,
            "choices": choices, "usage": self.usage(ups), "jaxserve": self.meta(ups)})

    async def chat(self, request: Request):
        body = await self.parse(request, ChatRequest)
        self.check_model(body.model)
        if self.tok is None or not self.tok.chat_template:
            raise APIError(400, "this model has no chat template; use /v1/completions", param="messages")
        tools = [t.model_dump(exclude_none=True) for t in body.tools] if body.tools else None
        try:
            prompt = await _off_loop(lambda: self.tok.apply_chat_template([m.template_dict() for m in body.messages],
                                                                     tools=tools))
        except Exception as e:  # noqa: BLE001 - the template raised on these messages (jinja2 errors)
            raise APIError(400, f"the chat template failed on these messages: {type(e).__name__}: {e}",
                           param="messages") from None
        params = self.sampling(body, (body.top_logprobs or 0) if body.logprobs else None)
        rid, ids, q = await self.submit(prompt, params, body.stream)
        if body.stream:
            return StreamingResponse(stream(self, rid, q, True, body, ids), media_type="text/event-stream")
        ups = await self.collect(request, rid, q, params.n)
        choices = []
        for u in ups:
            message, finish = {"role": "assistant", "content": u.text}, u.finish_reason
            try:
                content, calls = toolcalls.calls_of(u.text, body.tools or [], body.choice, self.srv.tool_call_parser,
                                                    body.parallel_tool_calls)
            except (ValueError, KeyError, TypeError):  # a constrained call cut short (max_tokens): its text
                content, calls = u.text, []
            if calls:
                message = {"role": "assistant", "content": content, "tool_calls": calls}
                finish = "tool_calls" if finish == "stop" else finish
            choices.append({"index": u.index, "message": message, "finish_reason": finish,
                            "logprobs": logprobs_block(u, 0, self.tok, True) if body.logprobs else None})
        return self.token_ids(body, ids, ups, {
            "id": f"chatcmpl-{rid}", "object": "chat.completion", "created": int(time.time()),
            "model": self.model_name, "choices": choices, "usage": self.usage(ups), "jaxserve": self.meta(ups)})

    async def admin_links(self, request: Request):
        """Change an emulated inter-cluster link's bandwidth now (stages a bandwidth drop on a live cluster)."""
        body = await self.parse(request, LinkUpdate)
        try:
            return await self.engine.set_link(body.src, body.dst, body.bandwidth_gbps)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None

    async def admin_roles(self, request: Request):
        """Change an instance's role in place: it drains, compiles what the new role runs, and switches."""
        body = await self.parse(request, RoleUpdate)
        try:
            return await self.engine.set_role(body.instance, body.role)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), "server_error", code="unavailable") from None

    async def admin_migrate(self, request: Request):
        """Move part of the decode work of the requests running on src to dst (the KV of some heads, or a range
        of layers); answers once the move is done."""
        body = await self.parse(request, MigrateRequest)
        try:
            return await self.engine.migrate(body.kind, body.src, body.dst, body.heads, body.layers)
        except RequestError as e:
            raise APIError(400, str(e), param=e.param) from None
        except EngineUnavailable as e:
            raise APIError(503, str(e), "server_error", code="unavailable") from None

    async def profile(self, request: Request):
        """A JAX profiler trace of every process that runs the model (jaxserve/trace.py)."""
        try:
            body = await request.json() if await request.body() else {}
        except json.JSONDecodeError:
            raise APIError(400, "the request body is not valid JSON") from None
        seconds = body.get("seconds", 5) if isinstance(body, dict) else None
        if not isinstance(seconds, (int, float)) or isinstance(seconds, bool) or not 0 < seconds <= 300:
            raise APIError(400, "seconds must be a number in (0, 300]", param="seconds")
        try:
            return await self.engine.profile(float(seconds), self.srv.profile_dir)
        except trace.Busy as e:
            raise APIError(409, str(e), code="busy") from None
