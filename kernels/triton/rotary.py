"""Rotary embedding of Q and K fused with the KV-cache write, as one Triton kernel.

References: `kernels/rotary.py` (`apply_rotary`, NeoX "rotate half") and `kernels/attention.py`
(`write_kv`, whose docstring gives the paged layout: V `[kv_heads, num_blocks, block_size,
head_dim]`, K with each block transposed, `[kv_heads, num_blocks, head_dim, block_size]`; slot =
block_id * block_size + offset).

Unfused, the torch path gathers cos/sin by position, rotates Q and K (several elementwise ops
each, every one a pass over memory) and then copies K and V into the cache; here each head vector
is read once, and a K head is written twice (the returned k and the cache). The grid is
`(tokens, q_heads + kv_heads)`: a program looks up its token's position and slot, then either
rotates one Q head (program ids below `num_q_heads`) or rotates one K head and stores it, with
the matching V head, into the cache. A head is `head_dim` values, handled as its two halves
(`x1`, `x2`: out1 = x1 cos1 - x2 sin1, out2 = x2 cos2 + x1 sin2), in fp32 from the fp32 tables,
rounded once to the output dtype. One program per head vector keeps every program the same size
whatever the GQA ratio, and gives a prefill of thousands of tokens enough programs to fill the GPU.

The K write goes down one column of a transposed block (stride `block_size`), uncoalesced, as
the layout implies; V rows are contiguous. Every stride is a kernel argument and the cache
offsets are computed in int64 (head * head_stride and block * block_stride can pass 2^31 on a
large cache). `block_size` is a constexpr: it is fixed for an engine, and the slot's division
becomes a shift. Positions must lie inside the tables and slots inside the cache: checking
that would cost a device sync, so the kernel trusts them as `write_kv` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triollm.kernels.triton import AotSpec
from triollm.kernels.triton.kv_quant import INT8, cache_args, float_to_fp8, kv_quant_mode

__all__ = ["AOT_SPECS", "rotary_write_kv"]


@triton.jit
def _rotate(src, d, mask, cos1, cos2, sin1, sin2, HALF: tl.constexpr):
    """The head vector at `src`, rotated, as its two fp32 halves."""
    x1 = tl.load(src + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + d, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos1 - x2 * sin1, x2 * cos2 + x1 * sin2


@triton.jit
def _store_kv(dst, stride, x1, x2, d, mask, scale_ptr, row, HALF: tl.constexpr, KV_QUANT: tl.constexpr):
    """One rotated K or V head (fp32 halves x1, x2) into the cache at `dst` (element stride
    `stride`), as the cache's dtype holds it (kernels/kv_quant.py): rounded to a plain cache's
    dtype; fp8 divided by the layer's scale, as bytes; int8 with its fp16 scale stored at
    `scale_ptr + row`."""
    if KV_QUANT == 0:
        ty = dst.dtype.element_ty
        tl.store(dst + d * stride, x1.to(ty), mask=mask)
        tl.store(dst + (HALF + d) * stride, x2.to(ty), mask=mask)
    elif KV_QUANT == 3:
        amax = tl.maximum(tl.max(tl.abs(x1), 0), tl.max(tl.abs(x2), 0))  # masked lanes are 0
        row_scale = (amax * 0.007874015748031496).to(tl.float16)  # absmax / 127
        sf = row_scale.to(tl.float32)
        inv = tl.where(sf > 0, 1.0 / tl.where(sf > 0, sf, 1.0), 0.0)  # an all-zero row: codes 0
        # Half to even by the 1.5 * 2^23 trick (|x * inv| <= 127), as torch.round.
        c1 = tl.minimum(tl.maximum((x1 * inv + 12582912.0) - 12582912.0, -127.0), 127.0)
        c2 = tl.minimum(tl.maximum((x2 * inv + 12582912.0) - 12582912.0, -127.0), 127.0)
        tl.store(dst + d * stride, c1.to(tl.int32).to(tl.int8), mask=mask)
        tl.store(dst + (HALF + d) * stride, c2.to(tl.int32).to(tl.int8), mask=mask)
        tl.store(scale_ptr + row, row_scale)
    else:
        inv = 1.0 / tl.load(scale_ptr)
        tl.store(dst + d * stride, float_to_fp8(x1 * inv, KV_QUANT), mask=mask)
        tl.store(dst + (HALF + d) * stride, float_to_fp8(x2 * inv, KV_QUANT), mask=mask)


@triton.jit
def _rotary_write_kv_kernel(
    q_ptr, k_ptr, v_ptr, cos_ptr, sin_ptr, pos_ptr, slot_ptr,
    q_out_ptr, k_out_ptr, k_cache_ptr, v_cache_ptr, k_scale_ptr, v_scale_ptr,
    q_stride_t, q_stride_h, k_stride_t, k_stride_h, v_stride_t, v_stride_h,
    cos_stride, sin_stride,
    q_out_stride_t, q_out_stride_h, k_out_stride_t, k_out_stride_h,
    kc_stride_h, kc_stride_b, kc_stride_d, kc_stride_o,
    vc_stride_h, vc_stride_b, vc_stride_o, vc_stride_d,
    s_stride_h, s_stride_b,
    num_q_heads,
    HALF: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_SIZE: tl.constexpr, KV_QUANT: tl.constexpr,
):  # fmt: skip
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    d = tl.arange(0, BLOCK_HALF)
    mask = d < HALF
    pos = tl.load(pos_ptr + token)
    cos1 = tl.load(cos_ptr + pos * cos_stride + d, mask=mask, other=0.0)
    cos2 = tl.load(cos_ptr + pos * cos_stride + HALF + d, mask=mask, other=0.0)
    sin1 = tl.load(sin_ptr + pos * sin_stride + d, mask=mask, other=0.0)
    sin2 = tl.load(sin_ptr + pos * sin_stride + HALF + d, mask=mask, other=0.0)
    # Names differ between the branches: Triton merges a name bound in both, and q and k may
    # differ in dtype.
    if head < num_q_heads:
        q_src = q_ptr + token * q_stride_t + head * q_stride_h
        q1, q2 = _rotate(q_src, d, mask, cos1, cos2, sin1, sin2, HALF)
        q_dst = q_out_ptr + token * q_out_stride_t + head * q_out_stride_h
        tl.store(q_dst + d, q1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(q_dst + HALF + d, q2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = (head - num_q_heads).to(tl.int64)
        k_src = k_ptr + token * k_stride_t + kv_head * k_stride_h
        k1, k2 = _rotate(k_src, d, mask, cos1, cos2, sin1, sin2, HALF)
        k_dst = k_out_ptr + token * k_out_stride_t + kv_head * k_out_stride_h
        tl.store(k_dst + d, k1.to(k_out_ptr.dtype.element_ty), mask=mask)
        tl.store(k_dst + HALF + d, k2.to(k_out_ptr.dtype.element_ty), mask=mask)

        slot = tl.load(slot_ptr + token)
        block, offset = slot // BLOCK_SIZE, slot % BLOCK_SIZE
        kc = k_cache_ptr + kv_head * kc_stride_h + block * kc_stride_b + offset * kc_stride_o
        row = kv_head * s_stride_h + block * s_stride_b + offset  # int8's scale of this row
        _store_kv(kc, kc_stride_d, k1, k2, d, mask, k_scale_ptr, row, HALF, KV_QUANT)

        v_src = v_ptr + token * v_stride_t + kv_head * v_stride_h
        vc = v_cache_ptr + kv_head * vc_stride_h + block * vc_stride_b + offset * vc_stride_o
        v1 = tl.load(v_src + d, mask=mask, other=0.0).to(tl.float32)
        v2 = tl.load(v_src + HALF + d, mask=mask, other=0.0).to(tl.float32)
        _store_kv(vc, vc_stride_d, v1, v2, d, mask, v_scale_ptr, row, HALF, KV_QUANT)


def _check(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    t, _, hd = q.shape
    if hd % 2:
        raise ValueError(f"rotary_write_kv: head_dim {hd} is odd")
    if k.shape != v.shape or k.shape[0] != t or k.shape[2] != hd:
        raise ValueError(
            f"rotary_write_kv: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if cos.shape != sin.shape or cos.dim() != 2 or cos.shape[1] != hd:
        raise ValueError(
            f"rotary_write_kv: cos {tuple(cos.shape)}, sin {tuple(sin.shape)} for head_dim {hd}"
        )
    kvh, _, bs, _ = v_cache.shape
    if v_cache.shape != (kvh, v_cache.shape[1], bs, hd) or kvh != k.shape[1]:
        raise ValueError(f"rotary_write_kv: v_cache {tuple(v_cache.shape)} for k {tuple(k.shape)}")
    if k_cache.shape != (kvh, v_cache.shape[1], hd, bs):
        raise ValueError(
            f"rotary_write_kv: k_cache {tuple(k_cache.shape)} vs v_cache {tuple(v_cache.shape)}"
        )
    if positions.shape != (t,) or slot_mapping.shape != (t,):
        raise ValueError(
            f"rotary_write_kv: positions {tuple(positions.shape)}, slot_mapping "
            f"{tuple(slot_mapping.shape)} for {t} tokens"
        )


def _num_warps(half: int) -> int:
    return 1 if half <= 64 else 2


def _unit_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _out(out: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty_like(like, memory_format=torch.contiguous_format)
    if out.shape != like.shape or out.stride(-1) != 1:
        raise ValueError(
            f"rotary_write_kv: {name} {tuple(out.shape)} must have shape {tuple(like.shape)} "
            "and unit stride in head_dim"
        )
    return out


def rotary_write_kv(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    q_out: torch.Tensor | None = None,
    k_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[T, H, hd]` and k `[T, kv_heads, hd]` by the rows `positions` `[T]` of the
    `[max_len, hd]` fp32 tables `cos`/`sin`; store the rotated k and v `[T, kv_heads, hd]` in the
    paged cache at `slot_mapping` `[T]` (as `write_kv` does); return `(q_rotated, k_rotated)`.
    Those are new tensors unless `q_out` / `k_out` are given (any strides but a unit one in
    head_dim; `q_out=q, k_out=k` rotates in place: a program reads its head before writing)."""
    _check(q, k, v, cos, sin, positions, k_cache, v_cache, slot_mapping)
    t, num_q_heads, hd = q.shape
    num_kv_heads, block_size = k.shape[1], v_cache.shape[2]
    q, k, v, cos, sin = (_unit_last(x) for x in (q, k, v, cos, sin))
    q_out, k_out = _out(q_out, q, "q_out"), _out(k_out, k, "k_out")
    if t:
        half = hd // 2
        mode = kv_quant_mode(k_cache)
        (k_arg, k_scale), (v_arg, v_scale) = cache_args(k_cache), cache_args(v_cache)
        scale_strides = (k_scale.stride(0), k_scale.stride(1)) if mode == INT8 else (0, 0)
        _rotary_write_kv_kernel[(t, num_q_heads + num_kv_heads)](
            q, k, v, cos, sin, positions, slot_mapping, q_out, k_out, k_arg, v_arg, k_scale, v_scale,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            cos.stride(0), sin.stride(0),
            q_out.stride(0), q_out.stride(1), k_out.stride(0), k_out.stride(1),
            *k_arg.stride(), *v_arg.stride(), *scale_strides,
            num_q_heads,
            HALF=half, BLOCK_HALF=triton.next_power_of_2(half), BLOCK_SIZE=block_size, KV_QUANT=mode,
            num_warps=_num_warps(half),
        )  # fmt: skip
    return q_out, k_out


