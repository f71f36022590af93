"""`POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`: OpenAI's Responses API for
text and function tools, on the chat machinery.

A request becomes a chat: `instructions` (a system message), then the stored conversation of
`previous_response_id`, then the `input` items (messages; `function_call` items as assistant
`tool_calls`; `function_call_output` items as `tool` messages), rendered with the chat template
and the `tools` (converted from Responses' flat shape to the chat one). Tool choice, the forced
call's grammar and the output parsers are the chat route's (`plan_tool_output` of
api/output_plan.py); `text.format` is the structured-outputs constraint.

The answer is one `response` object whose `output` holds a `reasoning` item (when the server's
reasoning parser split reasoning off), a `message` item with one `output_text` part, and a
`function_call` item per call. `max_output_tokens` reached: status "incomplete",
`incomplete_details.reason` "max_output_tokens". Streamed, the events are OpenAI's, each with a
`sequence_number`: `response.created`, `response.in_progress`, then per output item
`output_item.added`, (`content_part.added`, text or reasoning deltas, their `.done`,
`content_part.done`) or (`function_call_arguments.delta`..., `.done`), `output_item.done`, and
last `response.completed` (or `response.incomplete`) carrying the whole response. Each goes out
as `event: TYPE` and `data:` lines, with no closing `[DONE]` (`named_events`, api/sse.py).

Stored responses (`store`, OpenAI's default true) are kept in memory by `ResponseStore`, one per
app: least recently used first out, at most `STORE_MAX_RESPONSES` of them and
`STORE_MAX_BYTES` in all. An entry holds the response and the conversation so far (without its
instructions, which OpenAI does not carry over), so a follow-up names only
`previous_response_id` and new items. It holds them as their JSON bytes, and counts those bytes
plus a fixed `ENTRY_BYTES`, so the cap is what the store holds: decoded, the client's JSON that a
response echoes (`text`, tool parameters) costs many times its encoded size as Python objects
(36 MB counted once held 835 MB). `GET` returns the bytes as they are; a follow-up decodes the
conversation (in a worker thread, in pieces, once it is large). Each entry belongs to the API
key that made it (`api_key_id` of serving_common.py, a hash of the key; one owner when the
server has no key): for any other key it does not exist (404, as an unknown id, on `GET`,
`DELETE` and `previous_response_id`). Rejected: vLLM's unbounded dict behind an environment
flag (off by default); a store shared between apps (each `build_app` has its own, like its
other state); holding the decoded objects and estimating their size (the estimate was 23 times
low for small JSON values); compressing the bytes (the cap is already honest, and a follow-up
would pay to inflate them).
"""

from __future__ import annotations

import functools
import logging
import sys
import uuid
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import anyio
import msgspec
from starlette.requests import Request
from starlette.responses import Response

from triollm.api.json_pieces import decode_elements
from triollm.api.log_bounds import short_repr, shorten
from triollm.api.openai_errors import APIError, bad_request
from triollm.api.output_parsing import ChoiceStream, OutputParsing, OutputPiece
from triollm.api.output_plan import plan_tool_output, structured_outputs_params
from triollm.api.protocol import MAX_CONTENT_PARTS, ChatMessage, ContentPart, SamplingFields, decode_json
from triollm.api.protocol_responses import (
    ContentPartEvent,
    DeletedResponse,
    FunctionCallArgumentsDeltaEvent,
    FunctionCallArgumentsDoneEvent,
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    InputMessage,
    InputTokensDetails,
    OutputItem,
    OutputItemEvent,
    OutputMessage,
    OutputText,
    OutputTokensDetails,
    ReasoningItem,
    ReasoningText,
    ReasoningTextDeltaEvent,
    ReasoningTextDoneEvent,
    ResponseEvent,
    ResponseObject,
    ResponsesRequest,
    ResponseUsage,
    TextDeltaEvent,
    TextDoneEvent,
)
from triollm.api.serving_common import (
    LARGE_BODY,
    api_key_id,
    build_sampling_params,
    created_now,
    maybe_in_thread,
    output_kind,
    render_chat,
    start_generation,
)
from triollm.api.sse import GenerationResponse, Job
from triollm.api.state import ServerState
from triollm.engine.log_safe import log_safe
from triollm.engine.outputs import RequestOutput
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import StructuredOutputsParams

