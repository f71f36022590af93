"""`kimi_k2`: Kimi K2's tool calls, in a section of special tokens.

    <|tool_calls_section_begin|>
    <|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{"city": "Paris"}<|tool_call_end|>
    <|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|>
    <|tool_calls_section_end|>

The header `functions.NAME:INDEX` is the model's own call id, and the call keeps it (as in vLLM:
Kimi's template shows the ids of earlier calls back to the model); a header without `:INDEX`
gets a new id. Text after the section is content (vLLM drops it). The markers are special
tokens, so the server decodes with special tokens kept.
See _sections.py for the rules and what streaming holds back.
"""

from __future__ import annotations

import re
from typing import ClassVar, Final

from triollm.api.tool_parsers._sections import SectionMarkers, SectionSegmenter
from triollm.api.tool_parsers._segments import SegmentedToolParser, Segmenter

__all__ = ["KimiK2ToolParser"]

_MARKERS: Final = SectionMarkers(
    section_begin="<|tool_calls_section_begin|>",
    section_end="<|tool_calls_section_end|>",
    call_begin="<|tool_call_begin|>",
    separator="<|tool_call_argument_begin|>",
    call_end="<|tool_call_end|>",
)
_HEADER = re.compile(r"\s*((?:functions\.)?([\w.\-]+?)(:\d+)?)\s*")


def _header(text: str) -> tuple[str, str | None] | None:
    match = _HEADER.fullmatch(text)
    if match is None:
        return None
    return match.group(2), (match.group(1) if match.group(3) else None)


class KimiK2ToolParser(SegmentedToolParser):
    name: ClassVar[str] = "kimi_k2"
    keep_special_tokens: ClassVar[bool] = True

    def segmenter(self) -> Segmenter:
        return SectionSegmenter(_MARKERS, _header)
