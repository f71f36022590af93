"""What a choice's generated text turns into on the chat and Responses routes: reasoning, content
and tool calls, for the whole output or delta by delta.

The order is vLLM's: the reasoning parser (`--reasoning-parser`) splits the reasoning off first,
and tool calls are read from the content alone: under a forced tool choice by the constrained
call reader (api/tool_calls.py), under "auto" by the server's `--tool-call-parser`. Streaming
runs the same two stages on each delta, so the deltas of a choice add up to its whole output.

A parser never fails a request. The built-in ones do not raise on any text (their contract,
tests/api/test_parsers_never_raise.py), but a plugin may, and model output is anything: this
module is the one place that calls parsers, and an exception from one (building it, reading a
whole output, a streamed delta) is logged with the parser's name and the output is read as if
that parser were not there: plain text. A stream that fails gives as content what the parser
held back when it can tell (nothing was announced, and what the parser sent is a beginning of
what it was fed), else the delta it failed on; it is not called again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import msgspec

from triollm.api.protocol import DeltaToolCall, ToolCall
from triollm.api.tool_calls import ConstrainedCallStream, ToolChoice, constrained_tool_calls
from triollm.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from triollm.api.reasoning_parsers import ReasoningParser, ReasoningStream
    from triollm.api.tool_parsers import StreamDelta, ToolCallStream, ToolParser

log = logging.getLogger("triollm.api")
R = TypeVar("R")

__all__ = ["ChoiceStream", "OutputParsing", "OutputPiece", "ParsedOutput", "make_output_parsing"]


@dataclass
class ParsedOutput:
    """A choice's whole output. `tool_called`: its finish reason becomes "tool_calls" (the tool
    parser found calls under "auto", or "required" made them; a named call keeps its own)."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    tool_called: bool = False


