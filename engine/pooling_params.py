"""`PoolingParams`: what a request to a pooling (embedding) model may ask, with vLLM's names.

A msgspec Struct, like `SamplingParams`, so it crosses to the engine-core process unchanged.
`__post_init__` checks the types and ranges (on construction and on decode); fields may be
changed afterwards, so the input processor calls `validate()` again and resolves the model's
defaults there (`resolve`): `normalize` None takes the model's (sentence-transformers'
Normalize module), `dimensions` needs a Matryoshka model.

- `task` (vLLM's pooling tasks): "embed" (one vector per prompt, pooled as the model says),
  "token_embed" (one vector per prompt token), "classify" (a classifier's activated logits, one
  per label), "score" (a one-label classifier's activated logit: a cross-encoder's relevance),
  "token_classify" (per token: a reward model's rewards, `--convert reward`, `LLM.reward`). "encode",
  the older name of "token_embed", is accepted with a DeprecationWarning (the input processor
  renames it). None until the entry point sets it (`LLM.embed` -> "embed").
- `truncate_prompt_tokens`: k >= 1 keeps the first k tokens (a text keeps its [CLS]/[SEP],
  as the tokenizer and sentence-transformers truncate; a text pair loses tokens from its longer
  text first); -1 truncates to max_model_len; None: a longer prompt is an error.
- `dimensions`: keep the first d values of the embedding, then normalise (Matryoshka).
- `normalize`: L2-normalise the embedding (each token's vector for "token_embed").
- `use_activation`: apply the classifier's activation (sigmoid, softmax... as configured; a
  reward model's softmax); False returns the raw logits (hidden states). None: True.
"""

from __future__ import annotations

import copy
from typing import Literal, get_args

import msgspec

from triollm.engine.sampling_params import RequestOutputKind, check_wire_int

__all__ = ["DEPRECATED_TASKS", "POOLING_TASKS", "TOKEN_TASKS", "PoolingParams", "PoolingTask"]

PoolingTask = Literal["embed", "classify", "score", "token_embed", "token_classify"]
POOLING_TASKS: tuple[str, ...] = get_args(PoolingTask)
TOKEN_TASKS = ("token_embed", "token_classify")  # one row per prompt token
DEPRECATED_TASKS = {"encode": "token_embed"}  # old name -> vLLM's current one


class PoolingParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    truncate_prompt_tokens: int | None = None
    dimensions: int | None = None
    normalize: bool | None = None
    task: str | None = None
    use_activation: bool | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise `ValueError` naming the field for a value no model accepts."""
        k = self.truncate_prompt_tokens
        if k is not None:
            if isinstance(k, bool) or not isinstance(k, int) or not (k == -1 or k >= 1):
                raise ValueError(
                    f"truncate_prompt_tokens: must be -1 (the model's max_model_len) or a positive integer, got {k!r}"
                )
            check_wire_int("truncate_prompt_tokens", k)
        d = self.dimensions
        if d is not None:
            if isinstance(d, bool) or not isinstance(d, int) or d < 1:
                raise ValueError(f"dimensions: must be a positive integer, got {d!r}")
            check_wire_int("dimensions", d)
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize: must be true, false or None, got {self.normalize!r}")
        if self.use_activation is not None and not isinstance(self.use_activation, bool):
            raise ValueError(f"use_activation: must be true, false or None, got {self.use_activation!r}")
        if self.task is not None and self.task not in POOLING_TASKS and self.task not in DEPRECATED_TASKS:
            raise ValueError(f"task: {self.task!r} is not one of {', '.join(POOLING_TASKS)}")

    @property
    def output_kind(self) -> RequestOutputKind:
        """A pooling request has one output, when it finishes (vLLM's fixed FINAL_ONLY)."""
        return RequestOutputKind.FINAL_ONLY

    def clone(self) -> PoolingParams:
        return copy.copy(self)
