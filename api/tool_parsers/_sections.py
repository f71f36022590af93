"""A section of calls between marker tokens: the segmenter of `kimi_k2` and `deepseek_v31`.

    Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0
    <|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|><|tool_calls_section_end|>

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one line each, as the models write them).

A section opens with its marker and holds calls: the call marker, a header (the name, or Kimi's
`functions.NAME:INDEX` id), the separator, the arguments object, the call's end marker. Text
outside sections is content. As in vLLM, the last end markers may be missing (the model stopped
on its end-of-sequence token). A section in which something other than a call stands where a call
should begin ends there: if it made no call yet, it is text, markers included, else the stray
text is content. A header without its separator within `MAX_HEADER` characters, or arguments
that do not begin with `{`, are text as well.

Streaming holds back a trailing beginning of a marker and a call's header until the arguments'
`{` is seen; then the call is announced and its arguments stream as they arrive. After the
arguments, the rest of the call up to its end marker is dropped; a call that breaks after it was
announced drops the rest of it likewise (see _segments.py).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from triollm.api.text_markers import held
from triollm.api.tool_parsers._segments import ArgsStreamer, Segmenter

__all__ = ["MAX_HEADER", "SectionMarkers", "SectionSegmenter"]

MAX_HEADER = 256


@dataclass(frozen=True, slots=True)
class SectionMarkers:
    section_begin: str
    section_end: str
    call_begin: str
    separator: str  # between the header and the arguments
    call_end: str


# A call's header -> (name, the model's call id or None), or None when it is no header.
HeaderReader = Callable[[str], "tuple[str, str | None] | None"]

# States: text; in a section, between calls; a header; waiting for the arguments' `{`; the
# arguments; after them, up to the call's end marker (dropped).
_TEXT, _SECTION, _HEADER, _BRACE, _ARGS, _REST = range(6)


class SectionSegmenter(Segmenter):
    def __init__(self, markers: SectionMarkers, header: HeaderReader) -> None:
        super().__init__()
        self._m = markers
        self._read_header = header
        self._state = _TEXT
        self._markup = ""  # the section's text since its last call: text if no call follows
        self._made = 0  # calls made in this section
        self._call: tuple[str, str | None] = ("", None)
        self._args = ArgsStreamer()

    def step(self, final: bool) -> bool:
        m, buf = self._m, self.buf
        if self._state == _TEXT:
            if not self.text_until(m.section_begin, final):
                return False
            self._markup, self._made, self._state = m.section_begin, 0, _SECTION
            return True
        if self._state == _SECTION:
            rest = buf.lstrip()
            lead = len(buf) - len(rest)
            for marker, state in ((m.call_begin, _HEADER), (m.section_end, _TEXT)):
                if rest.startswith(marker):
                    self._markup += buf[: lead + len(marker)]
                    self.buf, self._state = rest[len(marker) :], state
                    if state == _TEXT:
                        self._end_section()
                    return True
            if not final and (not rest or held(rest, (m.call_begin, m.section_end)) == len(rest)):
                return False
            self._end_section()
            return True
        if self._state == _HEADER:
            i = buf.find(m.separator, 0, MAX_HEADER + len(m.separator))
            if i < 0 and not final and len(buf) - held(buf, (m.separator,)) <= MAX_HEADER:
                return False  # it may still come
            call = self._read_header(buf[:i]) if i >= 0 else None
            if call is None:
                self._end_section()
                return True
            self._markup += buf[: i + len(m.separator)]
            self._call, self.buf, self._state = call, buf[i + len(m.separator) :], _BRACE
            return True
        if self._state == _BRACE:
            rest = buf.lstrip()
            if not rest and not final:
                return False
            if not rest.startswith("{"):
                self._end_section()
                return True
            self.start(*self._call)
            self._made += 1
            self._args, self.buf, self._state = ArgsStreamer(), rest, _ARGS
            return True
        if self._state == _ARGS:
            n = self._args.push(self, buf, final)
            self.buf = buf[n:]
            if self._args.ok is None:
                return False
            self._state = _REST
            return True
        # _REST: drop up to the call's end marker (or, leniently, to the next call or section end).
        stops = (m.call_end, m.call_begin, m.section_end)
        found = [(i, s) for s in stops if (i := buf.find(s)) >= 0]
        if found:
            i, stop = min(found)
            self.buf = buf[i + len(stop) :] if stop == m.call_end else buf[i:]
            self._markup, self._state = "", _SECTION
            return True
        self.buf = "" if final else buf[len(buf) - held(buf, stops) :]
        return False

    def _end_section(self) -> None:
        """The section ends here: its text since the last call is text if it made no call."""
        if not self._made:
            self.text(self._markup)
        self._markup, self._state = "", _TEXT
