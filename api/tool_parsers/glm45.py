"""`glm45` (and `glm47`): GLM-4.5/4.6/4.7's XML-style tool calls.

    Let me check.<tool_call>get_weather
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    <arg_key>days</arg_key>
    <arg_value>3</arg_value>
    </tool_call>

The name comes first (GLM-4.7 puts the first `<arg_key>` right after it, with no newline); a
call may have no arguments. GLM's template writes a string value as it is and any other value
as JSON, so a value is read by the type the request's tool schema gives that parameter (as in
`qwen3_coder`: see qwen3_xml.py); where the schema gives no type, a value that is JSON is
decoded and anything else stays a string. The last `</tool_call>` (or `</arg_value>`) may be
missing: the model stopped. A region that is not a name and key-value pairs stays text, markers
included.

Streaming holds back a trailing beginning of `<tool_call>` and the rest of a region: the call is
announced with all of its arguments when `</tool_call>` arrives (or the output ends).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Final

from triollm.api.protocol import MAX_JSON_DEPTH
from triollm.api.tool_parsers._json_scan import MISSING, dumps_args, is_finite_json, loads
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter, held_prefix
from triollm.api.tool_parsers.qwen3_xml import convert

__all__ = ["Glm45ToolParser"]

_OPEN: Final = "<tool_call>"
_CLOSE: Final = "</tool_call>"
_NAME = re.compile(r"\s*([\w.\-]+)\s*(?=<arg_key>|\Z)")
_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)(?:</arg_value>\s*|\Z)", re.DOTALL)


def glm_value(value: str, schema: Any) -> Any:
    """A value's text as the JSON value its schema (or, with no type, its own text) asks for."""
    kind = schema.get("type") if isinstance(schema, Mapping) else None
    if kind:
        return convert(value, schema)
    parsed = loads(value.strip(), MAX_JSON_DEPTH - 1)  # in the arguments object
    return value if parsed is MISSING or not is_finite_json(parsed) else parsed


def glm_call(body: str, parameters: Mapping[str, Mapping[str, Any]]) -> tuple[str, str] | None:
    """(name, arguments) of a region's body, or None when it is not a call."""
    head = _NAME.match(body)
    if head is None:
        return None
    name, pos = head.group(1), head.end()
    schema = parameters.get(name, {}).get("properties")
    properties = schema if isinstance(schema, Mapping) else {}
    args: dict[str, Any] = {}
    while pos < len(body):
        pair = _PAIR.match(body, pos)
        if pair is None:
            return None
        key = pair.group(1).strip()
        args[key] = glm_value(pair.group(2), properties.get(key))
        pos = pair.end()
    arguments = dumps_args(args)
    return None if arguments is None else (name, arguments)


class _Glm45Segmenter(Segmenter):
    def __init__(self, parameters: Mapping[str, Mapping[str, Any]]) -> None:
        super().__init__()
        self._parameters = parameters
        self._region = False  # inside <tool_call>; buf starts right after it
        self._searched = 0  # `</tool_call>` does not start in buf before this

    def step(self, final: bool) -> bool:
        if not self._region:
            if not self.text_until(_OPEN, final):
                return False
            self._region, self._searched = True, 0
            return True
        end = self.buf.find(_CLOSE, self._searched)
        if end < 0 and not final:
            self._searched = len(self.buf) - held_prefix(self.buf, _CLOSE)
            return False
        tail = end + len(_CLOSE) if end >= 0 else len(self.buf)
        call = glm_call(self.buf[: end if end >= 0 else len(self.buf)], self._parameters)
        if call is None:
            self.text(_OPEN + self.buf[:tail])
        else:
            self.start(call[0])
            self.args(call[1])
        self.buf, self._region = self.buf[tail:], False
        return True


class Glm45ToolParser(SegmentedToolParser):
    name: ClassVar[str] = "glm45"

    def segmenter(self) -> Segmenter:
        return _Glm45Segmenter(self.tool_parameters)
