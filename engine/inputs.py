"""The prompt shapes vLLM scripts import from `vllm.inputs` (`from triollm import TokensPrompt`).

TypedDicts, as in vLLM: a prompt is still a plain dict (or a string), so `generate()` takes these
and literal dicts alike. Only the keys this engine uses exist: it runs text-only models, so there
is no `multi_modal_data`. `PromptType` is what `generate()` accepts: a string or any mapping with
these keys (a TypedDict is a plain dict at run time).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]


class TextPrompt(TypedDict):
    """A text prompt, tokenized by the engine (with the tokenizer's special tokens)."""

    prompt: str


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, total=False):
    """Token ids given as is; `prompt` (optional) is the text they came from, reported back in
    `RequestOutput.prompt`."""

    prompt: str


PromptType = str | Mapping[str, Any]
