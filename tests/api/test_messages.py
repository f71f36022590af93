"""Anthropic's Messages API in process: the conversion of a request into the chat route's own
request and of the chat's answer back (streamed events in Anthropic's order, adding up in the
`anthropic` client's own accumulator to the whole message, for any split of the output), then
the routes on the tiny model over asyncio and trio (httpx's ASGI transport): the message, its
stream, count_tokens, stop sequences, `x-api-key`, and errors in Anthropic's shape.
tests/acceptance/test_messages_server.py drives a real `triollm serve` with the `anthropic`
client."""

from __future__ import annotations

import json
from typing import Any

import httpx
import msgspec
import pytest
from anthropic.lib.streaming._messages import accumulate_event
from conftest import MODEL
from tinymodel import build_tokenizer

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.messages_convert import chat_request
from triollm.api.openai_errors import APIError
from triollm.api.output_parsing import make_output_parsing
from triollm.api.protocol_messages import MessagesRequest
from triollm.api.serving_chat import ChatFormatter
from triollm.api.serving_messages import MessagesFormatter, stop_reason
from triollm.api.state import ServerSettings, ServerState
from triollm.api.tool_calls import ToolChoice
from triollm.engine.outputs import CompletionOutput, RequestOutput

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
WEATHER = {"name": "get_weather", "description": "The weather in a city.", "input_schema": SCHEMA}
CHAT_WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "parameters": SCHEMA, "description": "The weather in a city."},
}
GREEDY = {"temperature": 0}


def convert(body: dict[str, Any]) -> Any:
    return chat_request(msgspec.convert({"model": MODEL, "max_tokens": 7, **body}, MessagesRequest))


# ----------------------------------------------------------------------- request -> chat


def test_a_request_becomes_the_chat_routes_request() -> None:
    chat = convert(
        {
            "system": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}],
            "messages": [
                {"role": "user", "content": "Weather in Paris?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "A tool knows.", "signature": ""},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                        {"type": "tool_result", "tool_use_id": "toolu_2", "is_error": True,
                         "content": [{"type": "text", "text": "no such city"}]},
                        {"type": "tool_result", "tool_use_id": "toolu_3"},
                        {"type": "text", "text": "And Rome?"},
                    ],
                },
            ],
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
            "stop_sequences": ["END"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 5,
            "metadata": {"user_id": "u1"},
            "thinking": {"type": "enabled", "budget_tokens": 1024},
        }
    )  # fmt: skip
    call = {"id": "toolu_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city":"Paris"}'}}
    assert [m.to_dict() for m in chat.messages] == [
        {"role": "system", "content": [{"type": "text", "text": "Be brief."}, {"type": "text", "text": "Use tools."}]},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."}], "tool_calls": [call]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "tool", "content": "Error: no such city", "tool_call_id": "toolu_2"},
        {"role": "tool", "content": "", "tool_call_id": "toolu_3"},
        {"role": "user", "content": [{"type": "text", "text": "And Rome?"}]},
    ]
    assert chat.tools == [CHAT_WEATHER]
    assert chat.tool_choice == {"type": "function", "function": {"name": "get_weather"}}
    assert chat.parallel_tool_calls is False
    assert (chat.max_tokens, chat.stop, chat.temperature, chat.top_p, chat.top_k) == (7, ["END"], 0.5, 0.9, 5)
    assert chat.user == "u1" and chat.chat_template_kwargs == {"enable_thinking": True}
    assert chat.add_generation_prompt and not chat.continue_final_message and not chat.stream


@pytest.mark.parametrize(
    ("choice", "expected"), [("auto", "auto"), ("any", "required"), ("none", "none")]
)
def test_tool_choices(choice: str, expected: str) -> None:
    user = [{"role": "user", "content": "hi"}]
    chat = convert({"messages": user, "tools": [WEATHER], "tool_choice": {"type": choice}})
    assert chat.tool_choice == expected and chat.parallel_tool_calls is None


def test_a_final_assistant_turn_is_continued_and_thinking_can_be_off() -> None:
    chat = convert(
        {
            "messages": [{"role": "user", "content": "Count"}, {"role": "assistant", "content": "1, 2,"}],
            "thinking": {"type": "disabled"},
            "output_config": {"format": {"type": "json_schema", "schema": SCHEMA}},
        }
    )
    assert chat.continue_final_message and not chat.add_generation_prompt
    assert chat.chat_template_kwargs == {"enable_thinking": False}
    assert chat.response_format == {"type": "json_schema", "json_schema": {"name": "output", "schema": SCHEMA}}


