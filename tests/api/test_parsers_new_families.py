"""The tool-call parsers `openai` (gpt-oss's harmony), `granite`, `phi4_mini_json`, `kimi_k2`,
`glm45` and `deepseek_v31`, and the reasoning parsers `gpt_oss`, `granite`, `mistral` and `olmo3`
(issue 46): recorded outputs (or outputs shaped as the models' chat templates and vLLM's parsers
show them) read whole, streamed cut at every position and in arbitrary pieces, outputs with
markers put in and characters cut out, arbitrary text that must not raise, and each format
through /v1/chat/completions on the tiny model, steered to write it."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinymodel
from hypothesis import given, settings
from hypothesis import strategies as st
from test_app import CHAT, GREEDY, ok, post, sse
from test_parsers_never_raise import PAYLOADS, read_with_reasoning_parsers, read_with_tool_parsers
from test_tool_parsers import NESTED, PARALLEL, PARIS, UNICODE, Calls, parser, streamed, whole
from test_vllm_cli import served

from triollm.actors.async_llm import AsyncLLM
from triollm.api.output_parsing import make_output_parsing
from triollm.api.reasoning_parsers import ReasoningParser, ReasoningParserManager
from triollm.api.state import ServerSettings, ServerState
from triollm.api.tool_calls import ToolChoice
from triollm.api.tool_parsers import ToolParserManager
from triollm.api.tool_parsers._segments import Broken
from triollm.engine.config import EngineArgs

SETTINGS = settings(max_examples=100, deadline=None, database=None)

# --------------------------------------------------------------------------- recorded outputs

ANALYSIS = "<|channel|>analysis<|message|>The user wants the weather in Paris.<|end|>"
HARMONY_CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
    '{"city": "Paris"}<|call|>'
)
# Kimi K2's calls, as its template writes them.
KIMI_BEGIN, KIMI_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_PARIS = '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>'
DS_BEGIN, DS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"


def ds_call(name: str, args: str) -> str:
    return f"<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>{args}<｜tool▁call▁end｜>"


def glm_call(name: str, *pairs: tuple[str, str]) -> str:
    body = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs)
    return f"<tool_call>{name}\n{body}</tool_call>"


# (text, content, calls) per parser; content is the whole-output answer (the text itself when
# there is no call, except for `openai`, which removes the channel markup).
CASES: dict[str, list[tuple[str, str | None, Calls]]] = {
    "openai": [
        (ANALYSIS + HARMONY_CALL, None, PARIS),
        # The call alone (what --reasoning-parser gpt_oss leaves), the recipient before the
        # channel, a preamble, the last <|call|> cut by the stop token.
        (HARMONY_CALL, None, PARIS),
        (
            "<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>"
            '{"city": "Paris", "days": 3}<|call|><|start|>assistant<|channel|>commentary to=functions.get_time'
            " <|constrain|>json<|message|>{}",
            None,
            PARALLEL,
        ),
        (
            "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
            'to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich 東京 \\"quoted\\" \\\\ 🌦"}',
            "Checking.",
            UNICODE,
        ),
        (
            ANALYSIS + '<|start|>assistant<|channel|>commentary to=functions.get_weather<|message|>{"where": '
            '{"lat": -1.5e3, "tags": [true, null, {"k": []}]}}',
            None,
            NESTED,
        ),
        # No call: the final channel is the content; plain text is content.
        (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>", "It is sunny.", []),
        (ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.", "It is sunny.", []),
        ("Hello <|chan", "Hello <|chan", []),
        ("Just text.", "Just text.", []),
        # A call message whose body is no object stays text; an unfinished header is text.
        (
            "<|channel|>commentary to=functions.get_weather<|message|>Paris<|call|>",
            "<|channel|>commentary to=functions.get_weather<|message|>Paris<|call|>",
            [],
        ),
        ("<|channel|>final", "<|channel|>final", []),
        ("", "", []),
    ],
    "granite": [
        ('<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, PARIS),
        (
            'Let me check. <tool_call>[{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}, '
            '{"name": "get_time", "arguments": {}}]',
            "Let me check. ",
            PARALLEL,
        ),
        (
            '<tool_call>[{"name": "get_weather", "arguments": {"city": "Zürich 東京 \\"quoted\\" \\\\ 🌦"}}',
            None,
            UNICODE,
        ),
        (
            '<|tool_call|>[{"name": "get_weather", "arguments": {"where": {"lat": -1.5e3, "tags": [true, null, '
            '{"k": []}]}}}] Done.',
            " Done.",
            NESTED,
        ),
        ("Use <tool_call> to call.", "Use <tool_call> to call.", []),
        ('<tool_call>{"name": "get_time"}', '<tool_call>{"name": "get_time"}', []),  # no array: hermes's form
        ("<|tool_call|>[1, 2]", "<|tool_call|>[1, 2]", []),
        ("a <|tool_", "a <|tool_", []),
    ],
    "phi4_mini_json": [
        ('functools[{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, PARIS),
        (
            'functools[{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}, '
            '{"name": "get_time", "arguments": {}}]',
            None,
            PARALLEL,
        ),
        ('functools[{"name": "get_weather", "arguments": {"city": "Zürich 東京 \\"quoted\\" \\\\ 🌦"}}]', None, UNICODE),
        (
            'Sure. functools[{"name": "get_weather", "arguments": {"where": {"lat": -1.5e3, "tags": [true, null, '
            '{"k": []}]}}}]',
            "Sure. ",
            NESTED,
        ),
        ("The functools module.", "The functools module.", []),
        ("functools[get_weather]", "functools[get_weather]", []),
    ],
    "kimi_k2": [
        (KIMI_BEGIN + KIMI_PARIS + KIMI_END, None, PARIS),
        (
            "I will look both up."
            + KIMI_BEGIN
            + "\n"
            + '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris", "days": 3}'
            + "<|tool_call_end|>\n<|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}"
            + "<|tool_call_end|>\n"
            + KIMI_END,
            "I will look both up.",
            PARALLEL,
        ),
        (
            KIMI_BEGIN + "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"city": "Zürich 東京 \\"quoted\\" \\\\ 🌦"}',
            None,
            UNICODE,
        ),  # cut off by the end-of-sequence token
        (
            KIMI_BEGIN + "<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
            '{"where": {"lat": -1.5e3, "tags": [true, null, {"k": []}]}}<|tool_call_end|>' + KIMI_END + " Done.",
            " Done.",
            NESTED,
        ),
        (KIMI_BEGIN + "no calls" + KIMI_END, KIMI_BEGIN + "no calls" + KIMI_END, []),
        (
            KIMI_BEGIN + "<|tool_call_begin|>functions.get weather:0<|tool_call_argument_begin|>{}",
            KIMI_BEGIN + "<|tool_call_begin|>functions.get weather:0<|tool_call_argument_begin|>{}",
            [],
        ),
        ("<|tool_calls_sec", "<|tool_calls_sec", []),
    ],
    "glm45": [
        (glm_call("get_weather", ("city", "Paris")), None, PARIS),
        (
            "Let me check.\n" + glm_call("get_weather", ("city", "Paris"), ("days", "3")) + "\n" + glm_call("get_time"),
            "Let me check.\n",
            PARALLEL,
        ),
        (
            '<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich 東京 "quoted" \\ 🌦</arg_value></tool_call>',
            None,
            UNICODE,
        ),  # GLM-4.7: no newlines
        (glm_call("get_weather", ("where", '{"lat": -1.5e3, "tags": [true, null, {"k": []}]}')), None, NESTED),
        ("<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris", None, PARIS),  # cut off
        ("<tool_call>not a call</tool_call>", "<tool_call>not a call</tool_call>", []),
        ("<tool_call>get_weather\n<arg_key>city", "<tool_call>get_weather\n<arg_key>city", []),
        ("a <tool_ca", "a <tool_ca", []),
    ],
    "deepseek_v31": [
        (DS_BEGIN + ds_call("get_weather", '{"city": "Paris"}') + DS_END, None, PARIS),
        (
            "Checking both."
            + DS_BEGIN
            + ds_call("get_weather", '{"city": "Paris", "days": 3}')
            + ds_call("get_time", "{}")
            + DS_END,
            "Checking both.",
            PARALLEL,
        ),
        (DS_BEGIN + ds_call("get_weather", '{"city": "Zürich 東京 \\"quoted\\" \\\\ 🌦"}'), None, UNICODE),
        (
            DS_BEGIN
            + ds_call("get_weather", '{"where": {"lat": -1.5e3, "tags": [true, null, {"k": []}]}}')
            + DS_END
            + " Anything else?",
            " Anything else?",
            NESTED,
        ),
        (DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}', None, PARIS),  # cut off
        # DeepSeek V3's fenced form is not V3.1's: text.
        (
            DS_BEGIN + ds_call("function", 'get_weather\n```json\n{"city": "Paris"}\n```'),
            DS_BEGIN + ds_call("function", 'get_weather\n```json\n{"city": "Paris"}\n```'),
            [],
        ),
        ("<｜tool▁", "<｜tool▁", []),
    ],
}

# Calls that break after they were announced: the whole output is content; the stream closes the
# arguments so that they stay valid JSON.
BROKEN: dict[str, list[str]] = {
    "openai": ['<|channel|>commentary to=functions.get_weather<|message|>{"city": "Par'],
    "granite": ['<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris" "days": 3}}]'],
    "phi4_mini_json": ['functools[{"name": "get_weather", "arguments": {"days": tru}}]'],
    "kimi_k2": [KIMI_BEGIN + '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": 1,}'],
    "deepseek_v31": [DS_BEGIN + ds_call("get_weather", '{"city": NaN}')],
}

ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL_CASES)
def test_whole_output(name: str, text: str, content: str | None, calls: Calls) -> None:
    assert whole(parser(name), text) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL_CASES)
def test_streamed_split_at_every_position(name: str, text: str, content: str | None, calls: Calls) -> None:
    p = parser(name)
    want = (content or "", calls)
    assert streamed(p, [text])[:2] == want
    assert streamed(p, list(text))[:2] == want  # one character at a time
    for cut in range(1, len(text)):
        assert streamed(p, [text[:cut], text[cut:]])[:2] == want


@pytest.mark.parametrize("name", sorted(CASES))
@SETTINGS
@given(data=st.data())
def test_streamed_in_arbitrary_pieces(name: str, data: st.DataObject) -> None:
    text, content, calls = data.draw(st.sampled_from(CASES[name]))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=12)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    got_content, got_calls, ids = streamed(parser(name), pieces)
    assert (got_content, got_calls) == (content or "", calls)
    assert len(set(ids)) == len(ids)


PIECES = [*'{}[]",:\\ \n<>/|', "functools", "<|tool_call|>", "<tool_call>", "</tool_call>", "<arg_key>"]
PIECES += ["</arg_key>", "<arg_value>", "</arg_value>", KIMI_BEGIN, KIMI_END, "<|tool_call_begin|>"]
PIECES += ["<|tool_call_argument_begin|>", "<|tool_call_end|>", DS_BEGIN, DS_END, "<｜tool▁call▁begin｜>"]
PIECES += ["<｜tool▁sep｜>", "<｜tool▁call▁end｜>", "<|channel|>", "<|message|>", "<|start|>", "<|end|>"]
PIECES += ["<|call|>", " to=functions.", "analysis", "final", "x1"]


@pytest.mark.parametrize("name", sorted(CASES))
@SETTINGS
@given(data=st.data())
def test_any_output_streams_like_the_whole(name: str, data: st.DataObject) -> None:
    """Recorded outputs with characters and markers cut out or put in: the stream is the same
    in any pieces, and the same as the whole output unless a call broke after it was sent."""
    p = parser(name)
    text = data.draw(st.sampled_from([case[0] for case in CASES[name]] + BROKEN.get(name, [])))
    for _ in range(data.draw(st.integers(1, 3))):
        i = data.draw(st.integers(0, len(text)))
        if data.draw(st.booleans()):
            text = text[:i] + text[i + data.draw(st.integers(1, 4)) :]
        else:
            text = text[:i] + data.draw(st.sampled_from(PIECES)) + text[i:]
    cuts = sorted(data.draw(st.lists(st.integers(0, len(text)), max_size=8)))
    pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
    got = streamed(p, pieces)[:2]
    assert got == streamed(p, [text])[:2] == streamed(p, list(text))[:2]
    content, calls = whole(p, text)
    if any(isinstance(event, Broken) for event in p.segmenter().push(text, final=True)):  # type: ignore[attr-defined]
        assert (content, calls) == (text, [])
    else:
        assert got == (content or "", calls)


@pytest.mark.parametrize(("name", "text"), [(n, t) for n, ts in BROKEN.items() for t in ts])
def test_a_broken_call_is_content_whole_and_closed_in_the_stream(name: str, text: str) -> None:
    p = parser(name)
    assert whole(p, text) == (text, [])
    content, calls, _ = streamed(p, [text])  # arguments that json.loads accepts
    assert calls and calls[0][0] == "get_weather"
    for pieces in (list(text), [text[: len(text) // 2], text[len(text) // 2 :]]):
        assert streamed(p, pieces)[:2] == (content, calls)


def test_arguments_stream_as_they_arrive() -> None:
    for name, head, rest in [
        ("openai", '<|channel|>commentary to=functions.get_weather<|message|>{"city": "Pa', 'ris"}'),
        (
            "kimi_k2",
            KIMI_BEGIN + '<|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Pa',
            'ris"}',
        ),
        ("deepseek_v31", DS_BEGIN + '<｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Pa', 'ris"}'),
        ("granite", '<tool_call>[{"name": "get_weather", "arguments": {"city": "Pa', 'ris"}}]'),
    ]:
        stream = parser(name).stream()
        [first] = stream.feed(head).tool_calls
        assert first.function is not None and first.function.name == "get_weather", name
        assert first.function.arguments == '{"city": "Pa', name
        assert [tc.function.arguments for tc in stream.feed(rest).tool_calls if tc.function] == ['ris"}'], name


def test_text_is_sent_at_once_and_only_a_marker_or_header_held() -> None:
    stream = parser("openai").stream()
    assert stream.feed("Hi <|cha").content == "Hi "
    assert stream.feed("nnel|>final").content == ""  # a header, until its <|message|>
    assert stream.feed("<|message|>there").content == "\nthere"  # a new message: vLLM's "\n".join
    stream = parser("deepseek_v31").stream()
    assert stream.feed("a <｜tool").content == "a "
    assert stream.feed("▁calls▁begin｜><｜tool▁call▁begin｜>get_").content == ""
    assert stream.finish().content == "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_"


def test_a_header_is_read_up_to_its_length_limit() -> None:
    """A harmony header (or a Kimi/DeepSeek call header) longer than its limit is no header: its
    opening marker is text, and a stream decides it as the whole output does, at any cut."""
    from triollm.api.harmony import MAX_HEADER
    from triollm.api.tool_parsers._sections import MAX_HEADER as MAX_CALL_HEADER

    opener = "<|channel|>final"
    for pad, header in ((MAX_HEADER - len(opener), True), (MAX_HEADER - len(opener) + 1, False)):
        text = opener + " " * pad + "<|message|>Hi"
        want = "Hi" if header else text
        assert whole(parser("openai"), text) == (want, [])
        for cut in range(0, len(text), 7):
            assert streamed(parser("openai"), [text[:cut], text[cut:]])[:2] == (want, [])
    for pad, call in ((MAX_CALL_HEADER - len("get_time"), True), (MAX_CALL_HEADER - len("get_time") + 1, False)):
        text = DS_BEGIN + "<｜tool▁call▁begin｜>get_time" + " " * pad + "<｜tool▁sep｜>{}"
        want: tuple[str | None, Calls] = (None, [("get_time", {})]) if call else (text, [])
        assert whole(parser("deepseek_v31"), text) == want
        for cut in range(0, len(text), 7):
            assert streamed(parser("deepseek_v31"), [text[:cut], text[cut:]])[:2] == (want[0] or "", want[1])


def test_kimi_keeps_its_call_ids() -> None:
    text = CASES["kimi_k2"][1][0]
    ids = streamed(parser("kimi_k2"), [text])[2]
    found = parser("kimi_k2").extract_tool_calls(text)
    assert ids == [c.id for c in found.tool_calls] == ["functions.get_weather:0", "functions.get_time:1"]
    no_index = KIMI_BEGIN + "<|tool_call_begin|>get_time<|tool_call_argument_begin|>{}"
    [call] = parser("kimi_k2").extract_tool_calls(no_index).tool_calls
    assert call.function.name == "get_time" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call.id)


def test_glm_values_follow_the_schema_types() -> None:
    def args(*pairs: tuple[str, str]) -> dict[str, Any]:
        [(_, got)] = whole(parser("glm45"), glm_call("get_weather", *pairs))[1]
        return got

    # `city` is a string in the schema: kept as written; `days` an integer; `other` untyped: JSON
    # when it is JSON.
    assert args(("city", "42"), ("days", "3"), ("metric", "true")) == {"city": "42", "days": 3, "metric": True}
    assert args(("other", "[1, 2]"), ("more", "Paris"), ("n", "1e999")) == {
        "other": [1, 2], "more": "Paris", "n": "1e999",
    }  # fmt: skip
    assert args(("days", "three")) == {"days": "three"}  # does not fit its type: a string


def test_keep_special_tokens_where_the_markers_are_special() -> None:
    assert {n for n in CASES if ToolParserManager.get_tool_parser(n).keep_special_tokens} == {
        "openai", "granite", "kimi_k2",
    }  # fmt: skip
    keep = {
        n
        for n in ("gpt_oss", "granite", "mistral", "olmo3")
        if ReasoningParserManager.get_reasoning_parser(n).keep_special_tokens
    }
    assert keep == {"gpt_oss", "mistral"}
    parsing = make_output_parsing(ToolChoice("none"), tokenizer=None, tool_call_parser=None, reasoning_parser="mistral")
    assert parsing.keep_special_tokens  # a reasoning parser alone asks for them too


# --------------------------------------------------------------------------- reasoning parsers

CALL_TEXT = HARMONY_CALL
REASONING_CASES: dict[str, list[tuple[str, tuple[str | None, str | None]]]] = {
    "gpt_oss": [
        (
            ANALYSIS + "<|start|>assistant<|channel|>final<|message|>It is sunny.",
            ("The user wants the weather in Paris.", "It is sunny."),
        ),
        (ANALYSIS + HARMONY_CALL, ("The user wants the weather in Paris.", HARMONY_CALL)),  # left for `openai`
        (
            "<|channel|>analysis<|message|>One.<|end|><|start|>assistant<|channel|>analysis<|message|>Two.<|end|>"
            "<|start|>assistant<|channel|>commentary<|message|>Let me look.<|end|>"
            "<|start|>assistant<|channel|>final<|message|>Done.<|return|>",
            ("One.\nTwo.", "Let me look.\nDone."),
        ),
        ("<|channel|>analysis<|message|>cut off", ("cut off", None)),
        ("No harmony at all.", (None, "No harmony at all.")),
        ("<|channel|>analysis", (None, "<|channel|>analysis")),  # no <|message|>: not a header
        ("", (None, None)),
    ],
    "granite": [
        (
            "Here is my thought process:\nParis is in France.\nHere is my response:\nParis.",
            ("\nParis is in France.\n", "\nParis."),
        ),
        ("Here's my thought process:\nhmm\nHere's my response:\nok", ("\nhmm\n", "\nok")),
        ("Here is my thought process:\ncut off", ("\ncut off", None)),
        ("Just an answer.", (None, "Just an answer.")),
        ("Here is my", (None, "Here is my")),
    ],
    "mistral": [
        ("[THINK]Paris is the capital.[/THINK]Paris.", ("Paris is the capital.", "Paris.")),
        ("Well [THINK]hmm[/THINK] Paris.", ("hmm", "Well  Paris.")),
        ("[THINK]cut off", ("cut off", None)),
        ("No thinking.", (None, "No thinking.")),
        ("[THINK]a[THINK]b[/THINK]c[/THINK]d", ("ab", "cd")),  # stray markers are dropped
        ("[/THI", (None, "[/THI")),
    ],
    "olmo3": [
        ("<think>Paris.</think>The capital is Paris.", ("Paris.", "The capital is Paris.")),
        ("Paris.</think>The capital is Paris.", ("Paris.", "The capital is Paris.")),  # <think> in the prompt
        ("cut off mid-thought", ("cut off mid-thought", None)),
        ("<think></think>Answer.", ("", "Answer.")),
    ],
}


def reasoning_parser(name: str) -> ReasoningParser:
    return ReasoningParserManager.get_reasoning_parser(name)()


def stream_split(p: ReasoningParser, pieces: list[str]) -> tuple[str, str]:
    stream = p.stream()
    out = [stream.feed(piece) for piece in pieces] + [stream.finish()]
    return "".join(r for r, _ in out), "".join(c for _, c in out)


REASONING_ALL = [(name, text, want) for name, cases in REASONING_CASES.items() for text, want in cases]


@pytest.mark.parametrize(("name", "text", "want"), REASONING_ALL)
def test_reasoning_whole_and_split_at_every_position(name: str, text: str, want: tuple[str | None, str | None]) -> None:
    p = reasoning_parser(name)
    assert p.extract_reasoning(text) == want
    joined = (want[0] or "", want[1] or "")
    assert stream_split(p, list(text)) == joined
    for cut in range(len(text) + 1):
        assert stream_split(p, [text[:cut], text[cut:]]) == joined


REASONING_PIECES = ["<|channel|>", "analysis", "final", "<|message|>", "<|end|>", "<|start|>", "[THINK]"]
REASONING_PIECES += ["[/THINK]", "Here is my thought process:", "Here's my response:", "Here", "<think>"]
REASONING_PIECES += ["</think>", "<", "[", "a", "ü", "\n", " to=functions.f"]


@pytest.mark.parametrize("name", sorted(REASONING_CASES))
@SETTINGS
@given(pieces=st.lists(st.sampled_from(REASONING_PIECES), max_size=14), cuts=st.lists(st.integers(0, 300)))
def test_reasoning_any_split_reassembles_to_the_whole(name: str, pieces: list[str], cuts: list[int]) -> None:
    p = reasoning_parser(name)
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)], strict=True)]
    reasoning, content = p.extract_reasoning(text)
    assert stream_split(p, chunks) == (reasoning or "", content or "")


def test_gpt_oss_grammar_holds_from_the_first_token() -> None:
    # As vLLM's parser: a structured output is not held back to a channel marker.
    assert reasoning_parser("gpt_oss").grammar_start_ids() is None
    assert ReasoningParserManager.get_reasoning_parser("openai_gptoss") is type(reasoning_parser("gpt_oss"))


@pytest.mark.parametrize("cut_every", [1, 3, 7, 1000])
def test_gpt_oss_and_openai_together(cut_every: int) -> None:
    """The recommended pair: reasoning from the analysis channel, the call from the rest."""
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    parsing = make_output_parsing(
        ToolChoice("auto", (weather,)), tokenizer=None, tool_call_parser="openai", reasoning_parser="gpt_oss"
    )
    text = ANALYSIS + HARMONY_CALL
    out = parsing.whole(text)
    assert out.reasoning == "The user wants the weather in Paris." and not out.content and out.tool_called
    assert [(c.function.name, json.loads(c.function.arguments)) for c in out.tool_calls] == PARIS
    stream = parsing.stream()
    pieces = [stream.feed(text[i : i + cut_every]) for i in range(0, len(text), cut_every)] + [stream.finish()]
    assert "".join(p.reasoning for p in pieces) == out.reasoning
    assert "".join(p.content for p in pieces) == ""
    assert (
        "".join((c.function.arguments or "") for p in pieces for c in p.tool_calls if c.function) == '{"city": "Paris"}'
    )
    # Without calls, and the tool parser alone: the final channel is the content, whole and streamed.
    alone = make_output_parsing(
        ToolChoice("auto", (weather,)), tokenizer=None, tool_call_parser="openai", reasoning_parser=None
    )
    final = ANALYSIS + "<|start|>assistant<|channel|>final<|message|>Sunny."
    assert alone.whole(final).content == "Sunny."
    stream = alone.stream()
    pieces = [stream.feed(final[i : i + cut_every]) for i in range(0, len(final), cut_every)] + [stream.finish()]
    assert "".join(p.content for p in pieces) == "Sunny."


# --------------------------------------------------------------------------- never raises

FRAMES = [
    ('<|channel|>commentary to=functions.f<|message|>{"a": ', "}<|call|>"),
    ("<|channel|>analysis<|message|>", "<|end|><|start|>assistant<|channel|>final<|message|>"),
    ('<|tool_call|>[{"name": "f", "arguments": {"a": ', "}}]"),
    ('functools[{"name": "f", "parameters": {"o": ', "}}, "),
    (KIMI_BEGIN + '<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{"a": ', "}<|tool_call_end|>"),
    (DS_BEGIN + '<｜tool▁call▁begin｜>f<｜tool▁sep｜>{"o": ', "}<｜tool▁call▁end｜>" + DS_END),
    ("<tool_call>f\n<arg_key>a</arg_key>\n<arg_value>", "</arg_value>\n</tool_call>"),
    ("<tool_call>f<arg_key>o</arg_key><arg_value>", ""),
    ("[THINK]", "[/THINK]"),
    ("Here is my thought process:", "Here is my response:"),
]


@settings(max_examples=20, deadline=None, database=None)
@given(frame=st.sampled_from(FRAMES), payload=PAYLOADS, cuts=st.lists(st.integers(0, 12_000), max_size=8))
def test_no_parser_raises_on_these_formats_around_any_payload(
    frame: tuple[str, str], payload: str, cuts: list[int]
) -> None:
    """The never-raise test (test_parsers_never_raise.py, which reads every registered parser)
    with the new formats' call syntax around its hostile payloads."""
    text = frame[0] + payload + frame[1]
    read_with_tool_parsers(text, cuts)
    read_with_reasoning_parsers(text, cuts)


