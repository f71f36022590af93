"""Hostile JSON through the real app (issue 39), on asyncio and trio: a client's deeply nested
tool-call arguments and malformed tool schemas are 400s naming the field, and model output that
no parser can read (JSON or XML nested thousands deep, a 5,000-digit integer, a parser that
raises) is a 200 with the text, whole and streamed. Never a 5xx.

The model's output is scripted: `ScriptedOutput` wraps the in-process `AsyncLLM` and replaces
the text of every output the tiny model generates with pieces of a given text (its token ids
and finish stay the model's), so what the parsers read is exactly that text.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import httpx
import pytest
from test_app import CHAT, GREEDY, assert_error, open_client, post, sse

from triollm.actors.async_llm import AsyncLLM
from triollm.api.protocol import MAX_JSON_DEPTH
from triollm.api.reasoning_parsers import ReasoningParser, ReasoningParserManager, ReasoningStream
from triollm.api.state import ServerSettings, ServerState
from triollm.api.tool_parsers import ExtractedToolCalls, StreamDelta, ToolCallStream, ToolParser, ToolParserManager
from triollm.engine.outputs import RequestOutput

pytestmark = pytest.mark.anyio

DEEP = 10_000
DEEP_ARGUMENTS = json.dumps({"city": "x"})[:-1] + ', "n": ' + "[" * DEEP + "]" * DEEP + "}"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "where": {"type": "array"},
                "extra": {"type": "object"},
            },
        },
    },
}


def deep_call_chat(arguments: str = DEEP_ARGUMENTS) -> list[dict[str, Any]]:
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return [
        *CHAT,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]


def assert_no_5xx(r: httpx.Response) -> None:
    assert r.status_code < 500, r.text


# ------------------------------------------------------------------- the client's JSON


@pytest.mark.parametrize("stream", [False, True])
async def test_deep_tool_call_arguments_on_chat_are_a_400_naming_the_field(
    client: httpx.AsyncClient, stream: bool
) -> None:
    body = {"messages": deep_call_chat(), "max_tokens": 2, "stream": stream, **GREEDY}
    r = await post(client, "/v1/chat/completions", body)
    assert_error(
        r, 400, f"messages[2].tool_calls[0].function.arguments: nested deeper than {MAX_JSON_DEPTH} levels",
        param="messages",
    )  # fmt: skip


async def test_deep_tool_call_arguments_on_tokenize_are_a_400_naming_the_field(client: httpx.AsyncClient) -> None:
    r = await post(client, "/tokenize", {"model": "tiny", "messages": deep_call_chat()})
    assert_error(r, 400, "messages[2].tool_calls[0].function.arguments: nested deeper than", param="messages")
    depth = MAX_JSON_DEPTH - 1  # in the arguments object: just inside the bound
    arguments = '{"n": ' + "[" * depth + "]" * depth + "}"
    r = await post(client, "/tokenize", {"model": "tiny", "messages": deep_call_chat(arguments)})
    assert r.status_code == 200, r.text


async def test_deep_function_call_arguments_on_responses_are_a_400_naming_the_field(
    client: httpx.AsyncClient,
) -> None:
    items = [
        {"role": "user", "content": "Weather?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": DEEP_ARGUMENTS},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    r = await post(client, "/v1/responses", {"input": items, "max_output_tokens": 2, "temperature": 0})
    assert_error(r, 400, "input[1].arguments: nested deeper than", param="input")


async def test_deep_decoded_json_is_a_400_naming_the_field(client: httpx.AsyncClient) -> None:
    """Within msgspec's own limit, but deeper than the bound: tools, template variables, tool
    calls sent as objects."""
    deep: Any = {"type": "string"}
    for _ in range(100):
        deep = {"type": "object", "properties": {"a": deep}}
    tool = {"type": "function", "function": {"name": "f", "parameters": deep}}
    body = {"messages": CHAT, "max_tokens": 2, "tools": [tool], "tool_choice": "none"}
    r = await post(client, "/v1/chat/completions", body)
    assert_error(r, 400, "tools[0].function.parameters.properties: nested deeper than", param="tools")
    nested: Any = []
    for _ in range(100):
        nested = [nested]
    body = {"messages": CHAT, "max_tokens": 2, "chat_template_kwargs": {"x": nested}}
    r = await post(client, "/v1/chat/completions", body)
    assert_error(r, 400, "chat_template_kwargs.x[0]", param="chat_template_kwargs")
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": {"a": nested}}}
    messages = [*CHAT, {"role": "assistant", "tool_calls": [call]}]
    r = await post(client, "/tokenize", {"model": "tiny", "messages": messages})
    assert_error(r, 400, "messages[2].tool_calls[0].function.arguments", param="messages")
    text = {"format": {"type": "text"}, "x": nested}
    r = await post(client, "/v1/responses", {"input": "hi", "max_output_tokens": 2, "text": text})
    assert_error(r, 400, "text.x[0]", param="text")


async def test_deep_schemas_are_400s_naming_the_field(client: httpx.AsyncClient) -> None:
    """A schema as JSON text is walked by the grammar converter alone: its depth is counted
    there, before it is parsed (before: a RecursionError, caught, "nested too deeply")."""
    schema = '{"type": "array", "items": ' * DEEP + "{}" + "}" * DEEP
    for field, value in [("guided_json", schema), ("structured_outputs", {"json": schema})]:
        r = await post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, field: value})
        name = "structured_outputs.json" if field == "structured_outputs" else field
        assert_error(r, 400, f"{name}: nested deeper than {MAX_JSON_DEPTH} levels", param=name)


@pytest.mark.parametrize("defs", [[], "x", 5, [["a", {}]]])
@pytest.mark.parametrize("tool_choice", ["required", "none", {"type": "function", "function": {"name": "f"}}])
async def test_a_defs_that_is_not_an_object_is_a_400_naming_it(
    client: httpx.AsyncClient, defs: Any, tool_choice: Any
) -> None:
    parameters = {"type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "$defs": defs}
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    body = {"messages": CHAT, "max_tokens": 2, "tools": [tool], "tool_choice": tool_choice}
    r = await post(client, "/v1/chat/completions", body)
    assert_error(r, 400, "tools[0].function.parameters.$defs: must be an object", param="tools")


@pytest.mark.parametrize(
    ("parameters", "message"),
    [
        ({"definitions": []}, "tools[0].function.parameters.definitions: must be an object"),
        ({"properties": "a"}, "tools[0].function.parameters.properties: must be an object"),
        ({"properties": {"a": 1}}, "tools[0].function.parameters.properties.a: must be a schema"),
        ({"properties": {"a": {"items": {"properties": []}}}}, "parameters.properties.a.items.properties: must be an"),
        ({"anyOf": {}}, "tools[0].function.parameters.anyOf: must be an array of schemas"),
        ({"required": "a"}, "tools[0].function.parameters.required: must be an array of strings"),
        ({"$defs": {"A": {"type": 3}}}, "tools[0].function.parameters.$defs.A.type: must be a string"),
    ],
)
async def test_malformed_tool_schemas_are_400s_naming_the_keyword(
    client: httpx.AsyncClient, parameters: dict[str, Any], message: str
) -> None:
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    body = {"messages": CHAT, "max_tokens": 2, "tools": [tool], "tool_choice": "required"}
    assert_error(await post(client, "/v1/chat/completions", body), 400, message, param="tools")


async def test_a_defs_that_is_not_an_object_on_responses_is_a_400(client: httpx.AsyncClient) -> None:
    tool = {"type": "function", "name": "f", "parameters": {"type": "object", "$defs": "x"}}
    body = {"input": "hi", "max_output_tokens": 2, "tools": [tool], "tool_choice": "required"}
    r = await post(client, "/v1/responses", body)
    assert_error(r, 400, ".parameters.$defs: must be an object", param="tools")


async def test_a_defs_that_is_an_object_is_kept(client: httpx.AsyncClient) -> None:
    """A valid schema with `$defs`, `anyOf` holding a boolean, `required` and `enum` is taken,
    and the same schema with `$defs` an array is not (before: the array was merged away)."""
    parameters = {
        "type": "object",
        "properties": {"a": {"$ref": "#/$defs/A"}, "b": {"anyOf": [{"type": "integer"}, True]}},
        "required": ["a"],
        "$defs": {"A": {"type": "string", "enum": ["x", "y"]}},
    }
    tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
    body = {"messages": CHAT, "max_tokens": 30, **GREEDY, "tools": [tool], "tool_choice": "required"}
    r = await post(client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    parameters["$defs"] = []
    r = await post(client, "/v1/chat/completions", body)
    assert_error(r, 400, "tools[0].function.parameters.$defs: must be an object", param="tools")


# ------------------------------------------------------------------------ the model's output


class ScriptedOutput:
    """An `AsyncLLM` whose outputs say `text` (see the module docstring): each delta the next
    `piece` characters of it, the last output the rest (so a final-only output is all of it)."""

    def __init__(self, llm: AsyncLLM, text: str, piece: int = 97) -> None:
        self._llm = llm
        self.text = text
        self.piece = piece

    def __getattr__(self, name: str) -> Any:
        return getattr(self._llm, name)

    async def add_request(self, *args: Any, **kwargs: Any) -> _ScriptedStream:
        return _ScriptedStream(await self._llm.add_request(*args, **kwargs), self)


class _ScriptedStream:
    def __init__(self, inner: Any, script: ScriptedOutput) -> None:
        self._inner = inner
        self._script = script
        self._sent: dict[int, int] = {}

    def __enter__(self) -> _ScriptedStream:
        self._inner.__enter__()
        return self

    def __exit__(self, *exc: Any) -> Any:
        return self._inner.__exit__(*exc)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        async for output in self._inner:
            outputs = [self._rewrite(c) for c in output.outputs]
            yield dataclasses.replace(output, outputs=outputs)

    def _rewrite(self, c: Any) -> Any:
        text, start = self._script.text, self._sent.get(c.index, 0)
        end = len(text) if c.finish_reason is not None else min(len(text), start + self._script.piece)
        self._sent[c.index] = end
        return dataclasses.replace(c, text=text[start:end])


@asynccontextmanager
async def scripted_client(llm: AsyncLLM, text: str, **settings: Any) -> AsyncIterator[httpx.AsyncClient]:
    server = ServerSettings(served_model_names=("tiny",), enable_auto_tool_choice=True, **settings)
    async with open_client(ServerState(cast(AsyncLLM, ScriptedOutput(llm, text)), server)) as client:
        yield client


async def whole_and_streamed(
    client: httpx.AsyncClient, tools: bool = True
) -> tuple[dict[str, Any], str, list[dict[str, Any]]]:
    """The whole answer's message, and the streamed content and tool calls."""
    body = {"messages": CHAT, "max_tokens": 6, **GREEDY, **({"tools": [TOOL]} if tools else {})}
    r = await post(client, "/v1/chat/completions", body)
    assert r.status_code == 200, r.text
    message = r.json()["choices"][0]["message"]
    events = sse(await post(client, "/v1/chat/completions", {**body, "stream": True}))
    content, calls = "", []
    for e in events:
        assert "error" not in e, e
        for c in e["choices"]:
            content += c["delta"].get("content") or ""
            calls += c["delta"].get("tool_calls") or []
    return message, content, calls