def _user(*blocks: dict[str, Any]) -> dict[str, Any]:
    return {"messages": [{"role": "user", "content": list(blocks)}]}


@pytest.mark.parametrize(
    ("body", "fragment"),
    [
        (_user({"type": "text", "text": "see"}, {"type": "image", "source": {"type": "url", "url": "http://x"}}),
         "messages[0].content[1].type: 'image' blocks are not supported"),
        (_user({"type": "document", "source": {}}), "messages[0].content[0].type: 'document' blocks are not supported"),
        (_user({"type": "tool_result", "tool_use_id": "t", "content": [{"type": "image", "source": {}}]}),
         "messages[0].content[0].content[0].type: 'image' blocks"),
        (_user({"type": "tool_use", "id": "t", "name": "f", "input": {}}),
         "messages[0].content[0].type: must be one of 'text', 'tool_result'; got 'tool_use'"),
        ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
         "messages[0].content[0].input: must be an object"),
        ({"messages": [{"role": "system", "content": "x"}]}, "messages[0].role: must be one of 'user', 'assistant'"),
        ({**_user({"type": "text", "text": "x"}), "tools": [WEATHER], "tool_choice": {"type": "sometimes"}},
         "tool_choice.type: must be one of 'auto', 'any', 'tool', 'none'; got 'sometimes'"),
        ({**_user({"type": "text", "text": "x"}), "tools": [WEATHER], "tool_choice": {"type": "tool"}},
         "tool_choice.name"),
        ({**_user({"type": "text", "text": "x"}), "tools": [{"type": "web_search_20250305", "name": "web_search"}]},
         "tools[0].type: only custom tools"),
        ({**_user({"type": "text", "text": "x"}), "tools": [{"name": "f"}]}, "tools[0].input_schema"),
        ({**_user({"type": "text", "text": "x"}), "thinking": {"type": "maybe"}},
         "thinking.type: must be one of 'enabled', 'disabled', 'adaptive'"),
        ({**_user({"type": "text", "text": "x"}), "output_config": {"format": {"type": "regex"}}},
         "output_config.format"),
        ({"system": [{"type": "image"}], **_user({"type": "text", "text": "x"})}, "system[0].type: 'image' blocks"),
    ],
)  # fmt: skip
def test_what_cannot_be_converted_is_a_400_naming_the_field(body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(APIError) as caught:
        convert(body)
    assert caught.value.status == 400 and fragment in caught.value.message, caught.value.message


# ----------------------------------------------------------------------- chat answer -> message


def test_stop_reasons() -> None:
    assert stop_reason("length", None, True) == ("max_tokens", None)
    assert stop_reason("tool_calls", None, True) == ("tool_use", None)
    assert stop_reason("stop", None, True) == ("tool_use", None)  # a forced call ends "stop"
    assert stop_reason("stop", "END", False) == ("stop_sequence", "END")
    assert stop_reason("stop", 2, False) == ("end_turn", None)  # the end token
    assert stop_reason("stop", None, False) == ("end_turn", None)


THOUGHT_AND_CALL = (
    '<think>Paris, then.</think>Let me check.<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}'
    "</tool_call>"
)


def _formatter(reasoning_parser: str | None, tool_call_parser: str | None) -> MessagesFormatter:
    tokenizer = build_tokenizer()
    choice = ToolChoice("auto", (CHAT_WEATHER,)) if tool_call_parser else ToolChoice("none")
    parsing = make_output_parsing(
        choice, tokenizer=tokenizer, tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser
    )
    chat = ChatFormatter(
        response_id="msg_test", model=MODEL, n=1, role="assistant", top_logprobs=None, include_usage=False,
        continuous_usage=False, tokenizer=tokenizer, prompt_tokens=3, parsing=parsing,
    )  # fmt: skip
    return MessagesFormatter(chat)


def _output(text: str, last: bool, finish: str = "stop", stop: int | str | None = None) -> RequestOutput:
    ids = [1] * max(1, len(text) // 4)
    c = CompletionOutput(0, text, ids, None, None, finish if last else None, stop if last else None)
    return RequestOutput("r", None, [1, 2, 3], None, [c], last)


def assert_anthropic_order(events: list[dict[str, Any]]) -> None:
    """message_start; per block content_block_start, its deltas (of its index and kind),
    content_block_stop; message_delta; message_stop. Pings may come anywhere after the start."""
    events = [e for e in events if e["type"] != "ping"]
    assert events[0]["type"] == "message_start"
    assert [e["type"] for e in events[-2:]] == ["message_delta", "message_stop"]
    kinds = {"text": "text_delta", "thinking": "thinking_delta", "tool_use": "input_json_delta"}
    open_block: dict[str, Any] | None = None
    blocks = 0
    for e in events[1:-2]:
        if open_block is None:
            assert e["type"] == "content_block_start" and e["index"] == blocks, e
            open_block, blocks = e, blocks + 1
        elif e["type"] == "content_block_stop":
            assert e["index"] == open_block["index"]
            open_block = None
        else:
            assert e["type"] == "content_block_delta" and e["index"] == open_block["index"], e
            assert e["delta"]["type"] == kinds[open_block["content_block"]["type"]]
    assert open_block is None and blocks >= 1


def _streamed(formatter: MessagesFormatter, pieces: list[str], **finish: Any) -> list[dict[str, Any]]:
    events = formatter.stream_start()
    for k, piece in enumerate(pieces):
        events += formatter.stream_output(0, _output(piece, k == len(pieces) - 1, **finish))
    events += formatter.stream_end()
    return [msgspec.to_builtins(e) for e in events]


def _without_tool_ids(message: dict[str, Any]) -> dict[str, Any]:
    for block in message["content"]:
        if block["type"] == "tool_use":
            assert block["id"].startswith("toolu_")
            block["id"] = "toolu_"
    return message


def _accumulated(events: list[dict[str, Any]]) -> dict[str, Any]:
    """The message the `anthropic` client builds from the events."""
    snapshot = None
    json_bufs: dict[int, bytes] = {}
    for event in events:
        snapshot = accumulate_event(event=event, current_snapshot=snapshot, json_bufs=json_bufs)  # type: ignore[arg-type]
    assert snapshot is not None
    return snapshot.to_dict(exclude_none=True)  # type: ignore[no-any-return]


def test_thinking_text_and_a_call_whole_and_streamed_at_every_split() -> None:
    whole = msgspec.to_builtins(_formatter("deepseek_r1", "hermes").final([_output(THOUGHT_AND_CALL, True)]))
    assert [b["type"] for b in whole["content"]] == ["thinking", "text", "tool_use"]
    assert whole["content"][0] == {"type": "thinking", "thinking": "Paris, then.", "signature": ""}
    assert whole["content"][1]["text"].strip() == "Let me check."
    assert whole["content"][2]["name"] == "get_weather" and whole["content"][2]["input"] == {"city": "Paris"}
    assert (whole["stop_reason"], whole["stop_sequence"]) == ("tool_use", None)
    assert whole["id"] == "msg_test" and whole["usage"]["input_tokens"] == 3
    whole = _without_tool_ids(whole)
    text = THOUGHT_AND_CALL
    splits = [[text[i : i + 3] for i in range(0, len(text), 3)], list(text)]
    splits += [[text[:i], text[i:]] for i in range(1, len(text))]
    for pieces in splits:
        events = _streamed(_formatter("deepseek_r1", "hermes"), pieces)
        assert_anthropic_order(events)
        message = _without_tool_ids(_accumulated(events))
        usage = events[-2]["usage"]
        assert message["content"] == whole["content"], pieces
        assert message["stop_reason"] == "tool_use" and usage["output_tokens"] == sum(
            max(1, len(p) // 4) for p in pieces
        )


def test_a_stop_string_and_an_empty_answer() -> None:
    formatter = _formatter(None, None)
    events = _streamed(formatter, ["It is ", "4."], stop="END")
    assert_anthropic_order(events)
    assert events[-2]["delta"] == {"stop_reason": "stop_sequence", "stop_sequence": "END"}
    assert _accumulated(events)["content"] == [{"type": "text", "text": "It is 4."}]
    # Nothing generated: one empty text block, streamed and whole alike.
    events = _streamed(_formatter(None, None), [""], finish="length")
    assert [e["type"] for e in events] == [
        "message_start", "content_block_start", "content_block_stop", "message_delta", "message_stop",
    ]  # fmt: skip
    assert events[-2]["delta"]["stop_reason"] == "max_tokens"
    whole = _formatter(None, None).final([_output("", True, finish="length")])
    assert msgspec.to_builtins(whole.content) == [{"type": "text", "text": ""}]


# ----------------------------------------------------------------------- the routes


def sse_events(r: httpx.Response) -> list[dict[str, Any]]:
    """The events of an Anthropic SSE body: each an `event: TYPE` line then its `data:`."""
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    blocks = r.text.split("\n\n")
    assert blocks[-1] == "" and "[DONE]" not in r.text
    events = []
    for block in blocks[:-1]:
        event_line, data_line = block.split("\n")
        data = json.loads(data_line.removeprefix("data: "))
        assert event_line == f"event: {data['type']}"
        events.append(data)
    return events


def assert_anthropic_error(r: httpx.Response, status: int, kind: str, *fragments: str) -> None:
    assert r.status_code == status, r.text
    body = r.json()
    assert list(body) == ["type", "error"] and body["type"] == "error"
    assert body["error"]["type"] == kind and set(body["error"]) == {"type", "message"}
    for fragment in fragments:
        assert fragment in body["error"]["message"], body


CHAT = {"system": "Be brief.", "messages": [{"role": "user", "content": "Hello"}]}


@pytest.mark.anyio
async def test_a_message_its_stream_and_its_token_count(client: httpx.AsyncClient, llm: AsyncLLM) -> None:
    body = {"model": MODEL, "max_tokens": 6, **GREEDY, **CHAT}
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    message = r.json()
    assert list(message) == ["id", "type", "role", "content", "model", "stop_reason", "stop_sequence", "usage"]
    assert message["id"].startswith("msg_") and message["type"] == "message" and message["role"] == "assistant"
    assert message["model"] == MODEL and message["stop_reason"] == "max_tokens" and message["stop_sequence"] is None
    [block] = message["content"]
    assert block["type"] == "text" and block["text"]
    prompt = llm.get_tokenizer().render_chat(
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello"}]
    )
    assert message["usage"] == {"input_tokens": len(prompt.token_ids), "output_tokens": 6}
    counted = await client.post("/v1/messages/count_tokens", json={"model": MODEL, **CHAT})
    assert counted.status_code == 200 and counted.json() == {"input_tokens": len(prompt.token_ids)}

    events = sse_events(await client.post("/v1/messages", json={**body, "stream": True}))
    assert_anthropic_order(events)
    start = events[0]["message"]
    assert start["content"] == [] and start["stop_reason"] is None and start["id"].startswith("msg_")
    assert start["usage"] == {"input_tokens": len(prompt.token_ids), "output_tokens": 0}
    text = "".join(e["delta"]["text"] for e in events if e["type"] == "content_block_delta")
    assert text == block["text"]
    assert events[-2]["delta"] == {"stop_reason": "max_tokens", "stop_sequence": None}
    assert events[-2]["usage"] == message["usage"]


@pytest.mark.anyio
async def test_stop_sequences(client: httpx.AsyncClient) -> None:
    body = {"model": MODEL, "max_tokens": 12, **GREEDY, **CHAT}
    text = (await client.post("/v1/messages", json=body)).json()["content"][0]["text"]
    at = next(i for i in range(1, len(text) - 1) if text[i : i + 2].strip() and "\ufffd" not in text[i : i + 2])
    stop = text[at : at + 2]
    r = await client.post("/v1/messages", json={**body, "stop_sequences": ["never-seen", stop]})
    message = r.json()
    assert (message["stop_reason"], message["stop_sequence"]) == ("stop_sequence", stop)
    assert message["content"] == [{"type": "text", "text": text[: text.index(stop)]}]


@pytest.mark.anyio
async def test_errors_are_in_anthropics_shape(client: httpx.AsyncClient) -> None:
    user = [{"role": "user", "content": "hi"}]
    r = await client.post("/v1/messages", json={"model": MODEL, "messages": user})
    assert_anthropic_error(r, 400, "invalid_request_error", "max_tokens")
    r = await client.post("/v1/messages", json={"model": MODEL, "max_tokens": 0, "messages": user})
    assert_anthropic_error(r, 400, "invalid_request_error", "max_tokens")
    body = {"model": MODEL, "max_tokens": 4, "messages": user, "tools": [WEATHER], "tool_choice": {"type": "x"}}
    r = await client.post("/v1/messages", json=body)
    assert_anthropic_error(r, 400, "invalid_request_error", "tool_choice.type")
    image = [{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "data": ""}}]}]
    r = await client.post("/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": image})
    assert_anthropic_error(r, 400, "invalid_request_error", "messages[0].content[0].type")
    r = await client.post("/v1/messages", json={"model": "claude-nope", "max_tokens": 4, "messages": user})
    assert_anthropic_error(r, 404, "not_found_error", "claude-nope")
    r = await client.post("/v1/messages", content=b"{}", headers={"content-type": "text/plain"})
    assert_anthropic_error(r, 400, "invalid_request_error", "application/json")
    r = await client.post("/v1/messages/count_tokens", json={"model": MODEL})
    assert_anthropic_error(r, 400, "invalid_request_error", "messages")
    # The engine's refusal (a prompt longer than the context), whole and streamed.
    long = [{"role": "user", "content": "hello " * 400}]
    for stream in (False, True):
        body = {"model": MODEL, "max_tokens": 4, "messages": long, "stream": stream}
        r = await client.post("/v1/messages", json=body)
        assert_anthropic_error(r, 400, "invalid_request_error")
    # The chat routes keep OpenAI's shape.
    r = await client.post("/v1/chat/completions", json={"model": MODEL, "messages": image})
    assert r.status_code == 400 and set(r.json()) == {"error"}


