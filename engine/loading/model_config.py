"""The model's side of the configuration, read once from the checkpoint directory.

`ModelConfig.from_pretrained` parses `config.json` of either transformers generation through
`hf_config.parse_hf_config` (every field that changes the numbers is honoured or refused there,
with a `ValueError` naming it), decides max_model_len against what the model can serve exactly
(dynamic RoPE), and reads `generation_config.json` for stop tokens and sampling
defaults. Special token ids outside the vocabulary are refused here (config_checks.py), not at
the first step that indexes the logits with them.

Sampling defaults follow vLLM's `generation_config` / `override_generation_config`: "auto" takes
them from the model's generation_config.json, "vllm" takes none (a request without `temperature`
gets 1.0, as OpenAI and vLLM), a folder path takes them from the generation_config.json there;
the override (a dict of those keys) is merged over the result last. Stop tokens (`eos_token_id`)
come from the same file as the defaults, except under "vllm", where the model's own file still
gives them (vLLM's behaviour too: stopping is part of the model, not a sampling default).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import torch

from triollm.engine.loading.config_checks import check_special_tokens
from triollm.engine.loading.hf_config import (
    DECODER_CLASSIFIERS,
    DTYPES,
    ENCODER_ARCHITECTURES,
    SUPPORTED_ARCHITECTURES,
    HfConfig,
    parse_hf_config,
)
from triollm.engine.loading.multimodal_config import MultimodalSpec, split_multimodal
from triollm.engine.loading.pooler_config import PoolerConfig, read_pooler_config, resolve_convert
from triollm.engine.loading.rope_config import RopeConfig
from triollm.kernels import cpu_native

__all__ = [
    "GENERATION_CONFIG_KEYS",
    "QUANTIZED_FILE",
    "RUNNER_TYPES",
    "SUPPORTED_ARCHITECTURES",
    "ModelConfig",
    "PoolerConfig",
    "RopeConfig",
    "check_generation_config",
]

# A .gguf import's quantized tensors as shipped (`quantization="gguf"`; engine/loading/gguf_import.py
# writes it): here, so that the config and the loader look for it without importing gguf.
QUANTIZED_FILE = "gguf_quantized.safetensors"

RUNNER_TYPES = ("generate", "pooling")
# The generation_config.json keys that become sampling defaults (vLLM's list).
GENERATION_CONFIG_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "max_new_tokens")


def check_generation_config(source: object, override: object) -> None:
    """`generation_config` ("auto", "vllm" or a folder) and `override_generation_config` (None or
    a dict of GENERATION_CONFIG_KEYS), refused with a ValueError naming the field."""
    if not isinstance(source, str) or not source:
        raise ValueError(f"generation_config: expected 'auto', 'vllm' or a folder path, got {source!r}")
    if source not in ("auto", "vllm") and not Path(source).expanduser().is_dir():
        raise ValueError(
            f"generation_config: {source!r} is not 'auto', 'vllm' or a folder holding a generation_config.json"
        )
    if override is None:
        return
    if not isinstance(override, dict):
        raise ValueError(f"override_generation_config: expected a JSON object, got {override!r}")
    for key, value in override.items():
        if key not in GENERATION_CONFIG_KEYS:
            raise ValueError(
                f"override_generation_config: unknown key {key!r}; allowed: {', '.join(GENERATION_CONFIG_KEYS)}"
            )
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"override_generation_config.{key}: expected a number, got {value!r}")


@dataclass(frozen=True)
class ModelConfig(HfConfig):
    """What `config.json` says (`HfConfig`: sizes, RoPE, biases, sliding window, ...) and what
    the engine decided from it and `generation_config.json`."""

    path: Path
    max_model_len: int
    dtype: torch.dtype
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    # Sampling defaults from generation_config.json (vLLM field names), e.g. {"temperature": 0.6}.
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    runner_type: str = "generate"  # "generate" or "pooling" (resolved from `runner`)
    pooler: PoolerConfig | None = None  # set for pooling models
    # Weight-only quantization of the linear layers (kernels/quant.py): None (dense), "gguf"
    # (the GGUF's blocks as shipped), "int8" or "int4" (float weights quantized at load), or a
    # quantized checkpoint's own method: "gptq", "awq", "fp8", "compressed-tensors".
    quantization: str | None = None
    # The KV cache's dtype where it differs from the activations' (`kv_cache_dtype`): a bf16
    # cache under fp32 activations on CPU, or a quantized one (float8_e4m3fn, float8_e5m2,
    # int8: kernels/kv_quant.py). None: the activations' dtype.
    kv_cache_dtype: torch.dtype | None = None
    # An fp8 cache's per-layer scales computed from the first prompt (`calculate_kv_scales`,
    # engine/execution/layers/attention.py) rather than 1.0.
    calculate_kv_scales: bool = False
    # A vision-language checkpoint's wrapper (multimodal_config.py); the fields above are its
    # decoder's. None: a text-only checkpoint.
    multimodal: MultimodalSpec | None = None

    @property
    def cache_dtype(self) -> torch.dtype:
        return self.kv_cache_dtype or self.dtype

    @classmethod
    def from_pretrained(
        cls,
        path: Path,
        dtype: str = "auto",
        max_model_len: int | None = None,
        device: str = "cpu",
        runner: str = "auto",
        *,
        convert: str = "auto",
        generation_config: str = "auto",
        override_generation_config: dict[str, Any] | None = None,
        model_impl: str = "auto",
        hf_overrides: dict[str, Any] | None = None,
    ) -> ModelConfig:
        """`hf_overrides`: merged into config.json before anything reads it (vLLM's), so the
        load-time checks see the overridden values; `convert`: vLLM's, a causal LM served as a
        pooling model (pooler_config.resolve_convert)."""
        cfg_file = path / "config.json"
        if not cfg_file.is_file():
            raise ValueError(
                f"model: {path} has no config.json (expected a Hugging Face-format directory or a .gguf file)"
            )
        raw = merge_overrides(json.loads(cfg_file.read_text()), hf_overrides or {})
        hf, multimodal = split_multimodal(raw)
        if multimodal is not None and model_impl == "transformers":
            raise ValueError(
                f"model_impl: 'transformers' runs causal LMs, not {multimodal.architecture}; its decoder runs "
                f"natively (allowed: auto, triollm)"
            )
        if multimodal is not None and multimodal.takes_images and not (path / "preprocessor_config.json").is_file():
            missing = f"{path} has no preprocessor_config.json (the image processor of {multimodal.architecture})"
            if multimodal.architecture != "Gemma3ForConditionalGeneration":
                raise ValueError(f"model: {missing}")
            multimodal = multimodal.without_images(missing)  # Gemma 3 is served for text too
        spec = parse_hf_config(hf, model_impl)
        runner_type, convert_type = _runner_type(spec, runner, convert)
        pooler = (
            read_pooler_config(
                path,
                hf,
                classifier=spec.architecture.endswith("ForSequenceClassification") or convert_type == "classify",
                reward=convert_type == "reward",
                default_pooling="CLS" if spec.encoder is not None else "LAST",
            )
            if runner_type == "pooling"
            else None
        )
        positions = spec.max_position_embeddings
        if spec.encoder is not None:
            positions = spec.encoder.max_tokens(positions)
        if pooler is not None and max_model_len is None and pooler.max_seq_length is not None:
            max_model_len = min(pooler.max_seq_length, positions)
        if spec.encoder is not None and max_model_len is None:
            max_model_len = positions
        if spec.encoder is not None and max_model_len is not None and max_model_len > positions:
            raise ValueError(
                f"max_model_len: {max_model_len} exceeds the model's max_position_embeddings "
                f"({positions}), the most positions it has embeddings for"
            )
        max_model_len = _max_model_len(spec, max_model_len)
        check_generation_config(generation_config, override_generation_config)
        own = _read_generation_config(path)
        gen = own if generation_config in ("auto", "vllm") else _read_generation_config(
            Path(generation_config).expanduser(), required=True
        )
        sources = {"config.json": hf, "generation_config.json": own}
        if gen is not own:
            sources[f"{generation_config}/generation_config.json"] = gen
        check_special_tokens(sources, spec.vocab_size)
        eos: list[int] = []
        for source in (gen.get("eos_token_id"), hf.get("eos_token_id")):
            for tok in source if isinstance(source, list) else [source]:
                if isinstance(tok, int) and tok not in eos:
                    eos.append(tok)
        defaults = {} if generation_config == "vllm" else _sampling_defaults(gen)
        defaults.update(_sampling_defaults(override_generation_config or {}))
        return cls(
            **{f.name: getattr(spec, f.name) for f in fields(HfConfig)},
            path=path,
            max_model_len=max_model_len,
            dtype=_resolve_dtype(dtype, spec.checkpoint_dtype, device),
            eos_token_ids=tuple(eos),
            bos_token_id=gen.get("bos_token_id", hf.get("bos_token_id")),
            generation_defaults=defaults,
            runner_type=runner_type,
            pooler=pooler,
            multimodal=multimodal,
        )


def merge_overrides(config: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    """`config` with `overrides` merged in (a new dict): an object merges into the object of
    the same key (a vision-language model's `text_config`, say); anything else replaces."""
    merged = dict(config)
    for key, value in overrides.items():
        old = merged.get(key)
        merged[key] = merge_overrides(old, value) if isinstance(old, dict) and isinstance(value, dict) else value
    return merged


def _read_generation_config(folder: Path, *, required: bool = False) -> dict[str, Any]:
    file = folder / "generation_config.json"
    if not file.is_file():
        if required:
            raise ValueError(f"generation_config: {folder} holds no generation_config.json")
        return {}
    data = json.loads(file.read_text())
    if not isinstance(data, dict):
        raise ValueError(f"generation_config: {file} does not hold a JSON object")
    return data


def _sampling_defaults(gen: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams keywords from generation_config keys (`max_new_tokens` is `max_tokens`;
    `do_sample: false` is greedy)."""
    defaults = {k: gen[k] for k in GENERATION_CONFIG_KEYS if gen.get(k) is not None}
    if "max_new_tokens" in defaults:
        defaults["max_tokens"] = defaults.pop("max_new_tokens")
    if gen.get("do_sample") is False:
        defaults["temperature"] = 0.0
    return defaults


def _runner_type(spec: HfConfig, runner: str, convert: str) -> tuple[str, str]:
    """vLLM's `--runner` and `--convert` (pooler_config.resolve_convert): "auto" follows the
    architecture (encoders and classifiers pool, causal LMs generate, a conversion pools); a
    natively run causal LM on the pooling runner is converted ("embed": a decoder embedder);
    a runner the model cannot serve is refused, naming the field. Returns (runner type,
    conversion)."""
    architecture = spec.architecture
    native = None
    if architecture in ENCODER_ARCHITECTURES or architecture in DECODER_CLASSIFIERS:
        native = "classify" if architecture.endswith("ForSequenceClassification") else "embed"
    if runner not in ("auto", *RUNNER_TYPES):
        raise ValueError(f"runner: {runner!r} is not one of auto, {', '.join(RUNNER_TYPES)}")
    if runner == "generate" and native is not None:
        raise ValueError(
            f"runner: 'generate' is not supported for {architecture}, a model that computes embeddings "
            "or scores; use runner 'pooling' (or 'auto')"
        )
    runner_type, convert_type = resolve_convert(architecture, native, runner, convert)
    if convert_type != "none" and not (spec.model_impl == "triollm" and spec.checkpoint_quant is None):
        raise ValueError(
            f"runner: 'pooling' is not supported for {architecture}: triollm pools encoders, classifiers and "
            f"the natively run decoders; use runner 'generate' (or 'auto')"
        )
    return runner_type, convert_type


def _max_model_len(spec: HfConfig, requested: int | None) -> int:
    """The requested length, or the model's own; refuses what the engine could not serve exactly.
    A sliding window is no limit: windowed layers mask what lies outside it (layers/attention.py)."""
    if requested is None:
        requested = spec.max_position_embeddings
    elif requested <= 0:
        raise ValueError(f"max_model_len: must be a positive integer, got {requested}")
    spec.rope.check_max_model_len(requested)
    if spec.model_impl == "transformers":
        # transformers computes positions itself: learned tables end at max_position_embeddings,
        # and LongRoPE picks its factors from the longest position in each forward call, which
        # in a flat batch is another request's (rope_config's module note).
        limit = spec.max_position_embeddings
        if spec.rope.rope_type == "longrope" and spec.rope.original_max_position_embeddings:
            limit = min(limit, spec.rope.original_max_position_embeddings)
        if requested > limit:
            raise ValueError(
                f"max_model_len: {requested} exceeds {limit}, the longest context the Transformers backend serves "
                f"exactly for {spec.architecture} (max_position_embeddings, or LongRoPE's original length); "
                f"allowed: 1 to {limit}"
            )
    return requested


def _resolve_dtype(dtype: str, checkpoint_dtype: torch.dtype | None, device: str) -> torch.dtype:
    if dtype != "auto":
        if dtype not in DTYPES:
            raise ValueError(f"dtype: {dtype!r} is not one of auto, {', '.join(DTYPES)}")
        return DTYPES[dtype]
    if device == "cpu":
        # A half-precision checkpoint runs in bf16 where the CPU computes bf16 natively (faster
        # than fp32 through oneDNN); elsewhere bf16/fp16 matmuls are emulated, slower than
        # fp32. An fp32 checkpoint stays fp32 (vLLM would cast it to bf16:
        # here the default is lossless; --dtype bfloat16 asks for the speed).
        half = checkpoint_dtype in (torch.bfloat16, torch.float16)
        return torch.bfloat16 if half and cpu_native.has_native_bf16() else torch.float32
    # CUDA, as vLLM: a half-precision checkpoint keeps its dtype; fp32 (and GGUF imports) run
    # in bf16, the dtype the Triton kernels and tensor cores are built for.
    return checkpoint_dtype if checkpoint_dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
