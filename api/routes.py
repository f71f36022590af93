"""The route table: every API route of the server, once. The app's Starlette routes (app.py),
the paths of /openapi.json (openapi.py) and the paths open without the API key are all read
from `ROUTES`, so a new route is one record here and a handler in endpoints.py.

A record holds what Starlette needs (path, method, handler), when the route exists (`when`, a
predicate of the server's state: the runtime LoRA routes only with
VLLM_ALLOW_RUNTIME_LORA_UPDATING, /openapi.json only with the docs, /metrics only with
metrics), whether it is open without the key, and what the OpenAPI operation says (id, summary,
request and response schemas, error codes). The records' order is the document's.

The browser pages (`/`, `/docs` and their assets, playground.py) are not API operations and are
not in the table; tests/api/test_routes.py checks that the app serves exactly the table's
routes besides them, and that /openapi.json documents exactly the same.

Rejected: FastAPI-style decorators on the handlers (the table would be scattered over the
handlers' module, and its order would be their order of definition); one Starlette `Route` per
path with several methods (the OpenAPI operations are per method, so the record is too).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from triollm.api import serving_dev as dev
from triollm.api.endpoints import Endpoints
from triollm.api.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
    VersionResponse,
)
from triollm.api.protocol_messages import (
    CountTokensRequest,
    MessageResponse,
    MessagesRequest,
    MessageStartEvent,
    TokensCount,
)
from triollm.api.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    ScoreRequest,
    ScoreResponse,
)
from triollm.api.protocol_rerank import (
    ClassificationRequest,
    ClassificationResponse,
    CohereEmbedRequest,
    CohereEmbedResponse,
    PoolingRequest,
    PoolingResponse,
    RerankRequest,
    RerankResponse,
)
from triollm.api.protocol_responses import (
    DeletedResponse,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
)
from triollm.api.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from triollm.api.state import ServerState

__all__ = ["ANTHROPIC_PATHS", "OPEN_PATHS", "ROUTES", "RouteSpec", "served_routes"]

Handler = Callable[[Endpoints, Request], Awaitable[Response]]
# A JSON schema written out, for a body that is no protocol struct.
Schema = dict[str, Any]


def _always(state: ServerState) -> bool:
    return True


def _with_docs(state: ServerState) -> bool:
    """`--disable-fastapi-docs` turns /openapi.json off (and /docs with it)."""
    return not state.settings.disable_docs


def _with_runtime_lora(state: ServerState) -> bool:
    """vLLM's VLLM_ALLOW_RUNTIME_LORA_UPDATING: without it the load and unload routes are 404."""
    return state.settings.allow_runtime_lora_updating


def _with_metrics(state: ServerState) -> bool:
    return state.metrics is not None


@dataclass(frozen=True)
class RouteSpec:
    """One method of one path: its handler, when it exists, and its OpenAPI operation."""

    path: str
    method: str  # "GET", "POST" or "DELETE"
    handler: Handler
    operation_id: str
    summary: str
    # The JSON request body: a struct, or several (the schema is then their `oneOf`).
    request: type | tuple[type, ...] | None = None
    # The 200 answer: a struct, a written-out schema, or nothing (no body described).
    ok: type | Schema | None = None
    ok_media: str = "application/json"
    stream: type | None = None  # the SSE event's struct, when the route can stream
    errors: tuple[str, ...] = ()  # the error statuses it answers besides 401
    open: bool = False  # served without the API key unless every route is keyed
    when: Callable[[ServerState], bool] = _always
    anthropic: bool = False  # errors in Anthropic's shape (the Messages API), else OpenAI's

    def schema_types(self) -> tuple[type, ...]:
        """The structs the operation's schemas refer to."""
        request = self.request if isinstance(self.request, tuple) else (self.request,)
        return tuple(t for t in (*request, self.ok, self.stream) if isinstance(t, type))


_GENERATION_ERRORS = ("400", "404", "413", "500", "503")
_TEXT = {"type": "string"}

