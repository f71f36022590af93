"""A two-turn agent on the bundled model, as an agent framework drives it: the official `openai`
client against a real `triollm serve` started with a vLLM recipe's tool flags, and the same turns
through `LLM.chat(tools=...)`. Turn one forces a call to the weather tool; the tool's result goes
back as a `tool` message; turn two answers in text."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from server import Server, run_server

MODEL = "smol"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
# A Hermes-style template (the bundled model's own does not show tools): the tools in the
# system turn, calls as <tool_call> JSON, results as <tool_response>.
TEMPLATE = """{%- if tools %}<|im_start|>system
You may call these tools:
{% for t in tools %}{{ t | tojson }}
{% endfor %}Answer a call with <tool_call>{"name": ..., "arguments": ...}</tool_call>.<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == "tool" %}<|im_start|>user
<tool_response>{{ m.content }}</tool_response><|im_end|>
{% elif m.tool_calls %}<|im_start|>assistant
{% for c in m.tool_calls %}<tool_call>{"name": "{{ c.function.name }}", "arguments": {{
c.function.arguments | tojson }}}</tool_call>{% endfor %}<|im_end|>
{% else %}<|im_start|>{{ m.role }}
{{ m.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
QUESTION = [{"role": "user", "content": "What is the weather in Paris right now?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.fixture(scope="module")
def server(bundled_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    template = tmp_path_factory.mktemp("template") / "tool_chat.jinja"
    template.write_text(TEMPLATE)
    flags = ("--served-model-name", MODEL, "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    with run_server(bundled_model_dir, *flags, "--chat-template", str(template), "--max-model-len", "2k") as srv:
        yield srv


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def _turn(
    client: openai.OpenAI, messages: list[dict[str, Any]], stream: bool, **kw: Any
) -> tuple[dict[str, Any], str | None]:
    """One assistant turn as a message dict (what an agent appends) and its finish reason."""
    if not stream:
        out = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kw)  # type: ignore[arg-type]
        choice = out.choices[0]
        return choice.message.model_dump(exclude_none=True), choice.finish_reason
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(model=MODEL, messages=messages, temperature=0, stream=True, **kw):  # type: ignore[arg-type]
        for c in chunk.choices:
            content += c.delta.content or ""
            for d in c.delta.tool_calls or []:
                call = calls.setdefault(
                    d.index, {"id": None, "type": "function", "function": {"name": None, "arguments": ""}}
                )
                if d.id:
                    call["id"], call["function"]["name"] = d.id, d.function.name  # type: ignore[union-attr]
                call["function"]["arguments"] += (d.function.arguments if d.function else None) or ""
            finish = c.finish_reason or finish
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if calls:
        message["tool_calls"] = [calls[i] for i in sorted(calls)]
    return message, finish


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_a_two_turn_agent_with_the_openai_client(client: openai.OpenAI, stream: bool) -> None:
    messages: list[dict[str, Any]] = list(QUESTION)
    first, finish = _turn(client, messages, stream, tools=[WEATHER], tool_choice=NAMED, max_tokens=24)
    assert finish == "stop" and not first.get("content")
    [call] = first["tool_calls"]
    assert call["id"].startswith("chatcmpl-tool-") and call["function"]["name"] == "get_weather"
    city = json.loads(call["function"]["arguments"])["city"]
    assert city in ("Paris", "Rome", "Oslo")
    messages += [
        first,
        {
            "role": "tool",
            "tool_call_id": call["id"],
            "content": json.dumps({"city": city, "sky": "sunny", "celsius": 21}),
        },
    ]
    second, finish = _turn(client, messages, stream, tools=[WEATHER], tool_choice="none", max_tokens=12)
    assert finish in ("stop", "length") and second["content"].strip() and not second.get("tool_calls")


def test_auto_reads_the_call_the_model_writes(client: openai.OpenAI) -> None:
    """`tool_choice="auto"` with the hermes parser: the call in the model's text becomes
    `tool_calls` and the finish reason "tool_calls" (the text is steered into the format with
    a regex, which a capable model would write unprompted)."""
    regex = r'<tool_call>\{"name": "get_weather", "arguments": \{"city": "(Paris|Rome)"\}\}</tool_call>'
    out = client.chat.completions.create(
        model=MODEL, messages=QUESTION, tools=[WEATHER], tool_choice="auto", temperature=0,  # type: ignore[arg-type]
        max_tokens=40, extra_body={"structured_outputs": {"regex": regex}},
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["city"] in ("Paris", "Rome")


def test_bad_tool_requests_are_400s(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=QUESTION,
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},  # type: ignore[arg-type]
        )
    assert caught.value.body["param"] == "tool_choice"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, tool_choice="required")  # type: ignore[arg-type]
    out = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2)
    assert out.choices[0].finish_reason == "length"  # nothing else disturbed


def test_the_same_agent_through_llm_chat(bundled_model_dir: Path) -> None:
    from triollm import LLM, SamplingParams
    from triollm.engine.sampling_params import StructuredOutputsParams

    schema = WEATHER["function"]["parameters"]  # type: ignore[index]
    with LLM(str(bundled_model_dir), max_model_len=2048, multiprocess=False) as llm:
        messages: list[dict[str, Any]] = list(QUESTION)
        forced = SamplingParams(
            temperature=0,
            max_tokens=24,
            structured_outputs=StructuredOutputsParams(json=schema, disable_any_whitespace=True),
        )
        [first] = llm.chat(messages, forced, tools=[WEATHER], chat_template=TEMPLATE, use_tqdm=False)
        assert '"name": "get_weather"' in (first.prompt or "")  # the tools reached the template
        arguments = json.loads(first.outputs[0].text)
        call = {
            "id": "call-1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps(arguments)},
        }
        messages += [
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call-1", "content": "sunny, 21 C"},
        ]
        [second] = llm.chat(
            messages,
            SamplingParams(temperature=0, max_tokens=12),
            tools=[WEATHER],
            chat_template=TEMPLATE,
            use_tqdm=False,
        )
        assert f'<tool_call>{{"name": "get_weather", "arguments": {json.dumps(arguments)}}}</tool_call>' in (
            second.prompt or ""
        )
        assert "<tool_response>sunny, 21 C</tool_response>" in (second.prompt or "")
        assert second.outputs[0].text.strip()


def test_the_responses_api_through_the_real_server(client: openai.OpenAI) -> None:
    """The same forced call and its follow-up as Responses calls (`previous_response_id`), and a
    stream cut by `max_output_tokens` (it ends with `response.incomplete`)."""
    tools = [{"type": "function", "name": "get_weather", "parameters": WEATHER["function"]["parameters"]}]  # type: ignore[index]
    first = client.responses.create(
        model=MODEL, input="What is the weather in Paris right now?", tools=tools,  # type: ignore[arg-type]
        tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=24, temperature=0,
    )
    [call] = first.output
    assert call.type == "function_call" and json.loads(call.arguments)["city"] in ("Paris", "Rome", "Oslo")
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, max_output_tokens=8, temperature=0,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}],
    )
    assert second.output_text.strip() and second.previous_response_id == first.id
    events = list(
        client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=6, temperature=0, stream=True)
    )
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")  # type: ignore[union-attr]
    final = events[-1].response  # type: ignore[union-attr]
    assert events[-1].type == "response.incomplete" and deltas == final.output_text and final.status == "incomplete"
