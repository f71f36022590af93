"""`LoRARequest`: which fine-tune a request runs under, as vLLM spells it.

`LoRARequest(lora_name, lora_int_id, lora_path)`: the adapter's name (what the server lists and
clients put in `model`), a positive integer id unique per adapter (the engine keys its caches,
slots and prefix-cache blocks by it), and the adapter's directory (PEFT's `adapter_config.json`
+ `adapter_model.safetensors`) or a Hub repo id in the local cache. A msgspec Struct: it crosses
to the engine core inside `EngineCoreRequest` unchanged.
"""

from __future__ import annotations

import msgspec

__all__ = ["LoRARequest"]


class LoRARequest(msgspec.Struct, frozen=True, omit_defaults=True, gc=False):
    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None  # the model the adapter was trained on (listed as its parent)

    def __post_init__(self) -> None:
        if isinstance(self.lora_int_id, bool) or not isinstance(self.lora_int_id, int) or self.lora_int_id < 1:
            raise ValueError(f"lora_int_id: must be an integer >= 1, got {self.lora_int_id!r}")
        if not isinstance(self.lora_name, str) or not self.lora_name:
            raise ValueError(f"lora_name: must be a non-empty string, got {self.lora_name!r}")
        if not isinstance(self.lora_path, str) or not self.lora_path:
            raise ValueError(f"lora_path: must be the adapter's directory, got {self.lora_path!r}")

    # vLLM's aliases.
    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path
