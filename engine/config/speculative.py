"""Speculative decoding (`speculative_config`, engine/speculative/, docs/speculative.md): vLLM's
keys checked, and for the draft_model method the draft's own `ModelConfig` resolved (another
checkpoint with the target's vocabulary, or the target's checkpoint under a cheaper scheme)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from triollm.engine.config.checks import one_of, positive
from triollm.engine.config.quantization import QUANTIZATIONS, quantize, with_kv_cache_dtype
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.model_files import resolve_model

__all__ = [
    "MAX_SPECULATIVE_TOKENS",
    "SPECULATIVE_KEYS",
    "SPECULATIVE_METHODS",
    "SPEC_DISABLE_BY_BATCH_SIZE",
    "SpeculativeConfig",
    "resolve_speculative",
]

SPECULATIVE_METHODS = ("ngram", "draft_model")
SPECULATIVE_KEYS = (
    "method", "model", "num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max",
    "quantization", "disable_by_batch_size", "draft_tensor_parallel_size", "revision",
)  # fmt: skip
MAX_SPECULATIVE_TOKENS = 32
# Where speculation stops paying on a CPU: with 8 requests decoding, free text lost 17% of its
# throughput to rejected drafts while copying output gained 12% (docs/speculative.md).
SPEC_DISABLE_BY_BATCH_SIZE = 8
_NGRAM_MODELS = ("ngram", "[ngram]")  # vLLM's older spelling: model "[ngram]"


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (`speculative_config`, engine/speculative/, docs/speculative.md)."""

    # "ngram" (prompt lookup) or "draft_model" (a smaller model, or the same one cheaper)
    method: str
    num_speculative_tokens: int  # drafts proposed per request per step
    prompt_lookup_min: int = 0  # ngram: the shortest and longest tail looked up
    prompt_lookup_max: int = 0
    draft: ModelConfig | None = None  # draft_model: the draft's resolved config
    # Speculation is off for a step once this many requests decode (None: never off).
    disable_by_batch_size: int | None = None


class SpeculativeArgs(Protocol):
    """The `EngineArgs` fields speculative decoding reads (the draft shares the target's
    dtype, KV cache dtype and Hub options)."""

    @property
    def speculative_config(self) -> dict[str, Any] | None: ...
    @property
    def model(self) -> str | None: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def download_dir(self) -> str | None: ...
    @property
    def hf_token(self) -> str | None: ...
    @property
    def dtype(self) -> str | torch.dtype: ...
    @property
    def kv_cache_dtype(self) -> str: ...
    @property
    def calculate_kv_scales(self) -> bool: ...
    @property
    def tensor_parallel_size(self) -> int: ...


@dataclass(frozen=True)
class _DraftArgs:
    """What quantization reads, for the draft (`quantization.QuantArgs`)."""

    model: str | None
    quantization: str | None
    dtype: str | torch.dtype
    tensor_parallel_size: int = 1


