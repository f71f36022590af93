"""`pythonic` (and vLLM's `llama4_pythonic`): calls written as a Python list of calls, as
Llama 3.2 and Llama 4 emit them with the pythonic chat templates.

    [get_weather(city="San Francisco", days=3), get_time(zone=None)]

The output *is* the list: keyword arguments only, each value a literal (string, number,
True/False/None and JSON's true/false/null, lists, tuples, dicts with string keys). It is read
with `ast.parse` and turned into JSON by walking the tree: nothing is ever evaluated, and the
walk stops at `MAX_JSON_DEPTH` levels (a value nested deeper is no literal). An output that does
not start with `[` (after whitespace) is all content, as is a list that is not such calls; text
after the list is content.

Streaming sends text at once unless the output starts with `[`; then it holds the list back
until its closing bracket and announces every call with its complete arguments.
"""

from __future__ import annotations

import ast
from typing import Any, ClassVar, Final

from triollm.api.protocol import MAX_JSON_DEPTH
from triollm.api.tool_parsers._json_scan import MISSING, dumps_args
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter

__all__ = ["PythonicToolParser", "python_literal"]

_JSON_NAMES: Final = {"true": True, "false": False, "null": None}


def _value(node: ast.expr, inside: int) -> Any:
    """The JSON value of a literal's syntax tree, or MISSING; `inside`: how many JSON containers
    hold it (a container in `MAX_JSON_DEPTH` of them is too deep, and is not looked into)."""
    if inside >= MAX_JSON_DEPTH and isinstance(node, ast.List | ast.Tuple | ast.Dict):
        return MISSING
    match node:
        case ast.Constant(value=value) if value is None or isinstance(value, str | int | float):
            return value
        case ast.UnaryOp(op=ast.USub() | ast.UAdd() as op, operand=ast.Constant(value=value)):
            if isinstance(value, int | float) and not isinstance(value, bool):
                return -value if isinstance(op, ast.USub) else value
        case ast.List(elts=items) | ast.Tuple(elts=items):
            values = [_value(item, inside + 1) for item in items]
            return MISSING if any(v is MISSING for v in values) else values
        case ast.Dict(keys=keys, values=items):
            out: dict[str, Any] = {}
            for key, item in zip(keys, items, strict=True):
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    return MISSING
                out[key.value] = _value(item, inside + 1)
                if out[key.value] is MISSING:
                    return MISSING
            return out
        case ast.Name(id=name) if name in _JSON_NAMES:
            return _JSON_NAMES[name]
    return MISSING


def _parse(text: str) -> ast.expr | None:
    try:
        return ast.parse(text.strip(), mode="eval").body
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


def python_literal(text: str, inside: int = 0) -> Any:
    """The JSON value of a Python (or JSON) literal written in `text` (to be held in `inside`
    JSON containers), or MISSING."""
    node = _parse(text)
    try:
        return MISSING if node is None else _value(node, inside)
    except RecursionError:
        return MISSING


def _calls(text: str) -> list[tuple[str, str]] | None:
    """(name, arguments JSON) of each call in a list of calls, or None."""
    node = _parse(text)
    if not isinstance(node, ast.List) or not node.elts:
        return None
    calls = []
    for call in node.elts:
        if not isinstance(call, ast.Call) or not isinstance(call.func, ast.Name) or call.args:
            return None
        args: dict[str, Any] = {}
        for keyword in call.keywords:
            try:
                value = MISSING if keyword.arg is None else _value(keyword.value, 1)
            except RecursionError:
                value = MISSING
            if value is MISSING or keyword.arg is None:
                return None
            args[keyword.arg] = value
        dumped = dumps_args(args)
        if dumped is None:
            return None
        calls.append((call.func.id, dumped))
    return calls


class _PythonicSegmenter(Segmenter):
    def __init__(self) -> None:
        super().__init__()
        self._list = False  # holding a list back
        self._text = False  # the rest is text
        self._pos = 0  # how far the list was scanned
        self._depth = 0
        self._quote = ""  # the open string's quotes
        self._escape = False

    def step(self, final: bool) -> bool:
        if self._text:
            self.text(self.buf)
            self.buf = ""
            return False
        if not self._list:
            rest = self.buf.lstrip()
            if not rest:
                return self._text_from_here() if final else False
            if rest[0] != "[":
                return self._text_from_here()
            self._list, self._pos = True, len(self.buf) - len(rest)
            return True
        end = self._scan(final)
        if end is None:
            return self._text_from_here() if final else False
        source, self.buf = self.buf[:end], self.buf[end:]
        calls = _calls(source)
        if calls is None:
            self.text(source)
        else:
            self.text(source[: len(source) - len(source.lstrip())])
            for name, args in calls:
                self.start(name)
                self.args(args)
        return self._text_from_here()

    def _text_from_here(self) -> bool:
        self._text = True
        return True

    def _scan(self, final: bool) -> int | None:
        """The end of the list (after its `]`), or None while it is open."""
        buf, i = self.buf, self._pos
        while i < len(buf):
            ch = buf[i]
            quote = self._quote
            if quote:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif buf.startswith(quote, i):
                    self._quote = ""
                    i += len(quote)
                    continue
                elif len(quote) == 3 and ch == quote[0] and i + 3 > len(buf) and not final:
                    break  # maybe the start of the closing quotes
            elif ch in "'\"":
                if buf.startswith(ch * 3, i):
                    self._quote = ch * 3
                    i += 3
                    continue
                if i + 3 > len(buf) and buf[i:] == ch * (len(buf) - i) and not final:
                    break  # maybe the start of a triple quote
                self._quote = ch
            elif ch in "([{":
                self._depth += 1
            elif ch in ")]}":
                self._depth -= 1
                if self._depth == 0:
                    return i + 1
            i += 1
        self._pos = i
        return None


class PythonicToolParser(SegmentedToolParser):
    name: ClassVar[str] = "pythonic"

    def segmenter(self) -> Segmenter:
        return _PythonicSegmenter()
