"""`deepseek_v31`: DeepSeek V3.1's tool calls.

    Let me check.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
    <｜tool▁call▁end｜><｜tool▁calls▁end｜>

(one line, as the model writes it).

The name stands right after the call marker (V3's `function<｜tool▁sep｜>name` and its fenced
JSON are not this format). See _sections.py for the rules and what streaming holds back.
"""

from __future__ import annotations

import re
from typing import ClassVar, Final

from triollm.api.tool_parsers._sections import SectionMarkers, SectionSegmenter
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter

__all__ = ["DeepSeekV31ToolParser"]

_MARKERS: Final = SectionMarkers(
    section_begin="<｜tool▁calls▁begin｜>",
    section_end="<｜tool▁calls▁end｜>",
    call_begin="<｜tool▁call▁begin｜>",
    separator="<｜tool▁sep｜>",
    call_end="<｜tool▁call▁end｜>",
)
_NAME = re.compile(r"\s*([\w.\-]+)\s*")


def _header(text: str) -> tuple[str, str | None] | None:
    match = _NAME.fullmatch(text)
    return (match.group(1), None) if match else None


class DeepSeekV31ToolParser(SegmentedToolParser):
    name: ClassVar[str] = "deepseek_v31"

    def segmenter(self) -> Segmenter:
        return SectionSegmenter(_MARKERS, _header)