NEST = "[" * DEEP + "]" * DEEP
DEEP_JSON_OUTPUTS = {
    "hermes": '<tool_call>\n{"name": "get_weather", "arguments": {"where": ' + NEST + "}}\n</tool_call>",
    "llama3_json": '{"arguments": {"where": ' + NEST + '}, "name": "get_weather"}',
    "mistral": '[TOOL_CALLS][{"name": "get_weather", "arguments": {"where": ' + NEST + "}}]",
}


@pytest.mark.parametrize("parser", list(DEEP_JSON_OUTPUTS))
async def test_deep_json_in_a_tool_call_is_text(llm: AsyncLLM, parser: str) -> None:
    text = DEEP_JSON_OUTPUTS[parser]
    async with scripted_client(llm, text, tool_call_parser=parser) as client:
        message, content, calls = await whole_and_streamed(client)
    assert message["content"] == text and message["tool_calls"] == []
    # Streamed, a call announced before its arguments went too deep is closed early (its
    # arguments stay JSON) and the rest of it dropped; a call not announced yet is text.
    arguments: dict[int, str] = {}
    for c in calls:
        arguments[c["index"]] = arguments.get(c["index"], "") + (c["function"].get("arguments") or "")
    assert content == text if not calls else all(isinstance(json.loads(a), dict) for a in arguments.values())


