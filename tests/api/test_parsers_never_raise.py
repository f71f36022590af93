"""Every registered tool-call parser and reasoning parser, fed arbitrary text, never raises
(issue 39): their contract says output that is not a well-formed call is content, and model
output may be anything. The text is hypothesis's: plain text over the markers' alphabet, and
each parser's call syntax around JSON and XML nested up to well past Python's recursion limit,
integers longer than Python's `int` reads, unclosed brackets and strings. Each text is read
whole, streamed one character at a time (a cut at every position) and streamed in pieces cut
where hypothesis chooses.
"""

from __future__ import annotations

from typing import Any

from hypothesis import example, given, settings
from hypothesis import strategies as st

from triollm.api.reasoning_parsers import ReasoningParser, ReasoningParserManager
from triollm.api.tool_parsers import ExtractedToolCalls, StreamDelta, ToolParser, ToolParserManager

# Every registered class once (aliases share a class), as registered when this module loads.
TOOL_PARSERS: list[type[ToolParser]] = list(dict.fromkeys(ToolParserManager.registry.parsers.values()))
REASONING_PARSERS: list[type[ReasoningParser]] = list(dict.fromkeys(ReasoningParserManager.registry.parsers.values()))

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {
                "type": "object",
                "properties": {
                    "a": {"type": "array"},
                    "o": {"type": "object"},
                    "n": {"type": "integer"},
                    "x": {"type": ["number", "null"]},
                    "b": {"type": "boolean"},
                    "s": {"type": "string"},
                },
            },
        },
    }
]
# Each parser's call syntax, before and after a payload (and a reasoning section's).
FRAMES = [
    ("", ""),
    ('<tool_call>\n{"name": "f", "arguments": {"a": ', "}}\n</tool_call>"),
    ('<tool_call>{"arguments": {"o": ', '}, "name": "f"}</tool_call>'),
    ('<tool_call>{"name": "f", "arguments": "{\\"a\\": ', '}"}</tool_call>'),
    ('<|python_tag|>{"name": "f", "parameters": {"a": ', "}}"),
    ('{"name": "f", "parameters": ', '}; {"name": "f"}'),
    ('[TOOL_CALLS][{"name": "f", "arguments": {"a": ', "}}, "),
    ("[TOOL_CALLS]f[ARGS]{\"o\": ", "}"),
    ("[TOOL_CALLS]f{\"n\": ", "}[TOOL_CALLS]f{}"),
    ("[f(a=", "), f(o=1)]"),
    ("<tool_call>\n<function=f>\n<parameter=a>\n", "\n</parameter>\n</function>\n</tool_call>"),
    ("<tool_call>\n<function=f>\n<parameter=o>\n", "\n</parameter>\n<parameter=n>\n"),
    ("<tool_call><function=f><parameter=n>", "</parameter></function>"),
    ("<think>", "</think>"),
    ("", '</think><tool_call>{"name": "f", "arguments": {"a": '),
]
MARKERS = "<tool_call></tool_call><function=f><parameter=a></parameter></function>[TOOL_CALLS][ARGS]<think></think>"
ALPHABET = st.sampled_from(list(set(MARKERS)) + list('{}[]()":,;\\ \n0123456789eE.-+tfn') + ["\x00", "é", "🌦"])


def nested(opening: str, closing: str, middle: str = "") -> st.SearchStrategy[str]:
    """`opening` n times, `middle`, then `closing` n times, closed or cut off."""
    return st.builds(
        lambda n, closed: opening * n + middle + (closing * n if closed else ""),
        st.integers(0, 1500),
        st.booleans(),
    )


PAYLOADS = st.one_of(
    st.text(ALPHABET, max_size=80),
    nested("[", "]"),
    nested('{"a": ', "}", "1"),
    nested("[{", "}]"),
    nested("(", ")"),
    nested("<a>", "</a>"),
    nested("<tool_call><function=f><parameter=o>", "</parameter></function></tool_call>", "[1]"),
    st.integers(4000, 6000).map(lambda n: "9" * n),
    st.integers(4000, 6000).map(lambda n: "-" + "9" * n + ".5e3"),
    st.just("1e999999"),
    st.just("0x" + "f" * 4000),
)
TEXTS = st.builds(
    lambda frame, payload, tail: frame[0] + payload + frame[1] + tail,
    st.sampled_from(FRAMES),
    PAYLOADS,
    st.text(ALPHABET, max_size=20),
)

DEEP = 3000


def read_with_tool_parsers(text: str, cuts: list[int]) -> None:
    for cls in TOOL_PARSERS:
        parser = cls(None, TOOLS)
        assert isinstance(parser.extract_tool_calls(text), ExtractedToolCalls)
        for pieces in (list(text), split(text, cuts)):
            stream = parser.stream()
            for piece in pieces:
                assert isinstance(stream.feed(piece), StreamDelta)
            assert isinstance(stream.finish(), StreamDelta)


def read_with_reasoning_parsers(text: str, cuts: list[int]) -> None:
    for cls in REASONING_PARSERS:
        for kwargs in (None, {"enable_thinking": False, "thinking": True}):
            parser = cls(None, chat_template_kwargs=kwargs)
            reasoning, content = parser.extract_reasoning(text)
            assert all(part is None or isinstance(part, str) for part in (reasoning, content))
            for pieces in (list(text), split(text, cuts)):
                stream = parser.stream()
                out: list[Any] = [stream.feed(piece) for piece in pieces]
                out.append(stream.finish())
                assert all(isinstance(r, str) and isinstance(c, str) for r, c in out)


def split(text: str, cuts: list[int]) -> list[str]:
    bounds = [0, *sorted(min(c, len(text)) for c in cuts), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:], strict=False)]


@settings(max_examples=60, deadline=None, database=None)
@given(text=TEXTS, cuts=st.lists(st.integers(0, 12_000), max_size=8))
@example(text='<tool_call>\n{"name": "f", "arguments": {"a": ' + "[" * DEEP + "]" * DEEP + "}}</tool_call>", cuts=[])
@example(text='{"arguments": {"a": ' + "[" * DEEP + "]" * DEEP + '}, "name": "f"}', cuts=[50])
@example(text='[TOOL_CALLS]f{"a": ' + "[" * DEEP + "]" * DEEP + "}", cuts=[])
@example(text="<tool_call><function=f><parameter=a>" + "[" * 600 + "]" * 600, cuts=[])
@example(text="<tool_call><function=f><parameter=n>" + "9" * 5000, cuts=[1000])
def test_no_parser_raises_on_any_text(text: str, cuts: list[int]) -> None:
    names = {cls.name for cls in TOOL_PARSERS} | {cls.name for cls in REASONING_PARSERS}
    assert {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_r1", "qwen3"} <= names
    read_with_tool_parsers(text, cuts)
    read_with_reasoning_parsers(text, cuts)
