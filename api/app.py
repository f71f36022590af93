"""The Starlette app of the OpenAI-compatible server: `build_app(state)`.

Every endpoint is wrapped so that no exception escapes it: whatever goes wrong with one request
becomes an OpenAI error body (see openai_errors.py) and never disturbs the others. A POST body
must be JSON: another Content-Type (or none) is a 400 before the body is read, with vLLM's
message ("Unsupported Media Type: Only 'application/json' is allowed"). Bodies are read
incrementally up to a limit (413 above it): `MAX_BODY_BYTES` for generation, the smaller
`SMALL_BODY_BYTES` for /tokenize and /detokenize. Generation
endpoints return a `GenerationResponse` (sse.py) that watches for the client's disconnect.

Middleware, outermost first: `RootPath` with `--root-path`, `RequestLimits` (limits.py:
concurrent requests, header count, body deadline), CORS when configured (`--allowed-origins`,
`--allowed-methods`, `--allowed-headers`, `--allow-credentials`), then `APIKeyMiddleware` with
`--api-key` (one key or several, any of them accepted): deny by default, every route needs the
key except the `OPEN_PATHS` (none with `--api-key-all-routes`), so a route added later is keyed
unless it is opened on purpose.

The routes are the route table's (routes.py), the same records /openapi.json is built from;
their handlers are endpoints.py's.

LoRA adapters (serving_models.py): `GET /v1/models` lists them after the base model's names, a
generation request names one in `model`, and with `VLLM_ALLOW_RUNTIME_LORA_UPDATING` set (the
`allow_runtime_lora_updating` setting) `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter`
exist; without it they are 404, as in vLLM.

The browser pages (playground.py): the chat playground at `/` (off with `--disable-playground`:
`build_app(state, playground=False)`) and Swagger UI at `/docs` (off with the docs, as
/openapi.json is); their paths are open without the key as the `OPEN_PATHS` are, since a browser
cannot send one to load a page, and the API they call stays keyed.

`--root-path PREFIX` (uvicorn's, as vLLM passes it): the ASGI `root_path` of every request is
PREFIX, for an app served behind a path-routing proxy. Starlette routes on the path with the
prefix taken off when it carries one, so a proxy that strips the prefix (`/v1/models`) and one
that forwards it (`/api/v1/models`) both reach the routes; the key's open paths are matched the
same way. /openapi.json then names the prefix as its server (FastAPI's `servers`), so Swagger
UI's "try it out" calls the API under it.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Awaitable, Callable, Sequence

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route
from starlette.types import ASGIApp, Receive, Scope, Send

import triollm
from triollm.api.endpoints import Endpoints
from triollm.api.limits import RequestLimits
from triollm.api.openai_errors import APIError, as_anthropic, from_exception
from triollm.api.openapi import openapi_document
from triollm.api.playground import page_paths, page_routes
from triollm.api.routes import ANTHROPIC_PATHS, OPEN_PATHS, RouteSpec, served_routes
from triollm.api.serving_common import API_KEY_ID
from triollm.api.state import ServerState

__all__ = ["build_app"]

# vLLM's check and answer (its `validate_json_request`: a validation error, so a 400).
UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


def build_app(state: ServerState, *, playground: bool = True) -> Starlette:
    """The app; `playground=False` (`--disable-playground`) serves no chat page at `/`."""
    settings = state.settings
    if not settings.served_model_names:
        raise ValueError("served_model_names: at least one name is needed")
    specs = served_routes(state)
    api = Endpoints(state, lambda: _openapi_json(state, specs))
    routes: list[BaseRoute] = [
        Route(spec.path, _guard(api, spec), methods=[spec.method]) for spec in specs
    ]
    # ------------------------------------------- the browser pages: / and /docs (playground.py)
    pages = {"playground": playground, "docs": not settings.disable_docs}
    routes += page_routes(**pages)
    # ------------------------------------------------------------------------------------------
    middleware: list[Middleware] = []
    if settings.root_path:
        middleware.append(Middleware(RootPath, root_path=settings.root_path))
    middleware += [
        Middleware(
            RequestLimits,
            limit_concurrency=settings.limit_concurrency,
            max_header_count=settings.h11_max_header_count,
            body_timeout=settings.request_body_timeout,
        )
    ]
    if settings.allowed_origins:  # before the key: preflight requests never need it
        middleware.append(
            Middleware(
                CORSMiddleware,
                allow_origins=list(settings.allowed_origins),
                allow_methods=list(settings.allowed_methods),
                allow_headers=list(settings.allowed_headers),
                allow_credentials=settings.allow_credentials,
            )
        )
    if settings.api_keys:
        middleware.append(
            Middleware(
                APIKeyMiddleware,
                api_key=settings.api_keys,
                open_paths=() if settings.api_key_all_routes else OPEN_PATHS + page_paths(**pages),
                anthropic_paths=ANTHROPIC_PATHS,
            )
        )
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_exception},
    )
    app.state.server = state
    return app


def _guard(api: Endpoints, spec: RouteSpec) -> Callable[[Request], Awaitable[Response]]:
    """The route's handler, wrapped so that no exception escapes it: the body of a route that
    takes one must be JSON, and whatever goes wrong becomes an OpenAI error body (Anthropic's
    on its routes)."""
    handler = spec.handler

    async def endpoint(request: Request) -> Response:
        try:
            if request.method == "POST" and spec.request is not None:
                _require_json(request)
            return await handler(api, request)
        except Exception as exc:
            error = from_exception(exc, engine_running=api.llm.is_running)
            return (as_anthropic(error) if spec.anthropic else error).response()

    endpoint.__name__ = handler.__name__
    return endpoint


def _openapi_json(state: ServerState, specs: Sequence[RouteSpec]) -> bytes:
    settings = state.settings
    doc = openapi_document(
        specs,
        title="triollm OpenAI-compatible API",
        version=triollm.__version__,
        api_key=bool(settings.api_keys),
        all_routes=settings.api_key_all_routes,
    )
    if settings.root_path:  # where the API is, for Swagger UI's "try it out"
        doc["servers"] = [{"url": settings.root_path}]
    return msgspec.json.encode(doc)


class RootPath:
    """Sets the ASGI `root_path` of every request to `--root-path` (as uvicorn does)."""

    def __init__(self, app: ASGIApp, root_path: str) -> None:
        self.app = app
        self.root_path = root_path

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            scope = {**scope, "root_path": self.root_path}
        await self.app(scope, receive, send)


def _route_path(scope: Scope) -> str:
    """The path the routes match: without the root_path when it starts with it (Starlette's
    rule)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):]
    return path


