"""`LoRAConfig`: the resolved adapter slots, as the engine config carries them.

It lives with the adapters (lora/ sits below engine/, which re-exports it from
`triollm.engine.config`); `engine/config/lora.py` resolves it from the arguments.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["LoRAConfig"]


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters (`enable_lora`): lora/ and docs/lora.md."""

    max_loras: int  # adapters in one batch: the slots of the stacked A/B buffers
    max_lora_rank: int  # the largest r an adapter may have (the slots' width)
    max_cpu_loras: int  # adapters kept read in memory (LRU), >= max_loras
    # The A/B buffers' dtype name (lora_dtype "auto": the model's; bfloat16 if quantized).
    dtype: str
