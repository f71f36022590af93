"""Tool-call parsers on recorded model outputs: whole outputs, the same outputs streamed in
arbitrary pieces (hypothesis), malformed ones, and the registry with its plugin hook."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

import triollm.api.tool_parsers as tool_parsers
from triollm.api.tool_parsers import ToolParser, ToolParserManager
from triollm.api.tool_parsers._json_scan import JsonScanner
from triollm.api.tool_parsers._segments import Broken

SETTINGS = settings(max_examples=100, deadline=None, database=None)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather at a place.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string"},
                    "days": {"type": "integer"},
                    "metric": {"type": "boolean"},
                    "hours": {"type": "array"},
                    "where": {"type": "object"},
                    "ratio": {"type": ["number", "null"]},
                },
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {}}},
]

Calls = list[tuple[str, dict[str, Any]]]
PARIS: Calls = [("get_weather", {"city": "Paris"})]
PARALLEL: Calls = [("get_weather", {"city": "Paris", "days": 3}), ("get_time", {})]
UNICODE: Calls = [("get_weather", {"city": "Zürich 東京 \"quoted\" \\ 🌦"})]
NESTED: Calls = [("get_weather", {"where": {"lat": -1.5e3, "tags": [True, None, {"k": []}]}})]

# (text, content, calls) per parser: outputs recorded from the models (or shaped like them),
# on which a whole output and every way of streaming it agree.
CASES: dict[str, list[tuple[str, str | None, Calls]]] = {
    "hermes": [
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
         None, PARIS),
        ('I will look both up.\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": '
         '"Paris", "days": 3}}\n</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {}}'
         "\n</tool_call>", "I will look both up.\n\n", PARALLEL),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich 東京 \\"quoted\\" '
         '\\\\ \\ud83c\\udf26"}}\n</tool_call>', None, UNICODE),
        ('<tool_call>{"name":"get_weather","arguments":{"where":{"lat":-1.5e3,"tags":[true,null,'
         '{"k":[]}]}}}</tool_call> Shall I go on?', " Shall I go on?", NESTED),
        # Unclosed at end of sequence (vLLM takes it), keys in another order, arguments
        # double-encoded as a string, no arguments for a declared tool, missing last brace.
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}', None, PARIS),
        ('<tool_call>{"arguments": {"city": "Paris"}, "name": "get_weather"}</tool_call>',
         None, PARIS),
        ('<tool_call>{"name": "get_weather", "arguments": "{\\"city\\": \\"Paris\\"}"}'
         "</tool_call>", None, PARIS),
        ('<tool_call>{"name": "get_time"}</tool_call>', None, [("get_time", {})]),
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
         None, PARIS),
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}, "id": 7}'
         "</tool_call>", None, PARIS),
        # Text only: a marker in prose, a region that holds no call, a lone "<".
        ("Use the <tool_call> tag to call a tool.", "Use the <tool_call> tag to call a tool.", []),
        ("<tool_call>not json</tool_call> so", "<tool_call>not json</tool_call> so", []),
        ('<tool_call>{"name": "Bob"}</tool_call>', '<tool_call>{"name": "Bob"}</tool_call>', []),
        ("a < b, and <tool_", "a < b, and <tool_", []),
        ("", "", []),
    ],
    "llama3_json": [
        ('{"name": "get_weather", "parameters": {"city": "Paris"}}', None, PARIS),
        ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris", "days": 3}}; '
         '{"name": "get_time", "parameters": {}}', None, PARALLEL),
        ('\n{"name": "get_weather", "arguments": {"city": "Zürich 東京 \\"quoted\\" \\\\ 🌦"}}',
         None, UNICODE),
        ('{"name": "get_weather", "parameters": {"where": {"lat": -1.5e3, "tags": [true, null, '
         '{"k": []}]}}} That is all.', " That is all.", NESTED),
        ('{"parameters": {"city": "Paris"}, "name": "get_weather"};', None, PARIS),
        ('{"name": "get_time"}', None, [("get_time", {})]),
        ("The weather in Paris is sunny.", "The weather in Paris is sunny.", []),
        ('Sure: {"name": "get_time", "parameters": {}}',
         'Sure: {"name": "get_time", "parameters": {}}', []),
        ('{"answer": 42, "name": "x"}', '{"answer": 42, "name": "x"}', []),
        ('<|python_tag|>brave_search.call(query="Paris")',
         '<|python_tag|>brave_search.call(query="Paris")', []),
        ("<|python_tag|", "<|python_tag|", []),
    ],
    "mistral": [
        ('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, PARIS),
        ('Let me check. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
         '"days": 3}}, {"name": "get_time", "arguments": {}}]', "Let me check. ", PARALLEL),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "days": 3}[TOOL_CALLS]get_time[ARGS]{}',
         None, PARALLEL),
        ('[TOOL_CALLS]get_weather{"city": "Zürich 東京 \\"quoted\\" \\\\ 🌦"}', None, UNICODE),
        ('[TOOL_CALLS]get_weather[ARGS]{"where": {"lat": -1.5e3, "tags": [true, null, {"k": []}]}}'
         " Done.", " Done.", NESTED),
        ("[TOOL_CALLS]", "[TOOL_CALLS]", []),
        ("Write [TOOL_ and [TOOL_CALLS]get weather{}", "Write [TOOL_ and [TOOL_CALLS]get weather{}",
         []),
        ("[TOOL_CALLS][1, 2]", "[TOOL_CALLS][1, 2]", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris")]', None, PARIS),
        ("[get_weather(city='Paris', days=3), get_time()]", None, PARALLEL),
        ('[get_weather(city="Zürich 東京 \\"quoted\\" \\\\ 🌦")]', None, UNICODE),
        ("[get_weather(where={'lat': -1.5e3, 'tags': (True, None, {'k': []})})] Anything else?",
         " Anything else?", NESTED),
        ('  [get_weather(city="""Paris""")]', None, PARIS),
        ("The answer is [1, 2].", "The answer is [1, 2].", []),
        ("[1] First point.", "[1] First point.", []),
        ("[get_weather('Paris')]", "[get_weather('Paris')]", []),
        ("[get_weather(city=__import__('os').getcwd())]",
         "[get_weather(city=__import__('os').getcwd())]", []),
        ("[get_weather(city='Par", "[get_weather(city='Par", []),
    ],
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>"
         "\n</tool_call>", None, PARIS),
        ("Checking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
         "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
         "<function=get_time>\n</function>\n</tool_call>", "Checking.\n", PARALLEL),
        ('<tool_call>\n<function=get_weather>\n<parameter=city>\nZürich 東京 "quoted" \\ 🌦\n'
         "</parameter>\n</function>\n</tool_call>", None, UNICODE),
        ('<tool_call>\n<function=get_weather>\n<parameter=where>\n{"lat": -1.5e3, "tags": [true, '
         'null, {"k": []}]}\n</parameter>\n</function>\n</tool_call>', None, NESTED),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis", None, PARIS),
        ("<tool_call>\nnothing\n</tool_call>", "<tool_call>\nnothing\n</tool_call>", []),
    ],
}

# Malformed calls that a stream has already announced when they break: the whole output is
# content; the stream ends the call with arguments that are still valid JSON.
BROKEN: dict[str, list[str]] = {
    "hermes": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris" "days": 3}}\n'
        "</tool_call>",
        '<tool_call>{"name": "get_weather", "arguments": {"days": 3, "city": NaN}}</tool_call>',
        '<tool_call>{"name": "get_weather", "arguments": {"city": "\\u00e</tool_call>',
    ],
    "llama3_json": [
        '{"name": "get_weather", "parameters": {"days": 3, "hours": [1, 2',
        '{"name": "get_weather", "parameters": {"days": tru}}',
    ],
    "mistral": [
        '[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"',
        '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", }[TOOL_CALLS]get_time{}',
    ],
}


def parser(name: str) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)(tools=TOOLS)


def whole(p: ToolParser, text: str) -> tuple[str | None, Calls]:
    result = p.extract_tool_calls(text)
    assert result.tools_called == bool(result.tool_calls)
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in result.tool_calls]
    for call in result.tool_calls:
        assert call.type == "function"
        assert json.loads(call.function.arguments) is not None  # a JSON object string
    return result.content, calls


def streamed(p: ToolParser, pieces: list[str]) -> tuple[str, Calls, list[str]]:
    """Feed the pieces; check the delta shapes; the content, calls and ids reassembled."""
    stream = p.stream()
    content, names, args, ids = "", [], [], []
    for delta in [*(stream.feed(piece) for piece in pieces), stream.finish()]:
        content += delta.content
        for tc in delta.tool_calls:
            assert tc.function is not None
            if tc.index == len(names):  # the first delta of a call
                assert tc.id and tc.type == "function" and tc.function.name
                ids.append(tc.id)
                names.append(tc.function.name)
                args.append("")
            else:
                assert tc.index == len(names) - 1, "deltas of an earlier call"
                assert tc.id is None and tc.type is None and tc.function.name is None
            args[-1] += tc.function.arguments or ""
    calls = [(name, json.loads(a)) for name, a in zip(names, args, strict=True)]
    assert all(isinstance(a, dict) for _, a in calls)
    return content, calls, ids


def expected_stream_content(content: str | None, text: str, calls: Calls) -> str:
    return (content or "") if calls else text


ALL_CASES = [(name, *case) for name, cases in CASES.items() for case in cases]


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL_CASES)
def test_whole_output(name: str, text: str, content: str | None, calls: Calls) -> None:
    assert whole(parser(name), text) == (content, calls)


@pytest.mark.parametrize(("name", "text", "content", "calls"), ALL_CASES)
def test_streamed_at_every_boundary(name: str, text: str, content: str | None, calls: Calls):
    p = parser(name)
    want = (expected_stream_content(content, text, calls), calls)
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
    assert (got_content, got_calls) == (expected_stream_content(content, text, calls), calls)
    assert len(set(ids)) == len(ids)


PIECES = [*'{}[]",:\\ \n<>/=()\';', "<tool_call>", "</tool_call>", "[TOOL_CALLS]", "[ARGS]"]
PIECES += ["<function=", "</function>", "<parameter=", "</parameter>", "<|python_tag|>", "x1"]


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
    if any(isinstance(event, Broken) for event in p.segmenter().push(text, final=True)):
        assert (content, calls) == (text, [])
    else:
        assert got == (expected_stream_content(content, text, calls), calls)


@pytest.mark.parametrize(("name", "text"), [(n, t) for n, ts in BROKEN.items() for t in ts])
def test_broken_call_is_content_whole_and_closed_in_stream(name: str, text: str) -> None:
    p = parser(name)
    assert whole(p, text) == (text, [])
    content, calls, _ = streamed(p, [text])  # arguments that json.loads accepts
    assert calls and calls[0][0] == "get_weather"
    for pieces in (list(text), [text[: len(text) // 2], text[len(text) // 2 :]]):
        assert streamed(p, pieces)[:2] == (content, calls)


def test_broken_stream_keeps_the_arguments_sent_so_far() -> None:
    text = BROKEN["hermes"][0]
    assert streamed(parser("hermes"), [text])[1] == [("get_weather", {"city": "Par"})]
    text = BROKEN["llama3_json"][0]
    want = [("get_weather", {"days": 3, "hours": [1]})]
    assert streamed(parser("llama3_json"), [text])[1] == want


def test_text_is_sent_at_once_and_only_a_marker_prefix_held() -> None:
    stream = parser("hermes").stream()
    assert stream.feed("Hello ").content == "Hello "
    assert stream.feed("wait <tool_").content == "wait "
    assert stream.feed("box> done").content == "<tool_box> done"
    assert stream.feed("<tool_call>").content == ""
    assert stream.finish().content == "<tool_call>"
    stream = parser("mistral").stream()
    assert stream.feed("a [TOOL_CALLS").content == "a "
    assert stream.feed("] x").content == ""  # holds back: the v11 form starts with a name


def test_arguments_stream_as_they_arrive() -> None:
    stream = parser("hermes").stream()
    head = stream.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    [first] = head.tool_calls
    assert (first.index, first.function and first.function.name) == (0, "get_weather")
    assert first.function is not None and first.function.arguments == '{"city": "Pa'
    piece = stream.feed('ris", "days": 3')
    assert [tc.function.arguments for tc in piece.tool_calls if tc.function] == ['ris"']
    rest = stream.feed("}}\n</tool_call>").tool_calls + stream.finish().tool_calls
    assert "".join(tc.function.arguments or "" for tc in rest if tc.function) == ', "days": 3}'


def test_no_call_is_announced_before_its_name_and_arguments_start() -> None:
    stream = parser("hermes").stream()
    assert not stream.feed('<tool_call>{"name": "get_wea').tool_calls
    assert not stream.feed('ther", "argu').tool_calls
    assert stream.feed('ments": {').tool_calls


def test_call_ids() -> None:
    ids = streamed(parser("hermes"), [CASES["hermes"][1][0]])[2]
    assert all(re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", i) for i in ids)
    mistral = parser("mistral")
    result = mistral.extract_tool_calls(CASES["mistral"][2][0])
    ids += [call.id for call in result.tool_calls] + streamed(mistral, [CASES["mistral"][2][0]])[2]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i in ids[2:])
    assert len(set(ids)) == len(ids) == 6


def test_qwen3_parameters_follow_the_schema_types() -> None:
    def call(params: str) -> dict[str, Any]:
        text = f"<tool_call>\n<function=get_weather>\n{params}</function>\n</tool_call>"
        [(_, args)] = whole(parser("qwen3_coder"), text)[1]
        return args

    def p(key: str, value: str) -> str:
        return f"<parameter={key}>\n{value}\n</parameter>\n"

    got = call(p("days", "3") + p("metric", "False") + p("hours", "[1, 2]") + p("ratio", "null"))
    assert got == {"days": 3, "metric": False, "hours": [1, 2], "ratio": None}
    got = call(p("where", "{'a': (1, 'b')}") + p("ratio", "0.5") + p("city", "42"))
    assert got == {"where": {"a": [1, "b"]}, "ratio": 0.5, "city": "42"}
    # A value that does not fit its type, or a parameter the schema does not name: a string.
    got = call(p("days", "three") + p("metric", "yes") + p("hours", "1 to 2") + p("other", "7"))
    assert got == {"days": "three", "metric": "yes", "hours": "1 to 2", "other": "7"}
    text = "<tool_call>\n<function=get_weather>\n" + p("days", "3") + "</function>\n</tool_call>"
    assert whole(ToolParserManager.get_tool_parser("qwen3_xml")(), text)[1] == [
        ("get_weather", {"days": "3"})  # no tools given: strings
    ]


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3)
    | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@SETTINGS
@given(value=st.dictionaries(st.text(max_size=5), JSON, max_size=4), ascii=st.booleans())
def test_scanner_safe_points_close_to_valid_json(value: dict[str, Any], ascii: bool) -> None:
    text = json.dumps(value, ensure_ascii=ascii)
    scanner = JsonScanner()
    for i, ch in enumerate(text):
        assert scanner.feed(ch) == 1 and not scanner.failed
        assert scanner.done == (i == len(text) - 1)
        json.loads(text[: scanner.safe] + scanner.safe_closer)
    assert scanner.feed(" more") == 0


@SETTINGS
@example(text='{"a": [1, {"b": null}], "c": "\\u00e9"}', edits=[])
@example(text='{"a": "\\x"}', edits=[])
@example(text='{"a": "\t"}', edits=[])
@example(text='{"a": 01}', edits=[])
@example(text='{"a": NaN}', edits=[])
@example(text='{"": [null, -1e309]}', edits=[])
@given(
    text=st.dictionaries(st.text(max_size=3), JSON, max_size=3).map(json.dumps),
    edits=st.lists(st.tuples(st.integers(0, 200), st.sampled_from([*'{}[],:"\\-.e0tx\n\t', ""]))),
)
def test_scanner_accepts_what_json_loads_accepts(text: str, edits: list[tuple[int, str]]) -> None:
    for at, ch in edits[:3]:  # characters put in ("" cuts one out)
        at %= len(text) + 1
        text = text[:at] + ch + text[at + (not ch) :]
    scanner = JsonScanner()
    n = scanner.feed(text)
    try:
        json.loads(text, parse_constant=_not_json, parse_float=_finite)
        valid = text.lstrip()[:1] in ("{", "[")  # the scanner reads objects and arrays
    except ValueError:
        valid = False
    assert valid == (scanner.done and not text[n:].strip()), text


def _not_json(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(token: str) -> float:
    """A float as json.loads reads it, refusing one that overflows to infinity (-1e309), as the
    scanner does: such a number would not be written back as the same JSON (its module note)."""
    value = float(token)
    if not math.isfinite(value):
        raise ValueError(f"{token} overflows")
    return value


def test_registry_names_and_unknown_name() -> None:
    names = ToolParserManager.names()
    assert names == sorted(names)
    builtin = {"hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "qwen3_xml"}
    assert builtin <= set(names)
    assert ToolParserManager.get_tool_parser("mistral").keep_special_tokens
    assert not ToolParserManager.get_tool_parser("hermes").keep_special_tokens
    with pytest.raises(ValueError, match="--tool-call-parser") as info:
        ToolParserManager.get_tool_parser("nope")
    assert ", ".join(names) in str(info.value)


PLUGIN = '''
from triollm.api.tool_parsers import ExtractedToolCalls, StreamDelta, ToolCallStream, ToolParser
from triollm.api.tool_parsers import ToolParserManager


class Echo(ToolCallStream):
    def feed(self, delta):
        return StreamDelta(content=delta.upper())

    def finish(self):
        return StreamDelta()


@ToolParserManager.register_module(["shout", "shout2"])
class Shout(ToolParser):
    name = "shout"

    def extract_tool_calls(self, text):
        return ExtractedToolCalls(tools_called=False, tool_calls=[], content=text.upper())

    def stream(self):
        return Echo()
'''


def test_plugin_registers_its_parsers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ToolParserManager.registry, "parsers", dict(ToolParserManager.registry.parsers))
    path = tmp_path / "my_parser.py"
    path.write_text(PLUGIN)
    ToolParserManager.import_tool_parser(str(path))
    shout = ToolParserManager.get_tool_parser("shout2")()
    assert shout.extract_tool_calls("hi").content == "HI"
    assert shout.stream().feed("hi").content == "HI"
    assert "shout" in ToolParserManager.names()


def test_plugin_errors_name_the_flag(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="--tool-parser-plugin.*missing.py"):
        ToolParserManager.import_tool_parser(str(tmp_path / "missing.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("raise RuntimeError('boom')\n")
    with pytest.raises(ValueError, match="--tool-parser-plugin.*RuntimeError: boom"):
        ToolParserManager.import_tool_parser(str(bad))


def test_public_names() -> None:
    assert tool_parsers.__all__ == [
        "ExtractedToolCalls",
        "StreamDelta",
        "ToolCallStream",
        "ToolParser",
        "ToolParserManager",
        "make_tool_call_id",
    ]
