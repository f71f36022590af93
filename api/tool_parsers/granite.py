"""`granite`: IBM Granite 3.x's tool calls, a JSON array after a marker.

    <|tool_call|>[{"name": "get_weather", "arguments": {"city": "Paris"}}]
    Checking.<tool_call>[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "arguments": {}}]

Granite 3.0 writes the special token `<|tool_call|>` (so the server decodes with special tokens
kept), 3.1 the text `<tool_call>`. Text around the array is content. See _json_array.py for the
rules and what streaming holds back.
"""

from __future__ import annotations

from typing import ClassVar, Final

from triollm.api.tool_parsers._json_array import JsonArraySegmenter
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter

__all__ = ["GraniteToolParser"]

_MARKERS: Final = ("<|tool_call|>", "<tool_call>")


class GraniteToolParser(SegmentedToolParser):
    name: ClassVar[str] = "granite"
    keep_special_tokens: ClassVar[bool] = True

    def segmenter(self) -> Segmenter:
        return JsonArraySegmenter(_MARKERS, ("arguments",), self.tool_names)
