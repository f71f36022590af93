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

import hmac
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

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
from triollm.actors.async_llm import AsyncLLM
from triollm.api.limits import RequestLimits
from triollm.api.log_bounds import shorten
from triollm.api.openai_errors import APIError, bad_request, from_exception
from triollm.api.openapi import openapi_document
from triollm.api.playground import page_paths, page_routes
from triollm.api.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
    decode_json,
    decode_request,
)
from triollm.api.serving_chat import create_chat_completion
from triollm.api.serving_common import (
    SMALL_BODY_BYTES,
    maybe_in_thread,
    read_body,
    render_chat,
    resolve_chat_template,
    resolve_model,
)
from triollm.api.serving_completions import create_completion
from triollm.api.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from triollm.api.serving_pooling import create_embedding, create_score, require_runner
from triollm.api.serving_responses import ResponsesAPI
from triollm.api.state import ServerState
from triollm.engine.config import ModelConfig

__all__ = ["build_app"]

Endpoint = Callable[[Request], Awaitable[Response]]

# vLLM's check and answer (its `validate_json_request`: a validation error, so a 400).
UNSUPPORTED_MEDIA_TYPE = "Unsupported Media Type: Only 'application/json' is allowed"


def build_app(state: ServerState, *, playground: bool = True) -> Starlette:
    """The app; `playground=False` (`--disable-playground`) serves no chat page at `/`."""
    settings = state.settings
    if not settings.served_model_names:
        raise ValueError("served_model_names: at least one name is needed")
    api = _Endpoints(state)
    routes: list[BaseRoute] = [
        Route("/v1/completions", api.guard(api.completions), methods=["POST"]),
        Route("/v1/chat/completions", api.guard(api.chat), methods=["POST"]),
        Route("/v1/responses", api.guard(api.responses.create), methods=["POST"]),
        Route("/v1/responses/{response_id}", api.guard(api.responses.retrieve), methods=["GET"]),
        Route("/v1/responses/{response_id}", api.guard(api.responses.delete), methods=["DELETE"]),
        Route("/v1/models", api.guard(api.models), methods=["GET"]),
        Route("/health", api.guard(api.health), methods=["GET"]),
        Route("/version", api.guard(api.version), methods=["GET"]),
        Route("/tokenize", api.guard(api.tokenize), methods=["POST"]),
        Route("/detokenize", api.guard(api.detokenize), methods=["POST"]),
        *([] if settings.disable_docs else [Route("/openapi.json", api.guard(api.openapi), methods=["GET"])]),
        # ------------------------------------------------------ pooling models (serving_pooling.py)
        Route("/v1/embeddings", api.guard(api.embeddings), methods=["POST"]),
        Route("/score", api.guard(api.score), methods=["POST"]),
        Route("/v1/score", api.guard(api.score), methods=["POST"]),
    ]
    # ---------------------------------------------------- LoRA adapters at runtime (serving_models.py)
    if settings.allow_runtime_lora_updating:  # vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING; else 404
        routes += [
            Route("/v1/load_lora_adapter", api.guard(api.load_lora_adapter), methods=["POST"]),
            Route("/v1/unload_lora_adapter", api.guard(api.unload_lora_adapter), methods=["POST"]),
        ]
    # ------------------------------------------- the browser pages: / and /docs (playground.py)
    pages = {"playground": playground, "docs": not settings.disable_docs}
    routes += page_routes(**pages)
    # ---------------------------------------------------------------- /metrics (api/metrics.py)
    metrics = _metrics_route(state)
    if metrics is not None:
        routes.append(metrics)
        api.extra_paths.append("/metrics")
    # ------------------------------------------------------------------------------------------
    middleware: list[Middleware] = [Middleware(RootPath, root_path=settings.root_path)] if settings.root_path else []
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
            )
        )
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers={HTTPException: _http_exception},
    )
    app.state.server = state
    return app


