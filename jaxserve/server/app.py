"""The OpenAI-compatible HTTP server (FastAPI): completions, chat completions, models, health, metrics, profile,
and the admin route that changes an emulated link's bandwidth.

Requests pass the gate first (gate.py: API keys, rate limits, the body limit), are validated (protocol.py),
tokenized, and queued on the EngineClient (engine/client.py) by the handlers of api.py (the routes, `ROUTES`);
responses are plain JSON or server-sent events (streaming.py).
Every error is an OpenAI-shaped body with a 4xx status (503 when the engine cannot take work). A streaming
client that disconnects aborts its request, which releases its slot and blocks; a non-streaming one is checked
for disconnection while it waits. Concurrency: asyncio on the server's event loop; JSON parsing and validation
of a body, tokenising and chat templating run on a small thread pool (`_work`) so a large request does not hold
the loop that streams other requests' tokens; the engine runs on its own thread (engine/async_engine.py) or in
worker processes behind the router.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..config import Config
from ..engine.client import EngineClient
from .api import Api, validation_error
from .gate import Gate
from .metrics import Metrics
from .protocol import APIError, ChatRequest, CompletionRequest, LinkUpdate, MigrateRequest, RoleUpdate

# (method, path, Api handler, the body it parses itself: its schema goes into the OpenAPI document)
ROUTES = [("GET", "/health", "health", None), ("GET", "/v1/models", "models", None),
          ("GET", "/metrics", "prom", None), ("POST", "/v1/completions", "completions", CompletionRequest),
          ("POST", "/v1/chat/completions", "chat", ChatRequest),
          ("POST", "/admin/links", "admin_links", LinkUpdate), ("POST", "/admin/roles", "admin_roles", RoleUpdate),
          ("POST", "/admin/migrate", "admin_migrate", MigrateRequest), ("POST", "/debug/profile", "profile", None)]


def _body_schema(model) -> dict:
    """OpenAPI for a route that parses its own body (off the loop): the model's schema as the request body."""
    return {"requestBody": {"required": True, "content": {"application/json": {
        "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}}


def create_app(config: Config, engine: EngineClient, model_name: str, metrics: Metrics, lifespan=None) -> FastAPI:
    """engine: the colocated AsyncEngine or a cluster's router (the same protocol over workers).
    lifespan: FastAPI lifespan (the cluster's worker start-up and shutdown)."""
    app = FastAPI(title="jaxserve", version="0.1.0", lifespan=lifespan)
    srv = config.server

    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return await _api_error(request, validation_error(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException):
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return await _api_error(request, APIError(e.status_code, str(e.detail), kind))

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

    api = Api(config, engine, model_name, metrics)
    for method, path, name, body in ROUTES:
        app.add_api_route(path, getattr(api, name), methods=[method], name=name,
                          openapi_extra=_body_schema(body) if body is not None else None)
    return app
