"""What the completion, chat, Responses and tokenize handlers share: the start every generation
route makes (`start_generation`: availability, runner, body, model, adapter, id, timer), body
reading, sampling-parameter building, logprob helpers, and the HTTP side of chat rendering (the
rendering itself is `Tokenizer.render_chat`). The grammar and parsers of a request's output
are output_plan.py's.

Work on the event loop is sized before it is done: a body is decoded (in short pieces, so
that the GIL is let go: json_pieces.py), a chat rendered and tokenized, in a worker thread once
it is large (`decode_sized`, `maybe_in_thread`). A chat's size is not its
text: every string the template may see counts (role, name, tool calls, content parts, the
template kwargs), plus a fixed cost per message and per part, so fifty thousand one-letter
messages weigh what they cost to render (`chat_size`). Counts are capped at decoding
(protocol.py), client ids here (`MAX_REQUEST_ID_LEN`)."""

from __future__ import annotations

import functools
import math
import time
import uuid
from collections.abc import Callable, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import anyio
import jinja2
import jinja2.nodes
from anyio.lowlevel import RunVar
from starlette.requests import ClientDisconnect, Request

from triollm.api.json_pieces import decode_in_pieces
from triollm.api.log_bounds import shorten
from triollm.api.metrics import RequestTimer
from triollm.api.openai_errors import APIError, bad_request, service_unavailable
from triollm.api.protocol import (
    ChatMessage,
    LogprobInfo,
    PromptLogprobsOut,
    SamplingFields,
    decode_request,
)
from triollm.api.state import ServerState
from triollm.api.tracing import RequestTrace
from triollm.engine.beam_search import BeamSearchParams
from triollm.engine.outputs import Logprob, PromptLogprobs
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from triollm.lora.request import LoRARequest

__all__ = [
    "API_KEY_ID",
    "MAX_BODY_BYTES",
    "MAX_REQUEST_ID_LEN",
    "SMALL_BODY_BYTES",
    "Started",
    "api_key_id",
    "beam_search_params",
    "build_sampling_params",
    "chat_size",
    "items_size",
    "check_available",
    "check_logprobs",
    "clamp_logprob",
    "decode_body",
    "decode_sized",
    "read_body",
    "render_chat",
    "request_id_base",
    "require_runner",
    "resolve_chat_template",
    "resolve_lora",
    "resolve_model",
    "start_generation",
    "start_timer",
    "stream_flags",
    "truncate_prompt",
]

# Request body limits (413 above them), enforced while reading, so an oversized body is never
# held whole: generation endpoints take long prompts and prompt lists; /tokenize and /detokenize
# have no business with more than a long document.
MAX_BODY_BYTES = 64 * 1024 * 1024
SMALL_BODY_BYTES = 1024 * 1024
# Above this many characters, prompt rendering/tokenizing moves to a worker thread.
LARGE_TEXT = 8192
# Above this many bytes, a request body is decoded in a worker thread.
LARGE_BODY = 1024 * 1024
# The longest request id a client may send (body `request_id`, header `X-Request-Id`), as
# vLLM-sized ids go: it is copied into every engine request, output batch and log line of the
# request, with the server's prefix and suffixes (the engine's own bound is above it).
MAX_REQUEST_ID_LEN = 256
# The key of the request scope's `state` where APIKeyMiddleware (app.py) puts the hash of the
# key a request was accepted with (`api_key_id`).
API_KEY_ID = "triollm.api_key_id"
# What rendering a chat message or content part costs beyond its strings, in characters.
_MESSAGE_CHARS = 32
_PART_CHARS = 16
# Optional sampling fields passed to SamplingParams only when the request sets them (otherwise
# the model's generation_config.json default, else SamplingParams' own default, applies).
_OPTIONAL_FIELDS = (
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "repetition_penalty",
    "presence_penalty",
    "frequency_penalty",
    "seed",
    "stop",
    "stop_token_ids",
    "logit_bias",
    "allowed_token_ids",
    "bad_words",
)
R = TypeVar("R")
T = TypeVar("T")


class _Addressed(Protocol):
    """What a generation request names besides its work: the model, and maybe its own id."""

    @property
    def model(self) -> str | None: ...

    @property
    def request_id(self) -> str | None: ...


Req = TypeVar("Req", bound=_Addressed)


