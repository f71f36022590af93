"""`JsonCall`: one `{"name": ..., "arguments": {...}}` object, read as it arrives.

Fast path: once `call_header` has seen the name and the arguments' `{`, the call is announced
and the arguments stream through an `ArgsStreamer`; after them come `}` (or, leniently, nothing:
a missing final brace is forgiven) or more members (`, "id": ...}`), checked when the object
closes. Slow path, for any other shape (keys in another order, `arguments` as a string, not a
call at all): the object is only scanned, then decoded whole; a call is announced with all of
its arguments at once, or the object is reported as text.
"""

from __future__ import annotations

from typing import Final

from triollm.api.tool_parsers._json_scan import (
    MORE,
    JsonScanner,
    call_from_json,
    call_header,
    loads,
)
from triollm.api.tool_parsers._segments import ArgsStreamer, Segmenter

__all__ = ["BROKEN", "CALL", "TEXT", "JsonCall"]

CALL: Final = "call"  # a call, announced and complete
TEXT: Final = "text"  # not a call: `raw` is plain text, nothing was announced
BROKEN: Final = "broken"  # announced, then malformed (the segmenter sent Broken)

_HEADER, _SLOW, _ARGS, _TAIL, _EXTRA = range(5)


class JsonCall:
    """One call object from its `{` (whitespace before it allowed)."""

    def __init__(self, arg_keys: tuple[str, ...], known: frozenset[str]) -> None:
        self.raw = ""  # the text consumed
        self.result: str | None = None  # CALL, TEXT or BROKEN once decided
        self._keys = arg_keys
        self._known = known
        self._state = _HEADER
        self._name = ""
        self._args = ArgsStreamer()
        self._scanner = JsonScanner()

    def push(self, seg: Segmenter, text: str, final: bool) -> int:
        """Read on in `text` (`final`: nothing follows it); returns how much was consumed."""
        used = 0
        if self._state == _HEADER:
            header = call_header(text, self._keys)
            if header == MORE and not final:
                return 0
            if isinstance(header, tuple):
                self._name, used = header
                self.raw = text[:used]
                seg.start(self._name)
                self._state = _ARGS
            else:
                self._state = _SLOW
        if self._state == _SLOW:
            used += self._scan(text[used:])
            if self._scanner.done:
                call = call_from_json(loads(self.raw), self._keys, self._known)
                if call is not None:
                    seg.start(call[0])
                    seg.args(call[1])
                self.result = TEXT if call is None else CALL
            elif self._scanner.failed or final:
                self.result = TEXT
            return used
        if self._state == _ARGS:
            n = self._args.push(seg, text[used:], final)
            self.raw += text[used : used + n]
            used += n
            if self._args.ok is None:
                return used
            if not self._args.ok:
                self.result = BROKEN
                return used
            self._state = _TAIL
        if self._state == _TAIL:
            rest = text[used:]
            after = rest.lstrip()
            self.raw += rest[: len(rest) - len(after)]
            used += len(rest) - len(after)
            if not after:
                self.result = CALL if final else None
                return used
            if after[0] != ",":  # the closing brace, or (forgiven) not even that
                if after[0] == "}":
                    self.raw += "}"
                    used += 1
                self.result = CALL
                return used
            self._state = _EXTRA
            self._scanner.feed('{"":0')  # so that the scanner reads on after a member
        used += self._scan(text[used:])
        if self._scanner.done:
            call = call_from_json(loads(self.raw), self._keys, self._known)
            same = call is not None and call[0] == self._name
            if same and call is not None and loads(call[1]) == loads(self._args.text):
                self.result = CALL
                return used
        elif not (self._scanner.failed or final):
            return used
        seg.broken()
        self.result = BROKEN
        return used

    def _scan(self, text: str) -> int:
        n = self._scanner.feed(text)
        self.raw += text[:n]
        return n
