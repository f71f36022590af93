"""RMSNorm as a module (kernels/norm.py has the kernels): the plain form, and fused with the
residual add (`add_forward`). The weight loads as the checkpoint's `weight`; `offset=True` is
Gemma's `(1 + weight)` form, folded into the stored weight at load (identical in fp32, where
Gemma computes it)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from triollm.kernels.norm import add_rms_norm, rms_norm

__all__ = ["RMSNorm"]


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