ROUTES: tuple[RouteSpec, ...] = (
    RouteSpec(
        "/v1/completions", "POST", Endpoints.completions, "create_completion",
        "Create a completion", CompletionRequest, CompletionResponse,
        stream=CompletionStreamResponse, errors=_GENERATION_ERRORS,
    ),
    RouteSpec(
        "/v1/chat/completions", "POST", Endpoints.chat, "create_chat_completion",
        "Create a chat completion", ChatCompletionRequest, ChatCompletionResponse,
        stream=ChatCompletionChunk, errors=_GENERATION_ERRORS,
    ),
    RouteSpec("/v1/models", "GET", Endpoints.models, "list_models", "List the served models",
              ok=ModelList),
    RouteSpec("/health", "GET", Endpoints.health, "health", "200 while the engine is healthy",
              errors=("503",), open=True),
    # SageMaker's / Vertex's container contract, as vLLM serves it (serving_invocations.py)
    *(
        RouteSpec("/ping", method, Endpoints.health, f"ping_{method.lower()}", "/health under SageMaker's name",
                  errors=("503",), open=True)
        for method in ("GET", "POST")
    ),
    RouteSpec(
        "/invocations", "POST", Endpoints.invocations, "invocations",
        "Any request body, answered by its own route (chat, completion, embedding, score, rerank, classify, pooling)",
        (ChatCompletionRequest, CompletionRequest, EmbeddingRequest, ScoreRequest, RerankRequest,
         ClassificationRequest, PoolingRequest),
        errors=_GENERATION_ERRORS,
    ),
    RouteSpec("/version", "GET", Endpoints.version, "version", "Server version",
              ok=VersionResponse, open=True),
    RouteSpec(
        "/tokenize", "POST", Endpoints.tokenize, "tokenize", "Tokenize a prompt or a chat",
        (TokenizeCompletionRequest, TokenizeChatRequest), TokenizeResponse,
        errors=_GENERATION_ERRORS, open=True,
    ),
    RouteSpec(
        "/detokenize", "POST", Endpoints.detokenize, "detokenize", "Detokenize token ids",
        DetokenizeRequest, DetokenizeResponse, errors=_GENERATION_ERRORS, open=True,
    ),
    # ------------------------------------------------------ pooling models (serving_pooling.py)
    RouteSpec(
        "/v1/embeddings", "POST", Endpoints.embeddings, "create_embedding",
        "Embeddings from a pooling model", EmbeddingRequest, EmbeddingResponse,
        errors=_GENERATION_ERRORS,
    ),
    *(
        RouteSpec(
            path, "POST", Endpoints.score, op_id, "Similarity scores from a pooling model",
            ScoreRequest, ScoreResponse, errors=_GENERATION_ERRORS,
        )
        for path, op_id in (("/score", "create_score"), ("/v1/score", "create_score_v1"))
    ),
    *(
        RouteSpec(
            path, "POST", Endpoints.rerank, op_id, "Documents ranked by relevance to a query (Jina / Cohere shape)",
            RerankRequest, RerankResponse, errors=_GENERATION_ERRORS,
        )
        for path, op_id in (("/rerank", "rerank"), ("/v1/rerank", "rerank_v1"), ("/v2/rerank", "rerank_v2"))
    ),
    RouteSpec(
        "/classify", "POST", Endpoints.classify, "create_classify", "Labels from a sequence classifier",
        ClassificationRequest, ClassificationResponse, errors=_GENERATION_ERRORS,
    ),
    RouteSpec(
        "/pooling", "POST", Endpoints.pooling, "create_pooling", "Any pooling task's raw output",
        PoolingRequest, PoolingResponse, errors=_GENERATION_ERRORS,
    ),
    RouteSpec(
        "/v2/embed", "POST", Endpoints.cohere_embed, "cohere_embed", "Embeddings in Cohere's v2 shape",
        CohereEmbedRequest, CohereEmbedResponse, errors=_GENERATION_ERRORS,
    ),
    # ------------------------------------------------ the Responses API (serving_responses.py)
    RouteSpec(
        "/v1/responses", "POST", Endpoints.create_response, "create_response",
        "Create a response (the Responses API)", ResponsesRequest, ResponseObject,
        stream=ResponseEvent, errors=_GENERATION_ERRORS,
    ),
    RouteSpec(
        "/v1/responses/{response_id}", "GET", Endpoints.retrieve_response, "get_response",
        "Retrieve a stored response", ok=ResponseObject, errors=("404",),
    ),
    RouteSpec(
        "/v1/responses/{response_id}", "DELETE", Endpoints.delete_response, "delete_response",
        "Delete a stored response", ok=DeletedResponse, errors=("404",),
    ),
    # ---------------------------------------- Anthropic's Messages API (serving_messages.py)
    RouteSpec(
        "/v1/messages", "POST", Endpoints.create_message, "create_message",
        "Create a message (Anthropic's Messages API)", MessagesRequest, MessageResponse,
        stream=MessageStartEvent, errors=_GENERATION_ERRORS, anthropic=True,
    ),
    RouteSpec(
        "/v1/messages/count_tokens", "POST", Endpoints.count_message_tokens, "count_message_tokens",
        "Count a message's prompt tokens (Anthropic's Messages API)", CountTokensRequest, TokensCount,
        errors=("400", "404", "413"), anthropic=True,
    ),
    # --------------------------------------------------------------------------- the docs
    RouteSpec("/openapi.json", "GET", Endpoints.openapi, "openapi", "This document",
              ok={"type": "object"}, open=True, when=_with_docs),
    # ---------------------------------------- LoRA adapters at runtime (serving_models.py)
    RouteSpec(
        "/v1/load_lora_adapter", "POST", Endpoints.load_lora_adapter, "load_lora_adapter",
        "Load a LoRA adapter by name and path", LoadLoRAAdapterRequest, _TEXT, "text/plain",
        errors=("400", "404"), when=_with_runtime_lora,
    ),
    RouteSpec(
        "/v1/unload_lora_adapter", "POST", Endpoints.unload_lora_adapter, "unload_lora_adapter",
        "Unload a LoRA adapter by name", UnloadLoRAAdapterRequest, _TEXT, "text/plain",
        errors=("400", "404"), when=_with_runtime_lora,
    ),
    # ------------------------------- development routes, VLLM_SERVER_DEV_MODE=1 (serving_dev.py)
    RouteSpec("/sleep", "POST", dev.sleep, "sleep", "Free the KV cache (?level=1), and the weights (?level=2)",
              errors=("400",), when=dev.with_dev_mode),
    RouteSpec("/wake_up", "POST", dev.wake_up, "wake_up", "Restore what sleep freed (?tags=weights&tags=kv_cache)",
              errors=("400",), when=dev.with_dev_mode),
    RouteSpec("/is_sleeping", "GET", dev.is_sleeping, "is_sleeping", "Whether the engine sleeps",
              ok={"type": "object", "properties": {"is_sleeping": {"type": "boolean"}}}, when=dev.with_dev_mode),
    RouteSpec("/collective_rpc", "POST", dev.collective_rpc, "collective_rpc", "A worker method on every rank",
              dev.CollectiveRPCRequest, {"type": "object", "properties": {"results": {"type": "array"}}},
              errors=("400",), when=dev.with_dev_mode),
    RouteSpec("/reset_prefix_cache", "POST", dev.reset_prefix_cache, "reset_prefix_cache",
              "Forget the cached prefixes", when=dev.with_dev_mode),
    RouteSpec("/pause", "POST", dev.pause, "pause", "Stop stepping (?mode=keep|wait|abort)", ok={"type": "object"},
              errors=("400",), when=dev.with_dev_mode),
    RouteSpec("/resume", "POST", dev.resume, "resume", "Step again", ok={"type": "object"}, when=dev.with_dev_mode),
    RouteSpec("/is_paused", "GET", dev.is_paused, "is_paused", "Whether the engine is paused",
              ok={"type": "object", "properties": {"is_paused": {"type": "boolean"}}}, when=dev.with_dev_mode),
    # ------------------------------------------------------------ /metrics (api/metrics.py)
    RouteSpec("/metrics", "GET", Endpoints.metrics, "metrics", "/metrics", open=True,
              when=_with_metrics),
)  # fmt: skip

# Open without the key by default (as vLLM leaves them); behind it with `--api-key-all-routes`.
# Every other path (/v1/*, /score, and any unknown path) needs the key. A path is open whether
# or not its route exists, so an absent route answers 404 either way.
OPEN_PATHS: tuple[str, ...] = tuple(dict.fromkeys(spec.path for spec in ROUTES if spec.open))
# The paths whose errors, a missing key's 401 included, are in Anthropic's shape.
ANTHROPIC_PATHS: tuple[str, ...] = tuple(dict.fromkeys(spec.path for spec in ROUTES if spec.anthropic))


def served_routes(state: ServerState) -> list[RouteSpec]:
    """The records of the routes this server has, in the table's order."""
    return [spec for spec in ROUTES if spec.when(state)]