def _metrics_route(state: ServerState) -> BaseRoute | None:
    """GET /metrics, served by `state.metrics` (an `api.metrics.Metrics`, which the server sets
    when metrics are enabled); None without it."""
    endpoint = getattr(state.metrics, "endpoint", None)
    return Route("/metrics", endpoint, methods=["GET"]) if callable(endpoint) else None


# Open without the key by default (as vLLM leaves them); behind it with `--api-key-all-routes`.
# Every other route (/v1/*, /score, and any unknown path) needs the key.
OPEN_PATHS = ("/health", "/version", "/openapi.json", "/tokenize", "/detokenize", "/metrics")


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
    """The path the routes match: without the root_path when it starts with it (Starlette's rule)."""
    path: str = scope.get("path", "")
    root: str = scope.get("root_path", "")
    if root and (path == root or path.startswith(root + "/")):
        return path[len(root):]
    return path


class APIKeyMiddleware:
    """`Authorization: Bearer <key>` on every path but `open_paths`: any of the keys, each
    compared in constant time (all of them, whichever matches)."""

    def __init__(self, app: ASGIApp, api_key: str | Sequence[str], open_paths: tuple[str, ...] = ()) -> None:
        self.app = app
        keys = [api_key] if isinstance(api_key, str) else list(api_key)
        if not keys or not all(keys):
            raise ValueError("api_key: at least one key, and no empty one")
        self.keys = [k.encode() for k in keys]
        self.open_paths = frozenset(p.rstrip("/") for p in open_paths)

    def _keyed(self, path: str) -> bool:
        return path.rstrip("/") not in self.open_paths

    def _accepts(self, token: bytes) -> bool:
        return sum(hmac.compare_digest(token, key) for key in self.keys) > 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket") and self._keyed(_route_path(scope)):
            header = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            scheme, _, token = header.partition(b" ")
            ok = self._accepts(token.strip())
            if not (ok and scheme.lower() == b"bearer"):
                error = APIError(
                    401, "Invalid or missing API key (expected `Authorization: Bearer <key>`)"
                )
                error.headers["WWW-Authenticate"] = "Bearer"
                await error.response()(scope, receive, send)
                return
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


def _json(obj: Any, status: int = 200) -> Response:
    return Response(msgspec.json.encode(obj), status_code=status, media_type="application/json")