# --------------------------------------------------------------------------- through the server


@pytest.mark.parametrize(
    ("tool_parser", "reasoning"),
    [("openai", "gpt_oss"), ("openai", "openai_gptoss"), ("granite", "granite"), ("phi4_mini_json", "mistral"),
     ("kimi_k2", "olmo3"), ("glm45", None), ("glm47", None), ("deepseek_v31", None)],
)  # fmt: skip
def test_triollm_serve_takes_the_names(
    monkeypatch: pytest.MonkeyPatch, tool_parser: str, reasoning: str | None
) -> None:
    words = ["--enable-auto-tool-choice", "--tool-call-parser", tool_parser]
    options = served(monkeypatch, *words, *(["--reasoning-parser", reasoning] if reasoning else []))
    assert options.settings is not None
    assert (options.settings.tool_call_parser, options.settings.reasoning_parser) == (tool_parser, reasoning)


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}},
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
]

# (tool parser, reasoning parser, what the model writes, content, reasoning, calls)
SERVER_CASES = [
    (
        "openai",
        "gpt_oss",
        "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary"
        ' to=functions.get_weather <|constrain|>json<|message|>{"city": "Rome"}',
        None,
        "Need weather.",
        [("get_weather", {"city": "Rome"})],
    ),
    (
        "openai",
        None,
        "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Sunny.",
        "Sunny.",
        None,
        [],
    ),
    (
        "granite",
        "granite",
        'Here is my thought process:\nEasy.\nHere is my response:\nOk.<tool_call>[{"name": '
        '"get_time", "arguments": {}}]',
        "\nOk.",
        "\nEasy.\n",
        [("get_time", {})],
    ),
    (
        "phi4_mini_json",
        None,
        'functools[{"name": "get_weather", "arguments": {"city": "Rome", "days": 2}}]',
        None,
        None,
        [("get_weather", {"city": "Rome", "days": 2})],
    ),
    (
        "kimi_k2",
        None,
        "Ok.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_time:0"
        "<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>",
        "Ok.",
        None,
        [("get_time", {})],
    ),
    (
        "glm45",
        None,
        "<tool_call>get_weather\n<arg_key>days</arg_key>\n<arg_value>2</arg_value>\n</tool_call>",
        None,
        None,
        [("get_weather", {"days": 2})],
    ),
    (
        "deepseek_v31",
        None,
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_time<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        None,
        None,
        [("get_time", {})],
    ),
    ("hermes", "mistral", "[THINK]Hmm.[/THINK]Rome.", "Rome.", "Hmm.", []),
]