__all__ = [
    "ENTRY_BYTES",
    "STORE_MAX_BYTES",
    "STORE_MAX_RESPONSES",
    "ResponseStore",
    "ResponsesAPI",
    "ResponsesFormatter",
    "StoreStatistics",
]

log = logging.getLogger("triollm.api")

STORE_MAX_RESPONSES = 1024
STORE_MAX_BYTES = 64 * 1024 * 1024
# What an entry costs beyond its two byte strings: its id, its slot in the table, the entry and
# the strings' headers (~320 bytes, measured with tracemalloc), rounded up.
ENTRY_BYTES = 512
_INPUT_TYPES = ("message", "function_call", "function_call_output", "reasoning")
_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")
_FORMATS = ("text", "json_schema", "json_object")
_encoder = msgspec.json.Encoder()


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ------------------------------------------------------------------------------ the store


@dataclass(frozen=True, slots=True)
class _Stored:
    """One stored response, as JSON: the response object (what `GET` returns) and the
    conversation a follow-up continues (an array of chat messages)."""

    owner: str  # the hash of the API key that made it (`api_key_id`), "" without keys
    response: bytes
    conversation: bytes

    @property
    def size(self) -> int:
        return ENTRY_BYTES + len(self.response) + len(self.conversation)


@dataclass(frozen=True)
class StoreStatistics:
    responses: int
    bytes: int  # what the entries hold: their JSON bytes plus ENTRY_BYTES each
    max_responses: int
    max_bytes: int


class ResponseStore:
    """Stored responses by id, each its owner's (the API key's hash: another owner's entry is
    not there for `get` and `pop`), least recently used evicted first once over
    `max_responses` entries or `max_bytes` (an entry larger than `max_bytes` is not kept).
    Entries are JSON bytes, counted by their length (the module docstring). Used from the event
    loop only (no awaits inside), so it needs no lock."""

    def __init__(self, max_responses: int = STORE_MAX_RESPONSES, max_bytes: int = STORE_MAX_BYTES) -> None:
        if max_responses < 1 or max_bytes < 1:
            raise ValueError(f"max_responses, max_bytes: must be at least 1, got {max_responses}, {max_bytes}")
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._entries: OrderedDict[str, _Stored] = OrderedDict()
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, response: ResponseObject, conversation: list[ChatMessage], *, owner: str) -> None:
        entry = _Stored(sys.intern(owner), _exact_json(response), _exact_json(conversation))
        self._remove(response.id)
        if entry.size > self.max_bytes:
            log.warning(
                "response %s not stored: %d bytes, over the store's %d", response.id, entry.size, self.max_bytes
            )
            return
        self._entries[response.id] = entry
        self.bytes += entry.size
        while len(self._entries) > self.max_responses or self.bytes > self.max_bytes:
            _, old = self._entries.popitem(last=False)
            self.bytes -= old.size

    def get(self, response_id: str, owner: str) -> _Stored | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        self._entries.move_to_end(response_id)
        return entry

    def pop(self, response_id: str, owner: str) -> _Stored | None:
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner:
            return None
        return self._remove(response_id)

    def _remove(self, response_id: str) -> _Stored | None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= entry.size
        return entry

    def statistics(self) -> StoreStatistics:
        return StoreStatistics(len(self._entries), self.bytes, self.max_responses, self.max_bytes)

    def check_integrity(self) -> None:
        """Raise AssertionError if an invariant is broken: the count is the sum of what the
        entries hold, each entry holds bytes only, and both caps hold."""
        held = 0
        for response_id, entry in self._entries.items():
            assert type(entry.response) is bytes and type(entry.conversation) is bytes, response_id
            assert type(entry.owner) is str, response_id
            held += entry.size
        assert held == self.bytes, f"counted {self.bytes} bytes, holds {held}"
        assert self.bytes <= self.max_bytes and len(self._entries) <= self.max_responses


def _exact_json(value: Any) -> bytes:
    """`value` as JSON, in a bytes object no larger than its length (msgspec's `encode` returns
    one with up to a third more room than it uses)."""
    buffer = bytearray()
    _encoder.encode_into(value, buffer)
    return bytes(buffer)


# ------------------------------------------------------------------------------ the routes


