"""`EngineConfig`: the resolved, frozen configuration one engine runs with, made by
`EngineArgs.create_engine_config()` and sent as is to an engine core elsewhere
(engine/config_codec.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from triollm.engine.config.actor import ActorConfig
from triollm.engine.config.cache import CacheConfig
from triollm.engine.config.limits import LimitsConfig
from triollm.engine.config.lora import LoRAConfig
from triollm.engine.config.scheduler import SchedulerConfig
from triollm.engine.config.speculative import SpeculativeConfig
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["EngineConfig"]


@dataclass(frozen=True)
class EngineConfig:
    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: str
    seed: int
    num_threads: int | None  # in all; with tensor parallelism each rank gets its share
    tokenizer: Path  # the tokenizer directory (the model's unless `tokenizer=` named another)
    actor: ActorConfig
    limits: LimitsConfig
    # vLLM arguments the user set that have no effect here (each warned about once).
    ignored_args: tuple[str, ...] = ()
    tensor_parallel_size: int = 1  # processes the model is sharded over (docs/scaling.md)
    # CUDA: the decode batch sizes replayed from captured graphs (engine/execution/cuda_graphs.py);
    # empty: every step runs eagerly (CPU, enforce_eager, use_cudagraph=False).
    cuda_graph_sizes: tuple[int, ...] = ()
    lora: LoRAConfig | None = None  # None: LoRA off (enable_lora=False)
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
