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
Scores (`compute_scores`, also behind the rerank routes) are vLLM's, 1 -> N or N -> N: a
cross-encoder's relevance of each pair read as one sequence when the model is a one-label
classifier (engine/processing/text_pairs.py), else the cosine similarity of the two texts'
embeddings.

The helpers the other pooling routes share (serving_rerank.py) are public here: `encode_all`,
`encode_inputs`, `pooling_inputs`, `make_params`, `check_count`, `encode_vector`, `list_response`.
"""

from __future__ import annotations

import base64
import contextlib
from collections.abc import Callable, Sequence
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
    InputRequest,
    ListResponse,
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
from triollm.engine.processing.text_pairs import pair_prompt

__all__ = [
    "check_count",
    "check_encoding_format",
    "compute_scores",
    "create_embedding",
    "create_score",
    "encode_all",
    "encode_inputs",
    "encode_vector",
    "json_response",
    "list_response",
    "make_params",
    "pooling_inputs",
    "prompt_tokens",
]

_PROMPT_FIELDS = ("prompt_token_ids", "prompt")


async def create_embedding(state: ServerState, request: Request) -> Response:
    check_available(state)
    req = await decode_body(request, EmbeddingRequest)
    model = resolve_model(state, req.model)
    require_runner(state, "pooling", "Embeddings API")
    check_encoding_format(req.encoding_format)
    params = make_params("embed", req.truncate_prompt_tokens, req.dimensions, req.normalize)
    rid, outputs = await encode_inputs(state, request, req, "embd", params)
    data = [
        EmbeddingResponseData(i, encode_vector(out.outputs.data, req.encoding_format)) for i, out in enumerate(outputs)
    ]
    return list_response(EmbeddingResponse, rid, model, data, prompt_tokens(outputs))


async def create_score(state: ServerState, request: Request) -> Response:
    check_available(state)
    req = await decode_body(request, ScoreRequest)
    model = resolve_model(state, req.model)
    require_runner(state, "pooling", "Score API")
    rid = f"score-{request_id_base(request, req.request_id)}"
    name_1, value_1 = _side(req, ("text_1", "data_1", "queries"))
    name_2, value_2 = _side(req, ("text_2", "data_2", "documents"))
    check_count(state, _count(value_1) + _count(value_2), name_2)  # before any list is walked
    texts_1, texts_2 = score_texts(value_1, name_1), score_texts(value_2, name_2)
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise bad_request(
            f"{name_1}: {len(texts_1)} texts for {len(texts_2)} in {name_2}; pass one, or as many as {name_2}",
            name_1,
        )
    scores, tokens = await compute_scores(
        state, texts_1, texts_2, (name_1, name_2), req.truncate_prompt_tokens, rid, req.priority
    )
    data = [ScoreResponseData(i, score) for i, score in enumerate(scores)]
    return list_response(ScoreResponse, rid, model, data, tokens)


async def compute_scores(
    state: ServerState,
    texts_1: list[str],
    texts_2: list[str],
    names: tuple[str, str],
    truncate: int | None,
    rid: str,
    priority: int,
    max_tokens_second: int | None = None,
) -> tuple[list[float], int]:
    """The score of each pair (`texts_1[0]` with every text of `texts_2`, or pairwise) and the
    prompt tokens read; `max_tokens_second` cuts each second text to that many tokens first."""
    config = state.llm.get_model_config()
    firsts = texts_1 * len(texts_2) if len(texts_1) == 1 else texts_1
    check_count(state, len(texts_1) + len(texts_2), names[1])
    if config.pooler is not None and config.pooler.num_labels is not None:  # a cross-encoder
        tokenizer = state.llm.get_tokenizer()

        def build() -> list[PromptType]:
            return [
                pair_prompt(tokenizer, a, b, truncate, config.max_model_len, max_tokens_second)
                for a, b in zip(firsts, texts_2)
            ]

        try:
            pairs = await maybe_in_thread(build, sum(len(a) + len(b) + 16 for a, b in zip(firsts, texts_2)))
        except ValueError as exc:
            raise bad_request(str(exc)) from None
        scored = await encode_all(state, pairs, make_params("score", truncate), rid, priority, names[1])
        return [float(out.outputs.data.item()) for out in scored], prompt_tokens(scored)
    second_truncate = truncate if max_tokens_second is None else max_tokens_second
    ones = await encode_all(state, texts_1, make_params("embed", truncate), f"{rid}-a", priority, names[0])
    twos = await encode_all(state, texts_2, make_params("embed", second_truncate), f"{rid}-b", priority, names[1])
    if len(ones) == 1:
        ones = ones * len(twos)
    cosine = torch.nn.functional.cosine_similarity
    scores = [float(cosine(a.outputs.data, b.outputs.data, dim=0)) for a, b in zip(ones, twos)]
    return scores, sum(len(a.prompt_token_ids) + len(b.prompt_token_ids) for a, b in zip(ones, twos))


async def pooling_inputs(state: ServerState, value: str | list[Any], add_special_tokens: bool) -> list[PromptType]:
    """OpenAI's `input` (a text, texts, token ids, lists of them) as prompts, counted against
    max_prompts_per_request; `add_special_tokens: false` tokenizes texts without them."""
    if isinstance(value, list) and value and not isinstance(value[0], int):
        check_count(state, len(value), "input")  # a list of inputs: counted before any walk
    prompts: list[PromptType] = list(await maybe_in_thread(lambda: embedding_inputs(value), items_size(value)))
    check_count(state, len(prompts), "input")
    if add_special_tokens:
        return prompts
    tokenizer = state.llm.get_tokenizer()
    return await maybe_in_thread(
        lambda: [
            {"prompt": p, "prompt_token_ids": tokenizer.encode(p, add_special_tokens=False)}
            if isinstance(p, str) else p
            for p in prompts
        ],
        sum(len(p) + 16 for p in prompts if isinstance(p, str)),  # 16: a call's fixed cost
    )  # fmt: skip


def _count(value: object) -> int:
    return len(value) if isinstance(value, list) else 1


def _side(req: ScoreRequest, names: tuple[str, ...]) -> tuple[str, Any]:
    given = [(name, getattr(req, name)) for name in names if getattr(req, name) is not None]
    if not given:
        raise bad_request(f"{names[0]}: required (or {' / '.join(names[1:])})", names[0])
    if len(given) > 1:
        raise bad_request(f"{given[1][0]}: give only one of {', '.join(names)}", given[1][0])
    return given[0]


def make_params(
    task: str | None,
    truncate: int | None,
    dimensions: int | None = None,
    normalize: bool | None = None,
    use_activation: bool | None = None,
) -> PoolingParams:
    try:
        return PoolingParams(
            task=task,
            truncate_prompt_tokens=truncate,
            dimensions=dimensions,
            normalize=normalize,
            use_activation=use_activation,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def check_count(state: ServerState, count: int, field: str) -> None:
    config = state.llm.config
    limit = config.limits.max_prompts_per_request if config is not None else None
    if limit is not None and count > limit:
        raise bad_request(f"{field}: {count} inputs exceed max_prompts_per_request ({limit})", field)


async def encode_all(
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


def encode_vector(data: torch.Tensor, encoding_format: str) -> Any:
    """A pooled tensor as JSON: its (nested) list of floats, or the base64 of its float32 bytes."""
    if encoding_format == "base64":
        return base64.b64encode(pack_pooled(data)).decode("ascii")
    return data.tolist()


def json_response(obj: Any) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")


def check_encoding_format(value: str) -> None:
    if value not in ENCODING_FORMATS:
        raise bad_request(f"encoding_format: {value!r} is not one of {', '.join(ENCODING_FORMATS)}", "encoding_format")


async def encode_inputs(
    state: ServerState, request: Request, req: InputRequest, prefix: str, params: PoolingParams
) -> tuple[str, list[PoolingRequestOutput[PoolingOutput]]]:
    """The request id (`prefix`-...) and one output per prompt of the request's `input`."""
    rid = f"{prefix}-{request_id_base(request, req.request_id)}"
    prompts = await pooling_inputs(state, req.input, req.add_special_tokens)
    return rid, await encode_all(state, prompts, params, rid, req.priority, "input")


def prompt_tokens(outputs: Sequence[PoolingRequestOutput[PoolingOutput]]) -> int:
    return sum(len(out.prompt_token_ids) for out in outputs)


def list_response(kind: Callable[..., ListResponse], rid: str, model: str, data: list[Any], tokens: int) -> Response:
    """A `{"object": "list", "data": [...]}` answer with usage counting `tokens` prompt tokens."""
    body = kind(id=rid, created=created_now(), model=model, data=data, usage=PoolingUsage(tokens, tokens))
    return json_response(body)
