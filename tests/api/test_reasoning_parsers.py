"""api.reasoning_parsers: recorded outputs, arbitrary stream splits, the registry, end-token ids."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.api.reasoning_parsers import (
    DeepSeekR1ReasoningParser,
    DeepSeekV3ReasoningParser,
    Qwen3ReasoningParser,
    ReasoningParser,
    ReasoningParserManager,
)
from triollm.engine.processing.tokenizer import Tokenizer

CALL = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'

# (output, (reasoning, content)) for each parser with thinking on (the default).
R1_CASES = [
    ("<think>I add them.</think>The answer is 4.", ("I add them.", "The answer is 4.")),
    ("I add them.</think>The answer is 4.", ("I add them.", "The answer is 4.")),  # <think> in the prompt
    ("<think>cut off mid-thought", ("cut off mid-thought", None)),
    ("cut off mid-thought", ("cut off mid-thought", None)),
    ("<think></think>Just the answer.", ("", "Just the answer.")),  # empty reasoning
    ("<think>done</think>", ("done", None)),  # stops right after the end tag
    ("<think>a\nb</think>\n\nx</think>y", ("a\nb", "\n\nx</think>y")),  # only the first end counts
    ("<think>ü 𝔘 思考</think>答案 ✓", ("ü 𝔘 思考", "答案 ✓")),
    ("<think>x<think>y</think>z", ("x<think>y", "z")),  # an inner start tag stays text
    ("", (None, None)),
    ("</think>", ("", None)),
    ("<thi", ("<thi", None)),  # a partial marker at the end is text
]
QWEN3_CASES = [
    *[c for c in R1_CASES],
    ("I read the file.\n\n" + CALL, ("I read the file.\n\n", CALL)),  # a call ends reasoning
    ("<think>I read the file.\n\n" + CALL, ("I read the file.\n\n", CALL)),
    ("<think>r</think>c " + CALL, ("r", "c " + CALL)),
]
QWEN3_NO_THINKING = [
    ("This is plain content", (None, "This is plain content")),
    ("I read the file.\n\n" + CALL, (None, "I read the file.\n\n" + CALL)),
    ("<think>r</think>c", ("r", "c")),  # it thought anyway: still split
    ("", (None, None)),
]
V3_NO_THINKING = [
    ("<think>r</think>c", (None, "<think>r</think>c")),
    ("plain", (None, "plain")),
]


def _run_stream(parser: ReasoningParser, chunks: list[str]) -> tuple[str, str]:
    s = parser.stream()
    reasoning = content = ""
    for chunk in chunks:
        r, c = s.feed(chunk)
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return reasoning + r, content + c


def _parsers() -> list[tuple[ReasoningParser, list[tuple[str, tuple[str | None, str | None]]]]]:
    return [
        (DeepSeekR1ReasoningParser(), R1_CASES),
        (DeepSeekV3ReasoningParser(chat_template_kwargs={"thinking": True}), R1_CASES),
        (Qwen3ReasoningParser(), QWEN3_CASES),
        (Qwen3ReasoningParser(chat_template_kwargs={"enable_thinking": False}), QWEN3_NO_THINKING),
        (DeepSeekV3ReasoningParser(), V3_NO_THINKING),
    ]


def test_recorded_outputs_whole_and_streamed() -> None:
    for parser, cases in _parsers():
        for text, expected in cases:
            assert parser.extract_reasoning(text) == expected, (type(parser).__name__, text)
            # One character at a time, and the whole text in one delta.
            want = (expected[0] or "", expected[1] or "")
            assert _run_stream(parser, list(text)) == want, (type(parser).__name__, text)
            assert _run_stream(parser, [text]) == want, (type(parser).__name__, text)


def test_r1_differs_from_qwen3_on_a_tool_call() -> None:
    text = "thinking " + CALL
    assert DeepSeekR1ReasoningParser().extract_reasoning(text) == (text, None)
    assert Qwen3ReasoningParser().extract_reasoning(text) == ("thinking ", CALL)


_PIECES = st.sampled_from(
    ["<think>", "</think>", "<tool_call>", "<", "</", "<th", "</thi", "think>", ">", "a", "ü", "思", "\n", " "]
)


@settings(max_examples=300, deadline=None)
@given(
    pieces=st.lists(_PIECES, max_size=12),
    cuts=st.lists(st.integers(min_value=0, max_value=200), max_size=8),
    which=st.integers(min_value=0, max_value=4),
)
def test_any_chunk_split_reassembles_to_the_whole_split(pieces: list[str], cuts: list[int], which: int) -> None:
    parser = _parsers()[which][0]
    text = "".join(pieces)
    bounds = sorted({min(c, len(text)) for c in cuts})
    chunks = [text[a:b] for a, b in zip([0, *bounds], [*bounds, len(text)])]
    r, c = parser.extract_reasoning(text)
    assert _run_stream(parser, chunks) == (r or "", c or "")


def test_stream_holds_back_only_a_possible_marker() -> None:
    s = Qwen3ReasoningParser().stream()
    assert s.feed("<th") == ("", "")  # may be <think>
    assert s.feed("ink>step one") == ("step one", "")
    assert s.feed(" and two </thi") == (" and two ", "")  # may be </think>
    assert s.feed("nk>") == ("", "")
    assert s.feed("ans") == ("", "ans")
    assert s.finish() == ("", "")
    s = DeepSeekR1ReasoningParser().stream()
    assert s.feed("a <b") == ("a <b", "")  # "<b" cannot start a marker
    assert s.feed(" <") == (" ", "")
    assert s.finish() == ("<", "")


def test_registry() -> None:
    assert {"deepseek_r1", "deepseek_v3", "qwen3"} <= set(ReasoningParserManager.names())
    assert ReasoningParserManager.names() == sorted(ReasoningParserManager.names())
    assert ReasoningParserManager.get_reasoning_parser("qwen3") is Qwen3ReasoningParser
    with pytest.raises(
        ValueError, match=r"--reasoning-parser: unknown parser 'nope'; known: .*deepseek_r1, deepseek_v3"
    ):
        ReasoningParserManager.get_reasoning_parser("nope")
    with pytest.raises(TypeError, match="ReasoningParser subclass"):
        ReasoningParserManager.register_module("bad")(object)  # type: ignore[type-var]


def test_register_and_plugin(tmp_path: Path) -> None:
    plugin = tmp_path / "my_parser.py"
    plugin.write_text(
        "from triollm.api.reasoning_parsers import ReasoningParserManager, ThinkTagReasoningParser\n"
        "@ReasoningParserManager.register_module(['seed_test', 'seed_test2'])\n"
        "class Seed(ThinkTagReasoningParser):\n"
        "    name = 'seed_test'\n"
        "    start_token = '<seed:think>'\n"
        "    end_token = '</seed:think>'\n"
    )
    try:
        ReasoningParserManager.import_reasoning_parser(plugin)
        cls = ReasoningParserManager.get_reasoning_parser("seed_test2")
        assert ReasoningParserManager.get_reasoning_parser("seed_test") is cls
        assert cls().extract_reasoning("<seed:think>r</seed:think>c") == ("r", "c")
        with pytest.raises(ValueError, match="'seed_test' is already registered"):
            ReasoningParserManager.register_module("seed_test", force=False)(cls)
    finally:
        for name in ("seed_test", "seed_test2"):
            ReasoningParserManager.registry.parsers.pop(name, None)
    with pytest.raises(ValueError, match="--reasoning-parser-plugin: no such file"):
        ReasoningParserManager.import_reasoning_parser(tmp_path / "missing.py")


def test_end_token_ids_decode_back(bundled_model_dir: Path) -> None:
    tok = Tokenizer.from_pretrained(bundled_model_dir)
    for cls in (DeepSeekR1ReasoningParser, Qwen3ReasoningParser):
        ids = cls(tok).end_token_ids()
        assert ids and tok.decode(ids) == "</think>"
    assert DeepSeekR1ReasoningParser().end_token_ids() is None  # no tokenizer
