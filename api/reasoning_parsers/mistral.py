"""Magistral's reasoning: `mistral` (vLLM's name)."""

from __future__ import annotations

from typing import ClassVar

from triollm.api.reasoning_parsers.markers import MarkerReasoningParser

__all__ = ["MistralReasoningParser"]


class MistralReasoningParser(MarkerReasoningParser):
    """`[THINK]…[/THINK]`, special tokens of Mistral's v13 tokenizers (so the server decodes
    with special tokens kept); text around the section is content (see markers.py)."""

    name: ClassVar[str] = "mistral"
    start_token: ClassVar[str] = "[THINK]"
    end_token: ClassVar[str] = "[/THINK]"
    start_markers: ClassVar[tuple[str, ...]] = ("[THINK]",)
    end_markers: ClassVar[tuple[str, ...]] = ("[/THINK]",)
    keep_special_tokens: ClassVar[bool] = True
