"""`llama3_json` (and vLLM's alias `llama4_json`): Llama 3.1/3.2/4 JSON tool calls.

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; {"name": ...}

The output *is* the calls: optional whitespace and `<|python_tag|>`, then one call object
(`parameters` or `arguments`), or several separated by `;`. An output that does not start that
way is all content (vLLM's streaming rule; its non-streaming parser also picks JSON out of the
middle of text, which a stream cannot do without holding back everything). Text after the last
call is content. `{"name": "Bob"}` with no arguments is a call only when a tool is named Bob.

Streaming holds back leading whitespace and a beginning of `<|python_tag|>`, a call's header
until the name and the arguments' `{` are known (then the arguments stream as they arrive),
and a whole object of another shape until it closes.
"""

from __future__ import annotations

from typing import ClassVar, Final

from triollm.api.tool_parsers._json_call import BROKEN, CALL, TEXT, JsonCall
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter

__all__ = ["Llama3JsonToolParser"]

_TAG: Final = "<|python_tag|>"
_KEYS: Final = ("parameters", "arguments")

# States: before anything; a call object expected next; inside one; after one; plain text to
# the end; a broken call's rest, dropped.
_START, _OBJECT, _CALL, _AFTER, _TEXT, _DROP = range(6)


class _Llama3Segmenter(Segmenter):
    def __init__(self, known: frozenset[str]) -> None:
        super().__init__()
        self._known = known
        self._state = _START
        self._markup = ""  # python tag or `;` before the next object: text if no call follows
        self._call = JsonCall(_KEYS, known)

    def step(self, final: bool) -> bool:
        buf = self.buf
        rest = buf.lstrip()
        lead = len(buf) - len(rest)
        state = self._state
        if state in (_TEXT, _DROP):
            if state == _TEXT:
                self.text(buf)
            self.buf = ""
            return False
        if state == _CALL:
            n = self._call.push(self, buf, final)
            self.buf = buf[n:]
            result = self._call.result
            if result == CALL:
                self._markup, self._state = "", _AFTER
            elif result == BROKEN:
                self._state = _DROP
            elif result == TEXT:
                self.text(self._markup + self._call.raw)
                self._state = _TEXT
            return result is not None
        if not rest and not final:
            return False
        if state == _START:
            if rest.startswith(_TAG):
                self._markup, self.buf = buf[: lead + len(_TAG)], rest[len(_TAG) :]
                self._state = _OBJECT
            elif rest and _TAG.startswith(rest) and not final:
                return False
            else:
                self._state = _OBJECT if rest.startswith("{") else _TEXT
            return True
        if state == _AFTER and rest.startswith(";"):
            self._markup, self.buf = buf[: lead + 1], rest[1:]
            self._state = _OBJECT
        elif state == _AFTER:
            if not rest:  # trailing whitespace after the calls
                self.buf = ""
            self._state = _TEXT
        elif rest.startswith("{"):  # _OBJECT
            self._call = JsonCall(_KEYS, self._known)
            self._state = _CALL
        else:  # _OBJECT, and no object: what came since the last call is text
            if self.calls == 0 or rest:
                self.text(self._markup)
            self._markup, self._state = "", _TEXT
        return True


class Llama3JsonToolParser(SegmentedToolParser):
    name: ClassVar[str] = "llama3_json"

    def segmenter(self) -> Segmenter:
        return _Llama3Segmenter(self.tool_names)