class ResponsesAPI:
    """The three routes, sharing one app's `ResponseStore`."""

    def __init__(self, state: ServerState, chat_template: str | None, store: ResponseStore | None = None) -> None:
        self.state = state
        self.chat_template = chat_template
        self.store = store if store is not None else ResponseStore()

    async def create(self, request: Request) -> Response:
        state = self.state
        start = await start_generation(
            state, request, ResponsesRequest, api="Responses API", id_prefix="resp_"
        )
        req, model, lora = start.req, start.model, start.lora
        engine_id, timer = start.request_id, start.timer
        owner = api_key_id(request)
        stream = bool(req.stream)
        if req.max_output_tokens is not None and req.max_output_tokens < 1:
            raise bad_request(
                f"max_output_tokens: must be at least 1, got {req.max_output_tokens}", "max_output_tokens"
            )
        history = await self._history(req.previous_response_id, owner)

        def convert() -> tuple[list[ChatMessage], tuple[list[FunctionTool], list[dict[str, Any]]]]:
            return input_messages(req.input), convert_tools(req.tools)

        # A large body's items (thousands, each checked) are converted off the loop too.
        items, (tools, chat_tools) = await maybe_in_thread(convert, start.body_bytes, LARGE_BODY)
        conversation = history + items
        if not conversation:
            raise bad_request("input: must hold at least one item", "input")
        messages = ([ChatMessage(role="system", content=req.instructions)] if req.instructions else []) + conversation
        settings = state.settings
        plan = await plan_tool_output(
            state,
            chat_tools or None,
            chat_tool_choice(req.tool_choice, bool(chat_tools)),
            parallel_tool_calls=req.parallel_tool_calls,
            constraint=functools.partial(_text_format_params, req.text),
            constraint_name="a json text.format",
        )
        llm = state.llm
        tokenizer, parsing = plan.tokenizer, plan.parsing
        fields = SamplingFields(
            temperature=req.temperature, top_p=req.top_p, top_k=req.top_k, min_p=req.min_p,
            repetition_penalty=req.repetition_penalty, seed=req.seed, stop=req.stop,
            skip_special_tokens=not parsing.keep_special_tokens,
        )  # fmt: skip
        defaults = llm.get_model_config().generation_defaults
        max_tokens = req.max_output_tokens if req.max_output_tokens is not None else defaults.get("max_tokens")
        params = build_sampling_params(
            fields, defaults, max_tokens=max_tokens, logprobs=None, kind=output_kind(stream, timer),
            structured=plan.structured,
        )  # fmt: skip
        text, token_ids = await render_chat(
            tokenizer,
            messages,
            template=self.chat_template,
            add_generation_prompt=True,
            continue_final_message=False,
            template_kwargs=dict(settings.default_chat_template_kwargs or {}),
            tools=chat_tools or None,
            content_format=settings.chat_template_content_format,
        )
        if not settings.disable_log_requests:
            shown = log_safe(engine_id), len(token_ids), short_repr(params)
            log.info("Received request %s: %d prompt tokens, params: %s", *shown)
        skeleton = ResponseObject(
            id=_new_id("resp"),
            created_at=created_now(),
            status="in_progress",
            instructions=req.instructions,
            max_output_tokens=req.max_output_tokens,
            model=model,
            parallel_tool_calls=req.parallel_tool_calls is not False,
            previous_response_id=req.previous_response_id,
            reasoning=req.reasoning,
            store=req.store is not False,
            temperature=params.temperature,
            text=req.text if req.text is not None else {"format": {"type": "text"}},
            tool_choice=req.tool_choice if req.tool_choice is not None else "auto",
            tools=tools,
            top_p=params.top_p,
            user=req.user,
            metadata=req.metadata or {},
        )
        on_done = None
        if req.store is not False:
            store = self.store

            def on_done(response: ResponseObject) -> None:
                store.put(response, conversation + output_messages(response.output), owner=owner)

        formatter = ResponsesFormatter(skeleton, parsing, tokenizer, on_done)
        job = Job({"prompt": text, "prompt_token_ids": token_ids}, params, engine_id, req.priority, lora_request=lora)
        return GenerationResponse(
            llm, [job], formatter, stream=stream, label=skeleton.id, timer=timer, admission=state.admission,
            trace=start.trace, model=model,
        )

    async def retrieve(self, request: Request) -> Response:
        entry = self._stored(request.path_params["response_id"], "response_id", api_key_id(request))
        return Response(entry.response, media_type="application/json")

    async def delete(self, request: Request) -> Response:
        response_id, owner = request.path_params["response_id"], api_key_id(request)
        self._stored(response_id, "response_id", owner)
        self.store.pop(response_id, owner)
        return Response(_encoder.encode(DeletedResponse(response_id)), media_type="application/json")

    async def _history(self, previous_response_id: str | None, owner: str) -> list[ChatMessage]:
        """The stored conversation `previous_response_id` continues, decoded (in a worker
        thread, in pieces, once it is large)."""
        if previous_response_id is None:
            return []
        stored = self._stored(previous_response_id, "previous_response_id", owner).conversation
        if len(stored) <= LARGE_BODY:
            return decode_json(stored, list[ChatMessage])
        return await anyio.to_thread.run_sync(decode_elements, stored, ChatMessage)

    def _stored(self, response_id: str, param: str, owner: str) -> _Stored:
        """The entry, or a 404 when there is none for this owner (another key's is not there)."""
        if not response_id.startswith("resp"):
            raise bad_request(f"{param}: expected an ID that begins with 'resp', got {response_id!r:.100}", param)
        entry = self.store.get(response_id, owner)
        if entry is None:
            raise APIError(404, f"{param}: response with id {shorten(response_id, 100)!r} not found", param)
        return entry


