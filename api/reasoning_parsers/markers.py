"""Reasoning in sections between text markers, anywhere in the output: one state machine for
`mistral` (`[THINK]…[/THINK]`) and `granite` ("Here is my thought process:" … "Here is my
response:").

The output opens in content. A start marker switches to reasoning and an end marker back to
content, wherever they stand; the markers are dropped, and a start marker inside reasoning or an
end marker inside content is dropped too (vLLM's Mistral parser absorbs such strays). Text
before the first start marker is content, as in vLLM. No end marker: the rest is reasoning (a
cut-off thought). A model family may have several spellings of a marker (Granite's "Here's").

A stream holds back only the longest end of its text that may begin a marker; the whole-output
split is the stream run over the whole text, so the two agree for any cutting.
"""

from __future__ import annotations

from typing import ClassVar

from triollm.api.reasoning_parsers.abstract import ReasoningParser, ReasoningStream
from triollm.api.text_markers import earliest, held

__all__ = ["MarkerReasoningParser"]


class MarkerReasoningParser(ReasoningParser):
    start_markers: ClassVar[tuple[str, ...]]
    end_markers: ClassVar[tuple[str, ...]]

    def expects_reasoning(self) -> bool:
        return False  # the output opens in content: a grammar holds from the first token

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        stream = _MarkerStream(self)
        reasoning, content = stream.feed(text)
        rest = stream.finish()
        started = stream.started
        return (reasoning + rest[0]) if started else None, (content + rest[1]) or None

    def stream(self) -> ReasoningStream:
        return _MarkerStream(self)


class _MarkerStream(ReasoningStream):
    def __init__(self, parser: MarkerReasoningParser) -> None:
        self._starts = parser.start_markers
        self._ends = parser.end_markers
        self._markers = (*self._starts, *self._ends)
        self._thinking = False
        self.started = False  # a start marker was seen
        self._buf = ""

    def feed(self, delta: str) -> tuple[str, str]:
        return self._split(delta, final=False)

    def finish(self) -> tuple[str, str]:
        return self._split("", final=True)

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        buf = self._buf + text
        out: dict[bool, list[str]] = {False: [], True: []}  # by self._thinking
        while True:
            found = earliest(buf, self._markers)
            if found is None:
                keep = 0 if final else held(buf, self._markers)
                out[self._thinking].append(buf[: len(buf) - keep])
                self._buf = buf[len(buf) - keep :]
                return "".join(out[True]), "".join(out[False])
            i, marker = found
            out[self._thinking].append(buf[:i])
            if marker in self._starts:
                self._thinking = self.started = True
            else:
                self._thinking = False
            buf = buf[i + len(marker) :]
