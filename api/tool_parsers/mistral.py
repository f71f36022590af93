"""`mistral`: Mistral's `[TOOL_CALLS]` special token, in both of its forms.

    Sure.[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}, {...}]
    Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time{}

The first is the pre-v11 tokenizers' JSON array, the second the v11+ form (one marker per call;
`[ARGS]` is in the text when a Hugging Face tokenizer decodes it). The form is told apart by
what follows the marker, `[` or a name. Text before the first marker is content. `[TOOL_CALLS]`
is a special token, so the server decodes with special tokens kept (`keep_special_tokens`).
Call ids are 9 letters and digits, as Mistral's templates require (and vLLM makes them).

Streaming holds back a trailing beginning of `[TOOL_CALLS]`, a call's name until its arguments'
`{` is seen, and (array form) a call object's header until the name and the arguments' `{` are
known; the arguments then stream as they arrive. vLLM returns a v11 call with malformed
arguments as a call; here it is content, like in every other parser.
"""

from __future__ import annotations

import re
import secrets
import string
from typing import ClassVar, Final

from triollm.api.tool_parsers._json_call import BROKEN, CALL, TEXT, JsonCall
from triollm.api.tool_parsers._json_scan import MORE, NO
from triollm.api.tool_parsers._segments import (
    ArgsStreamer,
    SegmentedToolParser,
    Segmenter,
    held_prefix,
)

__all__ = ["MistralToolParser"]

_BOT: Final = "[TOOL_CALLS]"
_ARGS: Final = "[ARGS]"
_KEYS: Final = ("arguments",)
_NAME = re.compile(r"\s*([\w.\-]*)\s*")
_ALPHANUMERIC: Final = string.ascii_letters + string.digits

# States: text; right after a marker; array: an item expected, inside one, after one;
# v11: the name, the arguments; a broken call's rest, dropped up to the next marker.
_TEXT, _MARKER, _ITEM, _ITEM_CALL, _ITEM_AFTER, _NAME_STATE, _V11_ARGS, _DROP = range(8)


def _v11_header(text: str) -> tuple[str, int] | str:
    """`name[ARGS]{` or `name{` at the start of `text`: (name, index of `{`), MORE or NO."""
    match = _NAME.match(text)  # it matches the empty string too
    name, i = (match.group(1), match.end()) if match else ("", 0)
    if text.startswith(_ARGS, i):
        i = len(text) - len(text[i + len(_ARGS) :].lstrip())
    elif _ARGS.startswith(text[i:]) and i < len(text):
        return MORE
    if i == len(text):
        return MORE
    return (name, i) if name and text[i] == "{" else NO


class _MistralSegmenter(Segmenter):
    def __init__(self, known: frozenset[str]) -> None:
        super().__init__()
        self._known = known
        self._state = _TEXT
        self._markup = ""  # marker and separators before the next call: text if none follows
        self._call = JsonCall(_KEYS, known)
        self._args = ArgsStreamer()

    def step(self, final: bool) -> bool:
        state, buf = self._state, self.buf
        if state == _TEXT:
            if self.text_until(_BOT, final):
                self._markup, self._state = _BOT, _MARKER
                return True
            return False
        if state == _DROP:
            i = buf.find(_BOT)
            if i >= 0:
                self.buf, self._state = buf[i:], _TEXT
                return True
            self.buf = "" if final else buf[len(buf) - held_prefix(buf, _BOT) :]
            return False
        if state in (_ITEM_CALL, _V11_ARGS):
            return self._read_call(final)
        rest = buf.lstrip()
        lead = len(buf) - len(rest)
        if state == _NAME_STATE:
            header = _v11_header(buf)
            if header == MORE and not final:
                return False
            if isinstance(header, tuple):
                self.start(header[0])
                self.buf = buf[header[1] :]
                self._args, self._state = ArgsStreamer(), _V11_ARGS
            else:
                self._as_text()
            return True
        if not rest and not final:
            return False
        if state == _MARKER:
            if rest.startswith("["):
                self._markup += buf[: lead + 1]
                self.buf, self._state = rest[1:], _ITEM
            else:
                self._state = _NAME_STATE
        elif state == _ITEM and rest.startswith("{"):
            self._call, self._state = JsonCall(_KEYS, self._known), _ITEM_CALL
        elif state == _ITEM_AFTER and rest[:1] in (",", "]"):
            self._markup = buf[: lead + 1]
            self.buf = rest[1:]
            self._state = _ITEM if rest[0] == "," else _TEXT
        elif state == _ITEM_AFTER:  # leniently, the array ends without its `]`
            self._state = _TEXT
        else:  # _ITEM and not an object
            self._as_text()
        return True

    def _read_call(self, final: bool) -> bool:
        if self._state == _V11_ARGS:
            n = self._args.push(self, self.buf, final)
            self.buf = self.buf[n:]
            if self._args.ok is not None:
                self._state = _TEXT if self._args.ok else _DROP
            return self._args.ok is not None
        n = self._call.push(self, self.buf, final)
        self.buf = self.buf[n:]
        result = self._call.result
        if result == CALL:
            self._markup, self._state = "", _ITEM_AFTER
        elif result == BROKEN:
            self._state = _DROP
        elif result == TEXT:
            self._markup += self._call.raw
            self._as_text()
        return result is not None

    def _as_text(self) -> None:
        """What came since the marker is no call: text, and look for the next marker."""
        self.text(self._markup)
        self._markup, self._state = "", _TEXT


class MistralToolParser(SegmentedToolParser):
    name: ClassVar[str] = "mistral"
    keep_special_tokens: ClassVar[bool] = True

    def new_call_id(self) -> str:
        return "".join(secrets.choice(_ALPHANUMERIC) for _ in range(9))

    def segmenter(self) -> Segmenter:
        return _MistralSegmenter(self.tool_names)