XML_CALL = "<tool_call>\n<function=get_weather>\n<parameter={name}>\n{value}\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("where", NEST),  # JSON in XML (a recursion error at ~470 levels)
        ("extra", '{"a": ' * DEEP + "1" + "}" * DEEP),
        ("days", "9" * 5000),  # more digits than Python's int() reads
    ],
)
async def test_deep_or_huge_values_in_an_xml_call_stay_strings(llm: AsyncLLM, name: str, value: str) -> None:
    text = "Checking." + XML_CALL.format(name=name, value=value)
    async with scripted_client(llm, text, tool_call_parser="qwen3_xml") as client:
        message, content, calls = await whole_and_streamed(client)
    [call] = message["tool_calls"]
    assert json.loads(call["function"]["arguments"]) == {name: value}
    assert message["content"] == content == "Checking."
    assert json.loads("".join(c["function"].get("arguments") or "" for c in calls)) == {name: value}


async def test_a_huge_integer_in_a_json_call_is_text(llm: AsyncLLM) -> None:
    text = '[TOOL_CALLS]get_weather{"days": ' + "9" * 5000 + "}"
    async with scripted_client(llm, text, tool_call_parser="mistral") as client:
        message, _, calls = await whole_and_streamed(client)
    assert message["content"] == text and message["tool_calls"] == []
    assert "9" * 5000 not in "".join(c["function"].get("arguments") or "" for c in calls)


