"""The OpenAI Responses API (`/v1/responses`) wire format as msgspec Structs: the request, the
`response` object with its output items, and the stream events.

Shapes follow the `openai` client's types (`openai.types.responses`), which is what clients
parse: output items and content parts are tagged by `type` (msgspec writes the tag first),
fields OpenAI sends as `null` are present as `null`, and every stream event carries its
`type` and a `sequence_number`.

Request: `input` items are decoded loosely here (a list of JSON objects, counted) and checked
one by one in serving_responses.py, so a bad item is a 400 naming `input[i]` and its field.
"""

from __future__ import annotations

from typing import Annotated, Any

import msgspec

from triollm.api.protocol import MAX_CHAT_MESSAGES, Int64, check_json_depth, check_json_text_depth

__all__ = [
    "ContentPartEvent",
    "DeletedResponse",
    "FunctionCallArgumentsDeltaEvent",
    "FunctionCallArgumentsDoneEvent",
    "FunctionCallItem",
    "FunctionCallOutputItem",
    "FunctionTool",
    "InputMessage",
    "InputTokensDetails",
    "OutputItem",
    "OutputItemEvent",
    "OutputMessage",
    "OutputText",
    "OutputTokensDetails",
    "ReasoningConfig",
    "ReasoningItem",
    "ReasoningText",
    "ReasoningTextDeltaEvent",
    "ReasoningTextDoneEvent",
    "ResponseEvent",
    "ResponseObject",
    "ResponseUsage",
    "ResponsesRequest",
    "TextDeltaEvent",
    "TextDoneEvent",
]

# =============================================================================== requests

# OpenAI's bounds on `metadata`: at most 16 pairs, keys of at most 64 characters, values of 512.
Metadata = Annotated[
    dict[Annotated[str, msgspec.Meta(max_length=64)], Annotated[str, msgspec.Meta(max_length=512)]],
    msgspec.Meta(max_length=16),
]
_Name = Annotated[str, msgspec.Meta(max_length=64)]


class ReasoningConfig(msgspec.Struct, kw_only=True):
    """`reasoning` of a request, echoed in its response: OpenAI's fields, any other key dropped
    at decoding (the stored response holds what it validated, not what the client sent)."""

    effort: _Name | None = None
    summary: _Name | None = None
    generate_summary: _Name | None = None


class ResponsesRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/responses`. OpenAI's fields, plus vLLM's sampling extras (`top_k`, `min_p`,
    `repetition_penalty`, `seed`, `stop`, `priority`, `request_id`) that vLLM also accepts
    here. `reasoning`, `include`, `truncation`, `service_tier`, `user` and the prompt-cache
    fields are accepted and echoed or ignored (nothing here acts on them)."""

    input: str | Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_CHAT_MESSAGES)]
    model: str | None = None
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    max_output_tokens: Int64 | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: dict[str, Any] | None = None
    stream: bool | None = False
    store: bool | None = True
    previous_response_id: str | None = None
    metadata: Metadata | None = None
    user: str | None = None
    reasoning: ReasoningConfig | None = None
    include: list[str] | None = None
    truncation: str | None = None
    background: bool | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # --- vLLM extras
    top_k: Int64 | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: Int64 | None = None
    stop: str | list[str] | None = None
    priority: Int64 = 0
    request_id: str | None = None

    def __post_init__(self) -> None:
        # Free-form JSON, a function call's arguments included, nests at most MAX_JSON_DEPTH
        # levels (api/protocol.py): a 400 naming the field before anything walks it.
        for name in ("input", "tools", "tool_choice", "text"):
            check_json_depth(getattr(self, name), name)
        for i, item in enumerate(self.input if isinstance(self.input, list) else ()):
            arguments = item.get("arguments") if item.get("type") == "function_call" else None
            if isinstance(arguments, str):
                check_json_text_depth(arguments, f"input[{i}].arguments", "input")


class InputMessage(msgspec.Struct, kw_only=True):
    """A message item of `input` (`type` "message", or no type: OpenAI's easy input message)."""

    role: str
    content: str | list[dict[str, Any]]
    type: str = "message"
    id: str | None = None
    status: str | None = None


class FunctionCallOutputItem(msgspec.Struct, kw_only=True):
    """A `function_call_output` item of `input`: a tool's result for `call_id`."""

    call_id: str
    output: str | list[dict[str, Any]]
    type: str = "function_call_output"
    id: str | None = None
    status: str | None = None


# =============================================================================== responses


class FunctionTool(msgspec.Struct, kw_only=True, tag_field="type", tag="function"):
    """A function tool, Responses' flat shape (the chat API nests it under `function`)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class OutputText(msgspec.Struct, kw_only=True, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = msgspec.field(default_factory=list)
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningText(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning_text"):
    text: str


class OutputMessage(msgspec.Struct, kw_only=True, tag_field="type", tag="message"):
    id: str
    status: str  # "in_progress" | "completed" | "incomplete"
    role: str = "assistant"
    content: list[OutputText] = msgspec.field(default_factory=list)


class FunctionCallItem(msgspec.Struct, kw_only=True, tag_field="type", tag="function_call"):
    """A call the model made (an output item), and the same item sent back in a later `input`
    (where `id` and `status` may be missing)."""

    call_id: str
    name: str
    arguments: str  # a JSON object, as a string
    id: str | None = None
    status: str | None = "completed"


class ReasoningItem(msgspec.Struct, kw_only=True, tag_field="type", tag="reasoning"):
    id: str
    summary: list[Any] = msgspec.field(default_factory=list)
    content: list[ReasoningText] = msgspec.field(default_factory=list)
    encrypted_content: str | None = None
    status: str | None = "completed"


OutputItem = OutputMessage | FunctionCallItem | ReasoningItem


class InputTokensDetails(msgspec.Struct):
    cached_tokens: int = 0
    cache_write_tokens: int = 0


class OutputTokensDetails(msgspec.Struct):
    reasoning_tokens: int = 0


class ResponseUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(msgspec.Struct, kw_only=True):
    """The `response` object (`GET /v1/responses/{id}`, the non-streamed answer, and the
    `response` of the lifecycle events)."""

    id: str
    object: str = "response"
    created_at: int
    status: str  # "in_progress" | "completed" | "incomplete" | "cancelled"
    background: bool = False
    error: dict[str, Any] | None = None
    incomplete_details: dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    max_tool_calls: int | None = None
    model: str
    output: list[OutputItem] = msgspec.field(default_factory=list)
    parallel_tool_calls: bool = True
    previous_response_id: str | None = None
    reasoning: ReasoningConfig | None = None
    store: bool = True
    temperature: float | None = None
    text: dict[str, Any] = msgspec.field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[FunctionTool] = msgspec.field(default_factory=list)
    top_p: float | None = None
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    user: str | None = None
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    completed_at: int | None = None


class DeletedResponse(msgspec.Struct):
    id: str
    object: str = "response"
    deleted: bool = True


# =============================================================================== stream events


class ResponseEvent(msgspec.Struct, kw_only=True):
    """`response.created`, `.in_progress`, `.completed`, `.incomplete`."""

    type: str
    sequence_number: int
    response: ResponseObject


class OutputItemEvent(msgspec.Struct, kw_only=True):
    """`response.output_item.added` / `.done`."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(msgspec.Struct, kw_only=True):
    """`response.content_part.added` / `.done`."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText | ReasoningText


class TextDeltaEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class TextDoneEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = msgspec.field(default_factory=list)


class ReasoningTextDeltaEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str


class ReasoningTextDoneEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str


class FunctionCallArgumentsDeltaEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class FunctionCallArgumentsDoneEvent(msgspec.Struct, kw_only=True):
    type: str
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str
