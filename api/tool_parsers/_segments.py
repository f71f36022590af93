"""One segmenter per format, two consumers: how the built-in parsers share their logic.

A `Segmenter` reads the output as it arrives and cuts it into events: `Text` (plain output),
`Start` (a call: its name is known and its arguments begin), `Args` (a piece of the current
call's arguments) and `Broken` (a call already announced turned out malformed: its arguments
were closed early so that they stay valid JSON, and the rest of that call is dropped). It
holds back only what may still be call syntax. The same segmenter serves both ways of asking:

- `SegmentStream` turns events into `StreamDelta`s as they come (the streaming contract of
  `abstract.py`);
- `SegmentedToolParser.extract_tool_calls` runs it over the whole output at once.

So a whole output and the same output streamed in any pieces give the same calls and content,
with one documented exception: a call whose arguments break off or turn invalid after it was
announced. The stream has already sent it and ends it with closing brackets; the whole-output
answer is all content, `tools_called=False` (an announced call cannot be taken back, and
announcing none before it is complete would give up streaming the arguments).

Whitespace: a stretch of text between calls (or before the first, or after the last) that is
only whitespace is dropped when the output has calls; the stream holds such whitespace until
text follows, a call starts, or the output ends.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from triollm.api.protocol import DeltaFunctionCall, DeltaToolCall, FunctionCall, ToolCall
from triollm.api.tool_parsers._json_scan import JsonScanner, dumps_args, loads
from triollm.api.tool_parsers.abstract import (
    ExtractedToolCalls,
    StreamDelta,
    ToolCallStream,
    ToolParser,
)

if TYPE_CHECKING:
    from triollm.engine.processing.tokenizer import Tokenizer

__all__ = [
    "Args",
    "ArgsStreamer",
    "Broken",
    "Event",
    "SegmentStream",
    "SegmentedToolParser",
    "Segmenter",
    "Start",
    "Text",
    "held_prefix",
]


@dataclass(slots=True)
class Text:
    text: str


@dataclass(slots=True)
class Start:
    name: str
    call_id: str | None = None  # the model's own id of the call (Kimi K2's); None: a new one


@dataclass(slots=True)
class Args:
    text: str


@dataclass(slots=True)
class Broken:
    pass


Event = Text | Start | Args | Broken


def held_prefix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `marker`."""
    for k in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:k]):
            return k
    return 0


class Segmenter:
    """Cuts one output into events. Subclasses implement `step`."""

    def __init__(self) -> None:
        self.buf = ""  # received, not yet consumed
        self.calls = 0  # calls started so far
        self._events: list[Event] = []

    def push(self, text: str, final: bool) -> list[Event]:
        """Take the next piece of output (`final`: the output ended); the events it completes."""
        self.buf += text
        while self.step(final):
            pass
        events, self._events = self._events, []
        return events

    @abstractmethod
    def step(self, final: bool) -> bool:
        """Consume from `buf`; False when more text is needed (with `final`, when all of
        `buf` was consumed)."""

    def text(self, text: str) -> None:
        if text:
            self._events.append(Text(text))

    def start(self, name: str, call_id: str | None = None) -> None:
        self.calls += 1
        self._events.append(Start(name, call_id))

    def args(self, text: str) -> None:
        if text:
            self._events.append(Args(text))

    def broken(self) -> None:
        self._events.append(Broken())

    def text_until(self, marker: str, final: bool) -> bool:
        """Send `buf` as text up to `marker` (consumed, True) or, holding back a possible
        beginning of it, as far as it goes (False)."""
        i = self.buf.find(marker)
        if i >= 0:
            self.text(self.buf[:i])
            self.buf = self.buf[i + len(marker) :]
            return True
        keep = 0 if final else held_prefix(self.buf, marker)
        self.text(self.buf[: len(self.buf) - keep])
        self.buf = self.buf[len(self.buf) - keep :]
        return False


