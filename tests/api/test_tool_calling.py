"""Tool calling and reasoning on /v1/chat/completions, in process on the tiny random model:
forced calls (a named function, "required") under the grammar built from the tools' schemas,
"auto" through the server's tool-call parser, the reasoning parser, the request checks, and the
request fields vLLM honours (`truncate_prompt_tokens`, `echo`, `return_tokens_as_token_ids`,
per-request `chat_template`, `documents`)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_app import CHAT, GREEDY, assert_error, assert_still_serving, ok, post, sse

from triollm.api.state import ServerSettings
from triollm.api.tool_calls import ConstrainedCallStream, ToolChoice, constrained_tool_calls

pytestmark = pytest.mark.anyio

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Paris", "Rome"]}, "days": {"enum": [1, 2]}},
            "required": ["city", "days"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"zone": {"enum": ["UTC"]}},
            "required": ["zone"],
            "additionalProperties": False,
        },
    },
}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
# A "required" output (the grammar's compact JSON, a string holding brackets and an escape).
REQUIRED_OUTPUT = (
    '[{"name":"get_weather","parameters":{"city":"Rome","days":2}},'
    '{"name":"get_time","parameters":{"zone":"UTC","note":"a [b] {c} \\"d\\""}},{"name":"get_weather","parameters":{}}]'
)
# A template that shows tools, tool calls and tool results (the tiny model's own ignores tools).
TOOL_TEMPLATE = (
    "{% for t in tools or [] %}TOOL {{ t.function.name }}\n{% endfor %}"
    "{% for d in documents or [] %}DOC {{ d.title }}\n{% endfor %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }} {{ c.function.arguments.city }}{% endfor %}"
    "{% if m.tool_call_id %} FOR {{ m.tool_call_id }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(name="settings")
def server_settings() -> ServerSettings:
    return ServerSettings(
        served_model_names=("tiny",),
        enable_auto_tool_choice=True,
        tool_call_parser="hermes",
        trust_request_chat_template=True,
    )


async def chat(client: httpx.AsyncClient, **body: Any) -> dict[str, Any]:
    return await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 40, **GREEDY, **body})


# --------------------------------------------------------------------------- forced calls


async def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client: httpx.AsyncClient) -> None:
    out = await chat(client, tools=[WEATHER, TIME], tool_choice=NAMED)
    [choice] = out["choices"]
    message = choice["message"]
    assert message["content"] == "" and choice["finish_reason"] == "stop"  # vLLM's choices
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("chatcmpl-tool-")
    assert call["function"]["name"] == "get_weather"
    arguments = json.loads(call["function"]["arguments"])
    assert arguments["city"] in ("Paris", "Rome") and arguments["days"] in (1, 2)


async def test_required_calls_a_listed_tool(client: httpx.AsyncClient) -> None:
    # parallel_tool_calls=false: one item (a random model left free never closes the array)
    out = await chat(client, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False, max_tokens=80)
    assert out["choices"][0]["finish_reason"] == "tool_calls"  # vLLM's and OpenAI's (agent loops key on it)
    [call] = out["choices"][0]["message"]["tool_calls"]
    arguments = json.loads(call["function"]["arguments"])
    if call["function"]["name"] == "get_weather":
        assert set(arguments) == {"city", "days"}
    else:
        assert call["function"]["name"] == "get_time" and arguments == {"zone": "UTC"}


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(0, len(REQUIRED_OUTPUT)), max_size=12))
def test_required_calls_stream_as_their_whole_output_reads(cuts: list[int]) -> None:
    """The "required" array split anywhere: one announcement per call (id, name), and argument
    pieces that add up to each call's parameters."""
    choice = ToolChoice("required", (WEATHER, TIME))
    whole = constrained_tool_calls(choice, REQUIRED_OUTPUT)
    assert whole is not None and len(whole) == 3
    stream = ConstrainedCallStream(choice)
    bounds = [0, *sorted(cuts), len(REQUIRED_OUTPUT)]
    deltas = [d for a, b in zip(bounds, bounds[1:]) for d in stream.feed(REQUIRED_OUTPUT[a:b])]
    calls: dict[int, dict[str, str]] = {}
    for d in deltas:
        assert d.function is not None
        if d.id is not None:
            assert d.index not in calls and d.type == "function"
            calls[d.index] = {"name": d.function.name or "", "arguments": ""}
        calls[d.index]["arguments"] += d.function.arguments or ""
    assert [c["name"] for c in calls.values()] == [c.function.name for c in whole]
    assert [json.loads(c["arguments"]) for c in calls.values()] == [json.loads(c.function.arguments) for c in whole]


