"""Qwen3's reasoning format: `qwen3` (vLLM's name; also Qwen3.5 and the -Thinking-2507 models)."""

from __future__ import annotations

from triollm.api.reasoning_parsers.think import ThinkTagReasoningParser

__all__ = ["Qwen3ReasoningParser"]


class Qwen3ReasoningParser(ThinkTagReasoningParser):
    """`<think>…</think>`; newer templates put `<think>` in the prompt, so `</think>` alone ends
    the reasoning, and a `<tool_call>` before any `</think>` ends it too (the call is content).

    With `enable_thinking=False` in the request's `chat_template_kwargs` the template closes an
    empty think block in the prompt, so an output without tags is all content; one that opens
    with `<think>` anyway is still split.
    """

    name = "qwen3"
    content_markers = ("<tool_call>",)

    @property
    def implicit_reasoning(self) -> bool:
        return self.chat_template_kwargs.get("enable_thinking", True) is not False
