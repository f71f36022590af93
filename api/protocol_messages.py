"""Anthropic's Messages API (`/v1/messages`, `/v1/messages/count_tokens`) wire format as msgspec
Structs: the requests, the `message` object with its content blocks, and the stream events
(the error body is openai_errors.py's `AnthropicErrorResponse`).

Shapes follow the `anthropic` client's types (`anthropic.types`), which is what clients parse:
every block, delta and event carries its `type` first (blocks and deltas are tagged unions;
events have a `type` field, which the SSE framing also writes as the `event:` line), and
fields Anthropic sends as `null` (`stop_reason` while streaming, `stop_sequence`) are present
as `null`.

Request: `system`, the messages' content blocks, `tools`, `tool_choice`, `thinking` and
`output_config` are decoded loosely here (JSON objects, counted and depth-checked) and checked
one by one where they are converted to a chat (serving_messages.py), so a bad block is a 400
naming `messages[i].content[j]` and its field, with the allowed values.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec

from triollm.api.protocol import MAX_CHAT_MESSAGES, MAX_CONTENT_PARTS, MAX_ROLE_LEN, Int64, check_json_depth

__all__ = [
    "ContentBlock",
    "ContentBlockDeltaEvent",
    "ContentBlockStartEvent",
    "ContentBlockStopEvent",
    "CountTokensRequest",
    "InputJsonDelta",
    "InputMessage",
    "MessageDelta",
    "MessageDeltaEvent",
    "MessageDeltaUsage",
    "MessageResponse",
    "MessageStartEvent",
    "MessageStopEvent",
    "MessageStreamEvent",
    "MessageUsage",
    "MessagesRequest",
    "TextBlock",
    "TextDelta",
    "ThinkingBlock",
    "ThinkingDelta",
    "TokensCount",
    "ToolUseBlock",
]

PositiveInt = Annotated[int, msgspec.Meta(ge=1, le=2**63 - 1)]
Blocks = Annotated[list[dict[str, Any]], msgspec.Meta(max_length=MAX_CONTENT_PARTS)]

# =============================================================================== requests


class InputMessage(msgspec.Struct, kw_only=True):
    """One turn: `user` or `assistant`, its content a string or a list of blocks (`text`,
    `tool_use`, `tool_result`, `thinking`; checked in serving_messages.py)."""

    role: Annotated[str, msgspec.Meta(max_length=MAX_ROLE_LEN)]
    content: str | Blocks


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """`POST /v1/messages/count_tokens`: the conversation whose prompt is counted."""

    model: str
    messages: Annotated[list[InputMessage], msgspec.Meta(min_length=1, max_length=MAX_CHAT_MESSAGES)]
    system: str | Blocks | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: dict[str, Any] | None = None
    thinking: dict[str, Any] | None = None

    @property
    def request_id(self) -> str | None:
        """Anthropic's requests carry no id of their own (the `X-Request-Id` header may)."""
        return None

    def __post_init__(self) -> None:
        for name in ("system", "tools", "tool_choice", "thinking"):
            check_json_depth(getattr(self, name), name)
        for i, message in enumerate(self.messages):
            check_json_depth(message.content, f"messages[{i}].content", "messages")


class MessagesRequest(CountTokensRequest, kw_only=True):
    """`POST /v1/messages`. `max_tokens` is required, as Anthropic has it."""

    max_tokens: PositiveInt
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: Int64 | None = None
    metadata: dict[str, Any] | None = None
    # `format` ({"type": "json_schema", "schema": ...}): structured outputs; `effort` ignored.
    output_config: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        check_json_depth(self.output_config, "output_config")


# =============================================================================== responses


class TextBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="text"):
    text: str


class ThinkingBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking"):
    """Reasoning the server's reasoning parser split off. `signature` is empty: nothing here
    signs it (a client sends the block back as it got it, and it is not shown to the model)."""

    thinking: str
    signature: str = ""


class ToolUseBlock(msgspec.Struct, kw_only=True, tag_field="type", tag="tool_use"):
    id: str  # toolu_...
    name: str
    input: dict[str, Any]


ContentBlock = TextBlock | ThinkingBlock | ToolUseBlock


class MessageUsage(msgspec.Struct, kw_only=True):
    input_tokens: int
    output_tokens: int


class MessageResponse(msgspec.Struct, kw_only=True):
    """The `message` object. `stop_reason`: "end_turn", "max_tokens", "stop_sequence" (then
    `stop_sequence` is the one matched) or "tool_use"; null only in `message_start`."""

    id: str  # msg_...
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[ContentBlock]
    model: str
    stop_reason: str | None
    stop_sequence: str | None
    usage: MessageUsage


class TokensCount(msgspec.Struct, kw_only=True):
    """The answer of `count_tokens`: the prompt's tokens as the generation would see them."""

    input_tokens: int


# ----------------------------------------------------------------------------- stream events


class TextDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="text_delta"):
    text: str


class ThinkingDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="thinking_delta"):
    thinking: str


class InputJsonDelta(msgspec.Struct, kw_only=True, tag_field="type", tag="input_json_delta"):
    """A piece of a tool call's `input` as JSON text; the pieces of a block add up to it."""

    partial_json: str


class MessageStartEvent(msgspec.Struct, kw_only=True):
    type: Literal["message_start"] = "message_start"
    message: MessageResponse


class ContentBlockStartEvent(msgspec.Struct, kw_only=True):
    type: Literal["content_block_start"] = "content_block_start"
    index: int
    content_block: ContentBlock


class ContentBlockDeltaEvent(msgspec.Struct, kw_only=True):
    type: Literal["content_block_delta"] = "content_block_delta"
    index: int
    delta: TextDelta | ThinkingDelta | InputJsonDelta


class ContentBlockStopEvent(msgspec.Struct, kw_only=True):
    type: Literal["content_block_stop"] = "content_block_stop"
    index: int


class MessageDelta(msgspec.Struct, kw_only=True):
    stop_reason: str | None
    stop_sequence: str | None


class MessageDeltaUsage(msgspec.Struct, kw_only=True):
    """Totals so far (Anthropic's counts on `message_delta` are cumulative)."""

    input_tokens: int
    output_tokens: int


class MessageDeltaEvent(msgspec.Struct, kw_only=True):
    type: Literal["message_delta"] = "message_delta"
    delta: MessageDelta
    usage: MessageDeltaUsage


class MessageStopEvent(msgspec.Struct, kw_only=True):
    type: Literal["message_stop"] = "message_stop"


MessageStreamEvent = (
    MessageStartEvent
    | ContentBlockStartEvent
    | ContentBlockDeltaEvent
    | ContentBlockStopEvent
    | MessageDeltaEvent
    | MessageStopEvent
)