# ------------------------------------------------------------------------------ request side


def input_messages(value: str | list[dict[str, Any]]) -> list[ChatMessage]:
    """`input` as chat messages (a 400 naming `input[i]` and the field for a bad item)."""
    if isinstance(value, str):
        return [ChatMessage(role="user", content=value)]
    out: list[ChatMessage] = []
    for i, item in enumerate(value):
        where = f"input[{i}]"
        kind = item.get("type", "message" if "role" in item else None)
        if kind == "message":
            message = _convert(item, InputMessage, where)
            if message.role not in _ROLES:
                raise bad_request(
                    f"{where}.role: must be one of {', '.join(map(repr, _ROLES))}; got {message.role!r:.80}", "input"
                )
            role = "system" if message.role == "developer" else message.role
            content = message.content
            if isinstance(content, list):
                content = [ContentPart(type="text", text=t) for t in _part_texts(content, f"{where}.content")]
            out.append(ChatMessage(role=role, content=content))
        elif kind == "function_call":
            call = _convert(item, FunctionCallItem, where)
            _add_call(out, call.call_id, call.name, call.arguments)
        elif kind == "function_call_output":
            result = _convert(item, FunctionCallOutputItem, where)
            output = result.output
            text = output if isinstance(output, str) else "".join(_part_texts(output, f"{where}.output"))
            out.append(ChatMessage(role="tool", content=text, tool_call_id=result.call_id))
        elif kind != "reasoning":  # reasoning items sent back are accepted and not shown to the model
            raise bad_request(
                f"{where}.type: must be one of {', '.join(map(repr, _INPUT_TYPES))} (or a message with a role); got "
                f"{kind!r:.80}",
                "input",
            )
    return out


def _part_texts(parts: list[dict[str, Any]], where: str) -> list[str]:
    if len(parts) > MAX_CONTENT_PARTS:
        raise bad_request(f"{where}: at most {MAX_CONTENT_PARTS} parts, got {len(parts)}", "input")
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type")
        text = part.get("text")
        if kind not in _TEXT_PARTS or not isinstance(text, str):
            raise bad_request(
                f"{where}[{j}]: only text parts are supported ({', '.join(map(repr, _TEXT_PARTS[:2]))} with a string "
                f"`text`); got type {kind!r:.80}",
                "input",
            )
        texts.append(text)
    return texts


