"""`qwen3_coder` and `qwen3_xml`: Qwen3-Coder's XML-style calls.

    <tool_call>
    <function=get_weather>
    <parameter=city>
    San Francisco
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A value is the text between the tags less one newline at each end. It is converted by the type
the request's tool schema gives that parameter: integer, number, boolean, object or array (JSON
or a Python literal; never evaluated), `null` for a non-string type; anything else, or a value
that does not fit its type, stays a string (as in vLLM, which also degrades to a string, except
that a bad boolean there becomes false), as does an integer of more than Python's 4,300 digits
and an object or array that would nest the arguments deeper than `MAX_JSON_DEPTH` levels. As in
vLLM, the last `</parameter>`, `</function>` or `</tool_call>` may be missing. A region with no
function in it stays text, markers included.

Streaming holds back a trailing beginning of `<tool_call>` and the rest of a region: each call
is announced, with its complete arguments, when its `</function>` arrives (or the region ends).
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from triollm.api.protocol import MAX_JSON_DEPTH
from triollm.api.tool_parsers._json_scan import MAX_INT_DIGITS, MISSING, dumps_args, is_finite_json, loads
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter
from triollm.api.tool_parsers.pythonic import python_literal

__all__ = ["Qwen3XmlToolParser"]

_OPEN: Final = "<tool_call>"
_CLOSE: Final = "</tool_call>"
_END_FUNCTION: Final = "</function>"
_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*?)</function>", re.DOTALL)
_OPEN_FUNCTION = re.compile(r"<function=([^>\n]*)>(.*)", re.DOTALL)
_PARAMETER = re.compile(
    r"<parameter=([^>\n]*)>(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL
)
_INTEGER = re.compile(r"[-+]?\d+")
_CONTAINERS: Final = {"object": dict, "array": list}


def convert(value: str, schema: Any) -> Any:
    """A parameter's text as the JSON value its schema's `type` asks for (see above)."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = [k for k in (kind if isinstance(kind, list) else [kind]) if isinstance(k, str)]
    text = value.strip()
    if "string" in kinds or not kinds:
        return value
    if text.lower() == "null":
        return None
    for kind in kinds:
        if kind == "integer" and _INTEGER.fullmatch(text) and len(text.lstrip("+-")) <= MAX_INT_DIGITS:
            return int(text)
        if kind == "number":
            try:
                number = float(text)
            except ValueError:
                continue
            if math.isfinite(number):
                return int(number) if number.is_integer() and "." not in text else number
        if kind == "boolean" and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kind in _CONTAINERS:
            parsed = loads(text, MAX_JSON_DEPTH - 1)  # in the arguments object
            if parsed is MISSING:
                parsed = python_literal(text, inside=1)
            if isinstance(parsed, _CONTAINERS[kind]) and is_finite_json(parsed):
                return parsed
    return value


class _Qwen3XmlSegmenter(Segmenter):
    def __init__(self, parameters: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__()
        self._parameters = parameters
        self._region = False  # inside <tool_call>; buf starts right after it
        self._pos = 0  # where the next function may start in buf
        self._found = 0  # calls announced from this region
        self._searched = 0  # neither end tag starts in buf before this

    def step(self, final: bool) -> bool:
        if not self._region:
            if not self.text_until(_OPEN, final):
                return False
            self._region, self._pos, self._found, self._searched = True, 0, 0, 0
            return True
        # Searches resume where the last one gave up, so a long value costs linear time.
        end = self.buf.find(_CLOSE, self._searched)
        closed = end >= 0
        body = self.buf[:end] if closed else self.buf
        if body.find(_END_FUNCTION, max(self._pos, self._searched)) >= 0:
            for match in _FUNCTION.finditer(body, self._pos):
                self._call(match.group(1), match.group(2))
                self._pos = match.end()
        self._searched = max(0, len(self.buf) - len(_CLOSE))
        if not (closed or final):
            return False
        last = _OPEN_FUNCTION.search(body, self._pos)
        if last is not None:
            self._call(last.group(1), last.group(2))
        tail = end + len(_CLOSE) if closed else len(self.buf)
        if not self._found:
            self.text(_OPEN + self.buf[:tail])
        self.buf, self._region = self.buf[tail:], False
        return True

    def _call(self, name: str, body: str) -> None:
        name = name.strip()
        if not name:
            return
        schema = self._parameters.get(name, {}).get("properties")
        properties = schema if isinstance(schema, Mapping) else {}
        args: dict[str, Any] = {}
        for match in _PARAMETER.finditer(body):
            value = match.group(2)
            value = value[1:] if value.startswith("\n") else value
            value = value[:-1] if value.endswith("\n") else value
            key = match.group(1).strip()
            args[key] = convert(value, properties.get(key))
        dumped = dumps_args(args)
        if dumped is not None:
            self._found += 1
            self.start(name)
            self.args(dumped)


class Qwen3XmlToolParser(SegmentedToolParser):
    name: ClassVar[str] = "qwen3_coder"

    def segmenter(self) -> Segmenter:
        return _Qwen3XmlSegmenter(self.tool_parameters)
