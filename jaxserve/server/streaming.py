"""Streaming answers (server-sent events) and the logprobs blocks of every answer, for the HTTP app (api.py)."""

from __future__ import annotations

import asyncio
import json
import time

from ..engine.client import Update
from . import tools as toolcalls
from .protocol import APIError


def logprobs_block(u: Update, start: int, tokenizer, chat: bool):
    """The OpenAI logprobs object of u's tokens from `start` on (chat: `content`; completions: the legacy lists)."""
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


TIMED_OUT = object()  # put on a request's queue at its deadline (server.request_timeout_s)


async def stream(api, rid: str, q, chat: bool, body, ids: list[int]):
    """The request's server-sent events: a chunk per update that adds text, logprobs or token ids (chat: content
    and tool-call deltas, server/tools.py), the last with the `jaxserve` object (and usage when asked), then
    [DONE]. Updates are cumulative: when the client is behind, the chunk says what the latest one adds. At the
    deadline a timer puts TIMED_OUT on the queue (one timer a request, not a timeout per update: a request costs
    its queue's wake-up a step). Leaving early aborts the request."""
    obj = "chat.completion.chunk" if chat else "text_completion"
    created, sent_text, sent_lp, sent_ids = int(time.time()), "", 0, 0
    want_lp = bool(body.logprobs) if chat else body.logprobs is not None
    # chat: what of the text goes out as content and as tool-call deltas (server/tools.py)
    ts = toolcalls.ToolStream(body.tools or [], body.choice, api.srv.tool_call_parser,
                              body.parallel_tool_calls) if chat else None

    def chunk(delta_text, finish, u=None, extra=None, delta=None):
        if chat:
            choice = {"index": 0, "delta": delta or {}, "finish_reason": finish, "logprobs": None}
        else:
            choice = {"index": 0, "text": delta_text, "finish_reason": finish, "logprobs": None}
        if u is not None and want_lp and len(u.logprobs) > sent_lp:
            choice["logprobs"] = logprobs_block(u, sent_lp, api.tok, chat)
        if body.return_token_ids:
            choice["token_ids"] = u.token_ids[sent_ids:] if u is not None else []
        d = {"id": rid, "object": obj, "created": created, "model": api.model_name, "choices": [choice]}
        if body.return_token_ids and sent_ids == 0 and not sent_text:
            d["prompt_token_ids"] = ids
        if extra:
            d.update(extra)
        return f"data: {json.dumps(d)}\n\n"

    timer = None
    try:
        if chat:
            d = {"id": rid, "object": obj, "created": created, "model": api.model_name,
                 "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]}
            yield f"data: {json.dumps(d)}\n\n"
        timer = asyncio.get_running_loop().call_later(api.srv.request_timeout_s, q.put_nowait, TIMED_OUT)
        while True:
            u = await q.get()
            while u is not TIMED_OUT and not u.finished and not q.empty():
                u = q.get_nowait()  # the client is behind: the latest update holds what the others did
            if u is TIMED_OUT:
                yield f"data: {json.dumps(APIError(408, 'request timed out', 'timeout').body())}\n\n"
                break
            if u.error:
                yield f"data: {json.dumps(APIError(503, u.error, 'server_error').body())}\n\n"
                break
            text = u.text if api.tok is not None else ""
            delta = text[len(sent_text):]
            if u.finished:
                extra = {"jaxserve": api.meta([u])}
                finish = u.finish_reason
                if chat:
                    last, called = ts.end(text)
                    finish = "tool_calls" if called and finish == "stop" else finish
                    yield chunk("", finish, u, extra, last)
                else:
                    yield chunk(delta, finish, u, extra)
                if body.stream_options is not None and body.stream_options.include_usage:
                    d = {"id": rid, "object": obj, "created": created, "model": api.model_name, "choices": [],
                         "usage": api.usage([u])}
                    yield f"data: {json.dumps(d)}\n\n"
                break
            out = ts.delta(text) if chat else None
            if (out if chat else delta) or (want_lp and len(u.logprobs) > sent_lp) or (
                    body.return_token_ids and len(u.token_ids) > sent_ids):
                yield chunk(delta, None, u, delta=out)
                sent_text, sent_lp, sent_ids = text, len(u.logprobs), len(u.token_ids)
        yield "data: [DONE]\n\n"
    finally:
        if timer is not None:
            timer.cancel()
        api.engine.abort(rid)  # no-op when finished; frees the slot when the client went away
