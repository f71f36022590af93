"""RMSNorm: torch's fused `F.rms_norm` (one op instead of six). In fp32 it is bit-identical to
Llama's reference here. In bf16/fp16 it rounds once, at the end, where the reference rounds the
normalised activations before scaling by the weight: measured on random activations, it differs
from the reference by at most one ulp in a quarter of the elements and is closer to the exact
value (max error 0.016 vs 0.021 in bf16); bf16 runs are checked against fp32 with a tolerance
(tests/engine/test_bf16.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dimension, returned in x's dtype."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    return F.rms_norm(x, weight.shape, weight, eps)