def as_regex(text: str) -> str:
    return "".join("\\" + ch if ch in "\\.^$*+?{}[]()|" else ch for ch in text)


@pytest.fixture
async def roomy_llm(tiny_model_dir: Path) -> AsyncIterator[AsyncLLM]:
    """The tiny model with room for a harmony header spelled out in byte-level tokens."""
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=512, multiprocess=False, seed=0)
    async with AsyncLLM.from_engine_args(args) as engine:
        yield engine


def assemble(events: list[dict[str, Any]]) -> tuple[str, str, list[tuple[str, Any]], list[str]]:
    content, reasoning, calls, finish = "", "", {}, []
    for event in events:
        for choice in event["choices"]:
            delta = choice["delta"]
            content += delta.get("content") or ""
            reasoning += delta.get("reasoning") or ""
            for d in delta.get("tool_calls") or []:
                call = calls.setdefault(d["index"], ["", ""])
                if d.get("id"):
                    call[0] = d["function"]["name"]
                call[1] += d["function"].get("arguments") or ""
            if choice["finish_reason"] is not None:
                finish.append(choice["finish_reason"])
    return content, reasoning, [(n, json.loads(a)) for n, a in calls.values()], finish


@pytest.mark.anyio
@pytest.mark.parametrize(
    ("tool_parser", "reasoning", "output", "content", "thought", "calls"),
    SERVER_CASES,
    ids=[f"{case[0]}-{case[1]}" for case in SERVER_CASES],
)
async def test_each_format_through_the_chat_route(
    roomy_llm: AsyncLLM,
    tool_parser: str,
    reasoning: str | None,
    output: str,
    content: str | None,
    thought: str | None,
    calls: Calls,
) -> None:
    from triollm.api.app import build_app

    settings = ServerSettings(
        served_model_names=("tiny",), enable_auto_tool_choice=True, tool_call_parser=tool_parser,
        reasoning_parser=reasoning,
    )  # fmt: skip
    body = {
        "messages": CHAT, "max_tokens": 400, **GREEDY, "tools": TOOLS, "tool_choice": "auto",
        "structured_outputs": {"regex": as_regex(output)},
    }  # fmt: skip
    app = build_app(ServerState(roomy_llm, settings))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        choice = (await ok(client, "/v1/chat/completions", body))["choices"][0]
        events = sse(await post(client, "/v1/chat/completions", {**body, "stream": True}))
    message = choice["message"]
    got_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    assert (message["content"] or None, message["reasoning"], got_calls) == (content, thought, calls)
    assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
    streamed_content, streamed_reasoning, streamed_calls, finish = assemble(events)
    assert (streamed_content, streamed_reasoning, streamed_calls) == (content or "", thought or "", calls)
    assert finish == [choice["finish_reason"]]