class _Endpoints:
    def __init__(self, state: ServerState) -> None:
        self.state = state
        self.llm: AsyncLLM = state.llm
        self.created = int(time.time())
        self.chat_template = resolve_chat_template(state.settings.chat_template)
        self.responses = ResponsesAPI(state, self.chat_template)  # serving_responses.py, its store
        self.extra_paths: list[str] = []
        self._openapi: bytes | None = None

    def guard(self, fn: Endpoint) -> Endpoint:
        async def endpoint(request: Request) -> Response:
            try:
                if request.method == "POST":
                    _require_json(request)
                return await fn(request)
            except Exception as exc:
                return from_exception(exc, engine_running=self.llm.is_running).response()

        endpoint.__name__ = fn.__name__
        return endpoint

    def _model_config(self) -> ModelConfig:
        config = self.llm.config
        return config.model if config is not None else self.llm.get_model_config()

    async def completions(self, request: Request) -> Response:
        require_runner(self.state, "generate", "Completions API")
        return await create_completion(self.state, request)

    async def chat(self, request: Request) -> Response:
        require_runner(self.state, "generate", "Chat Completions API")
        return await create_chat_completion(self.state, request, self.chat_template)

    async def embeddings(self, request: Request) -> Response:
        return await create_embedding(self.state, request)

    async def score(self, request: Request) -> Response:
        return await create_score(self.state, request)

    async def models(self, request: Request) -> Response:
        """The base model's names, then each LoRA adapter (`root` its path, `parent` the base
        model's served name), as vLLM lists them."""
        config = self._model_config()
        cards = [
            ModelCard(
                id=name,
                created=self.created,
                root=str(config.path),
                max_model_len=config.max_model_len,
            )
            for name in self.state.settings.served_model_names
        ]
        models = self.state.models
        cards += [
            ModelCard(
                id=lora.lora_name,
                created=self.created,
                root=lora.lora_path,
                parent=models.parent(lora),
                max_model_len=config.max_model_len,
            )
            for lora in models.adapters()
        ]
        return _json(ModelList(data=cards))

    async def load_lora_adapter(self, request: Request) -> Response:
        req = decode_request(await read_body(request, SMALL_BODY_BYTES), LoadLoRAAdapterRequest)
        lora = await self.state.models.load(self.llm, req)
        return Response(f"Success: LoRA adapter '{shorten(lora.lora_name, 100)}' added successfully.", media_type="text/plain")

    async def unload_lora_adapter(self, request: Request) -> Response:
        req = decode_request(await read_body(request, SMALL_BODY_BYTES), UnloadLoRAAdapterRequest)
        lora = self.state.models.unload(req)
        return Response(f"Success: LoRA adapter '{shorten(lora.lora_name, 100)}' removed successfully.", media_type="text/plain")

    async def health(self, request: Request) -> Response:
        if self.llm.errored:
            raise from_exception(self.llm.dead_error or RuntimeError("engine dead"))
        return Response(status_code=200)

    async def version(self, request: Request) -> Response:
        return _json(VersionResponse(triollm.__version__))

    async def tokenize(self, request: Request) -> Response:
        body = await read_body(request, SMALL_BODY_BYTES)
        keys = decode_json(body, dict[str, msgspec.Raw])
        tokenizer = self.llm.get_tokenizer()
        req: TokenizeChatRequest | TokenizeCompletionRequest
        if "messages" in keys:
            req = decode_request(body, TokenizeChatRequest)
            resolve_model(self.state, req.model)
            _, ids = await render_chat(
                tokenizer,
                req.messages,
                template=self.chat_template,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                template_kwargs=req.chat_template_kwargs,
                add_special_tokens=req.add_special_tokens,
            )
        else:
            req = decode_request(body, TokenizeCompletionRequest)
            resolve_model(self.state, req.model)
            text, special = req.prompt, req.add_special_tokens
            ids = await maybe_in_thread(lambda: tokenizer.encode(text, special), len(text))
        strs = None
        if req.return_token_strs:
            token_ids = ids
            strs = await maybe_in_thread(lambda: tokenizer.convert_ids_to_tokens(token_ids), len(ids))
        return _json(TokenizeResponse(len(ids), self._model_config().max_model_len, ids, strs))

    async def detokenize(self, request: Request) -> Response:
        req = decode_request(await read_body(request, SMALL_BODY_BYTES), DetokenizeRequest)
        resolve_model(self.state, req.model)
        tokenizer = self.llm.get_tokenizer()
        vocab = self._model_config().vocab_size
        bad = [t for t in req.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"tokens: token ids must be in [0, {vocab}), got {bad[:8]}", "tokens")
        ids = req.tokens
        text = await maybe_in_thread(
            lambda: tokenizer.decode(ids, skip_special_tokens=False), len(ids)
        )
        return _json(DetokenizeResponse(text))

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            doc = openapi_document(
                title="triollm OpenAI-compatible API",
                version=triollm.__version__,
                api_key=bool(self.state.settings.api_keys),
                all_routes=self.state.settings.api_key_all_routes,
                extra_paths=self.extra_paths,
                lora_updating=self.state.settings.allow_runtime_lora_updating,
            )
            if self.state.settings.root_path:  # where the API is, for Swagger UI's "try it out"
                doc["servers"] = [{"url": self.state.settings.root_path}]
            self._openapi = msgspec.json.encode(doc)
        return Response(self._openapi, media_type="application/json")
