"""`phi4_mini_json`: Phi-4-mini's tool calls (with vLLM's examples/tool_chat_template_phi4_mini.jinja).

    functools[{"name": "get_weather", "arguments": {"city": "Paris"}}, {"name": "get_time", "parameters": {}}]

`functools` is plain text; the arguments are under `arguments` or `parameters`. Text around the
array is content (vLLM drops it). See _json_array.py for the rules and what streaming holds back.
"""

from __future__ import annotations

from typing import ClassVar, Final

from triollm.api.tool_parsers._json_array import JsonArraySegmenter
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter

__all__ = ["Phi4MiniJsonToolParser"]

_MARKERS: Final = ("functools",)


class Phi4MiniJsonToolParser(SegmentedToolParser):
    name: ClassVar[str] = "phi4_mini_json"

    def segmenter(self) -> Segmenter:
        return JsonArraySegmenter(_MARKERS, ("arguments", "parameters"), self.tool_names)
