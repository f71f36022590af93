"""`hermes`: Hermes 2 Pro, Qwen2.5, Qwen3 and others trained on the Hermes format.

    Let me check both.<tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>
    <tool_call>
    {"name": "get_time", "arguments": {}}
    </tool_call>

Calls may follow one another and text may stand around them (it is `content`). The last
`<tool_call>` may lack its `</tool_call>` (the model stopped at end of sequence) and still be a
call, as in vLLM. A region whose JSON is not a call stays text, markers included.

Streaming holds back a trailing beginning of `<tool_call>`, and inside a region what cannot be
sent yet: the header until the name and the arguments' `{` are known (then the call is
announced and its arguments stream as they arrive), everything after the arguments up to
`</tool_call>`, and a whole region whose JSON has another shape (decided when it closes).
"""

from __future__ import annotations

from typing import ClassVar, Final

from triollm.api.tool_parsers._json_call import TEXT, JsonCall
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter, held_prefix

__all__ = ["HermesToolParser"]

_OPEN: Final = "<tool_call>"
_CLOSE: Final = "</tool_call>"
_KEYS: Final = ("arguments",)


class _HermesSegmenter(Segmenter):
    def __init__(self, known: frozenset[str]) -> None:
        super().__init__()
        self._known = known
        self._call: JsonCall | None = None  # inside a region when set
        self._region = ""  # the region's text consumed so far, markers included

    def step(self, final: bool) -> bool:
        call = self._call
        if call is None:
            if not self.text_until(_OPEN, final):
                return False
            self._call = JsonCall(_KEYS, self._known)
            self._region = _OPEN
            return True
        end = self.buf.find(_CLOSE)
        closed = end >= 0
        if not closed:
            end = len(self.buf) if final else len(self.buf) - held_prefix(self.buf, _CLOSE)
        if call.result is None:
            n = call.push(self, self.buf[:end], final=closed or final)
            self._region += self.buf[:n]
            self.buf = self.buf[n:]
            return call.result is not None
        # The call is decided: the rest of the region up to </tool_call> is not sent.
        if not (closed or final):
            return False
        tail = end + len(_CLOSE) if closed else len(self.buf)
        self._region += self.buf[:tail]
        self.buf = self.buf[tail:]
        if call.result == TEXT:
            self.text(self._region)
        self._call = None
        return True


class HermesToolParser(SegmentedToolParser):
    name: ClassVar[str] = "hermes"

    def segmenter(self) -> Segmenter:
        return _HermesSegmenter(self.tool_names)
