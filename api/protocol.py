"""The OpenAI-compatible wire format as msgspec Structs (vLLM's field names and JSON shapes).

Requests: unknown fields are ignored (msgspec's default) and listed in one log line by
`decode_request`. JSON nested deeper than msgspec's recursion limit is a `msgspec.DecodeError`
(a 400), never the parser's `RecursionError` (a 500). Optional sampling fields default to None,
meaning "the model's generation_config.json default, else OpenAI's". Integers are bounded to
int64 so no value that passes decoding can overflow a tensor in the engine. Counts that the
event loop would walk are bounded here too (`MAX_CHAT_MESSAGES`, `MAX_CONTENT_PARTS`,
`MAX_ROLE_LEN`), so an absurd chat is a 400 naming the field at decoding, before anything is
rendered.

Depth. The free-form JSON of a request (tools and their schemas, `tool_calls` and the JSON text
of their `function.arguments`, `response_format`, template variables) nests at most
`MAX_JSON_DEPTH` containers deep, checked when the request is decoded (`__post_init__`) by walks
that do not recurse; deeper is a 400 naming the field (`messages[2].tool_calls[0].function.
arguments: nested deeper than 64 levels`). Every later walk over those values (the chat
template's `tojson`, `json.loads` of the arguments, the grammar converter, the Responses store's
encoder) recurses once per level, so it stays far from Python's recursion limit wherever it
runs. The tool-call parsers hold the calls they read from model output to the same depth, so a
call the model made can always be sent back. Rejected: catching `RecursionError` where it
happens (it is raised wherever the stack runs out, inside Jinja or msgspec, and names no field).

Responses: fields OpenAI sends as `null` are present as `null`; stream chunks omit `usage`
unless it is set, and deltas omit unset `role`/`content` (as vLLM does).
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable, Sequence
from itertools import accumulate
from typing import Annotated, Any, TypeVar

import msgspec

from triollm.api.openai_errors import bad_request

__all__ = [
    "MAX_CHAT_MESSAGES",
    "MAX_CONTENT_PARTS",
    "MAX_JSON_DEPTH",
    "MAX_ROLE_LEN",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "check_json_depth",
    "check_json_text_depth",
    "check_messages",
    "decode_json",
    "decode_request",
    "json_text_depth",
    "json_value_depth",
]

log = logging.getLogger("triollm.api")

Int64 = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
NonNegInt = Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)]
# OpenAI's own limit on n; each choice is a sequence in the engine.
NumChoices = Annotated[int, msgspec.Meta(ge=1, le=128)]
TokenIds = list[Int64]
# Messages in one chat and content parts in one message (far above any real conversation: each
# message costs a few template tokens at least), and the length of a role (copied into every
# choice of the answer).
MAX_CHAT_MESSAGES = 8192
MAX_CONTENT_PARTS = 1024
MAX_ROLE_LEN = 256
# Containers in containers, in the free-form JSON of a request and in a tool call's arguments
# (see the module docstring). Real tool arguments and schemas nest a handful of levels.
MAX_JSON_DEPTH = 64

T = TypeVar("T")


def decode_json(body: bytes, type_: type[T]) -> T:
    """`msgspec.json.decode`, with too deep a nesting reported as the malformed JSON it is."""
    try:
        return msgspec.json.decode(body, type=type_)
    except RecursionError:
        raise msgspec.DecodeError("JSON is nested too deeply") from None


def decode_request(body: bytes, type_: type[T]) -> T:
    """Decode a JSON request body; log (once) the top-level fields that were ignored."""
    request = decode_json(body, type_)
    known: tuple[str, ...] = getattr(type_, "__struct_fields__", ())
    keys = decode_json(body, dict[str, msgspec.Raw])
    unknown = sorted(k for k in keys if k not in known)
    if unknown:  # client-chosen names: bounded, so a request cannot flood the log
        shown = [name[:64] for name in unknown[:16]]
        more = f" (and {len(unknown) - 16} more)" if len(unknown) > 16 else ""
        log.warning(
            "The following fields were present in the request but ignored: %s%s", shown, more
        )
    return request


# ================================================================================= depth

_CONTAINERS = (dict, list)
_JSON_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"')
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_BRACKET_STEP = {"[": 1, "{": 1, "]": -1, "}": -1}
_PATH_STEPS = 4  # how much of the way to a too-deep value an error shows
_PLAIN_KEY = re.compile(r"[\w$@-]{1,64}")


def json_text_depth(text: str) -> int:
    """How deeply the brackets of JSON `text` nest outside its strings, without parsing it and
    without recursion (in C-speed passes: strings cut out, then a running sum over the brackets).
    For text that is not JSON it is an upper bound (an unterminated string's brackets count)."""
    if text.count("[") + text.count("{") <= 1:
        return 1 if "[" in text or "{" in text else 0
    brackets = _NOT_BRACKET.sub("", _JSON_STRING.sub("", text))
    return max(accumulate(map(_BRACKET_STEP.__getitem__, brackets)), default=0)


def json_value_depth(value: Any, limit: int = MAX_JSON_DEPTH) -> int:
    """How deeply decoded JSON `value` nests (a scalar 0, `[]` 1), counted level by level without
    recursion; it stops at `limit + 1`."""
    level = [value] if type(value) in _CONTAINERS else []
    depth = 0
    while level and depth <= limit:
        depth += 1
        below: list[Any] = []
        for item in level:
            children = item.values() if type(item) is dict else item
            below.extend(child for child in children if type(child) in _CONTAINERS)
        level = below
    return depth


def check_json_depth(value: Any, where: str, param: str | None = None) -> None:
    """A 400 naming `where` (and the first steps of the way to the deepest value) when decoded
    JSON `value` nests more than `MAX_JSON_DEPTH` levels; `param` is the error's `param`."""
    if json_value_depth(value) > MAX_JSON_DEPTH:
        path = _path_below(value, MAX_JSON_DEPTH)
        raise bad_request(f"{where}{path}: nested deeper than {MAX_JSON_DEPTH} levels", param or where)


def check_json_text_depth(text: str, where: str, param: str | None = None) -> None:
    """A 400 naming `where` when JSON `text` (a tool call's `arguments`, say) nests more than
    `MAX_JSON_DEPTH` levels."""
    if json_text_depth(text) > MAX_JSON_DEPTH:
        raise bad_request(f"{where}: nested deeper than {MAX_JSON_DEPTH} levels", param or where)


def _path_below(value: Any, limit: int) -> str:
    """The first `_PATH_STEPS` steps of the way to a container deeper than `limit` (depth first,
    without recursion; only called once the value is known to be that deep)."""
    stack: list[tuple[Any, int, str]] = [(value, 1, "")]
    while stack:
        item, depth, path = stack.pop()
        if depth > limit:
            return path
        pairs: Iterable[tuple[Any, Any]] = item.items() if type(item) is dict else enumerate(item)
        for key, child in pairs:
            if type(child) in _CONTAINERS:
                step = path + _step(key) if depth <= _PATH_STEPS else path
                stack.append((child, depth + 1, step))
    return ""


def _step(key: Any) -> str:
    if isinstance(key, int):
        return f"[{key}]"
    return f".{key}" if _PLAIN_KEY.fullmatch(key) else ".…"


def check_messages(messages: Sequence[ChatMessage], field: str = "messages") -> None:
    """The depth of each message's `tool_calls` and of the JSON text of their arguments."""
    for i, message in enumerate(messages):
        calls = message.tool_calls
        if calls is None:
            continue
        where = f"{field}[{i}].tool_calls"
        check_json_depth(calls, where, field)
        for j, call in enumerate(calls):
            function = call.get("function")
            arguments = function.get("arguments") if isinstance(function, dict) else None
            if isinstance(arguments, str):
                check_json_text_depth(arguments, f"{where}[{j}].function.arguments", field)


def _check_fields(request: msgspec.Struct, names: tuple[str, ...]) -> None:
    for name in names:
        check_json_depth(getattr(request, name), name)


# =============================================================================== requests


class StreamOptions(msgspec.Struct, kw_only=True):
    include_usage: bool | None = True
    continuous_usage_stats: bool | None = False


class SamplingFields(msgspec.Struct, kw_only=True):
    """Fields shared by completions and chat (OpenAI's and vLLM's extra sampling fields)."""

    model: str | None = None
    n: NumChoices = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: Int64 | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # --- vLLM extras (the openai client sends them through `extra_body`)
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: NonNegInt = 0
    ignore_eos: bool = False
    stop_token_ids: TokenIds | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    allowed_token_ids: TokenIds | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: NonNegInt | None = None
    priority: Int64 = 0
    request_id: str | None = None
    # keep the last k prompt tokens (-1: the last max_model_len), vLLM's left truncation
    truncate_prompt_tokens: Annotated[int, msgspec.Meta(ge=-1, le=2**63 - 1)] | None = None
    return_tokens_as_token_ids: bool | None = None
    # --- structured outputs (engine/structured_outputs.py): OpenAI's response_format, vLLM's
    # structured_outputs object, and vLLM's older guided_* names
    response_format: dict[str, Any] | None = None
    structured_outputs: dict[str, Any] | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_whitespace_pattern: str | None = None
    guided_decoding_backend: str | None = None  # accepted, ignored: llguidance is the backend
    # --- beam search (vLLM's extra fields): n is the beam width
    use_beam_search: bool = False
    length_penalty: float = 1.0

    def __post_init__(self) -> None:
        _check_fields(self, ("response_format", "structured_outputs", "guided_json"))


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids or a list of token-id lists.
    prompt: str | list[str | Int64 | TokenIds]
    max_tokens: Int64 | None = 16
    logprobs: NonNegInt | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Int64 | None = None


class ImageURL(msgspec.Struct, kw_only=True):
    url: str  # a data: URL (file:// under --allowed-local-media-path)
    detail: str | None = None  # OpenAI's; accepted, ignored


class ContentPart(msgspec.Struct, kw_only=True):
    type: str = "text"
    text: str | None = None
    image_url: ImageURL | None = None  # an "image_url" part (a vision-language model)


class ChatMessage(msgspec.Struct, kw_only=True):
    role: Annotated[str, msgspec.Meta(max_length=MAX_ROLE_LEN)]
    content: str | Annotated[list[ContentPart], msgspec.Meta(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """The message as the chat template sees it."""
        out: dict[str, Any] = {"role": self.role}
        if isinstance(self.content, list):
            out["content"] = [
                {"type": p.type, "text": p.text}
                if p.image_url is None
                else {"type": p.type, "image_url": {"url": p.image_url.url}}
                for p in self.content
            ]
        else:
            out["content"] = self.content if self.content is not None else ""
        for key in ("name", "tool_call_id", "tool_calls"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        return out


Messages = Annotated[list[ChatMessage], msgspec.Meta(min_length=1, max_length=MAX_CHAT_MESSAGES)]


class ChatCompletionRequest(SamplingFields, kw_only=True):
    messages: Messages
    max_tokens: Int64 | None = None
    max_completion_tokens: Int64 | None = None
    logprobs: bool | None = False
    top_logprobs: NonNegInt | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    # --- vLLM extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    documents: list[dict[str, Any]] | None = None
    add_special_tokens: bool = False
    echo: bool = False
    include_reasoning: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        check_messages(self.messages)
        _check_fields(self, ("tools", "tool_choice", "chat_template_kwargs", "documents"))


class TokenizeCompletionRequest(msgspec.Struct, kw_only=True):
    prompt: str
    model: str | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(msgspec.Struct, kw_only=True):
    messages: Messages
    model: str | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False

    def __post_init__(self) -> None:
        check_messages(self.messages)
        _check_fields(self, ("chat_template_kwargs",))


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: TokenIds
    model: str | None = None


# =============================================================================== responses


class PromptTokensDetails(msgspec.Struct):
    cached_tokens: int  # prompt tokens the prefix cache held (not computed again)


class UsageInfo(msgspec.Struct, omit_defaults=True):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    # With `--enable-prompt-tokens-details` only (vLLM's): absent otherwise.
    prompt_tokens_details: PromptTokensDetails | None = None


class LogprobInfo(msgspec.Struct):
    """vLLM's prompt_logprobs entry (keyed by token id)."""

    logprob: float
    rank: int | None
    decoded_token: str | None


PromptLogprobsOut = list[dict[int, LogprobInfo] | None]


class CompletionLogProbs(msgspec.Struct):
    text_offset: list[int]
    token_logprobs: list[float | None]
    tokens: list[str]
    top_logprobs: list[dict[str, float] | None]


class CompletionChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None
    prompt_logprobs: PromptLogprobsOut | None = None


class CompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class CompletionStreamChoice(msgspec.Struct):
    index: int
    text: str
    logprobs: CompletionLogProbs | None
    finish_reason: str | None
    stop_reason: int | str | None


class CompletionStreamResponse(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[CompletionStreamChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None


class ChatLogprob(msgspec.Struct):
    token: str
    logprob: float
    bytes: list[int] | None
    top_logprobs: list[ChatTopLogprob]


class ChatLogprobs(msgspec.Struct):
    content: list[ChatLogprob] | None


class FunctionCall(msgspec.Struct):
    name: str
    arguments: str  # a JSON object, as a string (OpenAI's shape)


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: str = "function"
    function: FunctionCall


class DeltaFunctionCall(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One piece of a streamed tool call: the first piece of call `index` carries its `id`,
    `type` and `function.name`; later ones pieces of `function.arguments`."""

    index: int
    id: str | None = None
    type: str | None = None
    function: DeltaFunctionCall | None = None


class ChatResponseMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None
    # vLLM's current name is `reasoning`; `reasoning_content` (its earlier name, still read by
    # many clients) carries the same text.
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = msgspec.field(default_factory=list)


class ChatChoice(msgspec.Struct):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None


class ChatCompletionResponse(msgspec.Struct, kw_only=True):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobsOut | None = None


class DeltaMessage(msgspec.Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    reasoning: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(msgspec.Struct):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None
    finish_reason: str | None
    stop_reason: int | str | None = None


class ChatCompletionChunk(msgspec.Struct, omit_defaults=True):
    id: str
    object: str
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(msgspec.Struct, kw_only=True):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "triollm"
    root: str | None = None
    parent: str | None = None
    max_model_len: int


class ModelList(msgspec.Struct, kw_only=True):
    object: str = "list"
    data: list[ModelCard]


class TokenizeResponse(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeResponse(msgspec.Struct):
    prompt: str


class VersionResponse(msgspec.Struct):
    version: str
