"""`GET /openapi.json`: an OpenAPI 3.1 document of the route table (routes.py), its schemas
built from the msgspec protocol structs."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import msgspec

from triollm.api.openai_errors import AnthropicErrorResponse, ErrorResponse
from triollm.api.routes import ROUTES, RouteSpec

__all__ = ["openapi_document"]

_ERRORS = {
    "400": "Invalid request (the message names the field)",
    "401": "Invalid or missing API key",
    "404": "Unknown model",
    "413": "Request body too large",
    "500": "Internal error",
    "503": "The engine is dead or the server is shutting down",
}
_SSE = {
    "type": "string",
    "description": "SSE: `data: <chunk JSON>` events, then `data: [DONE]`",
}


def openapi_document(
    routes: Sequence[RouteSpec],
    *,
    title: str,
    version: str,
    api_key: bool,
    all_routes: bool = False,
) -> dict[str, Any]:
    """The document of `routes` (routes.py: the ones the app serves), in their order. With
    `api_key`, the keyed operations carry `security` and a 401 (with `all_routes` every
    operation, as `--api-key-all-routes` keys every route). The schemas of every route of the
    table are components, whether or not the route is served."""
    types = tuple(dict.fromkeys(t for spec in ROUTES for t in spec.schema_types()))
    types += (ErrorResponse, AnthropicErrorResponse)
    schemas, components = msgspec.json.schema_components(
        types, ref_template="#/components/schemas/{name}"
    )
    ref = dict(zip(types, schemas, strict=True))
    paths: dict[str, dict[str, Any]] = {}
    for spec in routes:
        op = _operation(spec, ref, secured=api_key and (all_routes or not spec.open))
        paths.setdefault(spec.path, {})[spec.method.lower()] = op
    doc: dict[str, Any] = {
        "openapi": "3.1.0",
        "info": {"title": title, "version": version},
        "paths": paths,
        "components": {"schemas": components},
    }
    if api_key:
        doc["components"]["securitySchemes"] = {"bearer": {"type": "http", "scheme": "bearer"}}
    return doc


def _operation(spec: RouteSpec, ref: dict[type, Any], *, secured: bool) -> dict[str, Any]:
    """One operation; `secured`: it needs the key (`security` and a 401 answer)."""

    def schema(value: type | dict[str, Any]) -> Any:
        return ref[value] if isinstance(value, type) else value

    content: dict[str, Any] = {}
    if spec.ok is not None:
        content[spec.ok_media] = {"schema": schema(spec.ok)}
    if spec.stream is not None:
        content["text/event-stream"] = {"schema": _SSE}
    answers: dict[str, Any] = {
        "200": {"description": "OK", **({"content": content} if content else {})}
    }
    error = ref[AnthropicErrorResponse if spec.anthropic else ErrorResponse]
    for code in (*spec.errors, "401") if secured else spec.errors:
        answers[code] = {
            "description": _ERRORS[code],
            "content": {"application/json": {"schema": error}},
        }
    op: dict[str, Any] = {
        "operationId": spec.operation_id,
        "summary": spec.summary,
        "responses": answers,
    }
    if isinstance(spec.request, tuple):
        body: Any = {"oneOf": [ref[t] for t in spec.request]}
    else:
        body = None if spec.request is None else ref[spec.request]
    if body is not None:
        op["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
    if secured:
        op["security"] = [{"bearer": []}]
    parameters = re.findall(r"{(\w+)}", spec.path)
    if parameters:
        op["parameters"] = [
            {"name": name, "in": "path", "required": True, "schema": {"type": "string"}}
            for name in parameters
        ]
    return op
