"""`vllm.inputs`, for scripts that import from there: the prompt shapes `generate()` takes.

A re-export only; the definitions live in `triollm.engine.inputs`.
"""

from __future__ import annotations

from triollm.engine.inputs import PromptType, TextPrompt, TokensPrompt

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]