@dataclass
class OutputPiece:
    """What one delta of text turned into."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[DeltaToolCall] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)


@dataclass
class OutputParsing:
    """One request's parsing: its tool choice, and the server's parsers (None when not set or
    not used by this request)."""

    choice: ToolChoice
    tool_parser: ToolParser | None = None
    reasoning_parser: ReasoningParser | None = None
    include_reasoning: bool = True

    @property
    def keep_special_tokens(self) -> bool:
        """A parser reads markers that are special tokens: decode them into the text."""
        return any(p is not None and p.keep_special_tokens for p in (self.tool_parser, self.reasoning_parser))

    def gate(self, structured: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """A grammar for this request starts after its reasoning (the reasoning parser's end
        marker), as in vLLM: the model thinks freely, then answers in the grammar."""
        parser = self.reasoning_parser
        if structured is None or parser is None:
            return structured
        ids = _guarded(parser, parser.grammar_start_ids, None)
        return structured if ids is None else msgspec.structs.replace(structured, start_after_token_ids=ids)

    def whole(self, text: str) -> ParsedOutput:
        reasoning, content = self._split(text)
        if self.choice.forced:
            calls = _guarded(self.choice, lambda: constrained_tool_calls(self.choice, content or ""), None)
            if calls is not None:
                return ParsedOutput("", reasoning, calls, tool_called=self.choice.mode == "required")
            return ParsedOutput(content, reasoning)
        parser = self.tool_parser
        if parser is not None:
            found = _guarded(parser, lambda: parser.extract_tool_calls(content or ""), None)
            if found is not None and found.tools_called:
                calls = found.tool_calls if self.choice.parallel else found.tool_calls[:1]
                return ParsedOutput(found.content, reasoning, calls, tool_called=True)
            if found is not None and found.content != (content or ""):
                # A parser that reads its format's plain text too (harmony's channels).
                return ParsedOutput(found.content or None, reasoning)
        return ParsedOutput(content, reasoning)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)

    def _split(self, text: str) -> tuple[str | None, str | None]:
        parser = self.reasoning_parser
        if parser is None:
            return None, text
        plain: tuple[str | None, str | None] = (None, text)
        reasoning, content = _guarded(parser, lambda: parser.extract_reasoning(text), plain)
        return (reasoning if self.include_reasoning else None), content


def _guarded(parser: object, call: Callable[[], R], fallback: R) -> R:
    """`call()`, or `fallback` when the parser it runs raises (logged)."""
    try:
        return call()
    except Exception as exc:  # noqa: BLE001 - a parser's failure is plain text, never the request's
        _failed(parser, exc)
        return fallback


def _failed(parser: object, exc: Exception) -> None:
    # The class names only: the message may quote the model's output.
    name = parser.__name__ if isinstance(parser, type) else type(parser).__name__
    log.warning("output parser %s raised %s; this output is read as plain text", name, type(exc).__name__)


class _Record:
    """What a parser's stream was fed and what it sent, for a stream that fails: the text it
    held back is what was fed beyond what was sent, while that is a beginning of it. Kept only
    since the parser last held nothing back, and no longer once the rule stops holding (a tool
    call was announced, reasoning gave way to content)."""

    def __init__(self) -> None:
        self.fed: list[str] | None = []  # None: no longer kept
        self.sent: list[str] = []
        self._held = 0  # characters fed beyond those sent

    def add(self, fed: str, sent: str, *, last: bool = False) -> None:
        """`fed` went in, `sent` came out; `last`: the rule stops holding here."""
        if last:
            self.fed = None
        if self.fed is None:
            return
        self._held += len(fed) - len(sent)
        if self._held == 0:
            self.fed, self.sent = [], []
        else:
            self.fed.append(fed)
            self.sent.append(sent)

    def unsent(self, delta: str) -> str:
        """The text to give as content once the stream failed on `delta`."""
        if self.fed is None:
            return delta
        fed, sent = "".join(self.fed) + delta, "".join(self.sent)
        self.fed, self.sent = None, []
        return fed[len(sent) :] if fed.startswith(sent) else delta


class ChoiceStream:
    """One choice's parsing, delta by delta; `tool_called` once the tool parser (or a "required"
    choice) sent a call: the finish reason becomes "tool_calls", as vLLM streams it."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.parsing = parsing
        reasoning_parser, tool_parser = parsing.reasoning_parser, parsing.tool_parser
        self._reasoning: ReasoningStream | None = (
            _guarded(reasoning_parser, reasoning_parser.stream, None) if reasoning_parser is not None else None
        )
        self._forced = ConstrainedCallStream(parsing.choice) if parsing.choice.forced else None
        self._tools: ToolCallStream | None = (
            _guarded(tool_parser, tool_parser.stream, None)
            if tool_parser is not None and self._forced is None
            else None
        )
        self._reasoning_record = _Record()
        self._tools_record = _Record()
        self.tool_called = False

    def feed(self, delta: str) -> OutputPiece:
        reasoning, content = self._reason(delta, end=False)
        return self._merge(reasoning, self._content(content, end=False))

    def finish(self) -> OutputPiece:
        reasoning, content = self._reason("", end=True)
        return self._merge(reasoning, self._content(content, end=True))

    def _merge(self, reasoning: str, piece: OutputPiece) -> OutputPiece:
        if self.parsing.include_reasoning:
            piece.reasoning = reasoning
        return piece

    def _reason(self, delta: str, *, end: bool) -> tuple[str, str]:
        stream = self._reasoning
        if stream is None:
            return "", delta
        try:
            reasoning, content = stream.finish() if end else stream.feed(delta)
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            _failed(self.parsing.reasoning_parser, exc)
            self._reasoning = None
            return "", self._reasoning_record.unsent(delta)
        self._reasoning_record.add(delta, reasoning, last=bool(content))
        return reasoning, content

    def _content(self, text: str, *, end: bool) -> OutputPiece:
        if self._forced is not None:
            try:
                calls = self._forced.feed(text)
                self.tool_called = self.tool_called or (bool(calls) and self.parsing.choice.mode == "required")
                return OutputPiece(tool_calls=calls)
            except Exception as exc:  # noqa: BLE001 - see the module docstring
                _failed(self._forced, exc)
                self._forced = None
                return OutputPiece(content=text)
        pieces = [self._tool_step(text, end=False)] if text else []
        if end:
            pieces.append(self._tool_step("", end=True))
        out = OutputPiece(
            content="".join(p.content for p in pieces),
            tool_calls=[c for p in pieces for c in p.tool_calls],
        )
        if not self.parsing.choice.parallel:
            out.tool_calls = [c for c in out.tool_calls if c.index == 0]
        self.tool_called = self.tool_called or bool(out.tool_calls)
        return out

    def _tool_step(self, text: str, *, end: bool) -> OutputPiece:
        stream = self._tools
        if stream is None:
            return OutputPiece(content=text)
        try:
            got: StreamDelta = stream.finish() if end else stream.feed(text)
        except Exception as exc:  # noqa: BLE001 - see the module docstring
            _failed(self.parsing.tool_parser, exc)
            self._tools = None
            return OutputPiece(content=self._tools_record.unsent(text))
        self._tools_record.add(text, got.content, last=bool(got.tool_calls))
        return OutputPiece(content=got.content, tool_calls=list(got.tool_calls))


def make_output_parsing(
    choice: ToolChoice,
    *,
    tokenizer: Any,
    tool_call_parser: str | None,
    reasoning_parser: str | None,
    include_reasoning: bool = True,
    chat_template_kwargs: dict[str, Any] | None = None,
) -> OutputParsing:
    """The parsers a request uses: the tool parser only under "auto" (a forced call is read by
    the grammar's own reader), the reasoning parser whenever the server has one (it reads the
    request's `chat_template_kwargs`: `enable_thinking=False` turns Qwen3's reasoning off)."""
    tool = None
    if choice.mode == "auto" and tool_call_parser is not None:
        from triollm.api.tool_parsers import ToolParserManager

        tool_class = ToolParserManager.get_tool_parser(tool_call_parser)
        tool = _guarded(tool_class, lambda: tool_class(tokenizer, list(choice.tools)), None)
    reasoning = None
    if reasoning_parser is not None:
        from triollm.api.reasoning_parsers import ReasoningParserManager

        reasoning_class = ReasoningParserManager.get_reasoning_parser(reasoning_parser)
        reasoning = _guarded(
            reasoning_class, lambda: reasoning_class(tokenizer, chat_template_kwargs=chat_template_kwargs), None
        )
    return OutputParsing(choice, tool, reasoning, include_reasoning)
