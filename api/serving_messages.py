"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API, as a chat.

An Anthropic request is converted into the chat route's own request (`chat_request`) and run
by the chat route's machinery (`chat_generation` of serving_chat.py: the chat template, tools
and tool choice, the tool-call and reasoning parsers, structured outputs), and the chat
answer it gives is converted back (`MessagesFormatter`, wrapping the chat's formatter). There
is no second copy of the chat path: what the chat route does with a chat, this route does
with the same chat.

Request -> chat: `system` (a string or text blocks) is the system message; a `user` turn's
text blocks are a user message and each `tool_result` block a `tool` message (in the order
they come); an `assistant` turn's text is its content and its `tool_use` blocks its
`tool_calls` (`input` as the JSON text of `arguments`); `thinking` blocks sent back are
dropped (the model is not shown its old reasoning, as with chat). A conversation that ends with
an `assistant` turn is continued (Anthropic's prefill: `continue_final_message`). `tools`
(name, description, input_schema) are function tools; `tool_choice` auto / any / tool / none
is chat's "auto" / "required" / a named function / "none" (`disable_parallel_tool_use`: no
parallel calls); `thinking` sets the template's `enable_thinking` (its budget is not enforced);
`stop_sequences` are stop strings; `metadata.user_id` is `user`; `output_config.format` (a JSON
schema) is structured outputs. Image and document blocks are refused (400 naming the block):
the chat path takes text only. Server tools (`web_search_...`, `bash_...`: a `type` other
than "custom") are refused too.

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

from triollm.api.openai_errors import APIError, as_anthropic, bad_request
from triollm.api.protocol import ChatCompletionRequest, ChatMessage, ContentPart, DeltaMessage
from triollm.api.protocol_messages import (
    ContentBlock,
    ContentBlockDeltaEvent,
    ContentBlockStartEvent,
    ContentBlockStopEvent,
    CountTokensRequest,
    InputJsonDelta,
    InputMessage,
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
from triollm.api.serving_chat import ChatFormatter, chat_generation, render_chat_request
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

__all__ = ["MessagesFormatter", "chat_request", "count_message_tokens", "create_message", "stop_reason"]

log = logging.getLogger("triollm.api")

_ROLES = ("user", "assistant")
_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")
_MEDIA_BLOCKS = ("image", "document")
_TOOL_CHOICES = ("auto", "any", "tool", "none")
_THINKING = ("enabled", "disabled", "adaptive")
_encoder = msgspec.json.Encoder()


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(map(repr, values))


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
    )


async def count_message_tokens(state: ServerState, request: Request, chat_template: str | None) -> Response:
    """The prompt's tokens exactly as `create_message` renders the same conversation."""
    body = await read_body(request)
    req = await decode_sized(body, CountTokensRequest)
    resolve_model(state, req.model)
    chat = await maybe_in_thread(lambda: chat_request(req), len(body), LARGE_BODY)
    _, token_ids = await render_chat_request(state.llm.get_tokenizer(), chat, chat_template)
    return Response(_encoder.encode(TokensCount(input_tokens=len(token_ids))), media_type="application/json")


# ------------------------------------------------------------------------------ request side


def chat_request(req: CountTokensRequest) -> ChatCompletionRequest:
    """The chat an Anthropic request is (the module docstring); a 400 naming the field for what
    cannot be converted."""
    messages = chat_messages(req.system, req.messages)
    tools = chat_tools(req.tools)
    tool_choice, parallel = chat_tool_choice(req.tool_choice, bool(tools))
    prefill = req.messages[-1].role == "assistant"
    fields: dict[str, Any] = {}
    if isinstance(req, MessagesRequest):
        fields = {
            "max_tokens": req.max_tokens,
            "stop": req.stop_sequences,
            "stream": req.stream,
            "temperature": req.temperature,
            "top_p": req.top_p,
            "top_k": req.top_k,
            "user": _user_id(req.metadata),
            "response_format": _response_format(req.output_config),
        }
    return ChatCompletionRequest(
        model=req.model,
        messages=messages,
        tools=tools,
        tool_choice=tool_choice,
        parallel_tool_calls=parallel,
        chat_template_kwargs=_template_kwargs(req.thinking),
        add_generation_prompt=not prefill,
        continue_final_message=prefill,
        **fields,
    )


def chat_messages(system: str | list[dict[str, Any]] | None, turns: list[InputMessage]) -> list[ChatMessage]:
    out: list[ChatMessage] = []
    if system is not None:
        parts = system if isinstance(system, str) else _text_parts(system, "system")
        if parts:
            out.append(ChatMessage(role="system", content=parts))
    for i, turn in enumerate(turns):
        where = f"messages[{i}]"
        if turn.role not in _ROLES:
            raise bad_request(f"{where}.role: must be one of {_quoted(_ROLES)}; got {turn.role!r:.80}", "messages")
        if isinstance(turn.content, str):
            out.append(ChatMessage(role=turn.role, content=turn.content))
        elif turn.role == "user":
            out += _user_turn(turn.content, f"{where}.content")
        else:
            out.append(_assistant_turn(turn.content, f"{where}.content"))
    return out


def _user_turn(blocks: list[dict[str, Any]], where: str) -> list[ChatMessage]:
    """Text blocks as user messages and `tool_result` blocks as tool messages, in order."""
    out: list[ChatMessage] = []
    text: list[ContentPart] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_type(block, at, _USER_BLOCKS)
        if kind == "text":
            text.append(ContentPart(text=_string(block, "text", at)))
            continue
        if text:
            out.append(ChatMessage(role="user", content=text))
            text = []
        call_id = _string(block, "tool_use_id", at)
        content = block.get("content", "")
        result = content if isinstance(content, str) else _joined(content, f"{at}.content")
        if block.get("is_error") is True:
            result = f"Error: {result}"
        out.append(ChatMessage(role="tool", content=result, tool_call_id=call_id))
    if text:
        out.append(ChatMessage(role="user", content=text))
    return out


def _assistant_turn(blocks: list[dict[str, Any]], where: str) -> ChatMessage:
    text: list[ContentPart] = []
    calls: list[dict[str, Any]] = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        kind = _block_type(block, at, _ASSISTANT_BLOCKS)
        if kind == "text":
            text.append(ContentPart(text=_string(block, "text", at)))
        elif kind == "tool_use":
            arguments = block.get("input")
            if not isinstance(arguments, dict):
                raise bad_request(f"{at}.input: must be an object (the tool's arguments)", "messages")
            function = {"name": _string(block, "name", at), "arguments": _encoder.encode(arguments).decode()}
            calls.append({"id": _string(block, "id", at), "type": "function", "function": function})
        # thinking blocks sent back are accepted and not shown to the model
    return ChatMessage(role="assistant", content=text or (None if calls else ""), tool_calls=calls or None)


def _block_type(block: dict[str, Any], where: str, allowed: tuple[str, ...]) -> str:
    kind = block.get("type")
    if kind in _MEDIA_BLOCKS:
        raise bad_request(
            f"{where}.type: {kind!r} blocks are not supported: this server's chat path takes text only "
            f"(allowed here: {_quoted(allowed)})",
            "messages",
        )
    if kind not in allowed:
        raise bad_request(f"{where}.type: must be one of {_quoted(allowed)}; got {kind!r:.80}", "messages")
    return str(kind)


def _string(block: dict[str, Any], key: str, where: str) -> str:
    value = block.get(key)
    if not isinstance(value, str):
        raise bad_request(f"{where}.{key}: must be a string; got {type(value).__name__}", "messages")
    return value


def _text_parts(blocks: list[dict[str, Any]], where: str) -> list[ContentPart]:
    parts = []
    for j, block in enumerate(blocks):
        at = f"{where}[{j}]"
        _block_type(block, at, ("text",))
        parts.append(ContentPart(text=_string(block, "text", at)))
    return parts


def _joined(blocks: object, where: str) -> str:
    """A tool result's content blocks (text only) as one text."""
    if not isinstance(blocks, list):
        raise bad_request(f"{where}: must be a string or a list of text blocks", "messages")
    return "\n".join(part.text or "" for part in _text_parts(blocks, where))


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Anthropic's custom tools as the chat's function tools."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        kind = tool.get("type")
        if kind not in (None, "custom"):
            raise bad_request(
                f"{where}.type: only custom tools (name, description, input_schema) are supported; got {kind!r:.80}",
                "tools",
            )
        name = tool.get("name")
        if not isinstance(name, str) or not name or len(name) > 256:
            raise bad_request(f"{where}.name: must be a non-empty string of at most 256 characters", "tools")
        schema = tool.get("input_schema")
        if not isinstance(schema, dict):
            raise bad_request(f"{where}.input_schema: must be a JSON schema object", "tools")
        function: dict[str, Any] = {"name": name, "parameters": schema}
        description = tool.get("description")
        if description is not None:
            if not isinstance(description, str):
                raise bad_request(f"{where}.description: must be a string", "tools")
            function["description"] = description
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(value: dict[str, Any] | None, has_tools: bool) -> tuple[Any, bool | None]:
    """Anthropic's `tool_choice` as the chat's, and whether calls may be parallel (None: the
    default, yes)."""
    if value is None:
        return None, None
    kind = value.get("type")
    if kind not in _TOOL_CHOICES:
        raise bad_request(f"tool_choice.type: must be one of {_quoted(_TOOL_CHOICES)}; got {kind!r:.80}", "tool_choice")
    parallel = False if value.get("disable_parallel_tool_use") is True else None
    if kind in ("auto", "none") and not has_tools:
        return None, parallel
    if kind == "tool":
        name = value.get("name")
        if not isinstance(name, str):
            raise bad_request('tool_choice.name: type "tool" needs the name of one of the tools', "tool_choice")
        return {"type": "function", "function": {"name": name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[kind], parallel


def _template_kwargs(thinking: dict[str, Any] | None) -> dict[str, Any] | None:
    if thinking is None:
        return None
    kind = thinking.get("type")
    if kind not in _THINKING:
        raise bad_request(f"thinking.type: must be one of {_quoted(_THINKING)}; got {kind!r:.80}", "thinking")
    return {"enable_thinking": kind != "disabled"}


def _user_id(metadata: dict[str, Any] | None) -> str | None:
    user = (metadata or {}).get("user_id")
    if user is not None and not isinstance(user, str):
        raise bad_request("metadata.user_id: must be a string", "metadata")
    return user


def _response_format(config: dict[str, Any] | None) -> dict[str, Any] | None:
    fmt = (config or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
        raise bad_request(
            'output_config.format: must be {"type": "json_schema", "schema": {...}} with a JSON schema object',
            "output_config",
        )
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}


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