class _RaisingToolStream(ToolCallStream):
    """Holds the first delta back, then fails."""

    def __init__(self) -> None:
        self.fed = 0

    def feed(self, delta: str) -> StreamDelta:
        self.fed += 1
        if self.fed > 1:
            raise RuntimeError("boom")
        return StreamDelta()

    def finish(self) -> StreamDelta:
        raise RuntimeError("boom")


class RaisingToolParser(ToolParser):
    name = "raising"

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        raise RecursionError("maximum recursion depth exceeded")

    def stream(self) -> ToolCallStream:
        return _RaisingToolStream()


class _RaisingReasoningStream(ReasoningStream):
    def __init__(self) -> None:
        self.fed = 0

    def feed(self, delta: str) -> tuple[str, str]:
        self.fed += 1
        if self.fed > 1:
            raise ValueError("boom")
        return "", ""

    def finish(self) -> tuple[str, str]:
        raise ValueError("boom")


class RaisingReasoningParser(ReasoningParser):
    name = "raising"
    start_token = "<think>"
    end_token = "</think>"

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        raise ValueError("boom")

    def stream(self) -> ReasoningStream:
        return _RaisingReasoningStream()


@pytest.mark.parametrize("which", ["tool", "reasoning"])
async def test_a_parser_that_raises_gives_the_text(
    llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, which: str
) -> None:
    """A plugin parser that raises, on the whole output and on the second delta of a stream:
    the output is plain text (what the stream held back included), logged by class name."""
    for manager in (ToolParserManager, ReasoningParserManager):
        monkeypatch.setattr(manager.registry, "parsers", dict(manager.registry.parsers))
    ToolParserManager.register_module("raising")(RaisingToolParser)
    ReasoningParserManager.register_module("raising")(RaisingReasoningParser)
    settings = {"tool_call_parser": "raising"} if which == "tool" else {"reasoning_parser": "raising"}
    text = "It is sunny in Paris. " * 20
    async with scripted_client(llm, text, **settings) as client:
        message, content, calls = await whole_and_streamed(client, tools=which == "tool")
    assert message["content"] == content == text and message["tool_calls"] == calls == []
    assert message["reasoning"] is None
    name = "RaisingToolParser" if which == "tool" else "RaisingReasoningParser"
    assert f"output parser {name} raised" in caplog.text