# A quantized cache's pointer types (codes, scales) and KV_QUANT (kernels/triton/kv_quant.py).
_CACHES = {None: None, "fp8": ("*u8", "*fp32", 1), "int8": ("*i8", "*fp16", 3)}


def _signature(dtype: str, cache: str | None = None) -> dict[str, str]:
    """Tensors of `dtype` but the fp32 tables, the i64 positions and slots and a quantized
    cache's codes and scales; the constexprs (upper case); every other argument i32."""
    special = {"cos_ptr": "*fp32", "sin_ptr": "*fp32", "pos_ptr": "*i64", "slot_ptr": "*i64"}
    quant = _CACHES[cache]
    if quant is not None:
        special |= dict.fromkeys(("k_cache_ptr", "v_cache_ptr"), quant[0])
        special |= dict.fromkeys(("k_scale_ptr", "v_scale_ptr"), quant[1])
    return {
        a: special.get(
            a, f"*{dtype}" if a.endswith("_ptr") else "constexpr" if a.isupper() else "i32"
        )
        for a in _rotary_write_kv_kernel.arg_names
    }


def _aot_specs() -> list[AotSpec]:
    return [
        AotSpec(
            name=f"rotary_write_kv[hd={hd}, block_size=16, {dtype}" + (f", {cache} cache]" if cache else "]"),
            kernel=_rotary_write_kv_kernel,
            signature=_signature(dtype, cache),
            constexprs={
                "HALF": hd // 2, "BLOCK_HALF": hd // 2, "BLOCK_SIZE": 16,
                "KV_QUANT": 0 if cache is None else _CACHES[cache][2],  # type: ignore[index]
            },  # fmt: skip
            num_warps=_num_warps(hd // 2),
        )
        for hd in (64, 128)
        for dtype in ("fp16", "bf16")
        for cache in ((None, "fp8", "int8") if (hd, dtype) == (128, "bf16") else (None,))
    ]


AOT_SPECS: list[AotSpec] = _aot_specs()
