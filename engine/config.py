"""Configuration: one user-facing schema (`EngineArgs`) validated once into a frozen `EngineConfig`.

`EngineArgs` keeps vLLM's user-facing keyword names so scripts work unchanged. Everything
derived from the model directory (architecture sizes, EOS ids, generation defaults) lives in
`ModelConfig`, read once from `config.json` / `generation_config.json`. Sizes the engine measures
at start-up (the number of KV blocks) are returned by the code that measures them, never written
back here.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "SchedulerConfig",
    "default_cache_dir",
]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
)


def default_cache_dir() -> Path:
    """Where imported models are cached: `$TRIOLLM_CACHE_DIR`, else `~/.cache/triollm`."""
    env = os.environ.get("TRIOLLM_CACHE_DIR")
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "triollm"


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


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None  # None: derive from available memory
    num_kv_blocks: int | None  # explicit override (tests force preemption with a few blocks)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    seed: int
    num_threads: int | None
    inject_fault_at_step: int | None = None
    load_format: str = "auto"


@dataclass(frozen=True)
class CompilationConfig:
    """How the model is compiled (GPU path: torch.compile and CUDA graphs). On CPU, eager
    execution measured faster, so level 0 is the default and the only level used there."""

    level: int = 0
    use_cudagraph: bool = True
    cudagraph_capture_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        if self.level not in (0, 1, 2, 3):
            raise ValueError(f"compilation_config.level: {self.level!r} is not one of 0, 1, 2, 3")

    @classmethod
    def coerce(cls, value: CompilationConfig | int | dict[str, Any] | None) -> CompilationConfig:
        """An int is the level; a dict must hold only this config's fields."""
        if value is None:
            return cls()
        if isinstance(value, cls):
            return value
        if isinstance(value, bool) or not isinstance(value, (int, dict)):
            raise ValueError(
                f"compilation_config: expected an int level, a dict or a CompilationConfig, got {type(value).__name__}"
            )
        if isinstance(value, int):
            return cls(level=value)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(
                    f"compilation_config: unknown key {key!r}; allowed keys: {', '.join(sorted(known))}"
                )
        kwargs = dict(value)
        if kwargs.get("cudagraph_capture_sizes") is not None:
            kwargs["cudagraph_capture_sizes"] = tuple(kwargs["cudagraph_capture_sizes"])
        return cls(**kwargs)


RUNNERS = ("auto", "generate")


@dataclass
class EngineArgs:
    """Every user-settable engine knob, with vLLM's names. `create_engine_config()` validates."""

    model: str | None = None  # None: the bundled SmolLM2-135M-Instruct
    tokenizer: str | None = None
    # "auto": load the weights; "scripted": no weights, tokens replayed (pipeline benchmarks)
    load_format: str = "auto"
    dtype: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None
    enable_chunked_prefill: bool = True
    block_size: int = 16
    enable_prefix_caching: bool = True
    kv_cache_memory_bytes: int | None = None
    num_gpu_blocks_override: int | None = None
    seed: int = 0
    runner: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    compilation_config: CompilationConfig | int | dict | None = None
    device: str = "auto"
    num_threads: int | None = None
    cache_dir: str | None = None  # where imported (GGUF) models are cached
    # --- the actor layer (AsyncLLM / LLM)
    multiprocess: bool | None = None  # engine core in a child process; None: $TRIOLLM_MULTIPROCESS, else True
    output_chunk_size: int = 128  # RequestOutputs built per chunk before yielding to the event loop
    max_logprobs: int = 20
    zmq_address: str = "ipc"  # "ipc" (a socket file in a private temp dir) or "tcp://HOST" (ports chosen freely)
    # --- test-only fault injection: the forward pass raises at this step (1-based)
    inject_fault_at_step: int | None = None

    def __post_init__(self) -> None:
        # Normalised once, here: every way of building EngineArgs sees the same values.
        self.compilation_config = CompilationConfig.coerce(self.compilation_config)
        if self.runner not in RUNNERS:
            raise ValueError(
                f"runner: {self.runner!r} is not supported; triollm runs generative models: "
                'use runner="generate" (or "auto")'
            )
        if self.data_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size: {self.data_parallel_size} is not supported in one engine; "
                "for data parallelism run one engine per replica (e.g. one `triollm serve` per "
                "port) behind a load balancer"
            )
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"tensor_parallel_size: {self.tensor_parallel_size} is not supported (1 only)"
            )

    def create_engine_config(self) -> EngineConfig:
        from triollm.engine.model_files import resolve_model

        device = self.device
        if device == "auto":
            device = "cuda" if torch.cuda.is_available() else "cpu"
        if device not in ("cpu", "cuda"):
            raise ValueError(f"device: {device!r} is not one of auto, cpu, cuda")
        _positive("max_num_seqs", self.max_num_seqs)
        if self.block_size not in (8, 16, 32, 64, 128):
            raise ValueError(f"block_size: {self.block_size} is not one of 8, 16, 32, 64, 128")
        if self.kv_cache_memory_bytes is not None:
            _positive("kv_cache_memory_bytes", self.kv_cache_memory_bytes)
        if self.num_gpu_blocks_override is not None:
            _positive("num_gpu_blocks_override", self.num_gpu_blocks_override)
        if self.num_threads is not None:
            _positive("num_threads", self.num_threads)
        _positive("output_chunk_size", self.output_chunk_size)
        if self.load_format not in ("auto", "scripted"):
            raise ValueError(f"load_format: {self.load_format!r} is not one of auto, scripted")
        if not isinstance(self.max_logprobs, int) or self.max_logprobs < 0:
            raise ValueError(f"max_logprobs: must be a non-negative integer, got {self.max_logprobs!r}")
        if self.zmq_address != "ipc" and not self.zmq_address.startswith("tcp://"):
            raise ValueError(f"zmq_address: {self.zmq_address!r} is not 'ipc' or 'tcp://HOST'")
        path = resolve_model(self.model, Path(self.cache_dir) if self.cache_dir else None)
        model = ModelConfig.from_pretrained(path, self.dtype, self.max_model_len, device)
        budget = self.max_num_batched_tokens
        if budget is None:
            budget = 2048 if self.enable_chunked_prefill else max(2048, model.max_model_len)
        _positive("max_num_batched_tokens", budget)
        if not self.enable_chunked_prefill and budget < model.max_model_len:
            raise ValueError(
                f"max_num_batched_tokens: {budget} is smaller than max_model_len "
                f"({model.max_model_len}) with chunked prefill disabled; raise it or enable chunked prefill"
            )
        return EngineConfig(
            model=model,
            cache=CacheConfig(
                block_size=self.block_size,
                enable_prefix_caching=self.enable_prefix_caching,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_kv_blocks=self.num_gpu_blocks_override,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=budget,
                enable_chunked_prefill=self.enable_chunked_prefill,
            ),
            device=device,
            seed=self.seed,
            num_threads=self.num_threads,
            inject_fault_at_step=self.inject_fault_at_step,
            load_format=self.load_format,
        )

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
