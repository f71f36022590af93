"""Quantization and the KV cache's dtype: which weight-only scheme a model runs (asked for, its
checkpoint's own, or by default a .gguf model's blocks where that is the fast path), whether it
can, and the KV cache's dtype where it differs from the activations'. The draft model of
speculative decoding goes through the same two steps (`quantize`, `with_kv_cache_dtype`)."""

from __future__ import annotations

import dataclasses
from typing import Protocol

import torch

from triollm.engine import envs
from triollm.engine.loading.model_config import QUANTIZED_FILE, ModelConfig
from triollm.engine.loading.quant_checkpoints import ALIASES, METHODS
from triollm.kernels.kv_quant import is_quantized

__all__ = ["KV_CACHE_DTYPES", "QUANTIZATIONS", "quantize", "with_kv_cache_dtype"]

# Weight-only quantization (kernels/quant.py): a .gguf model's blocks as shipped, float
# weights quantized at load, or a quantized checkpoint's own method (vLLM's spellings,
# engine/loading/quant_checkpoints.py; the *_marlin names are aliases here).
QUANTIZATIONS = (
    "gguf", "int8", "int4", "gptq", "gptq_marlin", "awq", "awq_marlin", "fp8",
    "compressed-tensors", "none",
)  # fmt: skip
# The KV cache's dtypes, vLLM's names (`fp8` is e4m3) and llama.cpp's `q8_0` for int8 (the
# formats: kernels/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float32", "fp8", "fp8_e4m3", "fp8_e5m2", "int8", "q8_0")
_KV_DTYPES = {
    "auto": None,
    "bfloat16": torch.bfloat16,
    "float32": torch.float32,
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
    "int8": torch.int8,
    "q8_0": torch.int8,
}
_KEPT_BLOCKS = "Q4_0, Q4_1, Q8_0, Q4_K, Q5_K, Q6_K"


class QuantArgs(Protocol):
    """The `EngineArgs` fields quantization reads (a draft model has its own: speculative.py)."""

    @property
    def model(self) -> str | None: ...
    @property
    def quantization(self) -> str | None: ...
    @property
    def dtype(self) -> str | torch.dtype: ...
    @property
    def tensor_parallel_size(self) -> int: ...


def quantize(model: ModelConfig, args: QuantArgs, device: str) -> ModelConfig:
    """`model` with the scheme it runs (`resolve_quantization`), checked; unchanged if dense."""
    scheme = resolve_quantization(model, args, device)
    if scheme is None:
        return model
    check_quantization(scheme, model, device, args.tensor_parallel_size)
    return dataclasses.replace(model, quantization=scheme)


def resolve_quantization(model: ModelConfig, args: QuantArgs, device: str) -> str | None:
    """The scheme to run: the one asked for ("none": dense), or by default a .gguf model's
    blocks as shipped where that is the fast path (docs/benchmarks.md, issue 13): on a CPU
    with a vector path for the quantized kernels (AVX2 or AVX-512 VNNI) and the
    native kernels, one rank, dtype auto, a generative model."""
    from triollm.kernels import cpu_native

    if args.quantization is not None:
        if args.quantization == "none":
            return None
        return ALIASES.get(args.quantization, args.quantization)
    if model.checkpoint_quant is not None:  # a quantized checkpoint runs by its own method (vLLM)
        return model.checkpoint_quant.method
    gguf = args.model is None or args.model.lower().endswith(".gguf")
    fast = (
        gguf
        and device == "cpu"
        and str(args.dtype) == "auto"
        and args.tensor_parallel_size == 1
        and model.runner_type == "generate"
        and (model.path / QUANTIZED_FILE).is_file()
        and cpu_native.has_fast_quant()
        and envs.cpu_kernels_enabled()
    )
    return "gguf" if fast else None


