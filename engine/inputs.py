"""The prompt shapes vLLM scripts import from `vllm.inputs` (`from triollm import TokensPrompt`).

TypedDicts, as in vLLM: a prompt is still a plain dict (or a string), so `generate()` takes these
and literal dicts alike. Only the keys this engine uses exist: `multi_modal_data` takes images
(`{"image": PIL.Image or a list of them}`) for a vision-language model, whose placeholders the
prompt holds (docs/serving.md, "Images"); `mm_processor_kwargs` go to its image processor.
`PromptType` is what `generate()` accepts: a string or any mapping with these keys (a TypedDict
is a plain dict at run time).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, TypedDict

__all__ = ["PromptType", "TextPrompt", "TokensPrompt"]


class _MultiModal(TypedDict, total=False):
    multi_modal_data: Mapping[str, Any]  # {"image": PIL.Image.Image | list[PIL.Image.Image]}
    mm_processor_kwargs: Mapping[str, Any]


class _Text(TypedDict):
    prompt: str


class TextPrompt(_Text, _MultiModal):
    """A text prompt, tokenized by the engine (with the tokenizer's special tokens)."""


class _TokenIds(TypedDict):
    prompt_token_ids: list[int]


class TokensPrompt(_TokenIds, _MultiModal, total=False):
    """Token ids given as is; `prompt` (optional) is the text they came from, reported back in
    `RequestOutput.prompt`."""

    prompt: str


PromptType = str | Mapping[str, Any]