def _add_call(messages: list[ChatMessage], call_id: str, name: str, arguments: str) -> None:
    """A call joins the assistant message just before it (its text, or calls made in the same
    turn), else starts one."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = messages[-1] if messages else None
    if last is not None and last.role == "assistant":
        last.tool_calls = [*(last.tool_calls or []), call]
    else:
        messages.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))


def _convert(item: dict[str, Any], type_: type[Any], where: str) -> Any:
    try:
        return msgspec.convert(item, type_)
    except msgspec.ValidationError as exc:
        raise bad_request(f"{where}: {str(exc).replace('`$', f'`{where}')}", "input") from None


def convert_tools(tools: list[dict[str, Any]] | None) -> tuple[list[FunctionTool], list[dict[str, Any]]]:
    """Responses' function tools, and the same in the chat shape (for the tool choice and the
    template). Any other tool type (web_search, file_search, mcp, ...) is a 400."""
    flat: list[FunctionTool] = []
    nested: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or ()):
        kind = tool.get("type")
        if kind != "function":
            raise bad_request(f"tools[{i}].type: only 'function' tools are supported; got {kind!r:.80}", "tools")
        try:
            fn = msgspec.convert(tool, FunctionTool)
        except msgspec.ValidationError as exc:
            raise bad_request(f"tools[{i}]: {str(exc).replace('`$', f'`tools[{i}]')}", "tools") from None
        if not fn.name or len(fn.name) > 256:
            raise bad_request(f"tools[{i}].name: must be a non-empty string of at most 256 characters", "tools")
        flat.append(fn)
        function: dict[str, Any] = {
            "name": fn.name,
            "parameters": fn.parameters or {"type": "object", "properties": {}},
        }
        if fn.description is not None:
            function["description"] = fn.description
        nested.append({"type": "function", "function": function})
    return flat, nested


def chat_tool_choice(value: str | dict[str, Any] | None, has_tools: bool) -> Any:
    """Responses' `tool_choice` in the chat shape. "auto" (OpenAI's default) without tools is
    no choice at all."""
    if value is None or (value == "auto" and not has_tools):
        return None
    if isinstance(value, str):
        return value
    name = value.get("name")
    if value.get("type") != "function" or not isinstance(name, str):
        raise bad_request(
            'tool_choice: must be "none", "auto", "required" or {"type": "function", "name": NAME}; '
            f"got {_encoder.encode(value)[:80].decode(errors='replace')}",
            "tool_choice",
        )
    return {"type": "function", "function": {"name": name}}


async def _text_format_params(text: dict[str, Any] | None) -> StructuredOutputsParams | None:
    """`text.format` as the structured-outputs constraint (None for plain text), compiled to
    check it: a bad schema is a 400 naming `text.format`."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    kind = fmt.get("type", "text") if isinstance(fmt, dict) else None
    if kind not in _FORMATS:
        raise bad_request(
            f"text.format.type: must be one of {', '.join(map(repr, _FORMATS))}; got {kind!r:.80}", "text.format"
        )
    if kind == "text":
        return None
    spec: dict[str, Any] = {"json_object": True}
    if kind == "json_schema":
        schema = fmt.get("schema")
        if not isinstance(schema, dict):
            raise bad_request(
                "text.format.schema: type 'json_schema' needs `schema`, a JSON schema object", "text.format"
            )
        spec = {"json": schema}
    try:
        return await structured_outputs_params(SamplingFields(structured_outputs=spec))
    except APIError as exc:
        message = exc.message.replace("structured_outputs.json", "text.format").replace(
            "structured_outputs", "text.format"
        )
        raise bad_request(message, "text.format") from None


def output_messages(items: list[OutputItem]) -> list[ChatMessage]:
    """A response's output as the chat messages that continue its conversation (reasoning is
    not carried over)."""
    out: list[ChatMessage] = []
    for item in items:
        if isinstance(item, OutputMessage):
            out.append(ChatMessage(role="assistant", content="".join(p.text for p in item.content)))
        elif isinstance(item, FunctionCallItem):
            _add_call(out, item.call_id, item.name, item.arguments)
    return out


# ------------------------------------------------------------------------------ the formatter


@dataclass
class _Item:
    """An output item being built (streamed: the one open at a time)."""

    kind: str  # "message" | "reasoning" | "function_call"
    index: int  # its output_index
    id: str
    text: str = ""  # the text, reasoning or arguments so far
    call_id: str = ""
    name: str = ""
    tool_index: int = -1  # the parser's index of the call

    def done(self, status: str) -> OutputItem:
        if self.kind == "message":
            return OutputMessage(id=self.id, status=status, content=[OutputText(text=self.text)])
        if self.kind == "reasoning":
            return ReasoningItem(id=self.id, content=[ReasoningText(text=self.text)], status=status)
        return FunctionCallItem(id=self.id, call_id=self.call_id, name=self.name, arguments=self.text, status=status)


