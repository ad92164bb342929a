"""The HTTP server's front door, as pure ASGI middleware: authorisation, per-key rate limits, the body limit.

- **Authorisation** is decided on the ASGI scope's path (what routing uses, not a header or a URL rebuilt from
  it): with `server.api_keys` set, every path needs `Authorization: Bearer <key>` except `PUBLIC` (health and
  metrics, for probes and scrapers). A presented key is hashed and compared with every configured key's hash in
  constant time, so neither its length nor a shared prefix shows in the time to refuse it.
- **Rate limits** (`server.rate_limit_rps`, `server.rate_limit_burst`): one token bucket per API key (per
  client address when no keys are set); a request over its bucket gets 429 with `Retry-After`.
- **Body limit** (`server.max_request_mb`): a declared Content-Length over it is refused with 413 before any
  byte is read; a chunked body is counted as it arrives and refused the moment it passes the limit. The
  body is then handed on whole, so no route parses more than the limit.
Refusals use the OpenAI error shape. Concurrency: runs on the server's asyncio loop; buckets are touched only
there.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import math
import time

PUBLIC = frozenset({"/health", "/metrics"})


def _digest(key: str | bytes) -> bytes:
    return hashlib.sha256(key if isinstance(key, bytes) else key.encode()).digest()


class KeyCheck:
    """Which configured API key (its index) a presented key is, in time independent of the presented key."""

    def __init__(self, keys: list[str]):
        self._digests = [_digest(k) for k in keys]

    def __call__(self, presented: bytes) -> int | None:
        got = _digest(presented)
        found = None
        for i, d in enumerate(self._digests):  # every key compared, no early exit
            if hmac.compare_digest(got, d) and found is None:
                found = i
        return found


class Bucket:
    """A token bucket: `take()` -> 0.0 when a request may go now, else the seconds until it may."""

    def __init__(self, rate: float, burst: float, now=time.monotonic):
        self.rate, self.burst, self.now = rate, burst, now
        self.tokens, self.t = burst, now()

    def take(self) -> float:
        t = self.now()
        self.tokens = min(self.burst, self.tokens + (t - self.t) * self.rate)
        self.t = t
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


def _error(status: int, message: str, type_: str, code: str | None, param: str | None = None,
           headers: dict | None = None):
    body = json.dumps({"error": {"message": message, "type": type_, "param": param, "code": code}}).encode()
    hdrs = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    hdrs += [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
    return status, hdrs, body


class Gate:
    def __init__(self, app, api_keys: list[str], max_body: int, rate: float | None = None, burst: int = 1,
                 on_refused=None, max_buckets: int = 65536):
        """on_refused(status): counts refusals (metrics)."""
        self.app, self.max_body = app, max_body
        self.keys = KeyCheck(api_keys) if api_keys else None
        self.rate, self.burst = rate, burst
        self.on_refused = on_refused
        self.buckets: dict[object, Bucket] = {}
        self.max_buckets = max_buckets

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        headers = dict(scope.get("headers") or ())
        who: object = None
        if path not in PUBLIC:
            if self.keys is not None:
                auth = headers.get(b"authorization", b"")
                who = self.keys(auth[7:]) if auth[:7].lower() == b"bearer " else None
                if who is None:
                    return await self._refuse(send, *_error(401, "invalid or missing API key (Authorization: "
                                                                 "Bearer <key>)", "authentication_error",
                                                            "invalid_api_key"))
            else:
                who = (scope.get("client") or ("?",))[0]
            if self.rate is not None:
                wait = self._bucket(who).take()
                if wait > 0:
                    after = str(max(1, math.ceil(wait)))
                    return await self._refuse(send, *_error(
                        429, f"rate limit exceeded: {self.rate:g} requests/s (burst {self.burst}); retry after "
                             f"{wait:.2f}s", "rate_limit_exceeded", "rate_limited", headers={"retry-after": after}))
        try:
            length = int(headers.get(b"content-length", b"0") or 0)
        except ValueError:
            return await self._refuse(send, *_error(400, "bad Content-Length", "invalid_request_error", None))
        if length > self.max_body:
            return await self._refuse(send, *self._too_large(length))
        if scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        chunks, size = [], 0
        while True:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunks.append(msg.get("body", b""))
            size += len(chunks[-1])
            if size > self.max_body:
                return await self._refuse(send, *self._too_large(size))
            if not msg.get("more_body"):
                break
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()
        return await self.app(scope, replay, send)

    def _bucket(self, who) -> Bucket:
        b = self.buckets.get(who)
        if b is None:
            if len(self.buckets) >= self.max_buckets:  # bounded: forget the oldest client's bucket
                self.buckets.pop(next(iter(self.buckets)))
            b = self.buckets[who] = Bucket(self.rate, self.burst)
        return b

    def _too_large(self, size: int):
        return _error(413, f"request body of {size} bytes or more exceeds this server's limit of {self.max_body} "
                           f"bytes (server.max_request_mb)", "invalid_request_error", "request_too_large")

    async def _refuse(self, send, status, headers, body):
        if self.on_refused is not None:
            self.on_refused(status)
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
