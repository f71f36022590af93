"""A cross-encoder's input: a (query, document) text pair as one prompt with its segments.

A cross-encoder (a `*ForSequenceClassification` reranker) reads both texts in one sequence,
encoded as its tokenizer encodes a pair (`[CLS] q [SEP] d [SEP]` with token types 0 then 1 for
BERT, `<s> q </s></s> d </s>` for XLM-R), as sentence-transformers' `CrossEncoder` does. The
prompt is vLLM's TokensPrompt with `token_type_ids`; the input processor checks it like any
other. `truncate_prompt_tokens` cuts the pair the way the tokenizer's `longest_first` does
(tokenizer.py `encode_pair`); without it a pair longer than max_model_len is refused there.
"""

from __future__ import annotations

from typing import Any

from triollm.engine.processing.tokenizer import Tokenizer

__all__ = ["pair_prompt"]


def pair_prompt(
    tokenizer: Tokenizer,
    first: str,
    second: str,
    truncate_prompt_tokens: int | None,
    max_model_len: int,
    max_second: int | None = None,
) -> dict[str, Any]:
    """The TokensPrompt of the pair (`first`, `second`), cut to `truncate_prompt_tokens` (-1: to
    max_model_len; None: not cut); `max_second` first cuts the second text to that many tokens."""
    keep = max_model_len if truncate_prompt_tokens == -1 else truncate_prompt_tokens
    if keep is not None and keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens: {keep} exceeds max_model_len ({max_model_len})")
    ids, types = tokenizer.encode_pair(first, second, keep, max_second)
    return {"prompt_token_ids": ids, "token_type_ids": types}
