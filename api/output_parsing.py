"""What a choice's generated text turns into on the chat and Responses routes: reasoning, content
and tool calls, for the whole output or delta by delta.

The order is vLLM's: the reasoning parser (`--reasoning-parser`) splits the reasoning off first,
and tool calls are read from the content alone: under a forced tool choice by the constrained
call reader (api/tool_calls.py), under "auto" by the server's `--tool-call-parser`. Streaming
runs the same two stages on each delta, so the deltas of a choice add up to its whole output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import msgspec

from triollm.api.protocol import DeltaToolCall, ToolCall
from triollm.api.tool_calls import ConstrainedCallStream, ToolChoice, constrained_tool_calls
from triollm.engine.sampling_params import StructuredOutputsParams

if TYPE_CHECKING:
    from triollm.api.reasoning_parsers import ReasoningParser, ReasoningStream
    from triollm.api.tool_parsers import ToolCallStream, ToolParser

__all__ = ["ChoiceStream", "OutputParsing", "OutputPiece", "ParsedOutput", "make_output_parsing"]


@dataclass
class ParsedOutput:
    """A choice's whole output. `auto_called`: the tool parser found calls (finish reason
    "tool_calls")."""

    content: str | None
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)
    auto_called: bool = False


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
        """The tool parser reads markers that are special tokens: decode them into the text."""
        return self.tool_parser is not None and self.tool_parser.keep_special_tokens

    def gate(self, structured: StructuredOutputsParams | None) -> StructuredOutputsParams | None:
        """A grammar for this request starts after its reasoning (the reasoning parser's end
        marker), as in vLLM: the model thinks freely, then answers in the grammar."""
        if structured is None or self.reasoning_parser is None:
            return structured
        ids = self.reasoning_parser.grammar_start_ids()
        return structured if ids is None else msgspec.structs.replace(structured, start_after_token_ids=ids)

    def whole(self, text: str) -> ParsedOutput:
        reasoning, content = self._split(text)
        if self.choice.forced:
            calls = constrained_tool_calls(self.choice, content or "")
            if calls is not None:
                return ParsedOutput("", reasoning, calls)
            return ParsedOutput(content, reasoning)
        if self.tool_parser is not None:
            found = self.tool_parser.extract_tool_calls(content or "")
            if found.tools_called:
                calls = found.tool_calls if self.choice.parallel else found.tool_calls[:1]
                return ParsedOutput(found.content, reasoning, calls, auto_called=True)
        return ParsedOutput(content, reasoning)

    def stream(self) -> ChoiceStream:
        return ChoiceStream(self)

    def _split(self, text: str) -> tuple[str | None, str | None]:
        if self.reasoning_parser is None:
            return None, text
        reasoning, content = self.reasoning_parser.extract_reasoning(text)
        return (reasoning if self.include_reasoning else None), content


class ChoiceStream:
    """One choice's parsing, delta by delta; `auto_called` once the tool parser sent a call."""

    def __init__(self, parsing: OutputParsing) -> None:
        self.parsing = parsing
        self._reasoning: ReasoningStream | None = (
            parsing.reasoning_parser.stream() if parsing.reasoning_parser is not None else None
        )
        self._forced = ConstrainedCallStream(parsing.choice) if parsing.choice.forced else None
        self._tools: ToolCallStream | None = (
            parsing.tool_parser.stream() if parsing.tool_parser is not None and self._forced is None else None
        )
        self.auto_called = False

    def feed(self, delta: str) -> OutputPiece:
        if self._reasoning is None:
            return self._content(delta, end=False)
        reasoning, content = self._reasoning.feed(delta)
        return self._merge(reasoning, self._content(content, end=False))

    def finish(self) -> OutputPiece:
        if self._reasoning is None:
            return self._content("", end=True)
        reasoning, content = self._reasoning.finish()
        return self._merge(reasoning, self._content(content, end=True))

    def _merge(self, reasoning: str, piece: OutputPiece) -> OutputPiece:
        if self.parsing.include_reasoning:
            piece.reasoning = reasoning
        return piece

    def _content(self, text: str, *, end: bool) -> OutputPiece:
        if self._forced is not None:
            return OutputPiece(tool_calls=self._forced.feed(text))
        if self._tools is None:
            return OutputPiece(content=text)
        got = self._tools.feed(text) if text else None
        pieces: list[Any] = [got] if got is not None else []
        if end:
            pieces.append(self._tools.finish())
        out = OutputPiece(
            content="".join(p.content for p in pieces),
            tool_calls=[c for p in pieces for c in p.tool_calls],
        )
        if not self.parsing.choice.parallel:
            out.tool_calls = [c for c in out.tool_calls if c.index == 0]
        self.auto_called = self.auto_called or bool(out.tool_calls)
        return out


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

        tool = ToolParserManager.get_tool_parser(tool_call_parser)(tokenizer, list(choice.tools))
    reasoning = None
    if reasoning_parser is not None:
        from triollm.api.reasoning_parsers import ReasoningParserManager

        reasoning = ReasoningParserManager.get_reasoning_parser(reasoning_parser)(
            tokenizer, chat_template_kwargs=chat_template_kwargs
        )
    return OutputParsing(choice, tool, reasoning, include_reasoning)
