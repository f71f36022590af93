"""`/v1/responses` on the bundled SmolLM2 served in process (httpx's ASGI transport), driven
with the official `openai` client: text, instructions, the token limit, `text.format`, a
forced function call and its result in a second turn through `previous_response_id`, the
stream events (checked by the client's own stream accumulator), the store (retrieve, delete,
`store: false`, eviction), and 400/404s in OpenAI's shape. One engine for the module (trio, see `anyio_backend`);
every request asks for at most 16 tokens."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import msgspec
import openai
import pytest
from openai._models import construct_type
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.output_parsing import make_output_parsing
from triollm.api.protocol import ChatMessage
from triollm.api.protocol_responses import ResponseObject
from triollm.api.serving_responses import ResponsesFormatter, ResponseStore
from triollm.api.state import ServerSettings, ServerState
from triollm.api.tool_calls import ToolChoice
from triollm.engine.config import EngineArgs
from triollm.engine.outputs import CompletionOutput, RequestOutput

pytestmark = pytest.mark.anyio
MODEL = "smol"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 8}},
        "required": ["city"],
        "additionalProperties": False,
    },
}
ANSWER = {
    "type": "object",
    "properties": {"answer": {"type": "string", "enum": ["yes", "no"]}},
    "required": ["answer"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def anyio_backend() -> str:
    # One engine for the module, on the project's default backend (the stream framing is the
    # same on both; tests/api/test_app.py runs the routes over asyncio and trio).
    return "trio"


@pytest.fixture(scope="module")
async def served(bundled_model_dir: Path, anyio_backend: str) -> AsyncIterator[tuple[AsyncLLM, Any]]:
    args = EngineArgs(model=str(bundled_model_dir), max_model_len=512, multiprocess=False, seed=0, num_threads=2)
    async with AsyncLLM.from_engine_args(args) as llm:
        yield llm, build_app(ServerState(llm, ServerSettings(served_model_names=(MODEL,))))


@pytest.fixture
async def http(served: tuple[AsyncLLM, Any]) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=served[1])
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        yield c


@pytest.fixture
def client(http: httpx.AsyncClient) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url="http://testserver/v1", api_key="x", http_client=http, max_retries=0)


def prompt_tokens(llm: AsyncLLM, messages: list[dict[str, Any]]) -> int:
    return len(llm.get_tokenizer().render_chat(messages).token_ids)


async def test_text_instructions_and_the_token_limit(client: openai.AsyncOpenAI, served: tuple[AsyncLLM, Any]) -> None:
    llm = served[0]
    r = await client.responses.create(
        model=MODEL, input="Name a colour.", instructions="Answer in one word.", max_output_tokens=3, temperature=0
    )
    assert r.id.startswith("resp_") and r.object == "response" and r.model == MODEL
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens"
    [message] = r.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert message.content[0].type == "output_text" and message.content[0].annotations == []
    assert r.output_text == message.content[0].text != ""
    assert r.instructions == "Answer in one word." and r.max_output_tokens == 3 and r.temperature == 0
    assert r.usage is not None and r.usage.output_tokens == 3
    expected = prompt_tokens(
        llm, [{"role": "system", "content": "Answer in one word."}, {"role": "user", "content": "Name a colour."}]
    )
    assert r.usage.input_tokens == expected and r.usage.total_tokens == expected + 3
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    # A developer message is the system message; message items with content parts.
    items = [
        {"role": "developer", "content": "Answer in one word."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Name a colour."}]},
    ]
    again = await client.responses.create(model=MODEL, input=items, max_output_tokens=3, temperature=0)  # type: ignore[arg-type]
    assert again.usage is not None and again.usage.input_tokens == expected
    assert again.output_text == r.output_text


async def test_text_format_json_schema(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(
        model=MODEL,
        input="Is the sky blue? Answer as JSON.",
        text={"format": {"type": "json_schema", "name": "answer", "schema": ANSWER, "strict": True}},
        max_output_tokens=16,
        temperature=0,
    )
    assert r.status == "completed" and r.completed_at is not None and r.incomplete_details is None
    jsonschema.validate(json.loads(r.output_text), ANSWER)
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"


async def test_forced_function_call_then_its_result(client: openai.AsyncOpenAI, served: tuple[AsyncLLM, Any]) -> None:
    first = await client.responses.create(
        model=MODEL,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=16,
        temperature=0,
    )
    assert first.status == "completed", first
    [call] = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.id is not None and call.id.startswith("fc_") and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    assert first.tools[0].type == "function" and first.tools[0].name == "get_weather"
    assert first.tool_choice.type == "function"  # type: ignore[union-attr]
    second = await client.responses.create(
        model=MODEL,
        previous_response_id=first.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"}],
        max_output_tokens=8,
        temperature=0,
    )
    assert second.previous_response_id == first.id and second.output[0].type == "message"
    assert second.output_text
    conversation = [
        {"role": "user", "content": "What is the weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "get_weather", "arguments": call.arguments}}
        ]},
        {"role": "tool", "content": "22 C, sunny", "tool_call_id": call.call_id},
    ]  # fmt: skip
    assert second.usage is not None and second.usage.input_tokens == prompt_tokens(served[0], conversation)
    # The same turn sent whole (the function_call item back in the input) reads the same prompt.
    whole = await client.responses.create(
        model=MODEL,
        input=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": "get_weather", "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "22 C, sunny"},
        ],
        max_output_tokens=8,
        temperature=0,
        store=False,
    )
    assert whole.usage is not None and whole.usage.input_tokens == second.usage.input_tokens
    assert whole.output_text == second.output_text


async def test_streamed_events(client: openai.AsyncOpenAI) -> None:
    plain = await client.responses.create(model=MODEL, input="Count to five.", max_output_tokens=12, temperature=0)
    stream = await client.responses.create(
        model=MODEL, input="Count to five.", max_output_tokens=12, temperature=0, stream=True
    )
    events = [e async for e in stream]
    types = [e.type for e in events]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    head = ["response.created", "response.in_progress", "response.output_item.added", "response.content_part.added"]
    tail = [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert types[:4] == head and types[-4:] == tail
    assert set(types[4:-4]) == {"response.output_text.delta"}
    final = events[-1].response  # type: ignore[union-attr]
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    assert deltas == events[-4].text == final.output_text == plain.output_text  # type: ignore[union-attr]
    assert events[0].response.status == "in_progress" and events[0].response.output == []  # type: ignore[union-attr]
    assert final.id == events[0].response.id and final.usage.output_tokens == 12  # type: ignore[union-attr]
    # The client's stream helper (it accumulates every event and checks their order) on a call.
    async with client.responses.stream(
        model=MODEL,
        input="Weather in Rome?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=16,
        temperature=0,
    ) as helper:
        seen = [e async for e in helper]
        response = await helper.get_final_response()
    [call] = response.output
    assert call.type == "function_call" and response.status == "completed"
    arguments = "".join(e.delta for e in seen if e.type == "response.function_call_arguments.delta")  # type: ignore[union-attr]
    assert arguments == call.arguments and json.loads(arguments)["city"]
    assert [e.type for e in seen if "function_call_arguments" in e.type][-1] == "response.function_call_arguments.done"
    # Streamed responses are stored too, as the final event shows them.
    stored = await client.responses.retrieve(response.id)
    assert stored.output[0].call_id == call.call_id  # type: ignore[union-attr]


async def test_the_stream_is_framed_as_openai_frames_it(http: httpx.AsyncClient) -> None:
    r = await http.post("/v1/responses", json={"model": MODEL, "input": "Hi", "max_output_tokens": 3, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    blocks = r.text.split("\n\n")
    assert blocks[-1] == "" and "[DONE]" not in r.text
    for block in blocks[:-1]:
        event, data = block.split("\n")
        assert event.startswith("event: ") and data.startswith("data: ")
        assert json.loads(data[len("data: ") :])["type"] == event[len("event: ") :]


async def test_retrieve_delete_and_store_false(client: openai.AsyncOpenAI, http: httpx.AsyncClient) -> None:
    r = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, temperature=0)
    got = await client.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    await client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve(r.id)
    unstored = await client.responses.create(model=MODEL, input="Hi", max_output_tokens=2, store=False)
    assert unstored.store is False
    missing = await http.get(f"/v1/responses/{unstored.id}")
    assert_error(missing, 404, "response_id", "not found")
    assert_error(await http.get("/v1/responses/nope"), 400, "response_id", "begins with 'resp'")
    followup = await http.post("/v1/responses", json={"input": "x", "previous_response_id": unstored.id})
    assert_error(followup, 404, "previous_response_id", "not found")


def assert_error(response: httpx.Response, status: int, param: str, text: str) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["param"] == param and text in error["message"], error
    assert error["code"] == status


async def test_bad_requests_are_400s_naming_the_field(http: httpx.AsyncClient) -> None:
    async def post(**body: Any) -> httpx.Response:
        return await http.post("/v1/responses", json={"model": MODEL, "max_output_tokens": 2, **body})

    hi = {"input": "hi"}
    assert_error(await post(input=5), 400, "input", "Expected")
    assert_error(await post(input=[]), 400, "input", "at least one item")
    assert_error(await post(input=[{"type": "image"}]), 400, "input", "input[0].type: must be one of")
    assert_error(await post(input=[{"role": "tool", "content": "x"}]), 400, "input", "input[0].role")
    image = [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x"}]}]
    assert_error(await post(input=image), 400, "input", "input[0].content[0]: only text parts")
    assert_error(await post(input=[{"type": "function_call", "name": "f"}]), 400, "input", "input[0]")
    assert_error(await post(**hi, tools=[{"type": "web_search"}]), 400, "tools", "only 'function' tools")
    assert_error(await post(**hi, tools=[{"type": "function"}]), 400, "tools", "tools[0]")
    assert_error(await post(**hi, tool_choice="required"), 400, "tool_choice", "`tools` must be set")
    named = {"type": "function", "name": "nope"}
    assert_error(await post(**hi, tools=[WEATHER], tool_choice=named), 400, "tool_choice", "not in tools")
    assert_error(await post(**hi, tools=[WEATHER]), 400, "tool_choice", "--enable-auto-tool-choice")
    assert_error(await post(**hi, tools=[WEATHER], tool_choice={"type": "mcp"}), 400, "tool_choice", "must be")
    assert_error(await post(**hi, text={"format": {"type": "xml"}}), 400, "text.format", "text.format.type")
    assert_error(await post(**hi, text={"format": {"type": "json_schema", "name": "x"}}), 400, "text.format", "schema")
    assert_error(await post(input="hi", max_output_tokens=0), 400, "max_output_tokens", "at least 1")
    assert_error(await post(**hi, temperature=-1), 400, "temperature", "temperature")
    assert_error(await post(**hi, model="other"), 404, "model", "does not exist")
    assert (await post(**hi, tools=[], tool_choice="auto")).status_code == 200  # no tools: "auto" is no choice


def test_store_evicts_least_recently_used_by_count_and_bytes() -> None:
    def response(i: int) -> ResponseObject:
        return ResponseObject(id=f"resp_{i}", created_at=0, status="completed", model="m")

    store = ResponseStore(max_responses=2)
    for i in range(3):
        store.put(response(i), [ChatMessage(role="user", content="x")], owner="")
    assert store.get("resp_0", "") is None and store.get("resp_1", "") is not None
    store.put(response(3), [], owner="")  # resp_1 was used last: resp_2 goes
    assert store.get("resp_2", "") is None and store.get("resp_1", "") is not None and len(store) == 2
    small = ResponseStore(max_bytes=4000)  # an entry: ~1,100 bytes and its content
    small.put(response(0), [ChatMessage(role="user", content="a" * 1500)], owner="")
    small.put(response(1), [ChatMessage(role="user", content="b" * 1500)], owner="")
    assert small.get("resp_0", "") is None and small.get("resp_1", "") is not None and small.bytes <= 4000
    small.put(response(2), [ChatMessage(role="user", content="c" * 5000)], owner="")  # larger than the store
    assert small.get("resp_2", "") is None and small.get("resp_1", "") is not None
    small.check_integrity()
    assert small.pop("resp_1", "") is not None and small.bytes == 0 and len(small) == 0
    with pytest.raises(ValueError, match="max_responses"):
        ResponseStore(max_responses=0)


def test_reasoning_item_streamed_as_the_client_accumulates_it(served: tuple[AsyncLLM, Any]) -> None:
    """With a reasoning parser: a `reasoning` item before the message, streamed and whole alike,
    and the events accepted by the openai client's own stream accumulator."""
    tokenizer = served[0].get_tokenizer()
    parsing = make_output_parsing(
        ToolChoice("none"), tokenizer=tokenizer, tool_call_parser=None, reasoning_parser="qwen3"
    )
    text = "<think>Two and two.</think>It is 4."
    pieces = [text[i : i + 3] for i in range(0, len(text), 3)]

    def output(delta: str, last: bool) -> RequestOutput:
        c = CompletionOutput(0, delta, [1], None, None, "stop" if last else None)
        return RequestOutput("r", None, [1, 2, 3], None, [c], last)

    skeleton = ResponseObject(id="resp_x", created_at=0, status="in_progress", model=MODEL)
    stored: list[ResponseObject] = []
    streamed = ResponsesFormatter(skeleton, parsing, tokenizer, stored.append)
    events = streamed.stream_start()
    for k, piece in enumerate(pieces):
        events += streamed.stream_output(0, output(piece, k == len(pieces) - 1))
    events += streamed.stream_end()
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=openai.omit, text_format=openai.omit)
    for event in events:
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=json.loads(msgspec.json.encode(event))))
    final = events[-1].response
    [reasoning, message] = final.output
    assert reasoning.content[0].text == "Two and two." and message.content[0].text == "It is 4."
    assert [e.type for e in events if "reasoning_text" in e.type][-1] == "response.reasoning_text.done"
    whole = ResponsesFormatter(skeleton, parsing, tokenizer).final([output(text, True)])
    assert [i.content[0].text for i in whole.output] == ["Two and two.", "It is 4."]  # type: ignore[union-attr]
    assert whole.usage is not None and whole.usage.output_tokens_details.reasoning_tokens > 0
    assert stored == [final] and final.status == "completed"