def resolve_speculative(
    args: SpeculativeArgs, target: ModelConfig, device: str, cache_dir: Path | None
) -> SpeculativeConfig | None:
    """`speculative_config` checked and resolved (the draft model's config loaded); every
    error is a ValueError naming the key and what it allows."""
    spec = args.speculative_config
    if spec is None:
        return None
    if not isinstance(spec, dict):
        raise ValueError(
            f"speculative_config: expected a JSON object (a dict), got {type(spec).__name__}"
        )
    unknown = sorted(set(spec) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(
            f"speculative_config: unknown key {unknown[0]!r}; "
            f"allowed: {', '.join(SPECULATIVE_KEYS)}"
        )
    if target.runner_type != "generate":
        raise ValueError(
            "speculative_config: speculative decoding applies to generative models; "
            "this one is a pooling model"
        )
    method = _method(spec)
    k = spec.get("num_speculative_tokens")
    if isinstance(k, bool) or not isinstance(k, int) or k <= 0:
        raise ValueError(
            f"speculative_config.num_speculative_tokens: must be a positive integer, got {k!r}"
        )
    if k > MAX_SPECULATIVE_TOKENS:
        raise ValueError(
            f"speculative_config.num_speculative_tokens: {k} is more than "
            f"{MAX_SPECULATIVE_TOKENS}"
        )
    # vLLM's key; unset, speculation stops at SPEC_DISABLE_BY_BATCH_SIZE decoding requests
    # (measured: docs/speculative.md); an explicit None speculates at every batch size.
    disable = spec.get("disable_by_batch_size", SPEC_DISABLE_BY_BATCH_SIZE)
    if disable is not None:
        positive("speculative_config.disable_by_batch_size", disable)
    tp = spec.get("draft_tensor_parallel_size", 1)
    if tp != 1:
        raise ValueError(
            f"speculative_config.draft_tensor_parallel_size: {tp!r} is not supported; allowed: 1"
        )
    if method == "ngram":
        lo, hi = _prompt_lookup(spec)
        return SpeculativeConfig("ngram", k, lo, hi, disable_by_batch_size=disable)
    for key in ("prompt_lookup_min", "prompt_lookup_max"):
        if spec.get(key) is not None:
            raise ValueError(
                f"speculative_config.{key}: applies to the ngram method only; remove {key}"
            )
    draft = _draft_model(args, spec, target, device, cache_dir)
    return SpeculativeConfig("draft_model", k, draft=draft, disable_by_batch_size=disable)


def _method(spec: dict[str, Any]) -> str:
    method = spec.get("method")
    if method in ("[ngram]", None) and spec.get("model") in _NGRAM_MODELS:
        method = "ngram"  # vLLM's older spelling: model "[ngram]"
    elif method is None:
        method = "draft_model" if "model" in spec or "quantization" in spec else None
    if method not in SPECULATIVE_METHODS:
        raise ValueError(
            f"speculative_config.method: {method!r} is not supported; "
            f"allowed: {', '.join(SPECULATIVE_METHODS)} "
            "(EAGLE, Medusa and MTP heads are not implemented)"
        )
    return str(method)


def _prompt_lookup(spec: dict[str, Any]) -> tuple[int, int]:
    """The ngram method's shortest and longest tail (vLLM's defaults: 5 and 5; one given: both)."""
    for key in ("model", "quantization"):
        if spec.get(key) is not None and spec.get(key) not in _NGRAM_MODELS:
            raise ValueError(
                f"speculative_config.{key}: the ngram method uses no draft model; remove {key}"
            )
    lo, hi = spec.get("prompt_lookup_min"), spec.get("prompt_lookup_max")
    if lo is None and hi is None:
        lo = hi = 5  # vLLM's defaults
    lo = hi if lo is None else lo
    hi = lo if hi is None else hi
    positive("speculative_config.prompt_lookup_min", lo)
    positive("speculative_config.prompt_lookup_max", hi)
    assert isinstance(lo, int) and isinstance(hi, int)  # positive() raised otherwise
    if lo > hi:
        raise ValueError(
            f"speculative_config.prompt_lookup_min: {lo} is more than prompt_lookup_max ({hi})"
        )
    return lo, hi


def _draft_model(
    args: SpeculativeArgs,
    spec: dict[str, Any],
    target: ModelConfig,
    device: str,
    cache_dir: Path | None,
) -> ModelConfig:
    """The draft's config: `model` (another checkpoint with the target's vocabulary) or, with
    no model, the target's own checkpoint (a self-draft) under `quantization`."""
    if args.tensor_parallel_size > 1:
        raise ValueError(
            "speculative_config: a draft model runs with tensor_parallel_size=1 only; "
            "use the ngram method"
        )
    quant = spec.get("quantization")
    if quant is not None:
        one_of("speculative_config.quantization", quant, QUANTIZATIONS)
    own = spec.get("model") in (None, args.model)
    if own and quant is None:
        raise ValueError(
            "speculative_config.quantization: a self-draft (no draft model given) is this "
            "checkpoint under a cheaper quantization; allowed: gguf (a .gguf model's blocks), "
            "int4, int8"
        )
    name = args.model if own else spec["model"]
    revision = spec.get("revision", args.revision if own else None)
    path = resolve_model(
        name, cache_dir, revision=revision, download_dir=args.download_dir, token=args.hf_token
    )
    draft = ModelConfig.from_pretrained(
        path, str(args.dtype), target.max_model_len, device, "generate"
    )
    draft = quantize(draft, _DraftArgs(name, quant, args.dtype), device)
    if own and draft.quantization == target.quantization:
        raise ValueError(
            f"speculative_config.quantization: {quant!r} is the target's own scheme, so the "
            "draft would be the target itself; choose a cheaper one (gguf, int4, int8) than "
            "the target's"
        )
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"speculative_config.model: the draft's vocabulary ({draft.vocab_size} tokens, "
            f"{path}) is not the target's ({target.vocab_size}); a draft model must share the "
            "target's tokenizer"
        )
    if draft.max_model_len < target.max_model_len:
        raise ValueError(
            f"speculative_config.model: the draft holds {draft.max_model_len} positions, fewer "
            f"than the target's max_model_len ({target.max_model_len}); lower max_model_len"
        )
    return with_kv_cache_dtype(draft, args.kv_cache_dtype, device, args.calculate_kv_scales)
