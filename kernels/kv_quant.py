"""The quantized KV cache formats (`kv_cache_dtype` fp8, fp8_e4m3, fp8_e5m2, int8): how a value
is written into the cache and read back, in torch. Every attention path (the torch reference in
kernels/attention.py, the native CPU kernels, the Triton kernels) reads and writes the same
codes and scales as these functions; they are the reference the others are tested against.

fp8 (vLLM's `--kv-cache-dtype fp8`, `fp8_e4m3`, `fp8_e5m2`; `fp8` is e4m3): the cache holds
`torch.float8_e4m3fn` or `torch.float8_e5m2` codes and each layer has one fp32 scale for K and
one for V (vLLM's `k_scale`, `v_scale`; 1.0 unless a checkpoint brings its own, as vLLM does
without calibration). A value x is stored as `fp8(clamp(x * (1 / scale)))` (saturated at the
format's largest finite value: e4m3fn has no infinity, and an overflow must not become NaN) and
read back as `code * scale`. Since the scale is per layer, the readers fold it out of the inner
loops: K's into the query's scale, V's into the output.

int8 (llama.cpp's `q8_0`, accepted as an alias): int8 codes in [-127, 127] with one fp16 scale
per (token, kv head), `absmax / 127` over that token's `head_dim` values, kept in a separate
`[kv_heads, num_blocks, block_size]` tensor per layer beside K's and V's codes. Per token and
head rather than q8_0's per 32 values: a score is then `scale_t * (q . code_t)` and a P.V term
`(p_t * scale_t) * code_t`, so the decode kernels widen int8 to fp32 and apply the scale once per
token, never per element, and the scales cost 2 bytes per `head_dim` values (1/32 of the
codes at head_dim 64, the same as q8_0's fp16 per 32). Codes are `round(x * (1 / scale))`
(round half to even) with the fp16-rounded scale, so a reader's `code * scale` is exactly what
every writer stored; an all-zero row has scale 0 and codes 0.

A cache tensor carries its scale as the attribute `kv_scale` (`cache_scale`), set by
`kernels.attention.allocate_kv_cache`: the layers hand their cache tensors to the kernels, and
the scale travels with them (a TP worker's and a draft model's caches included).
"""

from __future__ import annotations

import torch

__all__ = [
    "FP8_MAX",
    "INT8_MAX",
    "QUANTIZED_KV_DTYPES",
    "cache_scale",
    "dequantize_kv",
    "is_quantized",
    "layer_scale_bytes",
    "quantize_kv",
    "scale_bytes_per_token",
    "set_cache_scale",
]

FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
INT8_MAX = 127
QUANTIZED_KV_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)
INT8_SCALE_DTYPE = torch.float16


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype holds codes with scales (fp8, int8), not plain values."""
    return dtype in QUANTIZED_KV_DTYPES


def cache_scale(cache: torch.Tensor) -> torch.Tensor | None:
    """The scale of a quantized cache tensor: fp8 a `[1]` fp32 tensor (per layer), int8 the
    `[kv_heads, num_blocks, block_size]` fp16 per-token scales; None for a plain cache."""
    return getattr(cache, "kv_scale", None)


def set_cache_scale(cache: torch.Tensor, scale: torch.Tensor) -> None:
    """Attach `scale` to the cache tensor (`cache_scale` reads it back)."""
    cache.kv_scale = scale  # type: ignore[attr-defined]


def new_scale(
    dtype: torch.dtype, num_kv_heads: int, num_blocks: int, block_size: int, device: torch.device | str
) -> torch.Tensor | None:
    """A fresh scale for one layer's K or V cache of `dtype` (None for a plain cache)."""
    if dtype == torch.int8:
        return torch.zeros((num_kv_heads, num_blocks, block_size), dtype=INT8_SCALE_DTYPE, device=device)
    if dtype in FP8_MAX:
        return torch.ones(1, dtype=torch.float32, device=device)
    return None


def scale_bytes_per_token(dtype: torch.dtype) -> int:
    """Bytes of scale per (token, kv head) of K or of V: int8's fp16 scale; fp8's per-layer
    scale is no per-block cost."""
    return torch.empty((), dtype=INT8_SCALE_DTYPE).element_size() if dtype == torch.int8 else 0


def layer_scale_bytes(dtype: torch.dtype) -> int:
    """Bytes of fp8's per-layer scale of K or of V (a cost per layer, not per block)."""
    return 4 if dtype in FP8_MAX else 0


def quantize_kv(
    x: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`x` `[..., head_dim]` as the cache stores it: `(codes, None)` for fp8 (with the layer's
    `scale`) and plain dtypes, `(codes, per-row fp16 scales [...])` for int8."""
    if dtype == torch.int8:
        xf = x.float()
        amax = xf.abs().amax(dim=-1)
        row_scale = (amax * (1.0 / INT8_MAX)).to(INT8_SCALE_DTYPE)
        sf = row_scale.float()
        inv = torch.where(sf > 0, torch.reciprocal(sf), torch.zeros_like(sf))
        codes = torch.round(xf * inv[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
        return codes, row_scale
    if dtype in FP8_MAX:
        assert scale is not None, "an fp8 cache has a scale"
        big = FP8_MAX[dtype]
        inv = torch.reciprocal(scale.float())
        return (x.float() * inv).clamp_(-big, big).to(dtype), None
    return x.to(dtype), None


def dequantize_kv(
    codes: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype, row_scale: torch.Tensor | None = None
) -> torch.Tensor:
    """Cached values back in `dtype`: fp8 codes times the layer's `scale`; int8 codes times
    `row_scale` (one per row of the last dimension, `codes.shape[:-1]`)."""
    if codes.dtype == torch.int8:
        assert row_scale is not None, "int8 codes have per-token scales"
        return (codes.float() * row_scale.float()[..., None]).to(dtype)
    if codes.dtype in FP8_MAX:
        assert scale is not None, "an fp8 cache has a scale"
        return (codes.float() * scale.float()).to(dtype)
    return codes.to(dtype)
