"""RMSNorm. In fp32 it is torch's fused `F.rms_norm` (one op instead of six, bit-identical to
the reference here); other dtypes keep Llama's reference: normalise in fp32, cast back, scale."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm computed in fp32 (as Llama's reference does), returned in x's dtype."""
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)