@dataclass(frozen=True)
class Started(Generic[Req]):
    """A generation request past the start every generation route shares."""

    req: Req
    model: str  # the served name it asked for (a base model's or an adapter's)
    lora: LoRARequest | None  # the adapter, taken now: a later unload does not change it
    request_id: str  # the route's prefix + the client's id (or a fresh one)
    timer: RequestTimer | None  # the metrics' timer of this request, when metrics are on
    body_bytes: int  # the body's size, to size the route's own work on it (`maybe_in_thread`)
    trace: RequestTrace | None = None  # its OpenTelemetry context, when tracing is on (tracing.py)


async def start_generation(
    state: ServerState, request: Request, type_: type[Req], *, api: str, id_prefix: str
) -> Started[Req]:
    """The first checks of a generation route, in this order, each an OpenAI error: the engine
    runs and the server accepts (503), the body is read (413), the model generates (400 naming
    `api`), the body decodes into `type_` (400), the model is served (404), the client's id
    fits (400). Then the metrics' timer starts. The body is read before any 400: an answer sent
    while the client still sends its body makes the server drop the connection after it, and
    a client that reuses it (keep-alive) sees its next request fail."""
    check_available(state)
    body = await read_body(request)
    require_runner(state, "generate", api)
    req = await decode_sized(body, type_)
    model = resolve_model(state, req.model)
    lora = resolve_lora(state, model)
    request_id = id_prefix + request_id_base(request, req.request_id)
    trace = None if state.tracer is None else state.tracer.trace(request.headers)
    return Started(req, model, lora, request_id, start_timer(state, model), len(body), trace)


def check_available(state: ServerState) -> None:
    """503 when the engine is dead or the server is shutting down."""
    llm = state.llm
    dead = llm.dead_error
    if dead is not None:
        first_line = (str(dead).strip().splitlines() or ["the engine core died"])[0]
        raise service_unavailable(f"The engine is dead: {first_line}")
    if not state.accepting or not llm.is_running:
        raise service_unavailable("The server is shutting down and accepts no new requests")


def require_runner(state: ServerState, runner: str, api: str) -> None:
    """vLLM's answer when the served model cannot serve this endpoint: a 400 naming the API."""
    current = state.llm.get_model_config().runner_type
    if current != runner:
        raise APIError(
            400,
            f"The model does not support {api} (it runs with runner {current!r}; this API needs "
            f"a model served with `--runner {runner}`)",
        )


async def read_body(request: Request, limit: int | None = None) -> bytes:
    """The body, read chunk by chunk; 413 as soon as it (or its Content-Length) passes `limit`
    (default `MAX_BODY_BYTES`)."""
    limit = MAX_BODY_BYTES if limit is None else limit
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"Request body too large: {declared} bytes (limit {limit})")
    chunks: list[bytes] = []
    size = 0
    try:
        async with aclosing(request.stream()) as body:  # closed at once when we stop early
            async for chunk in body:
                size += len(chunk)
                if size > limit:
                    raise APIError(413, f"Request body too large: over {limit} bytes")
                chunks.append(chunk)
    except ClientDisconnect:
        raise bad_request("The client disconnected while sending the request") from None
    return b"".join(chunks)


async def decode_body(request: Request, type_: type[T], limit: int | None = None) -> T:
    """The request body read (`read_body`) and decoded into `type_`; `decode_sized`."""
    return await decode_sized(await read_body(request, limit), type_)


async def decode_sized(body: bytes, type_: type[T]) -> T:
    """`body` decoded into `type_`: on the loop when small, else in a worker thread and in short
    pieces (json_pieces.py), so that a big chat or item list stalls neither the loop nor, through
    the GIL, every other stream while it is parsed."""
    if len(body) <= LARGE_BODY:
        return decode_request(body, type_)
    return await anyio.to_thread.run_sync(decode_in_pieces, body, type_)


def resolve_model(state: ServerState, name: str | None) -> str:
    """The served name the request asked for (none: the first base name): a base model's or a
    LoRA adapter's (`state.models`); 404 otherwise."""
    names = state.settings.served_model_names
    if name is None or name == "":
        return names[0]
    if not state.models.is_served(name):
        raise APIError(404, f"The model `{shorten(name, 100)}` does not exist.", "model")
    return name


