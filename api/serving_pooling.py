"""`POST /v1/embeddings` (OpenAI's shape) and `POST /score`, `/v1/score` (vLLM's) on a pooling
model.

Each prompt is one engine request (`AsyncLLM.add_request` with `PoolingParams`, the same handle
every endpoint uses): all are added first (inside the server's admission, so a drain knows
them), then their one output each is read; leaving early in any way (an error, cancellation)
closes every handle, which aborts what is unfinished. No disconnect watcher: a request is a
single forward pass per batch, over before a watcher would matter.

`encoding_format: "base64"` sends each embedding as the base64 of its little-endian float32
bytes (what OpenAI's client decodes with `np.frombuffer(..., dtype="float32")`). The engine's
messages name the prompt `prompt`; here they name the request's field (`input`, `text_1`...).
Scores are vLLM's bi-encoder scores: the cosine similarity of the two texts' embeddings,
1 -> N or N -> N.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
from starlette.requests import Request
from starlette.responses import Response

from triollm.api.openai_errors import APIError, bad_request
from triollm.api.protocol_pooling import (
    ENCODING_FORMATS,
    EmbeddingRequest,
    EmbeddingResponse,
    EmbeddingResponseData,
    PoolingUsage,
    ScoreRequest,
    ScoreResponse,
    ScoreResponseData,
    embedding_inputs,
    score_texts,
)
from triollm.api.serving_common import (
    check_available,
    created_now,
    decode_body,
    items_size,
    maybe_in_thread,
    request_id_base,
    require_runner,
    resolve_model,
)
from triollm.api.state import ServerState
from triollm.engine.inputs import PromptType
from triollm.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput, pack_pooled
from triollm.engine.pooling_params import PoolingParams

__all__ = ["create_embedding", "create_score"]

_PROMPT_FIELDS = ("prompt_token_ids", "prompt")


async def create_embedding(state: ServerState, request: Request) -> Response:
    check_available(state)
    req = await decode_body(request, EmbeddingRequest)
    model = resolve_model(state, req.model)
    require_runner(state, "pooling", "Embeddings API")
    if req.encoding_format not in ENCODING_FORMATS:
        raise bad_request(
            f"encoding_format: {req.encoding_format!r} is not one of {', '.join(ENCODING_FORMATS)}",
            "encoding_format",
        )
    rid = f"embd-{request_id_base(request, req.request_id)}"
    value = req.input
    if isinstance(value, list) and value and not isinstance(value[0], int):
        _check_count(state, len(value), "input")  # a list of inputs: counted before any walk
    prompts: list[PromptType] = list(
        await maybe_in_thread(lambda: embedding_inputs(value), items_size(value))
    )
    _check_count(state, len(prompts), "input")
    if not req.add_special_tokens:
        tokenizer = state.llm.get_tokenizer()
        texts = prompts
        prompts = await maybe_in_thread(
            lambda: [
                {"prompt": p, "prompt_token_ids": tokenizer.encode(p, add_special_tokens=False)}
                if isinstance(p, str) else p
                for p in texts
            ],
            sum(len(p) + 16 for p in texts if isinstance(p, str)),  # 16: a call's fixed cost
        )
    params = _params(req.truncate_prompt_tokens, req.dimensions, req.normalize)
    outputs = await _encode_all(state, prompts, params, rid, req.priority, "input")
    data = [
        EmbeddingResponseData(i, _encode_vector(out.outputs.data, req.encoding_format))
        for i, out in enumerate(outputs)
    ]
    tokens = sum(len(out.prompt_token_ids) for out in outputs)
    body = EmbeddingResponse(
        id=rid, created=created_now(), model=model, data=data, usage=PoolingUsage(tokens, tokens)
    )
    return _json(body)


async def create_score(state: ServerState, request: Request) -> Response:
    check_available(state)
    req = await decode_body(request, ScoreRequest)
    model = resolve_model(state, req.model)
    require_runner(state, "pooling", "Score API")
    rid = f"score-{request_id_base(request, req.request_id)}"
    name_1, value_1 = _side(req, ("text_1", "data_1", "queries"))
    name_2, value_2 = _side(req, ("text_2", "data_2", "documents"))
    _check_count(state, _count(value_1) + _count(value_2), name_2)  # before any list is walked
    texts_1, texts_2 = score_texts(value_1, name_1), score_texts(value_2, name_2)
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise bad_request(
            f"{name_1}: {len(texts_1)} texts for {len(texts_2)} in {name_2}; pass one, or as many as {name_2}",
            name_1,
        )
    _check_count(state, len(texts_1) + len(texts_2), name_2)
    params = _params(req.truncate_prompt_tokens, None, None)
    firsts = await _encode_all(state, list(texts_1), params, f"{rid}-a", req.priority, name_1)
    seconds = await _encode_all(state, list(texts_2), params, f"{rid}-b", req.priority, name_2)
    if len(firsts) == 1:
        firsts = firsts * len(seconds)
    data = [
        ScoreResponseData(i, float(torch.nn.functional.cosine_similarity(a.outputs.data, b.outputs.data, dim=0)))
        for i, (a, b) in enumerate(zip(firsts, seconds))
    ]
    tokens = sum(len(a.prompt_token_ids) + len(b.prompt_token_ids) for a, b in zip(firsts, seconds))
    body = ScoreResponse(id=rid, created=created_now(), model=model, data=data, usage=PoolingUsage(tokens, tokens))
    return _json(body)


def _count(value: object) -> int:
    return len(value) if isinstance(value, list) else 1


def _side(req: ScoreRequest, names: tuple[str, ...]) -> tuple[str, Any]:
    given = [(name, getattr(req, name)) for name in names if getattr(req, name) is not None]
    if not given:
        raise bad_request(f"{names[0]}: required (or {' / '.join(names[1:])})", names[0])
    if len(given) > 1:
        raise bad_request(f"{given[1][0]}: give only one of {', '.join(names)}", given[1][0])
    return given[0]


def _params(truncate: int | None, dimensions: int | None, normalize: bool | None) -> PoolingParams:
    try:
        return PoolingParams(
            task="embed", truncate_prompt_tokens=truncate, dimensions=dimensions, normalize=normalize
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def _check_count(state: ServerState, count: int, field: str) -> None:
    config = state.llm.config
    limit = config.limits.max_prompts_per_request if config is not None else None
    if limit is not None and count > limit:
        raise bad_request(f"{field}: {count} inputs exceed max_prompts_per_request ({limit})", field)


async def _encode_all(
    state: ServerState,
    prompts: Sequence[PromptType],
    params: PoolingParams,
    rid: str,
    priority: int,
    field: str,
) -> list[PoolingRequestOutput[PoolingOutput]]:
    """Add one request per prompt, then read each one's output, in order."""
    llm = state.llm
    results: list[PoolingRequestOutput[PoolingOutput]] = []
    with contextlib.ExitStack() as handles:
        streams = []
        for i, prompt in enumerate(prompts):
            try:
                with state.admission():
                    stream = await llm.add_request(f"{rid}-{i}", prompt, params.clone(), priority=priority)
            except ValueError as exc:
                raise _renamed(exc, field, i, len(prompts)) from None
            streams.append(handles.enter_context(stream))
        for i, stream in enumerate(streams):
            try:
                output: Any = await stream.get()
            except ValueError as exc:
                raise _renamed(exc, field, i, len(prompts)) from None
            if not isinstance(output, PoolingRequestOutput):
                raise APIError(503, "The request was aborted before its embedding was computed")
            results.append(output)
    return results


def _renamed(exc: ValueError, field: str, index: int, count: int) -> APIError:
    """The engine's "prompt: ..." as the request's field ("input[2]: ..." for several)."""
    message = str(exc)
    name = field if count == 1 else f"{field}[{index}]"
    for prefix in _PROMPT_FIELDS:
        if message.startswith(prefix + ":"):
            return bad_request(name + message[len(prefix) :], field)
    return bad_request(message)


def _encode_vector(data: torch.Tensor, encoding_format: str) -> list[float] | str:
    if encoding_format == "base64":
        return base64.b64encode(pack_pooled(data)).decode("ascii")
    return list(data.tolist())


def _json(obj: Any) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")
