"""The arguments every attention path shares beyond the plain causal mask (kernels/attention.py
and kernels/triton/attention.py both check them here, below both), and the bidirectional
spans' mask (Gemma 3's images), which the torch prefill path builds."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["check_sinks_chunk", "check_spans", "check_window_softcap", "same_span"]


def check_window_softcap(window: int | None, softcap: float | None) -> None:
    """ValueError unless `window` is None or a positive int and `softcap` None or finite > 0."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window: {window!r} must be a positive number of tokens, or None")
    if softcap is not None and not 0 < softcap < math.inf:
        raise ValueError(f"softcap: {softcap!r} must be a finite number > 0, or None")


def check_sinks_chunk(sinks: torch.Tensor | None, chunk: int | None, num_heads: int) -> None:
    """ValueError unless `sinks` is None or one logit per query head (`[num_heads]`) and `chunk`
    None or a positive int."""
    if sinks is not None and tuple(sinks.shape) != (num_heads,):
        raise ValueError(f"sinks: shape {tuple(sinks.shape)} must be [{num_heads}] (one per query head), or None")
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"chunk: {chunk!r} must be a positive number of tokens, or None")


def same_span(q_pos: torch.Tensor, k_pos: torch.Tensor, spans: Sequence[tuple[int, int]]) -> torch.Tensor:
    """True where the query position (`[rows, 1]`) and the key position (`[1, keys]`) lie in one
    span `[first, end)` of `spans` (`[rows, keys]`): Gemma 3's image positions, which attend to
    each other both ways on top of the causal mask (transformers' `token_type_ids` block mask)."""
    out = torch.zeros(q_pos.shape[0], k_pos.shape[1], dtype=torch.bool, device=q_pos.device)
    for first, end in spans:
        out |= (q_pos >= first) & (q_pos < end) & (k_pos >= first) & (k_pos < end)
    return out


def check_spans(spans: Sequence[tuple[int, int]]) -> None:
    """ValueError unless `spans` are ordered, disjoint, non-empty `[first, end)` position ranges."""
    last = 0
    for span in spans:
        first, end = span
        if not last <= first < end:
            raise ValueError(f"bidirectional: span {span!r} must be a non-empty [first, end) after the one before")
        last = end
