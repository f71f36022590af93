"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, as a chat.

An Anthropic request is converted into the chat route's own request (`chat_request`) and run
by the chat route's machinery (`chat_generation` of serving_chat.py: the chat template, tools
and tool choice, the tool-call and reasoning parsers, structured outputs), and the chat
answer it gives is converted back (`MessagesFormatter`, wrapping the chat's formatter). There
is no second copy of the chat path: what the chat route does with a chat, this route does
with the same chat.

Request -> chat is messages_convert.py's (what each field becomes there, and what is refused:
image and document blocks, server tools, ...).

Chat answer -> message: the reasoning is a `thinking` block, the content a `text` block, each
call a `tool_use` block (`toolu_...` ids); `stop_reason` is "max_tokens" for the token limit,
"tool_use" when the answer calls a tool, "stop_sequence" (with `stop_sequence`) when a stop
string ended it, else "end_turn". Streamed, the events are Anthropic's, in its order:
`message_start`, then per block `content_block_start`, its deltas (`text_delta`,
`thinking_delta`, `input_json_delta`) and `content_block_stop`, then `message_delta` (the stop
reason and the usage) and `message_stop`; each as `event: TYPE` and `data:` lines with no
`[DONE]`. An answer with nothing in it is one empty text block, streamed or not.

Errors on these routes are in Anthropic's shape (`as_anthropic`, api/openai_errors.py), from
the app's guard and from the generation alike.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from triollm.api.messages_convert import chat_request
from triollm.api.openai_errors import APIError, as_anthropic, bad_request
from triollm.api.protocol import DeltaMessage
from triollm.api.protocol_messages import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    InputJsonDelta,
    MessageDelta,
    MessageDeltaEvent,
    MessageDeltaUsage,
    MessageResponse,
    MessagesRequest,
    MessageStartEvent,
    MessageStopEvent,
    MessageUsage,
    TextBlock,
    TextDelta,
    ThinkingBlock,
    ThinkingDelta,
    TokensCount,
    ToolUseBlock,
)
from triollm.api.serving_chat import ChatFormatter, chat_generation, render_chat_request, with_default_template_kwargs
from triollm.api.serving_common import (
    LARGE_BODY,
    Started,
    decode_sized,
    maybe_in_thread,
    read_body,
    resolve_model,
    start_generation,
)
from triollm.api.sse import GenerationResponse
from triollm.api.state import ServerState
from triollm.engine.outputs import RequestOutput

__all__ = ["MessagesFormatter", "count_message_tokens", "create_message", "stop_reason"]

log = logging.getLogger("triollm.api")

_encoder = msgspec.json.Encoder()


# ------------------------------------------------------------------------------ the routes


async def create_message(state: ServerState, request: Request, chat_template: str | None) -> Response:
    start = await start_generation(state, request, MessagesRequest, api="Messages API", id_prefix="msg_")
    req = start.req
    # A large body's blocks (thousands, each checked) are converted off the loop.
    chat = await maybe_in_thread(lambda: chat_request(req), start.body_bytes, LARGE_BODY)
    as_chat = Started(chat, start.model, start.lora, start.request_id, start.timer, start.body_bytes)
    try:
        job, formatter = await chat_generation(state, as_chat, chat_template)
    except APIError as exc:
        if exc.param != "response_format":
            raise
        # The chat route names its own field; the client sent output_config.format.
        raise bad_request(exc.message.replace("response_format", "output_config.format"), "output_config") from None
    return GenerationResponse(
        state.llm,
        [job],
        MessagesFormatter(formatter),
        stream=req.stream,
        label=start.request_id,
        timer=start.timer,
        admission=state.admission,
        error_shape=as_anthropic,
        trace=start.trace,
        model=start.model,
    )


async def count_message_tokens(state: ServerState, request: Request, chat_template: str | None) -> Response:
    """The prompt's tokens exactly as `create_message` renders the same conversation."""
    body = await read_body(request)
    req = await decode_sized(body, CountTokensRequest)
    resolve_model(state, req.model)
    chat = await maybe_in_thread(lambda: chat_request(req), len(body), LARGE_BODY)
    chat = with_default_template_kwargs(chat, state.settings)
    _, token_ids = await render_chat_request(
        state.llm.get_tokenizer(), chat, chat_template, content_format=state.settings.chat_template_content_format
    )
    return Response(_encoder.encode(TokensCount(input_tokens=len(token_ids))), media_type="application/json")


# ------------------------------------------------------------------------------ answer side


