"""The wire format of the pooling endpoints (`/v1/embeddings`, `/score`, `/v1/score`) as msgspec
Structs with OpenAI's and vLLM's field names and JSON shapes.

`EmbeddingRequest.input` is OpenAI's: a string, a list of strings, a list of token ids or a list
of token-id lists (msgspec takes one array type per union, so the list forms are told apart by
`embedding_inputs`). vLLM's extras: `truncate_prompt_tokens`, `normalize`, `add_special_tokens`,
`priority`, `request_id`. `ScoreRequest` takes vLLM's `text_1` / `text_2` (also spelt
`data_1` / `data_2`, or `queries` / `documents` as newer vLLM names them).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from triollm.api.openai_errors import bad_request
from triollm.api.protocol import Int64

__all__ = [
    "EmbeddingRequest",
    "EmbeddingResponse",
    "EmbeddingResponseData",
    "InputRequest",
    "ListResponse",
    "PoolingUsage",
    "ScoreRequest",
    "ScoreResponse",
    "ScoreResponseData",
    "embedding_inputs",
]

Truncation = Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)]
Dimensions = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
ENCODING_FORMATS = ("float", "base64")


class InputRequest(msgspec.Struct, kw_only=True):
    """The fields every request with OpenAI's `input` shares (embeddings, classify, pooling)."""

    input: str | list[Any]
    model: str | None = None
    user: str | None = None
    truncate_prompt_tokens: Truncation | None = None
    add_special_tokens: bool = True
    priority: Int64 = 0
    request_id: str | None = None


class EmbeddingRequest(InputRequest, kw_only=True):
    encoding_format: str = "float"
    dimensions: Dimensions | None = None
    normalize: bool | None = None


class ScoreRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    text_1: str | list[Any] | None = None
    text_2: str | list[Any] | None = None
    data_1: str | list[Any] | None = None
    data_2: str | list[Any] | None = None
    queries: str | list[Any] | None = None
    documents: str | list[Any] | None = None
    truncate_prompt_tokens: Truncation | None = None
    priority: Int64 = 0
    request_id: str | None = None


class PoolingUsage(msgspec.Struct):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class EmbeddingResponseData(msgspec.Struct):
    index: int
    embedding: list[float] | str  # a string with encoding_format "base64"
    object: Literal["embedding"] = "embedding"


class ListResponse(msgspec.Struct, kw_only=True):
    """The envelope of every pooling answer that is a list of `data` items."""

    id: str
    created: int
    model: str
    usage: PoolingUsage
    object: Literal["list"] = "list"


class EmbeddingResponse(ListResponse, kw_only=True):
    data: list[EmbeddingResponseData]


class ScoreResponseData(msgspec.Struct):
    index: int
    score: float
    object: Literal["score"] = "score"


class ScoreResponse(ListResponse, kw_only=True):
    data: list[ScoreResponseData]


def embedding_inputs(value: str | list[Any]) -> list[str | dict[str, Any]]:
    """`input` as prompts: texts, or `{"prompt_token_ids": [...]}`; 400 naming `input` when it
    is empty or of a form OpenAI does not define."""
    if isinstance(value, str):
        if not value:
            raise bad_request("input: must not be empty", "input")
        return [value]
    if not value:
        raise bad_request("input: must not be an empty list", "input")
    if all(isinstance(v, str) for v in value):
        if not all(value):
            raise bad_request("input: the strings must not be empty", "input")
        return list(value)
    if all(_is_token(v) for v in value):
        return [{"prompt_token_ids": list(value)}]
    if all(isinstance(v, list) and v and all(_is_token(t) for t in v) for v in value):
        return [{"prompt_token_ids": list(v)} for v in value]
    raise bad_request(
        "input: must be a string, a list of strings, a list of token ids or a list of "
        "non-empty token-id lists (not a mix)",
        "input",
    )


def score_texts(value: str | list[Any] | None, name: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if not isinstance(value, list) or not value or not all(isinstance(v, str) for v in value):
        raise bad_request(f"{name}: must be a string or a non-empty list of strings", name)
    return list(value)


def _is_token(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63