def resolve_lora(state: ServerState, model: str) -> LoRARequest | None:
    """The adapter a resolved `model` names (None: a base model), taken when the request
    arrives: unloading the adapter later does not change what the request runs under."""
    return state.models.lora_request(model)


def api_key_id(request: Request) -> str:
    """The hash of the API key the request was accepted with (put in the scope's state under
    `API_KEY_ID` by APIKeyMiddleware, app.py), "" when the server has no key: what state kept
    between requests (the Responses store) is scoped to."""
    state = request.scope.get("state")
    return str(state.get(API_KEY_ID, "")) if isinstance(state, dict) else ""


def request_id_base(request: Request, request_id: str | None) -> str:
    """The client's id (body `request_id`, else the `X-Request-Id` header), else a fresh one;
    400 naming the field for an id over `MAX_REQUEST_ID_LEN` characters."""
    header = request.headers.get("x-request-id")
    for name, value in (("request_id", request_id), ("X-Request-Id", header)):
        if value is not None and len(value) > MAX_REQUEST_ID_LEN:
            raise bad_request(
                f"{name}: at most {MAX_REQUEST_ID_LEN} characters, got {len(value)}", name
            )
    return request_id or header or uuid.uuid4().hex


def start_timer(state: ServerState, model: str) -> RequestTimer | None:
    """The metrics' per-request timer (`state.metrics.request_started`), or None."""
    metrics = state.metrics
    return metrics.request_started(model) if metrics is not None else None


def output_kind(stream: bool, timer: RequestTimer | None) -> RequestOutputKind:
    """DELTA when streaming or timing tokens (TTFT/ITL); otherwise one final output."""
    return RequestOutputKind.DELTA if stream or timer is not None else RequestOutputKind.FINAL_ONLY


def created_now() -> int:
    return int(time.time())


def stream_flags(req: SamplingFields) -> tuple[bool, bool, bool]:
    """(stream, include_usage, continuous_usage_stats)."""
    stream = bool(req.stream)
    options = req.stream_options
    if options is None:
        return stream, False, False
    if not stream:
        raise bad_request(
            "Stream options can only be defined when `stream=True`.", "stream_options"
        )
    include_usage = bool(options.include_usage)
    # vLLM: usage on every chunk only together with the final usage chunk.
    return stream, include_usage, include_usage and bool(options.continuous_usage_stats)


def check_logprobs(state: ServerState, name: str, value: int | None) -> None:
    limit = state.settings.max_logprobs
    if value is not None and 0 <= limit < value:
        raise bad_request(f"{name}: {value} exceeds max_logprobs ({limit})", name)


