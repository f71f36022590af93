"""OLMo 3 Think's reasoning: `olmo3` (vLLM's name)."""

from __future__ import annotations

from triollm.api.reasoning_parsers.think import ThinkTagReasoningParser

__all__ = ["Olmo3ReasoningParser"]


class Olmo3ReasoningParser(ThinkTagReasoningParser):
    """`<think>…</think>` in ordinary vocabulary tokens (so matched on text); the `<think>` may
    be in the output or already in the prompt, so text up to `</think>` is reasoning either way.
    No `</think>`: all reasoning, a thought cut off (the rules of think.py; vLLM's streaming
    parser agrees, its whole-output one calls such an output content)."""

    name = "olmo3"
