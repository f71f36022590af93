"""DeepSeek's reasoning formats: `deepseek_r1` and `deepseek_v3` (vLLM's names)."""

from __future__ import annotations

from triollm.api.reasoning_parsers.think import ThinkTagReasoningParser

__all__ = ["DeepSeekR1ReasoningParser", "DeepSeekV3ReasoningParser"]


class DeepSeekR1ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek R1 (and its distills): `<think>` is usually in the prompt, so text up to
    `</think>` is reasoning with or without the start tag; no end tag: all reasoning."""

    name = "deepseek_r1"


class DeepSeekV3ReasoningParser(ThinkTagReasoningParser):
    """DeepSeek V3.1+: thinks only when the request's `chat_template_kwargs` set `thinking` (or
    `enable_thinking`) true, then as R1; otherwise the whole output is content."""

    name = "deepseek_v3"

    @property
    def reasoning_enabled(self) -> bool:
        kw = self.chat_template_kwargs
        return bool(kw.get("thinking", False)) or bool(kw.get("enable_thinking", False))
