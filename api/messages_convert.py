"""An Anthropic Messages API request as the chat route's own request (`chat_request`), for
serving_messages.py to run through the chat machinery.

`system` (a string or text blocks) is the system message; a `user` turn's text blocks are a
user message and each `tool_result` block a `tool` message (in the order they come); an
`assistant` turn's text is its content and its `tool_use` blocks its `tool_calls` (`input` as
the JSON text of `arguments`); `thinking` blocks sent back are dropped (the model is not shown
its old reasoning, as with chat). A conversation that ends with an `assistant` turn is
continued (Anthropic's prefill: `continue_final_message`). `tools` (name, description,
input_schema) are function tools; `tool_choice` auto / any / tool / none is chat's "auto" /
"required" / a named function / "none" (`disable_parallel_tool_use`: no parallel calls);
`thinking` sets the template's `enable_thinking` (its budget is not enforced);
`stop_sequences` are stop strings; `metadata.user_id` is `user`; `output_config.format` (a JSON
schema) is structured outputs.

Refused, each a 400 naming the field and the allowed values: image and document blocks (the
chat path takes text only), any other block type, roles other than user and assistant, server
tools (`web_search_...`, `bash_...`: a `type` other than "custom"), an unknown `tool_choice`
or `thinking` type.
"""

from __future__ import annotations

from typing import Any

import msgspec

from triollm.api.openai_errors import bad_request
from triollm.api.protocol import ChatCompletionRequest, ChatMessage, ContentPart
from triollm.api.protocol_messages import CountTokensRequest, InputMessage, MessagesRequest

__all__ = ["chat_messages", "chat_request", "chat_tool_choice", "chat_tools"]

_ROLES = ("user", "assistant")
_USER_BLOCKS = ("text", "tool_result")
_ASSISTANT_BLOCKS = ("text", "tool_use", "thinking", "redacted_thinking")
_MEDIA_BLOCKS = ("image", "document")
_TOOL_CHOICES = ("auto", "any", "tool", "none")
_THINKING = ("enabled", "disabled", "adaptive")
_encoder = msgspec.json.Encoder()


def _quoted(values: tuple[str, ...]) -> str:
    return ", ".join(map(repr, values))


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
        content = block.get("content") or ""  # a result may have no content
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
