"""A reference quantizer for GGUF's K-quants, written from the block layouts (ggml-common.h's
block_q4_K, block_q5_K, block_q6_K), for tests: float32 `[N, K]` -> the bytes a GGUF holds.

Plain nearest rounding, not llama.cpp's search for the best sub-block scales: any reader takes
the bytes, and the codes come back too, so a decoder can be checked against them.

* Q4_K / Q5_K (d, dmin: fp16; 12 bytes of 6-bit scales and minimums; [Q5_K: 32 bytes of fifth
  bits]; 128 bytes of nibbles): per sub-block of 32, scale = (max - min) / (2^bits - 1) with
  min <= 0, scale = d * sc and -min = dmin * mn, sc and mn in 0..63.
* Q6_K (128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales, d: fp16): per
  sub-block of 16 a signed scale that maps its largest-magnitude value to -32, scale = d * sc.
"""

from __future__ import annotations

import numpy as np
from gguf import GGMLQuantizationType

KQUANTS = (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q6_K)
LOW_BIT = tuple(GGMLQuantizationType[name] for name in ("Q2_K", "Q3_K", "IQ4_NL", "IQ4_XS"))
# ggml-common.h's kvalues_iq4nl
IQ4_LEVELS = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], np.float64)


def quantize_kquant(x: np.ndarray, kind: GGMLQuantizationType) -> tuple[np.ndarray, np.ndarray]:
    """(raw uint8 `[N, K/256 * bytes]`, the stored codes `[N, K]`: 0..15, 0..31 or 0..63)."""
    n, k = x.shape
    if k % 256:
        raise ValueError(f"K-quants need rows of a multiple of 256 weights, got {k}")
    if kind == GGMLQuantizationType.Q6_K:
        return _q6_k(x.astype(np.float64))
    if kind in (GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q5_K):
        return _q4_q5_k(x.astype(np.float64), 4 if kind == GGMLQuantizationType.Q4_K else 5)
    raise ValueError(f"not a K-quant: {kind!r}")


def quantize_low_bit(x: np.ndarray, kind: GGMLQuantizationType) -> np.ndarray:
    """float32 `[N, K]` as Q2_K, Q3_K, IQ4_NL or IQ4_XS bytes (uint8 `[N, K/per * bytes]`): nearest
    rounding from ggml-common.h's block layouts, for tests (any reader takes the bytes)."""
    x = x.astype(np.float64)
    per = 32 if kind == GGMLQuantizationType.IQ4_NL else 256
    if x.shape[1] % per:
        raise ValueError(f"{kind.name} needs rows of a multiple of {per} weights, got {x.shape[1]}")
    quantize = {"Q2_K": _q2_k, "Q3_K": _q3_k, "IQ4_NL": _iq4_nl, "IQ4_XS": _iq4_xs}[kind.name]
    return quantize(x)


def _two_bit_bytes(codes: np.ndarray) -> np.ndarray:
    """codes 0..3 `[n, S, 256]` as 64 bytes per super-block: per half, byte l holds group j's code l at
    bits 2j..2j+1."""
    g = codes.reshape(*codes.shape[:2], 2, 4, 32).astype(np.uint8)
    return np.bitwise_or.reduce(g << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=3).reshape(*codes.shape[:2], 64)


