"""RMSNorm as a module (kernels/norm.py has the kernels): the plain form, and fused with the
residual add (`add_forward`). The weight loads as the checkpoint's `weight`; `offset=True` is
Gemma's `(1 + weight)` form, folded into the stored weight at load (identical in fp32, where
Gemma computes it).

`LayerNorm` (GPT-NeoX, Phi, StableLM): torch's layer norm with a weight and, where the family has
one, a bias; the same call signature as `RMSNorm.forward`, so the causal-LM shell's final norm can
be either."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from triollm.kernels.norm import add_rms_norm, rms_norm

__all__ = ["LayerNorm", "RMSNorm"]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float, *, exact: bool = True, offset: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.eps, self.exact, self.offset = eps, exact, offset

    def forward(self, x: torch.Tensor, triton: bool | None = None) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.exact, triton)

    def add_forward(
        self, x: torch.Tensor, residual: torch.Tensor, triton: bool | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`(norm(residual + x), residual + x)`."""
        return add_rms_norm(x, residual, self.weight, self.eps, self.exact, triton)

    def load(self, leaf: str, piece: int, source: Any) -> None:
        tensor = source[:]
        if tuple(tensor.shape) != tuple(self.weight.shape):
            raise ValueError(
                f"model: a norm of shape {tuple(tensor.shape)} where {tuple(self.weight.shape)} was expected"
            )
        self.weight.data.copy_(tensor.float() + 1 if self.offset else tensor)


class LayerNorm(nn.Module):
    """`(x - mean) / sqrt(var + eps) * weight (+ bias)` over the last dimension."""

    def __init__(self, size: int, eps: float, *, bias: bool = True) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size))
        self.bias = nn.Parameter(torch.empty(size)) if bias else None
        self.eps = eps

    def forward(self, x: torch.Tensor, triton: bool | None = None) -> torch.Tensor:
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, self.eps)

    def load(self, leaf: str, piece: int, source: Any) -> None:
        param = getattr(self, leaf)
        tensor = source[:]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"model: a norm of shape {tuple(tensor.shape)} where {tuple(param.shape)} was expected")
        param.data.copy_(tensor)
