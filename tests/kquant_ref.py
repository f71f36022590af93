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