@pytest.mark.anyio
async def test_x_api_key(llm: AsyncLLM) -> None:
    state = ServerState(llm, ServerSettings(served_model_names=(MODEL,), api_key="s3cret"))
    transport = httpx.ASGITransport(app=build_app(state))
    body = {"model": MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "hi"}]}
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        for headers in ({}, {"x-api-key": "wrong"}, {"Authorization": "Bearer wrong"}):
            r = await client.post("/v1/messages", json=body, headers=headers)
            assert_anthropic_error(r, 401, "authentication_error", "x-api-key")
            r = await client.post("/v1/messages/count_tokens", json=body, headers=headers)
            assert_anthropic_error(r, 401, "authentication_error")
            r = await client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and set(r.json()) == {"error"}  # OpenAI's shape off these routes
        for headers in ({"x-api-key": "s3cret"}, {"Authorization": "Bearer s3cret"}):
            assert (await client.post("/v1/messages", json=body, headers=headers)).status_code == 200
            assert (await client.get("/v1/models", headers=headers)).status_code == 200


@pytest.mark.anyio
async def test_an_error_after_the_stream_started_is_an_anthropic_error_event(
    client: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    works = MessagesFormatter.stream_output

    def broken(self: MessagesFormatter, index: int, output: RequestOutput) -> list[Any]:
        if self.blocks:  # once the first events are out
            raise RuntimeError("formatting failed")
        return works(self, index, output)

    monkeypatch.setattr(MessagesFormatter, "stream_output", broken)
    body = {"model": MODEL, "max_tokens": 8, "stream": True, **CHAT}
    r = await client.post("/v1/messages", json=body)
    assert r.status_code == 200 and r.text.startswith("event: message_start\n")
    last = r.text.split("\n\n")[-2]
    event_line, data_line = last.split("\n")
    assert event_line == "event: error"
    error = json.loads(data_line.removeprefix("data: "))
    assert error == {"type": "error", "error": {"type": "api_error", "message": error["error"]["message"]}}
    assert "RuntimeError" in error["error"]["message"]


@pytest.mark.anyio
async def test_output_config_format_is_structured_outputs(client: httpx.AsyncClient) -> None:
    answer = {
        "type": "object",
        "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
        "required": ["answer"],
        "additionalProperties": False,
    }
    body = {"model": MODEL, "max_tokens": 48, **GREEDY, **CHAT}

    def formatted(schema: dict[str, Any]) -> dict[str, Any]:
        return {**body, "output_config": {"format": {"type": "json_schema", "schema": schema}}}

    r = await client.post("/v1/messages", json=formatted(answer))
    assert r.status_code == 200, r.text
    text = "".join(r.json()["content"][0]["text"].split())  # the random model pads with whitespace
    assert text and any(f'{{"answer":"{a}"}}'.startswith(text) for a in ("yes", "no")), text
    bad = {"type": "object", "properties": {"a": {"type": "nonsense"}}}
    r = await client.post("/v1/messages", json=formatted(bad))
    assert_anthropic_error(r, 400, "invalid_request_error", "output_config.format")
    assert "response_format" not in r.json()["error"]["message"]
