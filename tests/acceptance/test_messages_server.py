"""Anthropic's Messages API through the official `anthropic` client against a real `triollm serve`
on the bundled model, as a coding agent pointed at a local server drives it: messages.create,
messages.stream (the events in Anthropic's order and the client's final message), a two-turn
agent loop (a forced `tool_use`, its `tool_result`, then an answer in text), count_tokens,
`thinking` blocks from the reasoning parser, the key sent as `x-api-key`, and bad requests as
400s in Anthropic's shape. The server runs test_agent_loop.py's Hermes-style template with the
hermes tool parser and DeepSeek V3's reasoning parser (which reads reasoning only when the
request switches thinking on)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest
from server import Server, run_server
from test_agent_loop import TEMPLATE, WEATHER

MODEL = "smol"
KEY = "s3cret"
TOOL = {
    "name": "get_weather",
    "description": WEATHER["function"]["description"],  # type: ignore[index]
    "input_schema": WEATHER["function"]["parameters"],  # type: ignore[index]
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]
GREEDY = {"temperature": 0}  # not among this client's keyword arguments: sent as an extra field


@pytest.fixture(scope="module")
def server(bundled_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = tmp_path_factory.mktemp("template") / "tool_chat.jinja"
    template.write_text(TEMPLATE)
    flags = (
        "--served-model-name", MODEL, "--api-key", KEY, "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
        "--reasoning-parser", "deepseek_v3", "--chat-template", str(template), "--max-model-len", "2k",
    )  # fmt: skip
    with run_server(bundled_model_dir, *flags) as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0)


def _event_types(events: list[Any]) -> list[str]:
    return [e.type for e in events if e.type != "ping"]


def assert_anthropic_order(types: list[str]) -> None:
    """message_start, (content_block_start, content_block_delta*, content_block_stop)+,
    message_delta, message_stop."""
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"], types
    in_block = False
    for kind in types[1:-2]:
        if not in_block:
            assert kind == "content_block_start", types
            in_block = True
        elif kind == "content_block_stop":
            in_block = False
        else:
            assert kind == "content_block_delta", types
    assert not in_block and "content_block_start" in types


def test_create_and_stream(client: anthropic.Anthropic) -> None:
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 8, "system": "Answer briefly.", "extra_body": GREEDY}
    message = client.messages.create(messages=QUESTION, **kw)  # type: ignore[arg-type]
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL and message.stop_reason == "max_tokens" and message.stop_sequence is None
    [block] = message.content
    assert block.type == "text" and block.text.strip()
    assert message.usage.output_tokens == 8 and message.usage.input_tokens > 0
    # The raw events, in Anthropic's order, and the client's own stream helper over them.
    events = list(client.messages.create(messages=QUESTION, stream=True, **kw))  # type: ignore[arg-type]
    assert_anthropic_order(_event_types(events))
    deltas = "".join(e.delta.text for e in events if e.type == "content_block_delta")  # type: ignore[union-attr]
    assert deltas == block.text
    with client.messages.stream(messages=QUESTION, **kw) as stream:  # type: ignore[arg-type]
        texts = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(texts) == block.text and final.content[0].text == block.text  # type: ignore[union-attr]
    assert final.stop_reason == "max_tokens" and final.usage == message.usage


def test_count_tokens_is_the_prompt_of_the_same_chat(client: anthropic.Anthropic, server: Server) -> None:
    kw: dict[str, Any] = {"model": MODEL, "system": "Answer briefly.", "messages": QUESTION}
    counted = client.messages.count_tokens(**kw).input_tokens
    message = client.messages.create(max_tokens=1, **kw)
    assert counted == message.usage.input_tokens > 0
    chat = [{"role": "system", "content": "Answer briefly."}, *QUESTION]
    r = httpx.post(f"{server.url}/tokenize", json={"model": MODEL, "messages": chat}, timeout=30)
    assert r.json()["count"] == counted
    # Tools reach the template, so they are counted too.
    with_tools = client.messages.count_tokens(tools=[TOOL], **kw).input_tokens  # type: ignore[list-item]
    assert with_tools == client.messages.create(max_tokens=1, tools=[TOOL], **kw).usage.input_tokens > counted  # type: ignore[list-item]


def _turn(
    client: anthropic.Anthropic, messages: list[dict[str, Any]], stream: bool, **kw: Any
) -> anthropic.types.Message:
    if not stream:
        return client.messages.create(model=MODEL, messages=messages, extra_body=GREEDY, **kw)  # type: ignore[arg-type]
    with client.messages.stream(model=MODEL, messages=messages, extra_body=GREEDY, **kw) as events:  # type: ignore[arg-type]
        types = _event_types(list(events))
        message = events.get_final_message()
    # The helper adds its own derived events (text, input_json, ...) after the raw ones.
    raw = [t for t in types if t in ("message_start", "content_block_start", "content_block_delta",
                                     "content_block_stop", "message_delta", "message_stop")]  # fmt: skip
    assert_anthropic_order(raw)
    return message


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_an_agent_loop_of_two_tool_turns(client: anthropic.Anthropic, stream: bool) -> None:
    """tool_use -> tool_result, twice (each call sent back with the client's own blocks, the
    results under their ids), then an answer in text, as an agent loop runs it."""
    messages: list[dict[str, Any]] = list(QUESTION)
    named = {"type": "tool", "name": "get_weather"}
    ids = []
    for celsius in (21, 23):
        turn = _turn(client, messages, stream, max_tokens=24, tools=[TOOL], tool_choice=named)
        assert turn.stop_reason == "tool_use"
        [call] = [b for b in turn.content if b.type == "tool_use"]
        assert call.id.startswith("toolu_") and call.name == "get_weather" and call.id not in ids
        assert call.input["city"] in ("Paris", "Rome", "Oslo")  # type: ignore[index]
        ids.append(call.id)
        result = json.dumps({"city": call.input["city"], "sky": "sunny", "celsius": celsius})  # type: ignore[index]
        messages += [
            {"role": "assistant", "content": turn.content},  # the client's own blocks, sent back as they came
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": result}]},
        ]
    second = _turn(client, messages, stream, max_tokens=12, tools=[TOOL], tool_choice={"type": "none"})
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [b.type for b in second.content] == ["text"] and second.content[0].text.strip()  # type: ignore[union-attr]
    # "any" forces a call of some tool too.
    again = _turn(client, list(QUESTION), stream, max_tokens=32, tools=[TOOL], tool_choice={"type": "any"})
    assert again.stop_reason == "tool_use" and again.content[-1].type == "tool_use"


def test_thinking_blocks_from_the_reasoning_parser(client: anthropic.Anthropic) -> None:
    """With thinking on, the reasoning parser reads the output as reasoning (no end marker: all
    of it): a `thinking` block, whole and streamed; off, the same output is text."""
    kw: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "messages": QUESTION, "extra_body": GREEDY}
    plain = client.messages.create(**kw)
    thinking = client.messages.create(thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    [block] = thinking.content
    assert block.type == "thinking" and block.thinking.strip() and thinking.stop_reason == "max_tokens"
    with client.messages.stream(thinking={"type": "enabled", "budget_tokens": 1024}, **kw) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert "thinking_delta" in [e.delta.type for e in events if e.type == "content_block_delta"]  # type: ignore[union-attr]
    assert final.content[0].type == "thinking" and final.content[0].thinking == block.thinking  # type: ignore[union-attr]
    assert [b.type for b in plain.content] == ["text"]


def test_the_key_as_x_api_key_and_errors_in_anthropics_shape(client: anthropic.Anthropic, server: Server) -> None:
    wrong = anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        wrong.messages.create(model=MODEL, max_tokens=4, messages=QUESTION)  # type: ignore[arg-type]
    assert caught.value.status_code == 401
    assert caught.value.body["type"] == "error"  # type: ignore[index]
    assert caught.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    r = httpx.post(f"{server.url}/v1/messages", json={"model": MODEL, "max_tokens": 4, "messages": QUESTION})
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    # max_tokens is required (the client insists too: sent here as a raw body).
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.post("/v1/messages", cast_to=anthropic.types.Message, body={"model": MODEL, "messages": QUESTION})
    assert bad.value.body["error"]["type"] == "invalid_request_error"  # type: ignore[index]
    assert "max_tokens" in bad.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as bad:
        client.messages.create(
            model=MODEL, max_tokens=4, messages=QUESTION, tools=[TOOL], tool_choice={"type": "sometimes"}  # type: ignore[arg-type, list-item, typeddict-item]
        )
    message = bad.value.body["error"]["message"]  # type: ignore[index]
    assert "tool_choice.type" in message and "'auto', 'any', 'tool', 'none'" in message
    with pytest.raises(anthropic.NotFoundError):
        client.messages.create(model="claude-nope", max_tokens=4, messages=QUESTION)  # type: ignore[arg-type]
    assert client.messages.create(model=MODEL, max_tokens=2, messages=QUESTION).usage.output_tokens <= 2  # type: ignore[arg-type]
