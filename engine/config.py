"""Configuration: one user-facing schema (`EngineArgs`) validated once into a frozen `EngineConfig`.

`EngineArgs` keeps vLLM's user-facing keyword names so scripts work unchanged. Everything
derived from the model directory (architecture sizes, EOS ids, generation defaults) lives in
`ModelConfig`, read once from `config.json` / `generation_config.json`. Sizes the engine measures
at start-up (the number of KV blocks) are returned by the code that measures them, never written
back here.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.model_files import resolve_model

__all__ = [
    "CacheConfig",
    "CompilationConfig",
    "EngineArgs",
    "EngineConfig",
    "ModelConfig",
    "SchedulerConfig",
]

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

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, skip: Sequence[str] = ()) -> None:
        """One flag per field (`--max-model-len` for `max_model_len`): the CLI shares the schema."""
        group = parser.add_argument_group("engine")
        for f in dataclasses.fields(cls):
            if f.name in skip:
                continue
            flag = "--" + f.name.replace("_", "-")
            type_name = str(f.type).split("|")[0].strip()
            if type_name == "bool":
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default, help="(default: %(default)s)")
            else:
                kind = _CLI_TYPES.get(type_name, _json_value)
                group.add_argument(flag, type=kind, default=f.default, help="(default: %(default)s)")

    @classmethod
    def from_cli_args(cls, ns: argparse.Namespace) -> EngineArgs:
        names = set(cls.field_names())
        return cls(**{k: v for k, v in vars(ns).items() if k in names})


def _json_value(text: str) -> object:
    """A flag holding a structured value: an int, or a JSON object (e.g. compilation config)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected an int or a JSON object, got {text!r}") from exc


_CLI_TYPES = {"int": int, "float": float, "str": str}


def _positive(name: str, value: int) -> None:
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
