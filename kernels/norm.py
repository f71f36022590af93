"""RMSNorm (and RMSNorm fused with the residual add). On CUDA: the Triton kernels
(`kernels/triton/norm.py`). fp32 elsewhere: torch's `F.rms_norm` (bit-identical to Llama's reference here).
Half precision on CPU: the native kernel (`kernels/cpu_native.py`, one pass per row; torch's CPU
rms_norm for bf16 decomposes into ~8 ops), else `F.rms_norm`. Both round once, at the end,
where the reference rounds the normalised activations before scaling by the weight: on random
activations that differs from the reference by at most one ulp and is closer to the exact value
(docs/benchmarks.md, "bf16 against fp32"); bf16 runs are checked against fp32 with a tolerance
(tests/engine/test_bf16.py)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triollm.kernels import cpu_native
from triollm.kernels.triton import use_triton


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, exact: bool = True, triton: bool | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension, returned in x's dtype. `exact=False` lets fp32 take the
    native kernel too (one rounding instead of the reference's two: a quantized model is no
    bit-for-bit reference anyway, and torch's fp32 rms_norm is ~8 ops). `triton`: the caller's
    `use_triton(x)`, when it has it (the model decides once per forward pass)."""
    if weight.dtype != x.dtype:
        weight = weight.to(x.dtype)
    if use_triton(x) if triton is None else triton:
        from triollm.kernels.triton import norm as triton_norm

        return triton_norm.rms_norm(x, weight, eps)
    if (x.dtype != torch.float32 or not exact) and x.device.type == "cpu" and cpu_native.available():
        return cpu_native.rms_norm(x, weight, eps)
    return F.rms_norm(x, weight.shape, weight, eps)


def add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    exact: bool = True,
    triton: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual + x`, and its RMSNorm: `(normed, new_residual)`. One kernel on the Triton path
    (vLLM's fused_add_rms_norm); the residual sum is the same on every path."""
    if triton is None:
        triton = use_triton(x)
    if triton:
        from triollm.kernels.triton import norm as triton_norm

        if weight.dtype != x.dtype:
            weight = weight.to(x.dtype)
        return triton_norm.fused_add_rms_norm(x, residual, weight, eps)
    residual = residual + x
    return rms_norm(residual, weight, eps, exact, triton), residual
