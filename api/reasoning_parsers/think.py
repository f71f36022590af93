"""`<think>…</think>` parsers: one state machine, the models' differences as class variables.

The output is read as  [start marker] reasoning (end marker | content marker) content:

- The start marker counts only at the very beginning of the output (where the models put it).
  vLLM's whole-output parsers drop text before the first `<think>` anywhere; a stream could only
  match that by holding back everything, so an inner `<think>` stays reasoning text here.
- Without a start marker the output opens in reasoning when `implicit_reasoning` is true: chat
  templates (DeepSeek R1, Qwen3 thinking models) end the prompt with `<think>`, so the output
  holds only `</think>`. When false (thinking switched off), it opens in content.
- The end marker is dropped; a content marker (Qwen3's `<tool_call>`, which ends reasoning that
  never closed) is kept as the start of content. The earliest one wins.
- `reasoning_enabled` false (the request switched thinking off, DeepSeek V3's default): the
  whole output is content, markers included, as vLLM's identity parser has it.
- No end: everything after the start is reasoning (a cut-off thought), content is None.
  Reasoning that ends right at the end marker leaves content None (vLLM's choice).
"""

from __future__ import annotations

from typing import ClassVar

from triollm.api.reasoning_parsers.abstract import ReasoningParser, ReasoningStream

__all__ = ["ThinkTagReasoningParser"]


class ThinkTagReasoningParser(ReasoningParser):
    start_token: ClassVar[str] = "<think>"
    end_token: ClassVar[str] = "</think>"
    # Markers that end reasoning and stay in the content.
    content_markers: ClassVar[tuple[str, ...]] = ()

    @property
    def reasoning_enabled(self) -> bool:
        """False: the request switched thinking off and the whole output is content."""
        return True

    @property
    def implicit_reasoning(self) -> bool:
        """Whether an output without the start marker opens in reasoning."""
        return True

    def expects_reasoning(self) -> bool:
        return self.reasoning_enabled and self.implicit_reasoning

    def _find_end(self, text: str, start: int = 0) -> tuple[int, int] | None:
        """(index, length to drop) of the earliest end or content marker at or after `start`."""
        best: tuple[int, int] | None = None
        for marker, drop in ((self.end_token, len(self.end_token)), *((m, 0) for m in self.content_markers)):
            i = text.find(marker, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, drop)
        return best

    def extract_reasoning(self, text: str) -> tuple[str | None, str | None]:
        if not self.reasoning_enabled:
            return None, text or None
        if text.startswith(self.start_token):
            text = text[len(self.start_token):]
        elif not self.implicit_reasoning:
            return None, text or None
        found = self._find_end(text)
        if found is None:
            return text or None, None
        i, drop = found
        return text[:i], text[i + drop:] or None

    def stream(self) -> ReasoningStream:
        return _ThinkTagStream(self)


_START, _REASONING, _CONTENT = range(3)


class _ThinkTagStream(ReasoningStream):
    def __init__(self, parser: ThinkTagReasoningParser) -> None:
        self._p = parser
        self._state = _START if parser.reasoning_enabled else _CONTENT
        self._implicit = parser.implicit_reasoning
        self._held = ""
        self._markers = (parser.end_token, *parser.content_markers)

    def feed(self, delta: str) -> tuple[str, str]:
        if self._state == _CONTENT:
            return "", delta
        text = self._held + delta
        self._held = ""
        if self._state == _START:
            start = self._p.start_token
            if len(text) < len(start) and start.startswith(text):
                self._held = text  # may still become the start marker
                return "", ""
            if text.startswith(start):
                text = text[len(start):]
                self._state = _REASONING
            elif self._implicit:
                self._state = _REASONING
            else:
                self._state = _CONTENT
                return "", text
        return self._reasoning(text)

    def _reasoning(self, text: str) -> tuple[str, str]:
        found = self._p._find_end(text)
        if found is not None:
            i, drop = found
            self._state = _CONTENT
            return text[:i], text[i + drop:]
        keep = self._partial_marker(text)
        self._held = text[len(text) - keep:] if keep else ""
        return text[: len(text) - keep], ""

    def _partial_marker(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a marker."""
        for n in range(min(len(text), max(map(len, self._markers)) - 1), 0, -1):
            tail = text[-n:]
            if any(len(m) > n and m.startswith(tail) for m in self._markers):
                return n
        return 0

    def finish(self) -> tuple[str, str]:
        held, self._held = self._held, ""
        if not held:
            return "", ""
        if self._state == _START and not self._implicit:
            return "", held
        return held, ""