def check_quantization(
    quantization: str, model: ModelConfig, device: str, tensor_parallel_size: int
) -> None:
    """`quantization` can run here, else a ValueError naming it and what to use instead."""
    if device != "cpu":
        raise ValueError(
            f"quantization: {quantization!r} runs on the CPU only (device {device!r}); "
            "use quantization='none'"
        )
    if model.runner_type != "generate":
        raise ValueError(
            f"quantization: {quantization!r} applies to generative models; use quantization='none'"
        )
    if tensor_parallel_size > 1:
        raise ValueError(
            f"quantization: {quantization!r} does not shard yet; use tensor_parallel_size=1 or "
            "quantization='none'"
        )
    if quantization in METHODS:
        theirs = None if model.checkpoint_quant is None else model.checkpoint_quant.method
        if theirs is None:
            raise ValueError(
                f"quantization: {quantization!r} reads a checkpoint's quantization_config, and "
                f"{model.path} has none; use int8 or int4 to quantize float weights"
            )
        if quantization != theirs:
            raise ValueError(
                f"quantization: {quantization!r} does not match the checkpoint's "
                f"quantization_config.quant_method {theirs!r}; use {theirs} (or none: dequantized "
                "to dense)"
            )
    if quantization == "gguf" and not (model.path / QUANTIZED_FILE).is_file():
        raise ValueError(
            f"quantization: 'gguf' keeps a .gguf model's blocks as shipped, and {model.path} is no "
            f".gguf import (or one without tensors in a kept block type: {_KEPT_BLOCKS}); use int8 "
            "or int4 to quantize float weights"
        )


def with_kv_cache_dtype(
    model: ModelConfig, kv_cache_dtype: str, device: str, calculate_kv_scales: bool = False
) -> ModelConfig:
    """`model` with the KV cache's dtype where it is not the activations'
    (`ModelConfig.kv_cache_dtype`). By default a quantized model's fp32 activations get a bf16
    cache: at 64 requests the decode attention reads more bytes of KV cache than of weights,
    and bf16 halves them (docs/benchmarks.md, issue 13); batch-1 tokens barely read it.
    Elsewhere the cache has the activations' dtype, as in vLLM. A quantized cache (fp8, int8:
    kernels/kv_quant.py) halves bf16's bytes again; on the CPU its kernels take float32
    activations (the CPU's default), on a GPU the Triton kernels take any."""
    if kv_cache_dtype not in _KV_DTYPES:
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} is not supported; allowed: {', '.join(KV_CACHE_DTYPES)}"
        )
    want = _KV_DTYPES[kv_cache_dtype]
    if want is not None and is_quantized(want):
        if device == "cpu" and model.dtype != torch.float32:
            raise ValueError(
                f"kv_cache_dtype: {kv_cache_dtype!r} on the CPU runs under float32 activations; "
                f"the model's are {str(model.dtype).removeprefix('torch.')} (use dtype auto or float32, "
                "or kv_cache_dtype auto or bfloat16)"
            )
        fp8_scales = calculate_kv_scales and want != torch.int8  # int8 has per-token scales
        return dataclasses.replace(model, kv_cache_dtype=want, calculate_kv_scales=fp8_scales)
    if want is None:
        quantized_fp32 = model.quantization is not None and model.dtype == torch.float32
        want = torch.bfloat16 if quantized_fp32 else model.dtype
    if want == model.dtype:
        return dataclasses.replace(model, kv_cache_dtype=None)
    if not (want == torch.bfloat16 and model.dtype == torch.float32 and device == "cpu"):
        activations = str(model.dtype).removeprefix("torch.")
        raise ValueError(
            f"kv_cache_dtype: {kv_cache_dtype!r} under {activations} activations on {device!r} is "
            "not supported; allowed: auto, fp8, fp8_e4m3, fp8_e5m2, int8 (q8_0), or bfloat16 under "
            "float32 activations on the CPU"
        )
    return dataclasses.replace(model, kv_cache_dtype=want)