class ArgsStreamer:
    """Streams one arguments object from its `{`: raw text up to the scanner's safe point."""

    def __init__(self) -> None:
        self.scanner = JsonScanner()
        self.text = ""  # the arguments' raw text so far
        self._sent = 0
        self.ok: bool | None = None  # None while the object is open

    def push(self, seg: Segmenter, text: str, final: bool) -> int:
        """Feed `text`; returns how much of it belongs to the arguments."""
        n = self.scanner.feed(text)
        self.text += text[:n]
        scanner = self.scanner
        if scanner.done:
            seg.args(self.text[self._sent :])
            self.ok = True
        elif scanner.failed or final:
            seg.args(self.text[self._sent : scanner.safe] + scanner.safe_closer)
            seg.broken()
            self.ok = False
        else:
            seg.args(self.text[self._sent : scanner.safe])
            self._sent = scanner.safe
        return n


class SegmentedToolParser(ToolParser):
    """A parser built on a `Segmenter`: both ways of parsing come from it."""

    def __init__(
        self,
        tokenizer: Tokenizer | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> None:
        super().__init__(tokenizer, tools)
        # The `parameters` schema of each tool the request declares, by name.
        self.tool_parameters: dict[str, Mapping[str, Any]] = {}
        for tool in self.tools:
            function = tool.get("function") if isinstance(tool, Mapping) else None
            if isinstance(function, Mapping) and isinstance(function.get("name"), str):
                parameters = function.get("parameters")
                schema = parameters if isinstance(parameters, Mapping) else {}
                self.tool_parameters[function["name"]] = schema
        self.tool_names = frozenset(self.tool_parameters)

    @abstractmethod
    def segmenter(self) -> Segmenter:
        """Fresh segmenter for one output."""

    def stream(self) -> ToolCallStream:
        return SegmentStream(self)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        none = ExtractedToolCalls(tools_called=False, tool_calls=[], content=text)
        texts: list[str] = [""]  # the text before each call, and after the last
        calls: list[list[str]] = []  # [name, arguments, id] of each call
        for event in self.segmenter().push(text, final=True):
            match event:
                case Text(piece):
                    texts[-1] += piece
                case Start(name, call_id):
                    calls.append([name, "", call_id or self.new_call_id()])
                    texts.append("")
                case Args(piece):
                    calls[-1][1] += piece
                case Broken():
                    return none
        if not calls:
            return none
        tool_calls = []
        for name, raw, call_id in calls:
            arguments = dumps_args(loads(raw))
            if arguments is None:
                return none
            function = FunctionCall(name=name, arguments=arguments)
            tool_calls.append(ToolCall(id=call_id, function=function))
        content = "".join(piece for piece in texts if piece.strip())
        return ExtractedToolCalls(tools_called=True, tool_calls=tool_calls, content=content or None)


class SegmentStream(ToolCallStream):
    """The streaming consumer of a segmenter (see the module docstring)."""

    def __init__(self, parser: SegmentedToolParser) -> None:
        self._parser = parser
        self._segmenter = parser.segmenter()
        self._index = -1  # of the current call
        self._held = ""  # whitespace that may still be dropped
        self._texted = False  # the current stretch of text has more than whitespace

    def feed(self, delta: str) -> StreamDelta:
        return self._apply(self._segmenter.push(delta, final=False)) if delta else StreamDelta()

    def finish(self) -> StreamDelta:
        out = self._apply(self._segmenter.push("", final=True))
        if self._index < 0:
            out.content += self._held
        self._held = ""
        return out

    def _apply(self, events: list[Event]) -> StreamDelta:
        out = StreamDelta()
        for event in events:
            match event:
                case Text(piece):
                    if self._texted:
                        out.content += piece
                        continue
                    self._held += piece
                    if self._held.strip():
                        out.content += self._held
                        self._held, self._texted = "", True
                case Start(name, call_id):
                    self._index += 1
                    self._held, self._texted = "", False
                    out.tool_calls.append(
                        DeltaToolCall(
                            index=self._index,
                            id=call_id or self._parser.new_call_id(),
                            type="function",
                            function=DeltaFunctionCall(name=name),
                        )
                    )
                case Args(piece):
                    last = out.tool_calls[-1] if out.tool_calls else None
                    if last is not None and last.index == self._index and last.function:
                        last.function.arguments = (last.function.arguments or "") + piece
                    else:
                        function = DeltaFunctionCall(arguments=piece)
                        out.tool_calls.append(DeltaToolCall(index=self._index, function=function))
                case Broken():
                    pass
        return out