@pytest.mark.parametrize("tool_choice", [NAMED, "required"])
async def test_a_streamed_forced_call_adds_up_to_the_whole_answer(client: httpx.AsyncClient, tool_choice: Any) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 80,
        **GREEDY,
        "tools": [WEATHER, TIME],
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
    }
    whole = (await ok(client, "/v1/chat/completions", body))["choices"][0]
    events = sse(await post(client, "/v1/chat/completions", {**body, "stream": True}))
    calls: dict[int, dict[str, Any]] = {}
    finish = []
    for e in events:
        for c in e["choices"]:
            if c["finish_reason"] is not None:
                finish.append(c["finish_reason"])
            for d in c["delta"].get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"arguments": ""})
                if "id" in d:
                    assert "id" not in call, "one id per call, in its first delta"
                    call.update(id=d["id"], name=d["function"]["name"], type=d["type"])
                call["arguments"] += d["function"].get("arguments") or ""
    assert finish == [whole["finish_reason"]] == ["tool_calls" if tool_choice == "required" else "stop"]
    expected = whole["message"]["tool_calls"]
    assert sorted(calls) == list(range(len(expected)))
    for i, call in calls.items():
        assert call["type"] == "function" and call["name"] == expected[i]["function"]["name"]
        assert json.loads(call["arguments"]) == json.loads(expected[i]["function"]["arguments"])


@pytest.mark.parametrize("stream", [False, True])
async def test_a_named_call_cut_short_is_still_the_call(client: httpx.AsyncClient, stream: bool) -> None:
    """vLLM returns a named call cut by max_tokens as the call, its arguments as far as they
    were generated, so the client sees what was attempted (it was plain content here)."""
    body = {"messages": CHAT, "max_tokens": 2, **GREEDY, "tools": [WEATHER], "tool_choice": NAMED}
    if not stream:
        [choice] = (await ok(client, "/v1/chat/completions", body))["choices"]
        [call] = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "length" and not choice["message"]["content"]
        assert call["function"]["name"] == "get_weather" and call["function"]["arguments"].startswith("{")
        with pytest.raises(json.JSONDecodeError):
            json.loads(call["function"]["arguments"])  # cut short: partial
        return
    events = sse(await post(client, "/v1/chat/completions", {**body, "stream": True}))
    deltas = [d for e in events for c in e["choices"] for d in c["delta"].get("tool_calls") or []]
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish == ["length"] and deltas[0]["function"]["name"] == "get_weather"
    assert "".join(d["function"].get("arguments") or "" for d in deltas).startswith("{")


async def test_a_required_call_cut_short_is_text(client: httpx.AsyncClient) -> None:
    """Under "required" only a complete call array is read back (vLLM fails such a request)."""
    out = await chat(client, tools=[WEATHER], tool_choice="required", max_tokens=2)
    [choice] = out["choices"]
    assert choice["finish_reason"] == "length" and choice["message"]["tool_calls"] == []
    assert choice["message"]["content"]


# --------------------------------------------------------------------------- checks


@pytest.mark.parametrize(
    "body, fragments, param",
    [
        ({"tool_choice": "required"}, ("`tools` must be set",), "tool_choice"),
        ({"tools": [], "tool_choice": "auto"}, ("must not be an empty array",), "tools"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
            ("'nope' is not in tools", "get_weather"),
            "tool_choice",
        ),
        ({"tools": [WEATHER], "tool_choice": "sometimes"}, ("must be one of", "'required'"), "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, ("named function",), "tool_choice"),
        ({"tools": [{"type": "retrieval"}]}, ("tools[0].type",), "tools"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": []}}]}, ("parameters",), "tools"),
        (
            {
                "tools": [
                    {
                        "type": "function",
                        "function": {
                            "name": "f",
                            "parameters": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}},
                        },
                    }
                ],
                "tool_choice": "required",
            },
            (),
            "tools",
        ),
        (
            {"tools": [WEATHER], "tool_choice": NAMED, "response_format": {"type": "json_object"}},
            ("cannot be combined",),
            "tool_choice",
        ),
        ({"truncate_prompt_tokens": 0}, ("truncate_prompt_tokens",), "truncate_prompt_tokens"),
        ({"truncate_prompt_tokens": 100000}, ("max_model_len",), "truncate_prompt_tokens"),
    ],
    ids=[
        "choice-without-tools",
        "empty-tools",
        "unknown-name",
        "bad-choice",
        "bad-named",
        "bad-type",
        "bad-parameters",
        "bad-schema",
        "with-response-format",
        "truncate-0",
        "truncate-too-long",
    ],
)
async def test_bad_tool_requests_are_400s_naming_the_field(
    client: httpx.AsyncClient, body: dict[str, Any], fragments: tuple[str, ...], param: str
) -> None:
    r = await post(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, **body})
    assert_error(r, 400, *fragments, param=param)
    await assert_still_serving(client)


