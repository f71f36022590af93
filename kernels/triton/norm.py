"""RMSNorm, and RMSNorm fused with the residual add before it, as Triton kernels.

Reference: `kernels/norm.py` (`rms_norm`). One program normalises one row (the product of the
leading dimensions is the row count): the whole row is one block of `BLOCK` (the next power of
two at or above `hidden`, masked), so the sum of squares is a single in-register reduction and
the row is read once. That holds up to `MAX_HIDDEN` columns (64 fp32 values per thread at 8
warps); every model this engine runs is far below it.

Numerics: the row is widened to fp32, normalised, multiplied by the weight (widened too) and
rounded to the output dtype once, at the end. Hugging Face's Llama rounds the normalised row
before the weight multiply; rounding once is what `kernels/norm.py`'s native CPU kernel does and
is the closer of the two to the exact value.

`fused_add_rms_norm` is vLLM's `fused_add_rms_norm`, returning `(rms_norm(x + residual),
x + residual)`: by default as new tensors, leaving its inputs unchanged; with `out=x,
residual_out=residual` in place, as vLLM's op writes them. The sum is
taken in fp32 and rounded to the residual's dtype, and the normalisation reads the rounded sum,
so `normed` is exactly `rms_norm(new_residual)` (vLLM's CUDA kernel does the same; its torch
path normalises the unrounded fp32 sum).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from triollm.kernels.triton import AotSpec

__all__ = ["AOT_SPECS", "MAX_HIDDEN", "fused_add_rms_norm", "rms_norm"]

MAX_HIDDEN = 16384


@triton.jit
def _normalize(x, w_ptr, cols, mask, n_cols, eps):
    """fp32 row `x` (zero where masked) times rsqrt(mean(x^2) + eps) times the weight."""
    mean_square = tl.sum(x * x, axis=0) / n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return x * tl.rsqrt(mean_square + eps) * w


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, out_ptr, x_row_stride, out_row_stride, n_cols, eps, BLOCK: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    y = _normalize(x, w_ptr, cols, mask, n_cols, eps)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_add_rms_norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    x_row_stride,
    res_row_stride,
    out_row_stride,
    res_out_row_stride,
    n_cols,
    eps,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    res = tl.load(res_ptr + row * res_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    summed = (x + res).to(res_out_ptr.dtype.element_ty)
    tl.store(res_out_ptr + row * res_out_row_stride + cols, summed, mask=mask)
    y = _normalize(summed.to(tl.float32), w_ptr, cols, mask, n_cols, eps)
    tl.store(out_ptr + row * out_row_stride + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


def _block(hidden: int) -> int:
    if not 0 < hidden <= MAX_HIDDEN:
        raise ValueError(f"rms_norm: hidden size {hidden} is outside 1..{MAX_HIDDEN}")
    return triton.next_power_of_2(hidden)


def _num_warps(block: int) -> int:
    """About 8 elements a thread (16-byte fp16 vectors), between 1 and 8 warps."""
    return max(1, min(8, block // 256))


def _rows(t: torch.Tensor) -> torch.Tensor:
    """`t` as `[rows, hidden]` with unit column stride (a view when possible)."""
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _out_rows(out: torch.Tensor | None, shape: torch.Size, like: torch.Tensor) -> torch.Tensor:
    """`[rows, hidden]`: a view of the caller's `out` (the kernel writes through it, so it must
    be one), else a new tensor of like's dtype."""
    if out is None:
        return torch.empty(shape, dtype=like.dtype, device=like.device).view(-1, shape[-1])
    if out.shape != shape or out.stride(-1) != 1:
        raise ValueError(
            f"out {tuple(out.shape)} must have shape {tuple(shape)} and unit column stride"
        )
    try:
        return out.view(-1, shape[-1])
    except RuntimeError as e:
        raise ValueError(f"out (strides {out.stride()}) is not a view of evenly spaced rows") from e


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, *, out: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm over the last dimension of `x` `[..., hidden]`, in x's dtype; into `out` if
    given (same shape, any row stride; `out=x` normalises in place)."""
    hidden = x.shape[-1]
    block = _block(hidden)
    x2 = _rows(x)
    out2 = _out_rows(out, x.shape, x)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](
            x2, weight.contiguous(), out2, x2.stride(0), out2.stride(0), hidden, eps,
            BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return out2.view(x.shape) if out is None else out


def fused_add_rms_norm(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`(rms_norm(x + residual), x + residual)`: the sum in residual's dtype, the normalised
    row in x's dtype (see the module docstring). New tensors unless `out` / `residual_out` are
    given; `out=x, residual_out=residual` is vLLM's in-place form (a program reads its whole row
    before it writes)."""
    if x.shape != residual.shape:
        raise ValueError(
            f"fused_add_rms_norm: x {tuple(x.shape)} vs residual {tuple(residual.shape)}"
        )
    hidden = x.shape[-1]
    block = _block(hidden)
    x2, res2 = _rows(x), _rows(residual)
    out2 = _out_rows(out, x.shape, x)
    res_out2 = _out_rows(residual_out, x.shape, residual)
    if x2.shape[0]:
        _fused_add_rms_norm_kernel[(x2.shape[0],)](
            x2, res2, weight.contiguous(), out2, res_out2,
            x2.stride(0), res2.stride(0), out2.stride(0), res_out2.stride(0), hidden, eps,
            BLOCK=block, num_warps=_num_warps(block),
        )  # fmt: skip
    return (
        out2.view(x.shape) if out is None else out,
        res_out2.view(x.shape) if residual_out is None else residual_out,
    )


def _signature(kernel: Any, ptr: str) -> dict[str, str]:
    """Pointers (`*_ptr`) to `ptr`, eps fp32, BLOCK constexpr, the rest (strides, sizes) i32."""
    types = {"eps": "fp32", "BLOCK": "constexpr"}
    return {a: ptr if a.endswith("_ptr") else types.get(a, "i32") for a in kernel.arg_names}


def _aot_specs() -> list[AotSpec]:
    return [
        AotSpec(
            name=f"{name}[hidden={hidden}, {dtype}]",
            kernel=kernel,
            signature=_signature(kernel, f"*{dtype}"),
            constexprs={"BLOCK": triton.next_power_of_2(hidden)},
            num_warps=_num_warps(triton.next_power_of_2(hidden)),
        )
        for hidden in (576, 4096)
        for dtype in ("fp16", "bf16", "fp32")
        for name, kernel in (
            ("rms_norm", _rms_norm_kernel),
            ("fused_add_rms_norm", _fused_add_rms_norm_kernel),
        )
    ]


AOT_SPECS: list[AotSpec] = _aot_specs()
