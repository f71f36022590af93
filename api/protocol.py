"""The OpenAI-compatible wire format as msgspec Structs (vLLM's field names and JSON shapes).

Requests: unknown fields are ignored (msgspec's default) and listed in one log line by
`decode_request`. JSON nested deeper than msgspec's recursion limit is a `msgspec.DecodeError`
(a 400), never the parser's `RecursionError` (a 500). Optional sampling fields default to None, meaning "the model's
generation_config.json default, else OpenAI's". Integers are bounded to int64 so no value
that passes decoding can overflow a tensor in the engine. Counts that the event loop would
walk are bounded here too (`MAX_CHAT_MESSAGES`, `MAX_CONTENT_PARTS`, `MAX_ROLE_LEN`), so an
absurd chat is a 400 naming the field at decoding, before anything is rendered.

Responses: fields OpenAI sends as `null` are present as `null`; stream chunks omit `usage`
unless it is set, and deltas omit unset `role`/`content` (as vLLM does).
"""

from __future__ import annotations

import logging
from typing import Annotated, Any, TypeVar

import msgspec

__all__ = [
    "MAX_CHAT_MESSAGES",
    "MAX_CONTENT_PARTS",
    "MAX_ROLE_LEN",
    "ChatCompletionChunk",
    "ChatCompletionRequest",
    "ChatCompletionResponse",
    "CompletionRequest",
    "CompletionResponse",
    "CompletionStreamResponse",
    "decode_json",
    "decode_request",
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


class CompletionRequest(SamplingFields, kw_only=True):
    # A string, a list of strings, a list of token ids or a list of token-id lists.
    prompt: str | list[str | Int64 | TokenIds]
    max_tokens: Int64 | None = 16
    logprobs: NonNegInt | None = None
    echo: bool | None = False
    suffix: str | None = None
    best_of: Int64 | None = None


class ContentPart(msgspec.Struct, kw_only=True):
    type: str = "text"
    text: str | None = None


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
            out["content"] = [{"type": p.type, "text": p.text} for p in self.content]
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


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    tokens: TokenIds
    model: str | None = None


# =============================================================================== responses


class UsageInfo(msgspec.Struct):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


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
