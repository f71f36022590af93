"""The model and its tokenizer: where the checkpoint comes from (a directory, a .gguf file, a
Hub repo id), the dtype, the runner, whose modeling code runs it (`model_impl`), and the checks
a pooling model and the Transformers backend add."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Protocol

import torch

from triollm.engine.config.checks import one_of
from triollm.engine.loading.hf_config import MODEL_IMPLS
from triollm.engine.loading.hub import is_hub_id, resolve_hub
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.model_files import resolve_model
from triollm.engine.loading.pooler_config import CONVERTS

__all__ = [
    "CONVERTS",
    "DTYPES",
    "LOAD_FORMATS",
    "MODEL_IMPLS",
    "RUNNERS",
    "TOKENIZER_MODES",
    "canonical_dtype",
    "check_hf_overrides",
    "check_model_impl",
    "check_pooling",
    "resolve_device",
    "resolve_model_config",
    "resolve_tokenizer",
]

RUNNERS = ("auto", "generate", "pooling")  # vLLM's --runner ("draft" has no meaning here)
DTYPES = ("auto", "half", "float16", "bfloat16", "float", "float32")  # vLLM's --dtype choices
_DTYPE_NAMES = {"half": "float16", "float": "float32"}
_TORCH_DTYPES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}
LOAD_FORMATS = ("auto", "safetensors", "gguf")
TOKENIZER_MODES = ("auto", "hf", "slow")
DEVICES = ("auto", "cpu", "cuda")


class ModelArgs(Protocol):
    """The `EngineArgs` fields the model's resolution reads."""

    @property
    def model(self) -> str | None: ...
    @property
    def tokenizer(self) -> str | None: ...
    @property
    def revision(self) -> str | None: ...
    @property
    def tokenizer_revision(self) -> str | None: ...
    @property
    def download_dir(self) -> str | None: ...
    @property
    def hf_token(self) -> str | None: ...
    @property
    def load_format(self) -> str: ...
    @property
    def dtype(self) -> str | torch.dtype: ...
    @property
    def max_model_len(self) -> int | None: ...
    @property
    def runner(self) -> str: ...
    @property
    def convert(self) -> str: ...
    @property
    def model_impl(self) -> str: ...
    @property
    def generation_config(self) -> str: ...
    @property
    def override_generation_config(self) -> dict[str, Any] | None: ...
    @property
    def hf_overrides(self) -> dict[str, Any] | None: ...


def canonical_dtype(value: object) -> str:
    """vLLM's dtype spellings (and a `torch.dtype`) -> auto, float16, bfloat16 or float32."""
    if isinstance(value, torch.dtype):
        if value not in _TORCH_DTYPES:
            raise ValueError(
                f"dtype: {value} is not one of torch.float16, torch.bfloat16, torch.float32"
            )
        return _TORCH_DTYPES[value]
    if not isinstance(value, str) or value.lower() not in DTYPES:
        raise ValueError(f"dtype: {value!r} is not one of {', '.join(DTYPES)} (or a torch.dtype)")
    name = value.lower()
    return _DTYPE_NAMES.get(name, name)


def resolve_device(device: str) -> str:
    """"auto" -> "cuda" where torch sees a GPU, else "cpu"."""
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    one_of("device", device, DEVICES)
    return device


def resolve_model_config(args: ModelArgs, device: str, cache_dir: Path | None) -> ModelConfig:
    """The model directory (imported or downloaded first if need be) read into a
    `ModelConfig`: sizes, dtype, context length, runner and sampling defaults."""
    if args.load_format == "gguf" and not (args.model or "").lower().endswith(".gguf"):
        raise ValueError(
            f"load_format: 'gguf' needs a .gguf model file, got model={args.model!r}"
        )
    path = resolve_model(
        args.model, cache_dir, revision=args.revision, download_dir=args.download_dir,
        token=args.hf_token,
    )  # fmt: skip
    return ModelConfig.from_pretrained(
        path, str(args.dtype), args.max_model_len, device, args.runner, convert=args.convert,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config, model_impl=args.model_impl,
        hf_overrides=args.hf_overrides,
    )  # fmt: skip


def check_hf_overrides(value: object) -> None:
    """`hf_overrides` (vLLM's): a JSON object whose keys are config.json's; a callable (vLLM
    also takes one) cannot cross to the engine core's process."""
    if value is not None and not (isinstance(value, dict) and all(isinstance(k, str) for k in value)):
        raise ValueError(
            f"hf_overrides: expected a JSON object of config.json keys, e.g. "
            f'{{"max_position_embeddings": 8192}}, got {type(value).__name__} {value!r:.80}'
        )


def resolve_tokenizer(args: ModelArgs, model_path: Path, cache_dir: Path | None) -> Path:
    """The tokenizer directory: the model's, or `tokenizer` (a directory, .gguf file or Hub
    id)."""
    repo = args.tokenizer or (args.model if args.tokenizer_revision is not None else None)
    if repo is not None and is_hub_id(repo):
        return resolve_hub(
            repo, "tokenizer", revision=args.tokenizer_revision, download_dir=args.download_dir,
            token=args.hf_token, files="tokenizer",
        )  # fmt: skip
    return _local_tokenizer(args.tokenizer, cache_dir) if args.tokenizer else model_path


def _local_tokenizer(tokenizer: str, cache_dir: Path | None) -> Path:
    path = Path(tokenizer).expanduser()
    if path.is_file() and path.suffix.lower() == ".gguf":
        return resolve_model(str(path), cache_dir)  # its tokenizer is rebuilt on import
    if not (path / "tokenizer.json").is_file():
        raise ValueError(
            f"tokenizer: {tokenizer} is not a directory holding tokenizer.json, a .gguf file or "
            "a Hub repo id; only fast tokenizers are supported"
        )
    return path


def check_pooling(
    model: ModelConfig, tensor_parallel_size: int, max_num_batched_tokens: int | None
) -> None:
    """A pooling model runs whole prompts on one rank, one step each (engine/pooling_core.py)."""
    if model.runner_type != "pooling":
        return
    if tensor_parallel_size != 1:
        raise ValueError(
            f"tensor_parallel_size: {tensor_parallel_size} is not supported for pooling models "
            "(allowed: 1)"
        )
    budget = max_num_batched_tokens
    if budget is not None and budget < model.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens: {budget} is smaller than max_model_len "
            f"({model.max_model_len}); a pooling model encodes each prompt whole in one step"
        )


def check_model_impl(model: ModelConfig, tensor_parallel_size: int, enable_lora: bool) -> None:
    """What the Transformers backend (engine/execution/models/transformers_backend.py) does not
    run yet, refused before the model loads: more than one rank, LoRA adapters, quantized weights."""
    if model.model_impl != "transformers":
        return
    what = f"through the Transformers backend ({model.architecture})"
    if tensor_parallel_size != 1:
        raise ValueError(f"tensor_parallel_size: {tensor_parallel_size} is not supported {what}; allowed: 1")
    if enable_lora:
        raise ValueError(f"enable_lora: LoRA adapters are not supported {what}; allowed: false")
    if model.quantization is not None:
        raise ValueError(f"quantization: {model.quantization!r} is not supported {what}; allowed: none")
