"""GGUF super-blocks (Q2_K..Q6_K, IQ4_XS) and IQ4_NL blocks decoded into kernels/quant.py's block forms.

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

* Q3_K: 16 sub-blocks of 16, a signed 6-bit scale s each, 3-bit codes c in -4..3: weight =
  d * s * c. The integer s * c lies in -124..128, so a block of 32 takes codes s * c + 128 with
  d and m = -128 d as in the file: exact, but for a block holding s * c = 128 (s = -32, c = -4),
  which is requantized as Q6_K's are.
* Q2_K: 16 sub-blocks of 16, each with a 4-bit scale and a 4-bit minimum (weight = d * sc * q -
  dmin * mn, q in 0..3): two minimums in one block of 32 cannot share one offset, so the exact
  values are requantized to 8 bits as Q6_K's, an error far below Q2_K's own step (d * sc).
* IQ4_NL (blocks of 32) and IQ4_XS (8 blocks of 32 per super-block, a 6-bit scale ls each:
  d * (ls - 32)): 4-bit indices into llama.cpp's 16 non-linear int8 levels (`IQ4_LEVELS`);
  weight = d * level. Kept as they are, in the IQ4 code format (`IQ4`: the file's nibbles, which
  the kernel looks up as the 8-bit codes level + 128, with m = -128 d): exact for IQ4_NL; IQ4_XS's
  d * (ls - 32) is rounded once to fp16, as Q4_K's scales are.

The cost is memory for the 8-bit forms: 9 bits a weight (codes, fp16 d and m per 32) where the
file has 2.6 (Q2_K), 3.4 (Q3_K), 5.5 (Q5_K) or 6.56 (Q6_K); Q4_K keeps its 4.5 -> 5, IQ4 its
4.25-4.5 -> 5. Still under a third of the dense fp32 import, and read by the same kernels.
Rejected: Q6_K's (Q2_K's, Q3_K's) 16-weight sub-blocks in the kernel (it and its packed layout are
built around blocks of 32, as every other GGUF type is); a kernel per K-quant (a second
dot-product family, where one conversion at load costs one fp16 rounding of the scales); IQ4 as
8-bit codes (what this module did first: exact, but twice the bytes to read per token, and decode
is bandwidth-bound: docs/benchmarks.md).

Everything is numpy over whole rows (a bounded number of rows at a time, to bound the scratch
memory of a large embedding), no loop per block. `decode_kquant` returns the QuantWeight parts;
kernels/quant.py's `QuantWeight.from_ggml` builds the object (this module sits below it).
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = [
    "GGML_IQ4_NL",
    "GGML_IQ4_XS",
    "GGML_Q2_K",
    "GGML_Q3_K",
    "GGML_Q4_K",
    "GGML_Q5_K",
    "GGML_Q6_K",
    "IQ4",
    "IQ4_CODES",
    "IQ4_LEVELS",
    "KQUANT_TYPES",
    "QK_K",
    "decode_kquant",
]

QK_K = 256  # weights per super-block
# gguf.GGMLQuantizationType values, their names and bytes per super-block (ggml-common.h); IQ4_NL's
# blocks are of 32 weights, so its "super-block" here is one block.
GGML_Q2_K, GGML_Q3_K, GGML_Q4_K, GGML_Q5_K, GGML_Q6_K, GGML_IQ4_NL, GGML_IQ4_XS = 10, 11, 12, 13, 14, 20, 23
_NAMES = {
    GGML_Q2_K: "Q2_K", GGML_Q3_K: "Q3_K", GGML_Q4_K: "Q4_K", GGML_Q5_K: "Q5_K", GGML_Q6_K: "Q6_K",
    GGML_IQ4_NL: "IQ4_NL", GGML_IQ4_XS: "IQ4_XS",
}  # fmt: skip
_SUPER_BYTES = {
    GGML_Q2_K: 84, GGML_Q3_K: 110, GGML_Q4_K: 144, GGML_Q5_K: 176, GGML_Q6_K: 210, GGML_IQ4_NL: 18, GGML_IQ4_XS: 136,
}  # fmt: skip
_SUPER_WEIGHTS = {GGML_IQ4_NL: 32}  # the others: QK_K
KQUANT_TYPES = frozenset(_SUPER_BYTES)
# IQ4_NL's and IQ4_XS's 16 levels (ggml-common.h's kvalues_iq4nl), as int16 for the code arithmetic.
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.int16)
# The IQ4 code format (QuantWeight.bits, kernels/csrc/quant_linear.cpp kIq4): 4-bit indices, read
# as the 8-bit codes IQ4_CODES[index] = level + 128 (with m = -128 d). Negative: not a bit count.
IQ4 = -4
IQ4_CODES = (IQ4_LEVELS + 128).astype(np.uint8)
_CHUNK_SUPER_BLOCKS = 1 << 15  # super-blocks decoded at a time: scratch of a few fp32 copies of 8M weights


def decode_kquant(
    raw: np.ndarray, ggml_type: int, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """GGUF K-quant bytes (the reader's uint8 array) of a `[N, K]` tensor as QuantWeight's
    (q, d, m, bits): q uint8 `[N, K/2]` (bits 4, Q4_K; IQ4, IQ4_NL and IQ4_XS) or `[N, K]` (bits
    8, the others)."""
    if ggml_type not in _SUPER_BYTES:
        names = ", ".join(_NAMES.values())
        raise ValueError(f"quantization: GGML type {ggml_type} is not a K-quant ({names} are)")
    n, k = shape
    name, size = _NAMES[ggml_type], _SUPER_BYTES[ggml_type]
    per = _SUPER_WEIGHTS.get(ggml_type, QK_K)
    if k % per:
        raise ValueError(f"quantization: a {name} tensor's row width {k} is not a multiple of {per}")
    data = np.ascontiguousarray(raw, dtype=np.uint8).reshape(-1)
    if data.size != n * (k // per) * size:
        raise ValueError(f"quantization: {data.size} bytes of {name} do not hold a [{n}, {k}] tensor")
    bits = {GGML_Q4_K: 4, GGML_IQ4_NL: IQ4, GGML_IQ4_XS: IQ4}.get(ggml_type, 8)
    blocks = data.reshape(n, k // per, size)
    q = np.empty((n, k if bits == 8 else k // 2), np.uint8)
    d = np.empty((n, k // 32), np.float16)
    m = np.empty((n, k // 32), np.float16)
    step = max(1, _CHUNK_SUPER_BLOCKS * (QK_K // per) // (k // per))
    decode = {
        GGML_Q2_K: _q2_k, GGML_Q3_K: _q3_k, GGML_Q4_K: _q4_k, GGML_Q5_K: _q5_k, GGML_Q6_K: _q6_k,
        GGML_IQ4_NL: _iq4_nl, GGML_IQ4_XS: _iq4_xs,
    }[ggml_type]  # fmt: skip
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
    codes, dd, m = _requantize(values, "Q6_K")
    return codes.reshape(r, s * QK_K), dd, m


def _two_bit_runs(qs: np.ndarray) -> np.ndarray:
    """Q2_K's and Q3_K's 64 bytes of 2-bit codes `[R, S, 64]` as `[R, S, 256]` in weight order: per
    half of 128 weights, group j (32 weights, l = 0..31) is bits 2j..2j+1 of byte l of the half's
    32 bytes."""
    r, s = qs.shape[:2]
    halves = qs.reshape(r, s, 2, 1, 32)
    return ((halves >> (2 * np.arange(4, dtype=np.uint8))[:, None]) & 3).reshape(r, s, QK_K)


def _q2_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes: 16 of scales (low nibble) and minimums (high nibble) per sub-block of 16, 64 of
    2-bit codes, d, dmin (fp16). The exact values are requantized to 8 bits (the module docstring)."""
    r, s = b.shape[:2]
    q = _two_bit_runs(b[..., 16:80]).astype(np.float32).reshape(r, s, 16, 16)
    sc = (b[..., 0:16] & 0x0F).astype(np.float32)
    mn = (b[..., 0:16] >> 4).astype(np.float32)
    scale = _f16(b[..., 80:82])[..., None] * sc  # exact: 11 bits times 4
    offset = _f16(b[..., 82:84])[..., None] * mn
    values = (q * scale[..., None] - offset[..., None]).reshape(r, s * 8, 32)
    codes, dd, m = _requantize(values, "Q2_K")
    return codes.reshape(r, s * QK_K), dd, m


def _q3_k(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes: 32 of high bits (bit 4 * half + j of byte l: group j of that half), 64 of 2-bit
    codes, 12 of packed 6-bit scales, d (fp16). A code is its two low bits, minus 4 when its high
    bit is clear."""
    r, s = b.shape[:2]
    low = _two_bit_runs(b[..., 32:96]).reshape(r, s, 2, 4, 32).astype(np.int16)
    high = (b[..., None, None, 0:32] >> np.arange(8, dtype=np.uint8).reshape(2, 4, 1)) & 1
    codes = low - 4 * (1 - high.astype(np.int16))  # -4..3
    scales = _q3_k_scales(b[..., 96:108]).astype(np.int16) - 32  # [R, S, 16]
    ints = (codes.reshape(r, s, 16, 16) * scales[..., None]).reshape(r, s * 8, 32)  # -124..128
    d = np.repeat(_half(_f16(b[..., 108:110]), "Q3_K"), 8, axis=-1)  # [R, S*8]
    fits = ints.max(axis=-1) <= 127
    out = (ints + 128).clip(0, 255).astype(np.uint8)
    m = _half(d.astype(np.float32) * np.float32(-128.0), "Q3_K")
    if not fits.all():  # a block holding s * c = 128: requantized
        values = ints[~fits].astype(np.float32) * d[~fits].astype(np.float32)[:, None]
        out[~fits], d[~fits], m[~fits] = _requantize(values, "Q3_K")
    return out.reshape(r, s * QK_K), d, m


def _q3_k_scales(packed: np.ndarray) -> np.ndarray:
    """Q3_K's 12 bytes as 16 unsigned 6-bit scales. Scale 4t + j (j < 4) has its low 4 bits in
    the low nibble of byte j (t = 0) or 4 + j (t = 1), the high nibble of byte j (t = 2) or
    4 + j (t = 3), and its top 2 bits in bits 2t..2t+1 of byte 8 + j."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    top = [((c >> (2 * t)) & 3) << 4 for t in range(4)]
    return np.concatenate([(a & 0x0F) | top[0], (b & 0x0F) | top[1], (a >> 4) | top[2], (b >> 4) | top[3]], axis=-1)


def _iq4_nl(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes: d (fp16), 16 of 4-bit indices (byte t: index t low, t + 16 high, QuantWeight's
    nibble order). Exact."""
    r, s = b.shape[:2]
    d = _half(_f16(b[..., 0:2]), "IQ4_NL")
    m = _half(d.astype(np.float32) * np.float32(-128.0), "IQ4_NL")
    return b[..., 2:18].reshape(r, s * 16), d, m


def _iq4_xs(b: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Bytes: d (fp16), scales_h (u16: bits 2i..2i+1 are block i's top scale bits), 4 of scales_l
    (block i's low 4 bits in nibble i % 2 of byte i // 2), 128 of indices (16 per block, as IQ4_NL's)."""
    r, s = b.shape[:2]
    high = np.ascontiguousarray(b[..., 2:4]).view("<u2")  # [R, S, 1]
    low = np.stack([b[..., 4:8] & 0x0F, b[..., 4:8] >> 4], axis=-1).reshape(r, s, 8)
    ls = low.astype(np.int32) | (((high >> (2 * np.arange(8, dtype=np.uint16))) & 3).astype(np.int32) << 4)
    d = _half(_f16(b[..., 0:2])[..., None] * (ls - 32).astype(np.float32), "IQ4_XS").reshape(r, s * 8)
    m = _half(d.astype(np.float32) * np.float32(-128.0), "IQ4_XS")
    return b[..., 8:136].reshape(r, s * QK_K // 2), d, m


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


def _requantize(values: np.ndarray, name: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact values `[..., 32]` per block as symmetric 8-bit codes round(v / D) + 128, D = amax / 127
    rounded up to fp16 (no code clips), m = -128 D: (codes uint8, D, m) as fp16."""
    amax = np.abs(values).max(axis=-1)
    dd = _half_up(amax / np.float32(127.0), name)
    dd_f = dd.astype(np.float32)[..., None]
    ratio = np.divide(values, dd_f, out=np.zeros_like(values), where=dd_f > 0)
    codes = np.clip(np.rint(ratio), -127, 127) + 128
    return codes.astype(np.uint8), dd, _half(dd.astype(np.float32) * np.float32(-128.0), name)


def _half_up(x: np.ndarray, name: str) -> np.ndarray:
    """The least fp16 value >= x (x >= 0)."""
    out = _half(x, name)
    low = out.astype(np.float32) < x
    out[low] = np.nextafter(out[low], np.float16(np.inf))
    return _half(out.astype(np.float32), name)
