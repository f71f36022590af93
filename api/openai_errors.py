"""OpenAI-shaped errors: `{"error": {"message", "type", "param", "code"}}` (vLLM's ErrorResponse).

Every failure a request can meet is turned into an `APIError` by `from_exception`: malformed
JSON and wrong types (msgspec, whose message names the field path), invalid values (the
engine's `ValueError`s, whose messages start with the field name) and JSON nested too deeply
-> 400; a full engine queue (`EngineBusyError`) -> 429 with `Retry-After`; a dead engine -> 503;
anything unexpected -> 500 with a log line (the client gets no traceback).

The Messages API's routes answer the same errors in Anthropic's shape
(`{"type": "error", "error": {"type": "invalid_request_error", "message": ...}}`, the status
unchanged): `as_anthropic(error)`.
"""

from __future__ import annotations

import logging
import math
import re
from http import HTTPStatus

import msgspec
from starlette.responses import Response

from triollm.actors.errors import EngineBusyError, EngineDeadError, EngineGenerateError
from triollm.api.log_bounds import shorten
from triollm.engine.log_safe import log_safe

__all__ = [
    "APIError",
    "AnthropicError",
    "AnthropicErrorBody",
    "AnthropicErrorResponse",
    "ErrorInfo",
    "ErrorResponse",
    "as_anthropic",
    "bad_request",
    "from_exception",
    "service_unavailable",
    "too_many_requests",
]

log = logging.getLogger("triollm.api")

_TYPES = {
    400: "BadRequestError",
    401: "AuthenticationError",
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: "RequestTooLargeError",
    429: "RateLimitError",
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}
# "prompt: ...", "temperature must ...", "messages[0].content: ..." -> the field it names.
_PARAM_PREFIX = re.compile(r"^([a-z_][a-z0-9_]*(?:\[\d+\])?(?:\.[a-z_][a-z0-9_]*)*)(?=[: ])")
# msgspec: "Expected `int`, got `str` - at `$.max_tokens`"; "Object missing required field `x`".
_MSGSPEC_PATH = re.compile(r"- at `\$\.?([^`]*)`$")
_MSGSPEC_MISSING = re.compile(r"missing required field `([^`]+)`")


class ErrorInfo(msgspec.Struct):
    message: str
    type: str
    param: str | None
    code: int


class ErrorResponse(msgspec.Struct):
    error: ErrorInfo


class AnthropicErrorBody(msgspec.Struct, kw_only=True):
    type: str  # invalid_request_error, authentication_error, not_found_error, ...
    message: str


class AnthropicErrorResponse(msgspec.Struct, kw_only=True):
    type: str = "error"
    error: AnthropicErrorBody


# Anthropic's error types by status (its API's list; another status is an api_error).
_ANTHROPIC_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


class APIError(Exception):
    """An error with its HTTP status, rendered as the OpenAI error body."""

    def __init__(
        self, status: int, message: str, param: str | None = None, type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.type = (
            type or _TYPES.get(status) or HTTPStatus(status).phrase.replace(" ", "") + "Error"
        )
        self.headers: dict[str, str] = {}

    def to_struct(self) -> msgspec.Struct:
        return ErrorResponse(ErrorInfo(self.message, self.type, self.param, self.status))

    def body(self) -> bytes:
        return msgspec.json.encode(self.to_struct())

    def response(self) -> Response:
        return Response(
            self.body(),
            status_code=self.status,
            media_type="application/json",
            headers=self.headers,
        )


class AnthropicError(APIError):
    """An `APIError` rendered in Anthropic's shape (the same status and headers)."""

    def to_struct(self) -> msgspec.Struct:
        kind = _ANTHROPIC_TYPES.get(self.status, "api_error")
        return AnthropicErrorResponse(error=AnthropicErrorBody(type=kind, message=self.message))


def as_anthropic(error: APIError) -> AnthropicError:
    """`error` in Anthropic's shape (itself when it already is)."""
    if isinstance(error, AnthropicError):
        return error
    out = AnthropicError(error.status, error.message, error.param, error.type)
    out.headers.update(error.headers)
    return out


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param if param is not None else _param_of(message))


def service_unavailable(message: str) -> APIError:
    return APIError(503, message)


def too_many_requests(message: str, retry_after_s: float) -> APIError:
    """429 with `Retry-After` in whole seconds (at least 1), as HTTP wants it."""
    error = APIError(429, message)
    seconds = math.ceil(retry_after_s) if math.isfinite(retry_after_s) else 1
    error.headers["Retry-After"] = str(max(1, seconds))
    return error


def from_exception(exc: BaseException, *, engine_running: bool = True) -> APIError:
    """The client-facing error for `exc`. `engine_running` False turns the engine's "not
    running" RuntimeError (a request that raced with shutdown) into a 503."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, EngineBusyError):
        return too_many_requests(str(exc), exc.retry_after_s)
    if isinstance(exc, EngineDeadError):
        first_line = (str(exc).strip().splitlines() or ["the engine core died"])[0]
        return service_unavailable(f"The engine is dead: {first_line}")
    if isinstance(exc, msgspec.ValidationError):
        return bad_request(str(exc), _msgspec_param(str(exc)))
    if isinstance(exc, msgspec.DecodeError):
        return bad_request(f"Invalid JSON body: {exc}", None)
    if isinstance(exc, ValueError):
        return bad_request(str(exc))
    if isinstance(exc, RuntimeError) and not engine_running:
        return service_unavailable("The server is shutting down")
    if isinstance(exc, EngineGenerateError):
        message = shorten(str(exc))  # it may quote the request's values
        log.error("request failed in the engine: %s", log_safe(message))
        return APIError(500, f"The request failed in the engine: {message}")
    log.error("unexpected error while serving a request", exc_info=exc)
    return APIError(500, f"Internal server error ({type(exc).__name__}); see the server log")


def _param_of(message: str) -> str | None:
    match = _PARAM_PREFIX.match(message)
    return match.group(1) if match else None


def _msgspec_param(message: str) -> str | None:
    match = _MSGSPEC_PATH.search(message) or _MSGSPEC_MISSING.search(message)
    return (match.group(1) or None) if match else None
