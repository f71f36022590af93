"""`GET /openapi.json`: an OpenAPI 3.1 document built from the msgspec protocol structs."""

from __future__ import annotations

from typing import Any

import msgspec

from triollm.api.openai_errors import ErrorResponse
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
from triollm.api.protocol_pooling import (
    EmbeddingRequest,
    EmbeddingResponse,
    ScoreRequest,
    ScoreResponse,
)
from triollm.api.protocol_responses import (
    DeletedResponse,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
)
from triollm.api.serving_models import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest

__all__ = ["openapi_document"]

_TYPES: tuple[type, ...] = (
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatCompletionChunk,
    TokenizeCompletionRequest,
    TokenizeChatRequest,
    TokenizeResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelList,
    VersionResponse,
    EmbeddingRequest,
    EmbeddingResponse,
    ScoreRequest,
    ScoreResponse,
    ResponsesRequest,
    ResponseObject,
    ResponseEvent,
    DeletedResponse,
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    ErrorResponse,
)
_ERRORS = {
    "400": "Invalid request (the message names the field)",
    "404": "Unknown model",
    "413": "Request body too large",
    "500": "Internal error",
    "503": "The engine is dead or the server is shutting down",
}


def openapi_document(
    *,
    title: str,
    version: str,
    api_key: bool,
    extra_paths: list[str],
    all_routes: bool = False,
    lora_updating: bool = False,
) -> dict[str, Any]:
    """The document; with `api_key`, the keyed operations carry `security` and a 401 (with
    `all_routes` every operation, as `--api-key-all-routes` keys every route); with
    `lora_updating` (VLLM_ALLOW_RUNTIME_LORA_UPDATING) the adapter load and unload routes."""
    schemas, components = msgspec.json.schema_components(
        _TYPES, ref_template="#/components/schemas/{name}"
    )
    ref = {t: s for t, s in zip(_TYPES, schemas, strict=True)}

    def json_body(schema: dict[str, Any]) -> dict[str, Any]:
        return {"required": True, "content": {"application/json": {"schema": schema}}}

    def responses(
        ok: dict[str, Any] | None,
        *,
        stream: dict[str, Any] | None = None,
        errors: tuple[str, ...] = ("400", "500", "503"),
        secured: bool = False,
    ) -> dict[str, Any]:
        content: dict[str, Any] = {}
        if ok is not None:
            content["application/json"] = {"schema": ok}
        if stream is not None:
            content["text/event-stream"] = {
                "schema": {
                    "type": "string",
                    "description": "SSE: `data: <chunk JSON>` events, then `data: [DONE]`",
                }
            }
        out: dict[str, Any] = {
            "200": {"description": "OK", **({"content": content} if content else {})}
        }
        codes = (*errors, "401") if secured else errors
        for code in codes:
            out[code] = {
                "description": _ERRORS.get(code, "Invalid or missing API key"),
                "content": {"application/json": {"schema": ref[ErrorResponse]}},
            }
        return out

    def operation(
        op_id: str,
        summary: str,
        resp: dict[str, Any],
        body: dict[str, Any] | None = None,
        secured: bool = False,
    ) -> dict[str, Any]:
        op: dict[str, Any] = {"operationId": op_id, "summary": summary, "responses": resp}
        if body is not None:
            op["requestBody"] = body
        if secured and api_key:
            op["security"] = [{"bearer": []}]
        return op

    generation_errors = ("400", "404", "413", "500", "503")
    paths: dict[str, Any] = {
        "/v1/completions": {
            "post": operation(
                "create_completion",
                "Create a completion",
                responses(
                    ref[CompletionResponse],
                    stream=ref[CompletionStreamResponse],
                    errors=generation_errors,
                    secured=api_key,
                ),
                json_body(ref[CompletionRequest]),
                secured=True,
            )
        },
        "/v1/chat/completions": {
            "post": operation(
                "create_chat_completion",
                "Create a chat completion",
                responses(
                    ref[ChatCompletionResponse],
                    stream=ref[ChatCompletionChunk],
                    errors=generation_errors,
                    secured=api_key,
                ),
                json_body(ref[ChatCompletionRequest]),
                secured=True,
            )
        },
        "/v1/models": {
            "get": operation(
                "list_models",
                "List the served models",
                responses(ref[ModelList], errors=(), secured=api_key),
                secured=True,
            )
        },
        "/health": {
            "get": operation(
                "health", "200 while the engine is healthy", responses(None, errors=("503",))
            )
        },
        "/version": {
            "get": operation(
                "version", "Server version", responses(ref[VersionResponse], errors=())
            )
        },
        "/tokenize": {
            "post": operation(
                "tokenize",
                "Tokenize a prompt or a chat",
                responses(ref[TokenizeResponse], errors=("400", "404", "413", "500", "503")),
                json_body({"oneOf": [ref[TokenizeCompletionRequest], ref[TokenizeChatRequest]]}),
            )
        },
        "/detokenize": {
            "post": operation(
                "detokenize",
                "Detokenize token ids",
                responses(ref[DetokenizeResponse], errors=("400", "404", "413", "500", "503")),
                json_body(ref[DetokenizeRequest]),
            )
        },
        "/v1/embeddings": {
            "post": operation(
                "create_embedding",
                "Embeddings from a pooling model",
                responses(ref[EmbeddingResponse], errors=generation_errors, secured=api_key),
                json_body(ref[EmbeddingRequest]),
                secured=True,
            )
        },
        **{
            path: {
                "post": operation(
                    op_id,
                    "Similarity scores from a pooling model",
                    responses(ref[ScoreResponse], errors=generation_errors, secured=api_key),
                    json_body(ref[ScoreRequest]),
                    secured=True,
                )
            }
            for path, op_id in (("/score", "create_score"), ("/v1/score", "create_score_v1"))
        },
        "/v1/responses": {
            "post": operation(
                "create_response",
                "Create a response (the Responses API)",
                responses(ref[ResponseObject], stream=ref[ResponseEvent], errors=generation_errors, secured=api_key),
                json_body(ref[ResponsesRequest]),
                secured=True,
            )
        },
        "/v1/responses/{response_id}": {
            method: {
                **operation(
                    f"{method}_response",
                    summary,
                    responses(ref[ok], errors=("404",), secured=api_key),
                    secured=True,
                ),
                "parameters": [{"name": "response_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            }
            for method, summary, ok in (
                ("get", "Retrieve a stored response", ResponseObject),
                ("delete", "Delete a stored response", DeletedResponse),
            )
        },
        "/openapi.json": {
            "get": operation("openapi", "This document", responses({"type": "object"}, errors=()))
        },
    }
    if lora_updating:
        for path, op_id, summary, body in (
            ("/v1/load_lora_adapter", "load_lora_adapter", "Load a LoRA adapter by name and path", LoadLoRAAdapterRequest),
            ("/v1/unload_lora_adapter", "unload_lora_adapter", "Unload a LoRA adapter by name", UnloadLoRAAdapterRequest),
        ):
            resp = responses(None, errors=("400", "404"), secured=api_key)
            resp["200"]["content"] = {"text/plain": {"schema": {"type": "string"}}}
            paths[path] = {"post": operation(op_id, summary, resp, json_body(ref[body]), secured=True)}
    for path in extra_paths:
        paths[path] = {"get": operation(path.strip("/"), path, responses(None, errors=()))}
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    if api_key and all_routes:
        for methods in paths.values():
            for op in methods.values():
                op["security"] = [{"bearer": []}]
                op["responses"].setdefault(
                    "401",
                    {
                        "description": "Invalid or missing API key",
                        "content": {"application/json": {"schema": ref[ErrorResponse]}},
                    },
                )
    return doc