async def test_auto_needs_the_server_flags(llm: Any) -> None:
    from triollm.api.app import build_app
    from triollm.api.state import ServerState

    state = ServerState(llm, ServerSettings(served_model_names=("tiny",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t") as client:
        # tools without tool_choice means "auto", as in vLLM
        r = await post(client, "/v1/chat/completions", {"messages": CHAT, "tools": [WEATHER]})
        assert_error(r, 400, "--enable-auto-tool-choice", "--tool-call-parser", param="tool_choice")
        # "none" and forced calls need no parser
        out = await ok(
            client,
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 3, **GREEDY, "tools": [WEATHER], "tool_choice": "none"},
        )
        assert out["choices"][0]["message"]["tool_calls"] == []
        out = await ok(
            client,
            "/v1/chat/completions",
            {"messages": CHAT, "max_tokens": 40, **GREEDY, "tools": [WEATHER], "tool_choice": NAMED},
        )
        assert out["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "get_weather"


# --------------------------------------------------------------------------- the template and request fields


async def test_tools_tool_calls_and_tool_results_reach_the_template(client: httpx.AsyncClient) -> None:
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call-1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Rome", "days": 1}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call-1", "content": "sunny"},
    ]
    body = {
        "messages": messages,
        "tools": [WEATHER],
        "tool_choice": "none",
        "chat_template": TOOL_TEMPLATE,
        "documents": [{"title": "Atlas", "text": "..."}],
    }
    out = await chat(client, **body, max_tokens=1, prompt_logprobs=0)
    prompt_ids = [int(next(iter(row))) for row in out["prompt_logprobs"][1:]]
    text = (await ok(client, "/detokenize", {"tokens": prompt_ids}))["prompt"]
    # (jinja's trim_blocks drops the newline after a block tag, as transformers' templates expect)
    assert text.endswith(
        "OOL get_weather\nDOC Atlas\nuser: Weather?assistant:  CALL get_weather Rometool: sunny FOR call-1assistant:"
    )


async def test_a_request_chat_template_needs_the_server_flag(llm: Any) -> None:
    from triollm.api.app import build_app
    from triollm.api.state import ServerState

    state = ServerState(llm, ServerSettings(served_model_names=("tiny",)))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t") as client:
        r = await post(client, "/v1/chat/completions", {"messages": CHAT, "chat_template": TOOL_TEMPLATE})
        assert_error(r, 400, "--trust-request-chat-template", param="chat_template")


async def test_truncate_prompt_tokens_keeps_the_last_tokens(client: httpx.AsyncClient) -> None:
    full = await chat(client, max_tokens=1)
    cut = await chat(client, max_tokens=1, truncate_prompt_tokens=5)
    assert cut["usage"]["prompt_tokens"] == 5 < full["usage"]["prompt_tokens"]


async def test_echo_and_token_ids_in_logprobs(client: httpx.AsyncClient) -> None:
    messages = [*CHAT, {"role": "assistant", "content": "Blue is"}]
    body = {"messages": messages, "add_generation_prompt": False, "continue_final_message": True, "max_tokens": 3}
    plain = await chat(client, **body)
    echoed = await chat(client, **body, echo=True)
    assert echoed["choices"][0]["message"]["content"] == "Blue is" + plain["choices"][0]["message"]["content"]
    events = sse(await post(client, "/v1/chat/completions", {**body, **GREEDY, "echo": True, "stream": True}))
    streamed = "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    assert streamed == echoed["choices"][0]["message"]["content"]
    ids = await chat(client, max_tokens=3, logprobs=True, top_logprobs=2, return_tokens_as_token_ids=True)
    for entry in ids["choices"][0]["logprobs"]["content"]:
        assert entry["token"].startswith("token_id:") and int(entry["token"][9:]) >= 0
        assert all(t["token"].startswith("token_id:") for t in entry["top_logprobs"])


async def test_completions_honour_truncation_and_token_ids(client: httpx.AsyncClient) -> None:
    prompt = "The quick brown fox jumps over the lazy dog"
    ids = (await ok(client, "/tokenize", {"prompt": prompt}))["tokens"]
    body = {"max_tokens": 3, "logprobs": 1, **GREEDY}
    cut = await ok(client, "/v1/completions", {"prompt": prompt, "truncate_prompt_tokens": 4, **body})
    by_ids = await ok(client, "/v1/completions", {"prompt": ids[-4:], **body})
    assert cut["usage"]["prompt_tokens"] == 4
    assert cut["choices"][0]["text"] == by_ids["choices"][0]["text"]
    as_ids = await ok(client, "/v1/completions", {"prompt": ids[-4:], "return_tokens_as_token_ids": True, **body})
    assert all(t.startswith("token_id:") for t in as_ids["choices"][0]["logprobs"]["tokens"])


async def test_outputs_are_logged_when_asked(llm: Any, caplog: pytest.LogCaptureFixture) -> None:
    from triollm.api.app import build_app
    from triollm.api.state import ServerState

    state = ServerState(llm, ServerSettings(served_model_names=("tiny",), enable_log_outputs=True, max_log_len=8))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t") as client:
        with caplog.at_level("INFO", logger="triollm"):
            out = await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, **GREEDY})
            streamed = sse(
                await post(
                    client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 12, **GREEDY, "stream": True}
                )
            )
    text = out["choices"][0]["message"]["content"]
    assert "".join(c["delta"].get("content") or "" for e in streamed for c in e["choices"]) == text
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Generated response")]
    assert len(lines) == 2 and all(repr(text[:8])[:-1] in line and "finish_reason: length" in line for line in lines)


