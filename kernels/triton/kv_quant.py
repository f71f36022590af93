"""The quantized KV cache's codes in Triton (the formats: kernels/kv_quant.py): fp8 read and
written with integer operations on its bytes, int8 with its per-token scales.

fp8 goes through bytes (the caller passes `cache.view(torch.uint8)`), not Triton's fp8 types: the
interpreter (`TRITON_INTERPRET=1`, the CPU tests) converts to and from them in its own way (it
saturated e4m3 at 256 and flushed its subnormals), and GPUs before sm_89 have no fp8
conversion. Reading: a normal code's exponent and mantissa bits shifted into a float's fields
give 2^(e - 127) * 1.m, times 2^(127 - bias); a subnormal code is its mantissa times its unit.
Writing: the value, already saturated at the format's largest finite value, is rounded to the
format's mantissa bits half to even on the float's bits (adding half an ulp minus one, plus the
kept bit's parity), which also carries into the exponent; below the smallest normal it is a
multiple of the subnormal unit, rounded half to even by the 1.5 * 2^23 trick. Both match
torch's `.to(torch.float8_e4m3fn / float8_e5m2)`, which the CPU paths use
(tests/kernels/test_kv_cache_dtype.py checks every path's bytes against write_kv's).

`KV_QUANT`, the kernels' constexpr: 0 a plain cache, 1 fp8 e4m3fn, 2 fp8 e5m2, 3 int8.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triollm.kernels.kv_quant import cache_scale

__all__ = ["NONE", "FP8_E4M3", "FP8_E5M2", "INT8", "cache_args", "kv_quant_mode"]

NONE, FP8_E4M3, FP8_E5M2, INT8 = 0, 1, 2, 3
_MODES = {torch.float8_e4m3fn: FP8_E4M3, torch.float8_e5m2: FP8_E5M2, torch.int8: INT8}


def kv_quant_mode(cache: torch.Tensor) -> int:
    """The `KV_QUANT` constexpr of a cache tensor."""
    return _MODES.get(cache.dtype, NONE)


def cache_args(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A cache tensor as a kernel takes it (fp8 as its bytes) and its scale (fp8: `[1]` fp32;
    int8: the `[kv_heads, num_blocks, block_size]` fp16 per-token scales; a plain cache: itself,
    never read)."""
    mode = kv_quant_mode(cache)
    if mode == NONE:
        return cache, cache
    scale = cache_scale(cache)
    assert scale is not None, "a quantized cache carries its scale (allocate_kv_cache)"
    if mode == INT8:
        assert scale.is_contiguous()
    return (cache.view(torch.uint8) if mode != INT8 else cache), scale


@triton.jit
def fp8_to_float(x, KV_QUANT: tl.constexpr):
    """uint8 fp8 codes (e4m3fn when KV_QUANT is 1, e5m2 when 2) as fp32."""
    b = x.to(tl.uint32)
    mag = b & 0x7F
    if KV_QUANT == 1:
        normal = (mag << 20).to(tl.float32, bitcast=True) * 1.329227995784916e36  # 2^120
        f = tl.where((mag >> 3) != 0, normal, (mag & 7).to(tl.float32) * 0.001953125)  # 2^-9
    else:
        normal = (mag << 21).to(tl.float32, bitcast=True) * 5.192296858534828e33  # 2^112
        f = tl.where((mag >> 2) != 0, normal, (mag & 3).to(tl.float32) * 1.52587890625e-05)  # 2^-16
    return tl.where((b & 0x80) != 0, -f, f)


@triton.jit
def _round_to_fp8(a, MANT: tl.constexpr, REBIAS: tl.constexpr, SMALLEST: tl.constexpr, UNIT_INV: tl.constexpr):
    """The code of a saturated magnitude `a`: MANT, fp32's mantissa bits the format drops;
    REBIAS, the bias difference in the exponent field; SMALLEST, its smallest normal; UNIT_INV,
    one over its subnormal unit."""
    bits = a.to(tl.uint32, bitcast=True)
    rounded = (bits + ((1 << (MANT - 1)) - 1) + ((bits >> MANT) & 1)) >> MANT
    sub = ((a * UNIT_INV + 12582912.0) - 12582912.0).to(tl.uint32)  # 1.5 * 2^23: half to even
    return tl.where(a >= SMALLEST, rounded - REBIAS, sub)


@triton.jit
def float_to_fp8(y, KV_QUANT: tl.constexpr):
    """fp32 values as uint8 fp8 codes, saturated, rounded half to even (as torch's `.to`)."""
    if KV_QUANT == 1:  # e4m3fn: 3 mantissa bits, bias 7, largest 448, smallest normal 2^-6
        code = _round_to_fp8(tl.minimum(tl.abs(y), 448.0), 20, 120 << 3, 0.015625, 512.0)
    else:  # e5m2: 2 mantissa bits, bias 15, largest 57344, smallest normal 2^-14
        code = _round_to_fp8(tl.minimum(tl.abs(y), 57344.0), 21, 112 << 2, 6.103515625e-05, 65536.0)
    sign = (y.to(tl.uint32, bitcast=True) >> 31) << 7
    return (code | sign).to(tl.uint8)
