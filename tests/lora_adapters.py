"""Random PEFT LoRA adapters for tests, written by `peft` itself, and peft's greedy reference.

`make_peft_adapter(base, out, ...)` loads the base model with transformers, wraps it with
`peft.get_peft_model(LoraConfig(...))`, draws every lora_A and lora_B at random (peft starts B
at zero, which would make every adapter the base model) at a scale that moves greedy tokens, and
saves `adapter_config.json` + `adapter_model.safetensors` with `save_pretrained`.
`peft_greedy(base, adapter, prompt_ids, n)` is the reference: peft's model with the adapter
applied, fp32, greedy.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

DEFAULT_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_peft_adapter(
    base: Path,
    out: Path,
    *,
    seed: int = 0,
    r: int = 8,
    alpha: float = 16,
    target_modules: Sequence[str] = DEFAULT_TARGETS,
    use_rslora: bool = False,
    scale: float = 0.3,
) -> Path:
    import peft
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(
        r=r, lora_alpha=alpha, target_modules=list(target_modules), use_rslora=use_rslora, lora_dropout=0.0, bias="none"
    )
    wrapped = peft.get_peft_model(model, config)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in wrapped.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)
    wrapped.save_pretrained(out, safe_serialization=True)
    return out


def peft_greedy(base: Path, adapter: Path | None, prompt_ids: list[int], n: int) -> list[int]:
    """`n` greedy tokens after `prompt_ids` from the base model with `adapter` applied (None: the
    base alone), fp32, through peft and transformers."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, adapter)
    model.eval()
    ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids) :].tolist()
