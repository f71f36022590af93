"""A marker, then a JSON array of call objects: the segmenter of `granite` and `phi4_mini_json`.

    Let me look.<|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]

Text before the marker and after the array's `]` is content; the `]` may be missing (the model
stopped). What follows a marker that is not an array of call objects stays text, marker
included. A call that breaks after it was announced ends the array: the rest of it up to the
next marker is dropped (see _segments.py).

Streaming holds back a trailing beginning of a marker, a call object's header until the name
and the arguments' `{` are known (then the arguments stream as they arrive), and an object of
another shape until it closes.
"""

from __future__ import annotations

from triollm.api.text_markers import earliest, held
from triollm.api.tool_parsers._json_call import BROKEN, CALL, TEXT, JsonCall
from triollm.api.tool_parsers._segments import Segmenter

__all__ = ["JsonArraySegmenter"]

# States: text; right after a marker; an item expected, inside one, after one; a broken call's
# rest, dropped up to the next marker.
_TEXT, _MARKER, _ITEM, _CALL, _AFTER, _DROP = range(6)


class JsonArraySegmenter(Segmenter):
    def __init__(self, markers: tuple[str, ...], arg_keys: tuple[str, ...], known: frozenset[str]) -> None:
        super().__init__()
        self._markers = markers
        self._keys = arg_keys
        self._known = known
        self._state = _TEXT
        self._markup = ""  # marker, `[` and separators since the last call: text if no call follows
        self._call = JsonCall(arg_keys, known)

    def _find(self, final: bool) -> tuple[int, int]:
        """(start, end) of the first marker in `buf`, or (-1, how much of `buf` is surely not one)."""
        found = earliest(self.buf, self._markers)
        if found is not None:
            return found[0], found[0] + len(found[1])
        return -1, len(self.buf) - (0 if final else held(self.buf, self._markers))

    def step(self, final: bool) -> bool:
        state, buf = self._state, self.buf
        if state in (_TEXT, _DROP):
            i, end = self._find(final)
            if state == _TEXT:
                self.text(buf[: i if i >= 0 else end])
            if i < 0:
                self.buf = buf[end:]
                return False
            self._markup, self.buf, self._state = buf[i:end], buf[end:], _MARKER
            return True
        if state == _CALL:
            n = self._call.push(self, buf, final)
            self.buf = buf[n:]
            result = self._call.result
            if result == CALL:
                self._markup, self._state = "", _AFTER
            elif result == BROKEN:
                self._state = _DROP
            elif result == TEXT:
                self._markup += self._call.raw
                self._as_text()
            return result is not None
        rest = buf.lstrip()
        lead = len(buf) - len(rest)
        if not rest and not final:
            return False
        if state == _MARKER and rest.startswith("["):
            self._markup += buf[: lead + 1]
            self.buf, self._state = rest[1:], _ITEM
        elif state == _ITEM and rest.startswith("{"):
            self._call, self._state = JsonCall(self._keys, self._known), _CALL
        elif state == _AFTER and rest[:1] in (",", "]"):
            self._markup = buf[: lead + 1]
            self.buf = rest[1:]
            self._state = _ITEM if rest[0] == "," else _TEXT
        elif state == _AFTER:  # leniently, the array ends without its `]`
            self._state = _TEXT
        else:  # no array after the marker, or an item that is not an object
            self._as_text()
        return True

    def _as_text(self) -> None:
        """What came since the marker (or the last call) is no call: text; read on after it."""
        self.text(self._markup)
        self._markup, self._state = "", _TEXT