class ResponsesFormatter:
    """The `Formatter` of api/sse.py for one response: the whole object, or its stream events
    (`event: TYPE` lines, no `[DONE]`). `on_done` gets the finished response (to store it)."""

    named_events = True

    def __init__(
        self,
        skeleton: ResponseObject,
        parsing: OutputParsing,
        tokenizer: Tokenizer,
        on_done: Callable[[ResponseObject], None] | None = None,
    ) -> None:
        self.skeleton = skeleton
        self.parsing = parsing
        self.tokenizer = tokenizer
        self.on_done = on_done
        self.sequence = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.stream: ChoiceStream | None = None
        self.finish_reason: str | None = None
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.output_tokens = 0

    # ------------------------------------------------------------------ non-streaming

    def final(self, outputs: list[RequestOutput]) -> ResponseObject:
        [output] = outputs
        [c] = output.outputs
        self._count(output)
        self.output_tokens = len(c.token_ids)
        self.finish_reason = c.finish_reason
        parsed = self.parsing.whole(c.text)
        if parsed.reasoning:
            self.items.append(_Item("reasoning", len(self.items), _new_id("rs"), parsed.reasoning))
        if parsed.content or not parsed.tool_calls:
            self.items.append(_Item("message", len(self.items), _new_id("msg"), parsed.content or ""))
        for call in parsed.tool_calls:
            self.items.append(
                _Item(
                    "function_call",
                    len(self.items),
                    _new_id("fc"),
                    call.function.arguments,
                    call.id,
                    call.function.name,
                )
            )
        return self._finished()

    # ------------------------------------------------------------------ streaming

    def stream_start(self) -> list[Any]:
        self.stream = self.parsing.stream()
        return [
            ResponseEvent(type="response.created", sequence_number=self._seq(), response=self.skeleton),
            ResponseEvent(type="response.in_progress", sequence_number=self._seq(), response=self.skeleton),
        ]

    def stream_output(self, index: int, output: RequestOutput) -> list[Any]:
        assert self.stream is not None
        self._count(output)
        events: list[Any] = []
        for c in output.outputs:
            if self.finish_reason is not None:
                continue
            self.output_tokens += len(c.token_ids)
            if c.text:
                self._piece(self.stream.feed(c.text), events)
            if c.finish_reason is not None:
                self.finish_reason = c.finish_reason
                self._piece(self.stream.finish(), events)
                self._close(events)
                if all(i.kind == "reasoning" for i in self.items):  # an empty message, as non-streamed
                    self._open("message", events)
                    self._close(events)
        return events

    def stream_end(self) -> list[Any]:
        events: list[Any] = []
        self._close(events)
        response = self._finished()
        kind = "response.completed" if response.status == "completed" else "response.incomplete"
        events.append(ResponseEvent(type=kind, sequence_number=self._seq(), response=response))
        return events

    def _piece(self, piece: OutputPiece, events: list[Any]) -> None:
        if piece.reasoning:
            item = self._ensure("reasoning", events)
            item.text += piece.reasoning
            events.append(
                ReasoningTextDeltaEvent(
                    type="response.reasoning_text.delta", sequence_number=self._seq(), item_id=item.id,
                    output_index=item.index, content_index=0, delta=piece.reasoning,
                )
            )  # fmt: skip
        if piece.content:
            item = self._ensure("message", events)
            item.text += piece.content
            events.append(
                TextDeltaEvent(
                    type="response.output_text.delta", sequence_number=self._seq(), item_id=item.id,
                    output_index=item.index, content_index=0, delta=piece.content,
                )
            )  # fmt: skip
        for call in piece.tool_calls:
            current = self.open
            if current is None or current.kind != "function_call" or current.tool_index != call.index:
                name = call.function.name if call.function is not None else None
                current = self._open("function_call", events, call.id, name, call.index)
            arguments = call.function.arguments if call.function is not None else None
            if arguments:
                current.text += arguments
                events.append(
                    FunctionCallArgumentsDeltaEvent(
                        type="response.function_call_arguments.delta", sequence_number=self._seq(),
                        item_id=current.id, output_index=current.index, delta=arguments,
                    )
                )  # fmt: skip

    def _ensure(self, kind: str, events: list[Any]) -> _Item:
        if self.open is not None and self.open.kind == kind:
            return self.open
        return self._open(kind, events)

    def _open(
        self, kind: str, events: list[Any], call_id: str | None = None, name: str | None = None, tool_index: int = -1
    ) -> _Item:
        self._close(events)
        prefix = {"message": "msg", "reasoning": "rs", "function_call": "fc"}[kind]
        item = _Item(
            kind,
            len(self.items),
            _new_id(prefix),
            call_id=call_id or _new_id("call"),
            name=name or "",
            tool_index=tool_index,
        )
        self.items.append(item)
        self.open = item
        added = item.done("in_progress")
        if isinstance(added, OutputMessage | ReasoningItem):
            added.content = []
        events.append(
            OutputItemEvent(
                type="response.output_item.added", sequence_number=self._seq(), output_index=item.index, item=added
            )
        )
        if kind != "function_call":
            part = OutputText(text="") if kind == "message" else ReasoningText(text="")
            events.append(self._part_event("response.content_part.added", item, part))
        return item

    def _close(self, events: list[Any]) -> None:
        item, self.open = self.open, None
        if item is None:
            return
        if item.kind == "message":
            events.append(
                TextDoneEvent(
                    type="response.output_text.done", sequence_number=self._seq(), item_id=item.id,
                    output_index=item.index, content_index=0, text=item.text,
                )
            )  # fmt: skip
            events.append(self._part_event("response.content_part.done", item, OutputText(text=item.text)))
        elif item.kind == "reasoning":
            events.append(
                ReasoningTextDoneEvent(
                    type="response.reasoning_text.done", sequence_number=self._seq(), item_id=item.id,
                    output_index=item.index, content_index=0, text=item.text,
                )
            )  # fmt: skip
            events.append(self._part_event("response.content_part.done", item, ReasoningText(text=item.text)))
        else:
            events.append(
                FunctionCallArgumentsDoneEvent(
                    type="response.function_call_arguments.done", sequence_number=self._seq(), item_id=item.id,
                    output_index=item.index, name=item.name, arguments=item.text,
                )
            )  # fmt: skip
        events.append(
            OutputItemEvent(
                type="response.output_item.done", sequence_number=self._seq(), output_index=item.index,
                item=item.done(self._item_status(item)),
            )
        )  # fmt: skip

    def _part_event(self, kind: str, item: _Item, part: OutputText | ReasoningText) -> ContentPartEvent:
        return ContentPartEvent(
            type=kind, sequence_number=self._seq(), item_id=item.id, output_index=item.index, content_index=0, part=part
        )

    # ------------------------------------------------------------------ both

    def _seq(self) -> int:
        self.sequence += 1
        return self.sequence - 1

    def _count(self, output: RequestOutput) -> None:
        self.prompt_tokens = len(output.prompt_token_ids)
        self.cached_tokens = output.num_cached_tokens or 0

    def _item_status(self, item: _Item) -> str:
        """An item cut short by the token limit is "incomplete" (its text or arguments end early)."""
        last = item is self.items[-1]
        return "incomplete" if last and self.finish_reason == "length" else "completed"

    def _finished(self) -> ResponseObject:
        status = {"stop": "completed", "length": "incomplete"}.get(self.finish_reason or "", "cancelled")
        reasoning = "".join(i.text for i in self.items if i.kind == "reasoning")
        reasoning_tokens = len(self.tokenizer.encode(reasoning, add_special_tokens=False)) if reasoning else 0
        response = msgspec.structs.replace(
            self.skeleton,
            status=status,
            incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
            output=[item.done(self._item_status(item)) for item in self.items],
            usage=ResponseUsage(
                input_tokens=self.prompt_tokens,
                input_tokens_details=InputTokensDetails(cached_tokens=self.cached_tokens),
                output_tokens=self.output_tokens,
                output_tokens_details=OutputTokensDetails(reasoning_tokens=reasoning_tokens),
                total_tokens=self.prompt_tokens + self.output_tokens,
            ),
            completed_at=created_now() if status == "completed" else None,
        )
        if self.on_done is not None:
            self.on_done(response)
        return response
