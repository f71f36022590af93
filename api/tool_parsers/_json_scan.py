"""JSON pieces shared by the JSON-call parsers (hermes, llama3_json, mistral).

`JsonScanner` validates one JSON value as it arrives, character by character, with the
grammar of `json.loads` (strict: no NaN/Infinity, no control characters inside strings). Besides
"done" and "failed" it keeps a *safe point*: the longest prefix seen so far that a closing
suffix (`safe_closer`) turns into valid JSON. Safe points sit right after an opening bracket,
after a complete value, and anywhere inside a string value except in the middle of an escape;
never inside a key or between a key and its value. A stream sends the raw text up to the safe
point, so if the output breaks off, sending `safe_closer` still ends the arguments as valid
JSON.

`call_header` reads the start of `{"name": "...", "arguments": {` incrementally: it answers
MORE (the text so far can still become a header), NO, or the name and where the arguments
object starts. A call is announced only once its header is complete.

Hostile output. Model output may be anything, and a parser never raises on it: the scanner
fails on brackets nested deeper than `MAX_JSON_DEPTH` (the bound client JSON has, so a call
the model made can be sent back), and on numbers Python does not turn back into the same JSON
(an integer of more than `MAX_INT_DIGITS` digits, Python's `int` limit; a float that overflows
to infinity); `loads` answers MISSING for such text without recursing into it. What the
scanner refuses is text, or a call broken off, never an exception.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Final

from triollm.api.protocol import MAX_JSON_DEPTH, json_text_depth

__all__ = [
    "MAX_INT_DIGITS",
    "MISSING",
    "MORE",
    "NO",
    "JsonScanner",
    "call_from_json",
    "call_header",
    "dumps_args",
    "is_finite_json",
    "loads",
]

_WS: Final = " \t\n\r"
_HEX: Final = frozenset("0123456789abcdefABCDEF")
_SCALAR_CHARS: Final = frozenset("+-.0123456789eEtruefalsn")
_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS: Final = frozenset({"true", "false", "null"})
# Python's default `sys.get_int_max_str_digits()`: `json.loads` refuses longer integers.
MAX_INT_DIGITS: Final = 4300

# What the scanner expects next, outside strings and scalars.
_VALUE, _VALUE_OR_CLOSE, _KEY, _KEY_OR_CLOSE, _COLON, _AFTER = range(6)
# Which string the scanner is inside.
_NO_STRING, _KEY_STRING, _VALUE_STRING = range(3)


class JsonScanner:
    """Incremental validator of one JSON object or array; see the module docstring."""

    def __init__(self) -> None:
        self.consumed = 0  # characters taken so far (stops at the end of the value)
        self.done = False
        self.failed = False
        self.safe = 0
        self.safe_closer = ""
        self._stack: list[str] = []  # the closing brackets still owed
        self._expect = _VALUE
        self._string = _NO_STRING
        self._escape = False
        self._hex = 0  # hex digits still owed by a \u escape
        self._scalar: list[str] | None = None

    def feed(self, text: str) -> int:
        """Scan `text`, the continuation of what was fed before; returns how many of its
        characters belong to the value (all of them unless it ended or failed in `text`)."""
        if self.done or self.failed:
            return 0
        base = self.consumed
        for i, ch in enumerate(text):
            if not self._step(ch, base + i):
                self.failed = True
                self.consumed = base + i
                return i
            if self.done:
                self.consumed = base + i + 1
                return i + 1
        self.consumed = base + len(text)
        return len(text)

    def _closers(self) -> str:
        return "".join(reversed(self._stack))

    def _mark_safe(self, end: int, closer: str) -> None:
        self.safe = end
        self.safe_closer = closer

    def _value_ended(self, end: int) -> None:
        if self._stack:
            self._expect = _AFTER
            self._mark_safe(end, self._closers())
        else:
            self.done = True

    def _step(self, ch: str, pos: int) -> bool:
        if self._string:
            return self._string_step(ch, pos)
        if self._scalar is not None:
            if ch in _SCALAR_CHARS:
                self._scalar.append(ch)
                return True
            token = "".join(self._scalar)
            self._scalar = None
            if token not in _LITERALS and not _is_number(token):
                return False
            self._value_ended(pos)
        if ch in _WS:
            return True
        expect = self._expect
        if expect in (_VALUE, _VALUE_OR_CLOSE):
            if ch == "]" and expect == _VALUE_OR_CLOSE:
                return self._close(ch, pos)
            if ch in "{[":
                if len(self._stack) >= MAX_JSON_DEPTH:
                    return False
                self._stack.append("}" if ch == "{" else "]")
                self._expect = _KEY_OR_CLOSE if ch == "{" else _VALUE_OR_CLOSE
                self._mark_safe(pos + 1, self._closers())
            elif not self._stack:  # the scanned value is an object or an array
                return False
            elif ch == '"':
                self._string = _VALUE_STRING
                self._mark_safe(pos + 1, '"' + self._closers())
            elif ch in "-0123456789tfn":
                self._scalar = [ch]
            else:
                return False
        elif expect in (_KEY, _KEY_OR_CLOSE):
            if ch == "}" and expect == _KEY_OR_CLOSE:
                return self._close(ch, pos)
            if ch != '"':
                return False
            self._string = _KEY_STRING
        elif expect == _COLON:
            if ch != ":":
                return False
            self._expect = _VALUE
        else:  # _AFTER
            if ch == ",":
                self._expect = _KEY if self._stack[-1] == "}" else _VALUE
            elif ch == self._stack[-1]:
                return self._close(ch, pos)
            else:
                return False
        return True

    def _close(self, ch: str, pos: int) -> bool:
        self._stack.pop()
        self._value_ended(pos + 1)
        return True

    def _string_step(self, ch: str, pos: int) -> bool:
        if self._hex:
            if ch not in _HEX:
                return False
            self._hex -= 1
        elif self._escape:
            if ch == "u":
                self._hex = 4
            elif ch not in '"\\/bfnrt':
                return False
            self._escape = False
        elif ch == "\\":
            self._escape = True
        elif ch == '"':
            kind, self._string = self._string, _NO_STRING
            if kind == _KEY_STRING:
                self._expect = _COLON
            else:
                self._value_ended(pos + 1)
            return True
        elif ch < " ":
            return False
        if self._string == _VALUE_STRING and not self._escape and not self._hex:
            self._mark_safe(pos + 1, '"' + self._closers())
        return True


def _is_number(token: str) -> bool:
    """A JSON number that `json.loads` reads and `json.dumps` writes back (see the docstring)."""
    if not _NUMBER.fullmatch(token):
        return False
    if token.isdigit() or token[1:].isdigit():  # an integer
        return len(token.lstrip("-")) <= MAX_INT_DIGITS
    return math.isfinite(float(token))


class _Missing:
    pass


MISSING: Final = _Missing()
MORE: Final = "more"  # call_header: the text so far may still become a header
NO: Final = "no"  # call_header: it will not


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def loads(text: str, max_depth: int = MAX_JSON_DEPTH) -> Any:
    """`json.loads` without NaN/Infinity; MISSING when `text` is not JSON, nests deeper than
    `max_depth` (checked before parsing) or holds an integer Python will not read."""
    if json_text_depth(text) > max_depth:
        return MISSING
    try:
        return json.loads(text, parse_constant=_reject_constant)
    except ValueError:
        return MISSING


def dumps_args(args: Any) -> str | None:
    """Arguments as the JSON object string of the API; None when they are not an object."""
    if not isinstance(args, dict):
        return None
    try:
        return json.dumps(args, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return None


def call_from_json(
    obj: Any, arg_keys: tuple[str, ...], known: frozenset[str]
) -> tuple[str, str] | None:
    """(name, arguments JSON) from a decoded `{"name": ..., "arguments": {...}}`, or None.

    The arguments may be left out (they are `{}`) only by a call that names one of the request's
    tools (`known`): `{"name": "Bob"}` alone is not a call. Arguments given as a string holding
    a JSON object (some models double-encode) are decoded once.
    """
    if not isinstance(obj, dict):
        return None
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return None
    key = next((key for key in arg_keys if key in obj), None)
    if key is None and name not in known:
        return None
    args: Any = {} if key is None else obj[key]
    if isinstance(args, str):
        args = loads(args)
    dumped = dumps_args(args)
    return None if dumped is None else (name, dumped)


def _literal(text: str, i: int, options: tuple[str, ...]) -> int | str:
    """Skip whitespace, then one of `options`: the index after it, MORE or NO."""
    while i < len(text) and text[i] in _WS:
        i += 1
    rest = text[i:]
    for option in options:
        if rest.startswith(option):
            return i + len(option)
    return MORE if any(option.startswith(rest) for option in options) else NO


def _string(text: str, i: int) -> tuple[str, int] | str:
    """Skip whitespace, then a JSON string: (its value, the index after it), MORE or NO."""
    while i < len(text) and text[i] in _WS:
        i += 1
    if i == len(text):
        return MORE
    if text[i] != '"':
        return NO
    j = i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == '"':
            value = loads(text[i : j + 1])
            return (value, j + 1) if isinstance(value, str) and value else NO
        j += 1
    return MORE


def call_header(text: str, arg_keys: tuple[str, ...]) -> tuple[str, int] | str:
    """Read `{"name": "<name>", "<arg key>": {` at the start of `text` (whitespace allowed):
    (name, index of the arguments' `{`), MORE or NO."""
    i: int | str = _literal(text, 0, ("{",))
    name = ""
    steps: list[tuple[str, ...] | None] = [('"name"',), (":",), None, (",",)]
    steps += [tuple(f'"{key}"' for key in arg_keys), (":",), ("{",)]
    for step in steps:
        if isinstance(i, str):
            return i
        if step is None:
            found = _string(text, i)
            if isinstance(found, str):
                return found
            name, i = found
        else:
            i = _literal(text, i, step)
    if isinstance(i, str):
        return i
    return name, i - 1


def is_finite_json(value: Any) -> bool:
    """Whether `value` dumps as strict JSON (used for values converted from non-JSON text),
    walked without recursion."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, float):
            if not math.isfinite(item):
                return False
        elif isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if not all(isinstance(k, str) for k in item):
                return False
            stack.extend(item.values())
        elif not (item is None or isinstance(item, str | int | bool)):
            return False
    return True