class APIKeyMiddleware:
    """`Authorization: Bearer <key>`, or `x-api-key: <key>` (what Anthropic's clients send), on
    every path but `open_paths`: any of the keys, each compared in constant time (all of them,
    whichever matches). An accepted request carries the SHA-256 of its key in the scope's state
    (`api_key_id` of serving_common.py), so that what one key stores (the Responses store)
    another key does not see. The 401 is in Anthropic's shape on `anthropic_paths`."""

    def __init__(
        self,
        app: ASGIApp,
        api_key: str | Sequence[str],
        open_paths: tuple[str, ...] = (),
        anthropic_paths: tuple[str, ...] = (),
    ) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        if not keys or not all(keys):
            raise ValueError("api_key: at least one key, and no empty one")
        self.keys = [k.encode() for k in keys]
        self.open_paths = frozenset(p.rstrip("/") for p in open_paths)
        self.anthropic_paths = frozenset(p.rstrip("/") for p in anthropic_paths)

    def _keyed(self, path: str) -> bool:
        return path.rstrip("/") not in self.open_paths

    def _accepts(self, token: bytes) -> bool:
        return sum(hmac.compare_digest(token, key) for key in self.keys) > 0

    def _token(self, headers: Sequence[tuple[bytes, bytes]]) -> bytes | None:
        """The key the request was sent with, when it is one of the keys: the bearer token,
        else the `x-api-key` header."""
        bearer = next((v for k, v in headers if k == b"authorization"), b"")
        scheme, _, token = bearer.partition(b" ")
        if scheme.lower() == b"bearer" and self._accepts(token.strip()):
            return token.strip()
        token = next((v for k, v in headers if k == b"x-api-key"), b"").strip()
        return token if self._accepts(token) else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = _route_path(scope)
        if scope["type"] in ("http", "websocket") and self._keyed(path):
            token = self._token(scope["headers"])
            if token is None:
                error = APIError(
                    401,
                    "Invalid or missing API key (expected `Authorization: Bearer <key>` or "
                    "`x-api-key: <key>`)",
                )
                error.headers["WWW-Authenticate"] = "Bearer"
                if path.rstrip("/") in self.anthropic_paths:
                    error = as_anthropic(error)
                await error.response()(scope, receive, send)
                return
            # Who the request is, for the state kept between requests: a hash, never the key.
            key_id = hashlib.sha256(token).hexdigest()
            scope = {**scope, "state": {**scope.get("state", {}), API_KEY_ID: key_id}}
        await self.app(scope, receive, send)


async def _http_exception(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    error = APIError(exc.status_code, str(exc.detail))
    error.headers.update(exc.headers or {})
    return error.response()


def _require_json(request: Request) -> None:
    content_type = request.headers.get("content-type", "")
    if content_type.split(";", 1)[0].strip().lower() != "application/json":
        raise APIError(400, UNSUPPORTED_MEDIA_TYPE)
