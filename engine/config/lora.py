"""LoRA adapters (`enable_lora`): the slots of the stacked A/B buffers (lora/, docs/lora.md)."""

from __future__ import annotations

from typing import Protocol

from triollm.engine.config.checks import one_of, positive
from triollm.engine.loading.model_config import ModelConfig
from triollm.lora.config import LoRAConfig

__all__ = ["LORA_DTYPES", "LORA_RANKS", "LoRAConfig", "resolve_lora"]

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's --max-lora-rank choices
LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


class LoRAArgs(Protocol):
    """The `EngineArgs` fields LoRA reads."""

    @property
    def enable_lora(self) -> bool: ...
    @property
    def max_loras(self) -> int: ...
    @property
    def max_lora_rank(self) -> int: ...
    @property
    def max_cpu_loras(self) -> int | None: ...
    @property
    def lora_dtype(self) -> str: ...


def resolve_lora(args: LoRAArgs, model: ModelConfig) -> LoRAConfig | None:
    """None with LoRA off; else the checked slots, the A/B dtype resolved against `model`."""
    if not args.enable_lora:
        return None
    if model.mla is not None and model.model_impl == "triollm":
        raise ValueError(
            f"enable_lora: LoRA adapters are not supported for {model.architecture} (multi-head latent attention "
            "has no q/k/v projections of LoRA's shapes); allowed: false"
        )
    if model.runner_type == "pooling":
        raise ValueError(
            "enable_lora: LoRA adapters apply to generating models; this one is a pooling model"
        )
    if model.llama4 is not None and model.model_impl == "triollm":
        raise ValueError(
            "enable_lora: LoRA adapters are not supported for Llama4ForCausalLM (its q and k rows are reordered at "
            "load, an adapter's are not); allowed: false"
        )
    positive("max_loras", args.max_loras)
    one_of("max_lora_rank", args.max_lora_rank, LORA_RANKS)
    one_of("lora_dtype", args.lora_dtype, LORA_DTYPES)
    cpu = args.max_loras if args.max_cpu_loras is None else args.max_cpu_loras
    if isinstance(cpu, bool) or not isinstance(cpu, int) or cpu < args.max_loras:
        raise ValueError(
            f"max_cpu_loras: must be an integer >= max_loras ({args.max_loras}), "
            f"got {args.max_cpu_loras!r}"
        )
    dtype = args.lora_dtype
    if dtype == "auto":
        # The model's, except over quantized weights: there the base is approximate already,
        # and bf16 slots halve the adapter bytes each decode step reads (docs/lora.md).
        quantized = model.quantization is not None
        dtype = "bfloat16" if quantized else str(model.dtype).removeprefix("torch.")
    return LoRAConfig(args.max_loras, args.max_lora_rank, cpu, dtype)
