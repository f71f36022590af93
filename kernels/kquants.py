"""GGUF K-quant super-blocks (Q4_K, Q5_K, Q6_K) decoded into kernels/quant.py's block form.

K-quants group 256 weights in a super-block with one float16 scale `d` (and `dmin`), and give
each sub-block its own small integer scale: 8 sub-blocks of 32 with 6-bit scale and minimum
(Q4_K, Q5_K: weight = d * sc * q - dmin * mn), or 16 sub-blocks of 16 with an int8 scale (Q6_K:
weight = d * sc * (q - 32)). The quantized kernel reads one float16 scale and offset per block
of 32 (`QuantWeight`: weight = d * q + m), so each K-quant is mapped once, at load:

* Q4_K: the 4-bit codes as they are; d = fp16(d_super * sc), m = fp16(-dmin * mn). The products
  are exact in fp32 (an 11-bit mantissa times a 6-bit integer) and rounded once to fp16, so per
  weight |ours - exact| <= 2^-11 * (q * |d_super * sc| + |dmin * mn|) + 2^-25 * (q + 1) (the last
  term: fp16's subnormal spacing, for scales below 2^-14).
* Q5_K: the 5-bit codes 0..31 as 8-bit codes (bits=8, exact), d and m as for Q4_K, same bound.
* Q6_K: two sub-blocks of 16 with different scales share one block of 32, which one scale
  cannot express; the exactly dequantized values v are requantized to 8 bits per block of 32,
  symmetric as Q8_0 (codes round(v / D) + 128, m = -128 * D). D is amax / 127 rounded *up* to
  fp16, so no code clips: |ours - exact| <= D / 2 <= amax / 254 * (1 + 2^-10) + 2^-25. As amax <=
  32 d |sc| for the pair's larger scale, that is about a quarter of Q6_K's own rounding error
  there (half its step, d |sc| / 2).

The cost is memory for the 8-bit forms: 9 bits a weight (codes, fp16 d and m per 32) where the
file has 5.5 (Q5_K) or 6.56 (Q6_K); Q4_K keeps its 4.5 -> 5. Rejected: Q6_K's 16-weight
sub-blocks in the kernel (it and its packed layout are built around blocks of 32, as every other
GGUF type is); a kernel per K-quant (a second dot-product family, where one conversion at load
costs one fp16 rounding of the scales).

Everything is numpy over whole rows (a bounded number of rows at a time, to bound the scratch
memory of a large embedding), no loop per block. `decode_kquant` returns the QuantWeight parts;
kernels/quant.py's `QuantWeight.from_ggml` builds the object (this module sits below it).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["GGML_Q4_K", "GGML_Q5_K", "GGML_Q6_K", "KQUANT_TYPES", "QK_K", "decode_kquant"]

QK_K = 256  # weights per super-block
# gguf.GGMLQuantizationType values, their names and bytes per super-block (ggml-common.h).
GGML_Q4_K, GGML_Q5_K, GGML_Q6_K = 12, 13, 14
_NAMES = {GGML_Q4_K: "Q4_K", GGML_Q5_K: "Q5_K", GGML_Q6_K: "Q6_K"}
_SUPER_BYTES = {GGML_Q4_K: 144, GGML_Q5_K: 176, GGML_Q6_K: 210}
KQUANT_TYPES = frozenset(_SUPER_BYTES)
_CHUNK_SUPER_BLOCKS = 1 << 15  # super-blocks decoded at a time: scratch of a few fp32 copies of 8M weights


def decode_kquant(
    raw: np.ndarray, ggml_type: int, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """GGUF K-quant bytes (the reader's uint8 array) of a `[N, K]` tensor as QuantWeight's
    (q, d, m, bits): q uint8 `[N, K/2]` (bits 4, Q4_K) or `[N, K]` (bits 8, Q5_K and Q6_K)."""
    if ggml_type not in _SUPER_BYTES:
        names = ", ".join(_NAMES.values())
        raise ValueError(f"quantization: GGML type {ggml_type} is not a K-quant ({names} are)")
    n, k = shape
    name, size = _NAMES[ggml_type], _SUPER_BYTES[ggml_type]
    if k % QK_K:
        raise ValueError(f"quantization: a {name} tensor's row width {k} is not a multiple of {QK_K}")
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if data.size != n * (k // QK_K) * size:
        raise ValueError(f"quantization: {data.size} bytes of {name} do not hold a [{n}, {k}] tensor")
    bits = 4 if ggml_type == GGML_Q4_K else 8
    blocks = data.reshape(n, k // QK_K, size)
    q = np.empty((n, k * bits // 8), np.uint8)
    d = np.empty((n, k // 32), np.float16)
    m = np.empty((n, k // 32), np.float16)
    step = max(1, _CHUNK_SUPER_BLOCKS // (k // QK_K))
    decode = {GGML_Q4_K: _q4_k, GGML_Q5_K: _q5_k, GGML_Q6_K: _q6_k}[ggml_type]
    for start in range(0, n, step):
        rows = slice(start, start + step)
        q[rows], d[rows], m[rows] = decode(blocks[rows])
    return torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(m), bits


# ------------------------------------------------------------------------------- per type
# Each takes super-blocks `[R, S, bytes]` and returns q `[R, ...]`, d and m float16 `[R, S*8]`.


def _q4_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes: d, dmin (fp16), 12 bytes of packed 6-bit scales and minimums, 128 bytes of codes:
    byte l of the i-th 32-byte run holds sub-block 2i's code l (low nibble) and 2i+1's (high)."""
    r, s = b.shape[:2]
    d, m = _scales_and_offsets(b, "Q4_K")
    runs = b[..., 16:144].reshape(r, s, 4, 2, 16)  # [run, first/second 16 codes, byte]
    first, second = runs[..., 0, :], runs[..., 1, :]
    # QuantWeight's nibble order: byte t of a block holds codes t (low) and t + 16 (high).
    even = (first & 0x0F) | (second << 4)
    odd = (first >> 4) | (second & 0xF0)
    return np.stack([even, odd], axis=3).reshape(r, s * QK_K // 2), d, m


def _q5_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Q4_K's layout with 32 bytes of fifth bits after the scales: bit j of byte l is the high
    bit of sub-block j's code l."""
    r, s = b.shape[:2]
    d, m = _scales_and_offsets(b, "Q5_K")
    runs = b[..., 48:176].reshape(r, s, 4, 1, 32)
    low = np.concatenate([runs & 0x0F, runs >> 4], axis=3).reshape(r, s, 8, 32)
    high = (b[..., None, 16:48] >> np.arange(8, dtype=np.uint8)[:, None]) & 1  # [R, S, 8, 32]
    return (low | (high << 4)).reshape(r, s * QK_K), d, m


def _q6_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes: 128 of low nibbles, 64 of high bit pairs, 16 int8 scales, d (fp16). Per half of
    128 weights, group g (32 weights, l = 0..31) takes its low nibble from ql[l + 32 (g & 1)]
    (g < 2: low, else high nibble) and its two high bits from qh[l] at bit 2g."""
    r, s = b.shape[:2]
    ql = b[..., 0:128].reshape(r, s, 2, 2, 32)  # [half, run, l]
    qh = b[..., 128:192].reshape(r, s, 2, 1, 32)
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=3)  # [R, S, half, group, l]
    high = (qh >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
    q = (low | (high << 4)).astype(np.float32).reshape(r, s, 16, 16) - 32.0
    sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
    scale = _f16(b[..., 208:210])[..., None] * sc  # exact in fp32: 11 bits times 7
    values = (q * scale[..., None]).reshape(r, s * 8, 32)  # exact: 18 bits times 5
    amax = np.abs(values).max(axis=-1)
    dd = _half_up(amax / np.float32(127.0), "Q6_K")
    dd_f = dd.astype(np.float32)[..., None]
    ratio = np.divide(values, dd_f, out=np.zeros_like(values), where=dd_f > 0)
    codes = np.clip(np.rint(ratio), -127, 127) + 128
    m = _half(dd.astype(np.float32) * np.float32(-128.0), "Q6_K")
    return codes.astype(np.uint8).reshape(r, s * QK_K), dd, m


# ------------------------------------------------------------------------------- helpers


def _scales_and_offsets(b: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K / Q5_K: per block of 32, d = d_super * sc and m = -dmin * mn, rounded to fp16."""
    r, s = b.shape[:2]
    sc, mn = _unpack_scales(b[..., 4:16])
    d = _half(_f16(b[..., 0:2])[..., None] * sc, name)
    m = _half(-(_f16(b[..., 2:4])[..., None] * mn), name)
    return d.reshape(r, s * 8), m.reshape(r, s * 8)


def _unpack_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """ggml's `get_scale_min_k4` over 12 bytes: sub-blocks 0..3 have their 6-bit scale and
    minimum in the low 6 bits of bytes 0..3 and 4..7; sub-blocks 4..7 have their low 4 bits in
    the nibbles of bytes 8..11 and their top 2 bits in the top bits of bytes 0..3 / 4..7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 6) << 4)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 6) << 4)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _f16(pair: np.ndarray) -> np.ndarray:
    """Two bytes per entry (little-endian fp16) as float32 `[...]`."""
    return np.ascontiguousarray(pair).view(np.float16)[..., 0].astype(np.float32)


def _half(x: np.ndarray, name: str) -> np.ndarray:
    """Round to fp16 (nearest even); a value beyond its range (65504) is refused, not made inf."""
    with np.errstate(over="ignore", invalid="ignore"):
        out = x.astype(np.float16)
    if not np.isfinite(out).all():
        raise ValueError(f"quantization: {name} block scales outside float16's range (|d| > 65504, or not finite)")
    return out


def _half_up(x: np.ndarray, name: str) -> np.ndarray:
    """The least fp16 value >= x (x >= 0)."""
    out = _half(x, name)
    low = out.astype(np.float32) < x
    out[low] = np.nextafter(out[low], np.float16(np.inf))
    return _half(out.astype(np.float32), name)