def _q2_k(x: np.ndarray) -> np.ndarray:
    n, k = x.shape
    sub = x.reshape(n, k // 256, 16, 16)
    low = np.minimum(sub.min(-1), 0.0)
    scale, minimum = (sub.max(-1) - low) / 3, -low
    d = (scale.max(-1) / 15).astype(np.float16).astype(np.float64)
    dmin = (minimum.max(-1) / 15).astype(np.float16).astype(np.float64)
    sc = _ratio(scale, d[..., None]).clip(0, 15).astype(np.uint8)
    mn = _ratio(minimum, dmin[..., None]).clip(0, 15).astype(np.uint8)
    codes = _ratio(sub + (dmin[..., None] * mn)[..., None], (d[..., None] * sc)[..., None]).clip(0, 3)
    parts = [sc | (mn << 4), _two_bit_bytes(codes.reshape(n, k // 256, 256)), _fp16_bytes(d), _fp16_bytes(dmin)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _q3_k(x: np.ndarray) -> np.ndarray:
    n, k = x.shape
    sub = x.reshape(n, k // 256, 16, 16)
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = big / -4.0  # the largest magnitude at code -4
    d = (np.abs(scale).max(-1) / 31).astype(np.float16).astype(np.float64)
    s = _ratio(scale, d[..., None]).clip(-32, 31)
    u = (_ratio(sub, (d[..., None] * s)[..., None]).clip(-4, 3) + 4).astype(np.uint8).reshape(n, k // 256, 256)
    high = (u >> 2).reshape(n, k // 256, 8, 32)  # bit 4 * half + j of byte l
    hmask = np.bitwise_or.reduce(high << np.arange(8, dtype=np.uint8)[:, None], axis=2)
    ls = (s + 32).astype(np.uint8)  # [n, S, 16]: scale 4t + j
    t = ls.reshape(n, k // 256, 4, 4)
    packed = np.concatenate(
        [
            (t[..., 0, :] & 15) | ((t[..., 2, :] & 15) << 4),
            (t[..., 1, :] & 15) | ((t[..., 3, :] & 15) << 4),
            np.bitwise_or.reduce((t >> 4) << (2 * np.arange(4, dtype=np.uint8))[:, None], axis=2),
        ],
        axis=-1,
    )
    parts = [hmask, _two_bit_bytes(u & 3), packed, _fp16_bytes(d)]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _iq4_indices(values: np.ndarray, scale: np.ndarray) -> np.ndarray:
    """The nearest level's index for each of `values` `[..., 32]` at `scale` `[...]`, packed 16 bytes per
    32 (byte t: index t low, t + 16 high)."""
    ratio = np.divide(values, scale[..., None], out=np.zeros(values.shape), where=scale[..., None] != 0)
    idx = np.abs(ratio[..., None] - IQ4_LEVELS).argmin(-1).astype(np.uint8)
    return idx[..., :16] | (idx[..., 16:] << 4)


def _iq4_nl(x: np.ndarray) -> np.ndarray:
    n, k = x.shape
    blocks = x.reshape(n, k // 32, 32)
    d = (np.abs(blocks).max(-1) / 127).astype(np.float16).astype(np.float64)
    return np.concatenate([_fp16_bytes(d), _iq4_indices(blocks, d)], axis=-1).reshape(n, -1)


def _iq4_xs(x: np.ndarray) -> np.ndarray:
    n, k = x.shape
    sub = x.reshape(n, k // 256, 8, 32)
    scale = np.abs(sub).max(-1) / 127
    d = (scale.max(-1) / 31).astype(np.float16).astype(np.float64)
    ls = (_ratio(scale, d[..., None]).clip(-32, 31) + 32).astype(np.uint16)
    high = np.bitwise_or.reduce((ls >> 4) << (2 * np.arange(8, dtype=np.uint16)), axis=-1)
    low = (ls & 15).astype(np.uint8).reshape(n, k // 256, 4, 2)
    qs = _iq4_indices(sub, d[..., None] * (ls.astype(np.float64) - 32)).reshape(n, k // 256, 128)
    parts = [_fp16_bytes(d), high[..., None].view(np.uint8), low[..., 0] | (low[..., 1] << 4), qs]
    return np.concatenate(parts, axis=-1).reshape(n, -1)


def _fp16_bytes(v: np.ndarray) -> np.ndarray:
    return v.astype(np.float16)[..., None].view(np.uint8)


def _q4_q5_k(x: np.ndarray, bits: int) -> tuple[np.ndarray, np.ndarray]:
    n, k = x.shape
    nmax = (1 << bits) - 1
    sub = x.reshape(n, k // 256, 8, 32)
    low = np.minimum(sub.min(-1), 0.0)
    scale, minimum = (sub.max(-1) - low) / nmax, -low
    d = (scale.max(-1) / 63).astype(np.float16).astype(np.float64)
    dmin = (minimum.max(-1) / 63).astype(np.float16).astype(np.float64)
    sc = _ratio(scale, d[..., None]).clip(0, 63).astype(np.uint8)
    mn = _ratio(minimum, dmin[..., None]).clip(0, 63).astype(np.uint8)
    step, offset = d[..., None] * sc, dmin[..., None] * mn
    codes = _ratio(sub + offset[..., None], step[..., None]).clip(0, nmax).astype(np.uint8)
    packed = np.concatenate(
        [
            sc[..., :4] | ((sc[..., 4:] >> 4) << 6),
            mn[..., :4] | ((mn[..., 4:] >> 4) << 6),
            (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4),
        ],
        axis=-1,
    )
    pairs = codes.reshape(n, k // 256, 4, 2, 32)  # run i: sub-blocks 2i (low nibble) and 2i+1
    qs = ((pairs[..., 0, :] & 15) | ((pairs[..., 1, :] & 15) << 4)).reshape(n, k // 256, 128)
    parts = [_fp16_bytes(d).reshape(n, -1, 2), _fp16_bytes(dmin).reshape(n, -1, 2), packed]
    if bits == 5:
        fifth = (codes >> 4) << np.arange(8, dtype=np.uint8)[:, None]  # bit j of byte l: sub-block j
        parts.append(np.bitwise_or.reduce(fifth, axis=2))
    parts.append(qs)
    return np.concatenate(parts, axis=-1).reshape(n, -1), codes.reshape(n, k)


def _q6_k(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    n, k = x.shape
    sub = x.reshape(n, k // 256, 16, 16)
    big = np.take_along_axis(sub, np.abs(sub).argmax(-1)[..., None], -1)[..., 0]
    scale = big / -32.0
    d = (np.abs(scale).max(-1) / 127).astype(np.float16).astype(np.float64)
    sc = _ratio(scale, d[..., None]).clip(-128, 127).astype(np.int8)
    step = d[..., None] * sc
    codes = (_ratio(sub, step[..., None]).clip(-32, 31) + 32).astype(np.uint8)
    g = codes.reshape(n, k // 256, 2, 4, 32)  # [half, group of 32, l]
    ql = np.concatenate(
        [(g[..., 0, :] & 15) | ((g[..., 2, :] & 15) << 4), (g[..., 1, :] & 15) | ((g[..., 3, :] & 15) << 4)], axis=-1
    )
    qh = (g[..., 0, :] >> 4) | ((g[..., 1, :] >> 4) << 2) | ((g[..., 2, :] >> 4) << 4) | ((g[..., 3, :] >> 4) << 6)
    parts = [ql.reshape(n, -1, 128), qh.reshape(n, -1, 64), sc.view(np.uint8), _fp16_bytes(d).reshape(n, -1, 2)]
    return np.concatenate(parts, axis=-1).reshape(n, -1), codes.reshape(n, k)


def _ratio(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """round(a / b), 0 where b is 0."""
    b = np.broadcast_to(b, a.shape)
    return np.rint(np.divide(a, b, out=np.zeros(a.shape), where=b != 0))