# --------------------------------------------------------------------------- auto and reasoning, on steered text

HERMES_CALLS = (
    r'Let me check\.<tool_call>\{"name": "get_weather", "arguments": \{"city": "Rome", "days": 2\}\}</tool_call>'
    r'<tool_call>\{"name": "get_time", "arguments": \{"zone": "UTC"\}\}</tool_call>'
)


def _assemble(events: list[dict[str, Any]]) -> tuple[str, str, dict[int, dict[str, str]], list[str]]:
    content, reasoning, calls, finish = "", "", {}, []
    for e in events:
        for c in e["choices"]:
            delta = c["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            assert delta.get("reasoning") == delta.get("reasoning_content")
            for d in delta.get("tool_calls") or []:
                call = calls.setdefault(d["index"], {"name": "", "arguments": ""})
                if "id" in d:
                    call.update(id=d["id"], name=d["function"]["name"])
                call["arguments"] += d["function"].get("arguments") or ""
            if c["finish_reason"] is not None:
                finish.append(c["finish_reason"])
    return content, reasoning, calls, finish


@pytest.mark.parametrize("parallel", [True, False])
async def test_auto_reads_the_calls_the_model_wrote(client: httpx.AsyncClient, parallel: bool) -> None:
    body = {
        "messages": CHAT, "max_tokens": 200, **GREEDY, "tools": [WEATHER, TIME], "tool_choice": "auto",
        "parallel_tool_calls": parallel, "structured_outputs": {"regex": HERMES_CALLS},
    }  # fmt: skip
    whole = (await ok(client, "/v1/chat/completions", body))["choices"][0]
    assert whole["finish_reason"] == "tool_calls" and whole["message"]["content"] == "Let me check."
    calls = whole["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == (["get_weather", "get_time"] if parallel else ["get_weather"])
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Rome", "days": 2}
    content, _, streamed, finish = _assemble(sse(await post(client, "/v1/chat/completions", {**body, "stream": True})))
    assert finish == ["tool_calls"] and content == "Let me check."
    assert [c["name"] for c in streamed.values()] == [c["function"]["name"] for c in calls]
    assert [json.loads(c["arguments"]) for c in streamed.values()] == [
        json.loads(c["function"]["arguments"]) for c in calls
    ]


async def test_auto_without_a_call_is_text(client: httpx.AsyncClient) -> None:
    body = {
        "messages": CHAT,
        "max_tokens": 30,
        **GREEDY,
        "tools": [WEATHER],
        "structured_outputs": {"regex": r"It is sunny\."},
    }
    whole = (await ok(client, "/v1/chat/completions", body))["choices"][0]
    assert whole["finish_reason"] == "stop" and whole["message"] == {
        "role": "assistant", "content": "It is sunny.", "reasoning": None, "reasoning_content": None, "tool_calls": [],
    }  # fmt: skip


@pytest.mark.parametrize("include_reasoning", [True, False])
async def test_the_reasoning_parser_splits_reasoning_off(llm: Any, include_reasoning: bool) -> None:
    from triollm.api.app import build_app
    from triollm.api.state import ServerState

    settings = ServerSettings(
        served_model_names=("tiny",), reasoning_parser="qwen3", enable_auto_tool_choice=True, tool_call_parser="hermes"
    )
    state = ServerState(llm, settings)
    # Steered by a regex over the whole output: with thinking switched off the output does not
    # open in reasoning, so the grammar holds from the first token (and Qwen3's parser still
    # splits a <think> section the model writes anyway).
    regex = (
        r'<think>Rome is warm\.</think>Sunny\.<tool_call>\{"name": "get_time", "arguments": \{"zone": '
        r'"UTC"\}\}</tool_call>'
    )
    body = {
        "messages": CHAT, "max_tokens": 120, **GREEDY, "tools": [TIME], "include_reasoning": include_reasoning,
        "structured_outputs": {"regex": regex}, "chat_template_kwargs": {"enable_thinking": False},
    }  # fmt: skip
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t") as client:
        whole = (await ok(client, "/v1/chat/completions", body))["choices"][0]
        events = sse(await post(client, "/v1/chat/completions", {**body, "stream": True}))
    message = whole["message"]
    expected = "Rome is warm." if include_reasoning else None
    assert message["reasoning"] == message["reasoning_content"] == expected
    assert message["content"] == "Sunny." and whole["finish_reason"] == "tool_calls"  # calls read from the content
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["get_time"]
    content, reasoning, calls, finish = _assemble(events)
    assert (reasoning or None) == expected and content == "Sunny." and finish == ["tool_calls"]
    assert [c["name"] for c in calls.values()] == ["get_time"]


async def test_a_grammar_waits_for_the_end_of_the_reasoning(llm: Any) -> None:
    from triollm.api.app import build_app
    from triollm.api.output_parsing import make_output_parsing
    from triollm.api.state import ServerState
    from triollm.api.tool_calls import ToolChoice
    from triollm.engine.sampling_params import StructuredOutputsParams

    tokenizer = llm.get_tokenizer()
    end = tokenizer.encode("</think>", add_special_tokens=False)
    so = StructuredOutputsParams(json_object=True)
    for parser, kwargs, gated in [
        ("deepseek_r1", None, True),
        ("qwen3", None, True),
        ("qwen3", {"enable_thinking": False}, False),
    ]:
        parsing = make_output_parsing(
            ToolChoice("none"),
            tokenizer=tokenizer,
            tool_call_parser=None,
            reasoning_parser=parser,
            chat_template_kwargs=kwargs,
        )
        assert parsing.gate(so).start_after_token_ids == (end if gated else None)  # type: ignore[union-attr]
    assert (
        make_output_parsing(ToolChoice("none"), tokenizer=tokenizer, tool_call_parser=None, reasoning_parser=None).gate(
            so
        )
        is so
    )
    # Through the server: the tiny model never writes </think>, so its output stays free (all
    # reasoning); without the wait it would be a JSON object from the first token.
    state = ServerState(llm, ServerSettings(served_model_names=("tiny",), reasoning_parser="deepseek_r1"))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=build_app(state)), base_url="http://t") as client:
        body = {"messages": CHAT, "max_tokens": 8, **GREEDY, "response_format": {"type": "json_object"}}
        message = (await ok(client, "/v1/chat/completions", body))["choices"][0]["message"]
        free = (await ok(client, "/v1/chat/completions", {"messages": CHAT, "max_tokens": 8, **GREEDY}))["choices"][0][
            "message"
        ]
    assert (
        message["content"] is None
        and message["reasoning"] == free["reasoning"]
        and not message["reasoning"].startswith("{")
    )