@pytest.mark.anyio
async def test_olmo3_reasoning_through_the_chat_route(roomy_llm: AsyncLLM) -> None:
    """OLMo 3 Think opens in reasoning (its `<think>` is in the prompt): the tiny model never
    writes `</think>`, so its whole free output is reasoning, the same text as without a parser."""
    from triollm.api.app import build_app

    body = {"messages": CHAT, "max_tokens": 12, **GREEDY}
    answers = []
    for reasoning in (None, "olmo3"):
        app = build_app(
            ServerState(roomy_llm, ServerSettings(served_model_names=("tiny",), reasoning_parser=reasoning))
        )
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            answers.append((await ok(client, "/v1/chat/completions", body))["choices"][0]["message"])
    plain, olmo = answers
    assert plain["content"] and plain["reasoning"] is None
    assert olmo["reasoning"] == plain["content"] and olmo["content"] is None


HARMONY_SPECIALS = ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>"]


@pytest.fixture(scope="module")
def harmony_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny model whose tokenizer has gpt-oss's markers as special tokens, as gpt-oss's has."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(tinymodel, "SPECIALS", [*tinymodel.SPECIALS, *HARMONY_SPECIALS])
        return tinymodel.make_tiny_model(tmp_path_factory.mktemp("tiny-harmony"))


