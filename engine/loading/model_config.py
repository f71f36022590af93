"""The model's side of the configuration, read once from the checkpoint directory.

`ModelConfig.from_pretrained` parses `config.json` / `generation_config.json` as transformers
reads them, so every field that changes the numbers is honoured or refused at load.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = ["SUPPORTED_ARCHITECTURES", "ModelConfig"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)


@dataclass(frozen=True)
class ModelConfig:
    path: Path
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    max_model_len: int
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Sampling defaults from generation_config.json (vLLM field names), e.g. {"temperature": 0.6}.
    generation_defaults: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_pretrained(
        cls, path: Path, dtype: str = "auto", max_model_len: int | None = None, device: str = "cpu"
    ) -> ModelConfig:
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"model: {path} has no config.json (expected a Hugging Face-format directory or a .gguf file)")
        hf = json.loads(cfg_file.read_text())
        archs = hf.get("architectures") or ["LlamaForCausalLM"]
        arch = archs[0]
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"model: architecture {arch!r} is not supported; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        num_heads = hf["num_attention_heads"]
        hidden = hf["hidden_size"]
        max_pos = hf.get("max_position_embeddings", 2048)
        if max_model_len is None:
            max_model_len = max_pos
        elif max_model_len <= 0:
            raise ValueError(f"max_model_len: must be a positive integer, got {max_model_len}")
        gen: dict[str, Any] = {}
        gen_file = path / "generation_config.json"
        if gen_file.is_file():
            gen = json.loads(gen_file.read_text())
        eos: list[int] = []
        for source in (gen.get("eos_token_id"), hf.get("eos_token_id")):
            for tok in source if isinstance(source, list) else [source]:
                if isinstance(tok, int) and tok not in eos:
                    eos.append(tok)
        defaults = {
            k: gen[k]
            for k in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")
            if gen.get(k) is not None
        }
        if "max_new_tokens" in defaults:
            defaults["max_tokens"] = defaults.pop("max_new_tokens")
        if gen.get("do_sample") is False:
            defaults["temperature"] = 0.0
        return cls(
            path=path,
            architecture=arch,
            hidden_size=hidden,
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=hf.get("num_key_value_heads") or num_heads,
            head_dim=hf.get("head_dim") or hidden // num_heads,
            vocab_size=hf["vocab_size"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=hf.get("rope_theta", 10000.0),
            rope_scaling=hf.get("rope_scaling"),
            max_position_embeddings=max_pos,
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", arch == "Qwen2ForCausalLM"),
            max_model_len=max_model_len,
            dtype=_resolve_dtype(dtype, hf.get("torch_dtype") or hf.get("dtype"), device),
            eos_token_ids=tuple(eos),
            bos_token_id=gen.get("bos_token_id", hf.get("bos_token_id")),
            generation_defaults=defaults,
        )


def _resolve_dtype(dtype: str, checkpoint_dtype: str | None, device: str) -> torch.dtype:
    if dtype != "auto":
        if dtype not in _DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(_DTYPES)}")
        return _DTYPES[dtype]
    if device == "cpu":
        # bf16/fp16 matmuls are several times slower than fp32 on AVX2-only CPUs.
        return torch.float32
    return _DTYPES.get(checkpoint_dtype or "", torch.bfloat16)
