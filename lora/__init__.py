"""LoRA adapters: the request type users import (`triollm.lora.request.LoRARequest`, vLLM's path)."""

from triollm.lora.request import LoRARequest

__all__ = ["LoRARequest"]