@pytest.mark.anyio
@pytest.mark.parametrize("tool_parser", [None, "openai"])
async def test_harmony_markers_written_as_special_tokens_reach_the_parsers(
    harmony_model_dir: Path, tool_parser: str | None
) -> None:
    """The model writes the markers as special tokens (a grammar with llguidance's special-token
    syntax makes it): the server decodes them for the parsers (`keep_special_tokens`, asked by
    the reasoning parser too), or the reasoning parser would see "analysisHm.assistantfinal"."""
    from triollm.api.app import build_app

    grammar = (
        'start: <|channel|> "analysis" <|message|> "Hm." <|end|> <|start|> "assistant" <|channel|> '
        + ('"commentary to=functions.get_time " <|constrain|> "json" <|message|> "{}"' if tool_parser else
           '"final" <|message|> "Sunny."')
    )  # fmt: skip
    settings = ServerSettings(
        served_model_names=("tiny",), reasoning_parser="gpt_oss", enable_auto_tool_choice=tool_parser is not None,
        tool_call_parser=tool_parser,
    )  # fmt: skip
    body = {"messages": CHAT, "max_tokens": 60, **GREEDY, "structured_outputs": {"grammar": grammar}}
    if tool_parser:
        body["tools"] = TOOLS
    args = EngineArgs(model=str(harmony_model_dir), max_model_len=256, multiprocess=False, seed=0)
    async with AsyncLLM.from_engine_args(args) as llm:
        app = build_app(ServerState(llm, settings))
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            choice = (await ok(client, "/v1/chat/completions", body))["choices"][0]
            events = sse(await post(client, "/v1/chat/completions", {**body, "stream": True}))
    message = choice["message"]
    calls = [("get_time", {})] if tool_parser else []
    got_calls = [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in message["tool_calls"]]
    content = None if tool_parser else "Sunny."
    assert (message["reasoning"], message["content"] or None, got_calls) == ("Hm.", content, calls)
    assert assemble(events)[:3] == (content or "", "Hm.", calls)
