"""IBM Granite 3.2+'s reasoning: `granite` (vLLM's name)."""

from __future__ import annotations

from typing import ClassVar

from triollm.api.reasoning_parsers.markers import MarkerReasoningParser

__all__ = ["GraniteReasoningParser"]


class GraniteReasoningParser(MarkerReasoningParser):
    """With `chat_template_kwargs={"thinking": true}` Granite writes

        Here is my thought process:
        The user wants...
        Here is my response:
        Paris.

    The phrases are plain text, and (as vLLM notes of quantized Granite models) sometimes begin
    "Here's"; both spellings count (see markers.py)."""

    name: ClassVar[str] = "granite"
    start_token: ClassVar[str] = "Here is my thought process:"
    end_token: ClassVar[str] = "Here is my response:"
    start_markers: ClassVar[tuple[str, ...]] = ("Here is my thought process:", "Here's my thought process:")
    end_markers: ClassVar[tuple[str, ...]] = ("Here is my response:", "Here's my response:")
