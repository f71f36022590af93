"""The arguments every attention path shares beyond the plain causal mask (kernels/attention.py
and kernels/triton/attention.py both check them here, below both)."""

from __future__ import annotations

import math

import torch

__all__ = ["check_sinks_chunk", "check_window_softcap"]


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