def build_sampling_params(
    req: SamplingFields,
    defaults: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    kind: RequestOutputKind,
    prompt_logprobs: int | None = None,
    structured: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """SamplingParams from the request (ValueError naming the field when a value is invalid)."""
    overrides: dict[str, Any] = {
        name: getattr(req, name) for name in _OPTIONAL_FIELDS if getattr(req, name) is not None
    }
    overrides.update(
        n=req.n,
        max_tokens=max_tokens,
        min_tokens=req.min_tokens,
        ignore_eos=req.ignore_eos,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs if prompt_logprobs is not None else req.prompt_logprobs,
        skip_special_tokens=req.skip_special_tokens,
        spaces_between_special_tokens=req.spaces_between_special_tokens,
        include_stop_str_in_output=req.include_stop_str_in_output,
        output_kind=kind,
        structured_outputs=structured,
    )
    return SamplingParams.with_defaults(defaults, **overrides)


def beam_search_params(req: SamplingFields, max_tokens: int | None, max_model_len: int) -> BeamSearchParams | None:
    """vLLM's `use_beam_search`: `n` beams (None when the request does not ask for it); no
    max_tokens means up to the context length."""
    if not req.use_beam_search:
        return None
    if (
        req.structured_outputs is not None
        or req.response_format is not None
        and req.response_format.get("type", "text") != "text"
    ):
        raise bad_request("use_beam_search: cannot be combined with structured outputs", "use_beam_search")
    try:
        return BeamSearchParams(
            beam_width=req.n,
            max_tokens=max_model_len if max_tokens is None else max_tokens,
            ignore_eos=req.ignore_eos,
            temperature=req.temperature or 0.0,
            length_penalty=req.length_penalty,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
    except ValueError as exc:
        raise bad_request(str(exc)) from None


def truncate_prompt(token_ids: list[int], keep: int, max_model_len: int) -> list[int]:
    """vLLM's `truncate_prompt_tokens` for generation: the last `keep` prompt tokens (-1: the
    last max_model_len)."""
    if keep == -1:
        keep = max_model_len
    if keep == 0 or keep > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens: must be -1 or between 1 and max_model_len ({max_model_len}); got {keep}",
            "truncate_prompt_tokens",
        )
    return token_ids[-keep:]


def clamp_logprob(value: float) -> float:
    """JSON has no -inf (nor NaN): vLLM sends -9999.0 for them."""
    return value if value > -9999.0 and not math.isnan(value) else -9999.0


def prompt_logprobs_out(rows: PromptLogprobs | None) -> PromptLogprobsOut | None:
    if rows is None:
        return None
    return [
        None
        if row is None
        else {
            t: LogprobInfo(clamp_logprob(lp.logprob), lp.rank, lp.decoded_token)
            for t, lp in row.items()
        }
        for row in rows
    ]


def token_text(row: dict[int, Logprob] | None, token_id: int, tokenizer: Tokenizer) -> str:
    entry = None if row is None else row.get(token_id)
    if entry is not None and entry.decoded_token is not None:
        return entry.decoded_token
    return tokenizer.decode([token_id], skip_special_tokens=False)


# ------------------------------------------------------------------------------ chat


def resolve_chat_template(value: str | None) -> str | None:
    """`--chat-template` (settings.chat_template): the template itself or a file holding it
    (vLLM's flag). The server's operator names the file; a request's `chat_template` never
    comes here: it is always the template's text (`render_chat`'s `request_template`)."""
    if value is None or "{" in value or "\n" in value:
        return value
    path = Path(value)
    if path.is_file():
        return path.read_text(encoding="utf-8")
    return value


# At most this many requests' own templates render at once, each in a worker thread (per event
# loop: a RunVar), so a burst of hostile templates queues here rather than taking every thread.
REQUEST_TEMPLATE_THREADS = 4
_request_templates: RunVar[anyio.CapacityLimiter] = RunVar("triollm_request_templates")


async def render_chat(
    tokenizer: Tokenizer,
    messages: Sequence[ChatMessage],
    *,
    template: str | None,
    add_generation_prompt: bool,
    continue_final_message: bool,
    template_kwargs: dict[str, Any] | None,
    add_special_tokens: bool = False,
    tools: Sequence[dict[str, Any]] | None = None,
    documents: Sequence[dict[str, Any]] | None = None,
    request_template: str | None = None,
    content_format: str = "auto",
) -> tuple[str, list[int]]:
    """`Tokenizer.render_chat` for a request's messages, in a worker thread for large chats
    (`chat_size` of the messages, tools, documents and `template_kwargs` over `LARGE_TEXT`).
    Its ValueErrors name the field, so they become 400s with the right `param`. `tools` and
    `documents` reach the template as the variables of those names (transformers' and vLLM's).

    `template` is the server's (`--chat-template`, or None: the model's). `request_template`,
    a request's own `chat_template`, is its text, never a path: the tokenizer renders it under
    its counted budget, always in a worker thread (`REQUEST_TEMPLATE_THREADS` at once), so the
    event loop keeps answering while it runs; the budget is what ends it.

    `content_format` (`--chat-template-content-format`, vLLM's): how a message's content
    reaches the template: "string" (a list of parts joined into one text), "openai" (the list
    kept, and a plain string made one text part), "auto" (the list kept when the template loops
    over a message's content, `content_format_of`; strings stay strings)."""
    kwargs = dict(template_kwargs or {})
    if documents is not None:
        kwargs["documents"] = list(documents)
    source = request_template or template or tokenizer.chat_template or ""
    parts = (content_format if content_format != "auto" else content_format_of(source)) == "openai"
    wrap = content_format == "openai"

    def work() -> tuple[str, list[int]]:
        return tokenizer.render_chat(
            [_text_part(m.to_dict()) if wrap else m.to_dict() for m in messages],
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            chat_template=template if request_template is None else request_template,
            tools=tools,
            chat_template_kwargs=kwargs,
            add_special_tokens=add_special_tokens,
            content_parts=parts,
        )

    if request_template is not None:
        limiter = _request_templates.get(None)
        if limiter is None:
            limiter = anyio.CapacityLimiter(REQUEST_TEMPLATE_THREADS)
            _request_templates.set(limiter)
        return await anyio.to_thread.run_sync(work, limiter=limiter)
    size = chat_size(messages, kwargs, tools, stop_above=LARGE_TEXT)
    return await maybe_in_thread(work, size)


def _text_part(message: dict[str, Any]) -> dict[str, Any]:
    """vLLM's "openai" format: a plain string content becomes one text part."""
    content = message.get("content")
    return {**message, "content": [{"type": "text", "text": content}]} if isinstance(content, str) else message


@functools.lru_cache(maxsize=64)
def content_format_of(source: str) -> str:
    """"openai" when the template loops over a message's content (`for part in
    message['content']`, also through a variable set from it), else "string": vLLM's "auto".
    A template that does not parse is "string" (rendering it reports the error)."""
    try:
        tree = jinja2.Environment().parse(source)
    except jinja2.TemplateSyntaxError:
        return "string"
    names = {
        target.name
        for node in tree.find_all(jinja2.nodes.Assign)
        if _reads_content(node.node)
        for target in [node.target]
        if isinstance(target, jinja2.nodes.Name)
    }
    for loop in tree.find_all(jinja2.nodes.For):
        it = loop.iter
        if _reads_content(it) or (isinstance(it, jinja2.nodes.Name) and it.name in names):
            return "openai"
    return "string"


def _reads_content(node: jinja2.nodes.Node) -> bool:
    """`x['content']` or `x.content` (a filter over it too: `message['content'] | list`)."""
    while isinstance(node, jinja2.nodes.Filter) and node.node is not None:
        node = node.node
    if isinstance(node, jinja2.nodes.Getitem):
        return isinstance(node.arg, jinja2.nodes.Const) and node.arg.value == "content"
    return isinstance(node, jinja2.nodes.Getattr) and node.attr == "content"


async def maybe_in_thread(fn: Callable[[], R], size: int, threshold: int = LARGE_TEXT) -> R:
    if size > threshold:
        return await anyio.to_thread.run_sync(fn)
    return fn()


def items_size(value: object, stop_above: int = LARGE_TEXT) -> int:
    """A prompt list's size for `maybe_in_thread`: its items plus the lengths of those that are
    strings or lists (token ids), counted no further than just past `stop_above`."""
    if not isinstance(value, list | str):
        return 0
    if isinstance(value, str) or len(value) > stop_above:
        return len(value)
    total = len(value)
    for item in value:
        if isinstance(item, list | str):
            total += len(item)
            if total > stop_above:
                break
    return total


def chat_size(messages: Sequence[ChatMessage], *extra: object, stop_above: int | None = None) -> int:
    """What rendering `messages` (and the JSON values in `extra`: template kwargs, tools) costs,
    in characters: every string in them, plus `_MESSAGE_CHARS` per message and `_PART_CHARS`
    per content part or JSON value. With `stop_above`, the count stops as soon as it passes it
    (the walk then costs O(stop_above), however large the chat)."""
    limit = stop_above if stop_above is not None else math.inf
    total = 0
    for m in messages:
        total += _MESSAGE_CHARS + len(m.role) + len(m.name or "") + len(m.tool_call_id or "")
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            for part in m.content:
                total += _PART_CHARS + len(part.type) + len(part.text or "")
                if total > limit:
                    return total
        if m.tool_calls is not None:
            total += _json_size(m.tool_calls, limit - total)
        if total > limit:
            return total
    for value in extra:
        total += _json_size(value, limit - total)
        if total > limit:
            break
    return total


def _json_size(value: object, limit: float) -> int:
    """The strings in a decoded JSON value plus `_PART_CHARS` per value, walked without
    recursion and stopped once over `limit`."""
    total = 0
    stack = [value]
    while stack and total <= limit:
        item = stack.pop()
        total += _PART_CHARS
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            for key, child in item.items():
                total += _PART_CHARS + (len(key) if isinstance(key, str) else 0)
                stack.append(child)
                if total > limit:
                    break
        elif isinstance(item, list | tuple):
            # Each child costs at least _PART_CHARS: no more than this many can fit.
            room = int((limit - total) // _PART_CHARS) + 1 if limit != math.inf else len(item)
            stack.extend(item[:room])
    return total