def stop_reason(finish_reason: str | None, matched: int | str | None, called: bool) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a chat choice's finish: the token limit,
    a tool call, a stop string (the engine's `stop_reason` is then the string), else the end of
    the turn (the model's end token)."""
    if finish_reason == "length":
        return "max_tokens", None
    if called:
        return "tool_use", None
    if finish_reason == "stop" and isinstance(matched, str):
        return "stop_sequence", matched
    return "end_turn", None


def _tool_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def _tool_input(arguments: str, name: str) -> dict[str, Any]:
    """A call's arguments as its `input` object (the parsers give JSON objects; anything else
    is logged and sent as `{}`)."""
    try:
        value = msgspec.json.decode(arguments or "{}")
    except msgspec.DecodeError:
        value = None
    if isinstance(value, dict):
        return value
    log.warning("tool call %r: arguments are not a JSON object; sent as {}", name[:64])
    return {}


@dataclass
class _Block:
    """A content block being streamed."""

    kind: str  # "text" | "thinking" | "tool_use"
    index: int
    tool_index: int = -1  # the chat's index of the call


class MessagesFormatter:
    """The `Formatter` of api/sse.py for one message: the chat's formatter reads the engine's
    outputs (parsers and all), this one turns its answer into Anthropic's `message` or its
    stream events (`event: TYPE` lines, no `[DONE]`)."""

    named_events = True

    def __init__(self, chat: ChatFormatter) -> None:
        if chat.n != 1:
            raise ValueError(f"n: the Messages API answers one choice; got {chat.n}")
        self.chat = chat
        self.blocks: list[_Block] = []
        self.open: _Block | None = None
        self.finish_reason: str | None = None
        self.matched: int | str | None = None

    # ------------------------------------------------------------------ non-streaming

    def final(self, outputs: list[RequestOutput]) -> MessageResponse:
        response = self.chat.final(outputs)
        [choice] = response.choices
        message = choice.message
        content: list[ContentBlock] = []
        if message.reasoning:
            content.append(ThinkingBlock(thinking=message.reasoning))
        if message.content or not (message.reasoning or message.tool_calls):
            content.append(TextBlock(text=message.content or ""))
        for call in message.tool_calls:
            name = call.function.name
            content.append(ToolUseBlock(id=_tool_id(), name=name, input=_tool_input(call.function.arguments, name)))
        reason, sequence = stop_reason(choice.finish_reason, choice.stop_reason, bool(message.tool_calls))
        usage = MessageUsage(input_tokens=response.usage.prompt_tokens, output_tokens=response.usage.completion_tokens)
        return self._message(content, reason, sequence, usage)

    # ------------------------------------------------------------------ streaming

    def stream_start(self) -> list[Any]:
        self.chat.stream_start()  # the chat's role chunk: nothing of it is sent
        usage = MessageUsage(input_tokens=self.chat.prompt_tokens, output_tokens=0)
        return [MessageStartEvent(message=self._message([], None, None, usage))]

    def stream_output(self, index: int, output: RequestOutput) -> list[Any]:
        events: list[Any] = []
        for chunk in self.chat.stream_output(index, output):
            for choice in chunk.choices:
                self._delta(choice.delta, events)
                if choice.finish_reason is not None:
                    self.finish_reason, self.matched = choice.finish_reason, choice.stop_reason
        return events

    def stream_end(self) -> list[Any]:
        events: list[Any] = []
        if not self.blocks:  # an empty answer: one empty text block, as non-streamed
            self._open("text", events)
        self._close(events)
        called = any(block.kind == "tool_use" for block in self.blocks)
        reason, sequence = stop_reason(self.finish_reason, self.matched, called)
        usage = MessageDeltaUsage(input_tokens=self.chat.prompt_tokens, output_tokens=self.chat.completion_tokens[0])
        events.append(MessageDeltaEvent(delta=MessageDelta(stop_reason=reason, stop_sequence=sequence), usage=usage))
        events.append(MessageStopEvent())
        return events

    def _delta(self, delta: DeltaMessage, events: list[Any]) -> None:
        if delta.reasoning:
            block = self._ensure("thinking", events)
            events.append(ContentBlockDeltaEvent(index=block.index, delta=ThinkingDelta(thinking=delta.reasoning)))
        if delta.content:
            block = self._ensure("text", events)
            events.append(ContentBlockDeltaEvent(index=block.index, delta=TextDelta(text=delta.content)))
        for call in delta.tool_calls or ():
            tool = self.open
            if tool is None or tool.kind != "tool_use" or tool.tool_index != call.index:
                name = call.function.name if call.function is not None else None
                tool = self._open("tool_use", events, name or "", call.index)
            arguments = call.function.arguments if call.function is not None else None
            if arguments:
                events.append(ContentBlockDeltaEvent(index=tool.index, delta=InputJsonDelta(partial_json=arguments)))

    def _ensure(self, kind: str, events: list[Any]) -> _Block:
        if self.open is not None and self.open.kind == kind:
            return self.open
        return self._open(kind, events)

    def _open(self, kind: str, events: list[Any], name: str = "", tool_index: int = -1) -> _Block:
        self._close(events)
        block = _Block(kind, len(self.blocks), tool_index)
        self.blocks.append(block)
        self.open = block
        start: ContentBlock
        if kind == "text":
            start = TextBlock(text="")
        elif kind == "thinking":
            start = ThinkingBlock(thinking="")
        else:
            start = ToolUseBlock(id=_tool_id(), name=name, input={})
        events.append(ContentBlockStartEvent(index=block.index, content_block=start))
        return block

    def _close(self, events: list[Any]) -> None:
        block, self.open = self.open, None
        if block is not None:
            events.append(ContentBlockStopEvent(index=block.index))

    # ------------------------------------------------------------------ both

    def _message(
        self, content: list[ContentBlock], reason: str | None, sequence: str | None, usage: MessageUsage
    ) -> MessageResponse:
        chat = self.chat
        return MessageResponse(
            id=chat.id, content=content, model=chat.model, stop_reason=reason, stop_sequence=sequence, usage=usage
        )
