"""The KV cache: block size, prefix caching, and how big it is (measured at start-up from free
memory unless `kv_cache_memory_bytes`, `num_gpu_blocks_override` or, on CPU, vLLM-CPU's
`$VLLM_CPU_KVCACHE_SPACE` says). The number of blocks
the engine measures is returned by the code that measures it, never written back here."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from triollm.engine.config.checks import one_of, positive
from triollm.engine.envs import cpu_kvcache_space_bytes

__all__ = ["BLOCK_SIZES", "CacheConfig", "check_gpu_memory_utilization", "resolve_cache"]

BLOCK_SIZES = (8, 16, 32, 64, 128)


@dataclass(frozen=True)
class CacheConfig:
    block_size: int
    enable_prefix_caching: bool
    kv_cache_memory_bytes: int | None  # None: derive from available memory
    num_kv_blocks: int | None  # explicit override (tests force preemption with a few blocks)
    # CUDA: the fraction of the GPU's memory this engine may use (weights + KV cache), as vLLM.
    gpu_memory_utilization: float = 0.9


class CacheArgs(Protocol):
    """The `EngineArgs` fields the KV cache reads."""

    @property
    def block_size(self) -> int: ...
    @property
    def enable_prefix_caching(self) -> bool: ...
    @property
    def kv_cache_memory_bytes(self) -> int | None: ...
    @property
    def num_gpu_blocks_override(self) -> int | None: ...
    @property
    def gpu_memory_utilization(self) -> float: ...


def check_gpu_memory_utilization(value: float) -> None:
    """Checked as `EngineArgs` is built (vLLM's range)."""
    if not 0 < value <= 1:
        raise ValueError(f"gpu_memory_utilization: must be in (0, 1], got {value!r}")


def resolve_cache(args: CacheArgs, device: str) -> CacheConfig:
    """The KV cache's settings checked (`gpu_memory_utilization` was, with `EngineArgs`). On
    CPU, `$VLLM_CPU_KVCACHE_SPACE` (GiB, how vLLM-CPU containers size the cache) stands in for an
    unset `kv_cache_memory_bytes`."""
    one_of("block_size", args.block_size, BLOCK_SIZES)
    kv_bytes = args.kv_cache_memory_bytes
    if kv_bytes is not None:
        positive("kv_cache_memory_bytes", kv_bytes)
    elif device == "cpu":
        kv_bytes = cpu_kvcache_space_bytes()
    if args.num_gpu_blocks_override is not None:
        positive("num_gpu_blocks_override", args.num_gpu_blocks_override)
    return CacheConfig(
        block_size=args.block_size,
        enable_prefix_caching=args.enable_prefix_caching,
        kv_cache_memory_bytes=kv_bytes,
        num_kv_blocks=args.num_gpu_blocks_override,
        gpu_memory_utilization=args.gpu_memory_utilization,
    )
