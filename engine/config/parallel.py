"""Parallelism: tensor parallel ranks (processes the model is sharded over, CPU and gloo only),
data parallel ranks (whole replicas behind one frontend, or one server per rank behind the
user's balancer), and no pipeline parallelism. `check_parallel` runs as `EngineArgs` is built;
`check_tensor_parallel_model` once the model's sizes are known."""

from __future__ import annotations

from typing import Protocol

from triollm.engine.config.checks import one_of, positive
from triollm.engine.distributed.sharding import check_tensor_parallel
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["DP_BACKENDS", "check_parallel", "check_tensor_parallel_model"]

DP_BACKENDS = ("mp", "ray")


class ParallelArgs(Protocol):
    """The `EngineArgs` fields parallelism reads."""

    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def pipeline_parallel_size(self) -> int: ...
    @property
    def data_parallel_size(self) -> int: ...
    @property
    def data_parallel_rank(self) -> int | None: ...
    @property
    def data_parallel_external_lb(self) -> bool: ...
    @property
    def data_parallel_backend(self) -> str: ...


def check_parallel(args: ParallelArgs) -> bool:
    """The parallel sizes checked; returns `data_parallel_external_lb` resolved (as vLLM: a
    rank given means one server per rank)."""
    positive("data_parallel_size", args.data_parallel_size)
    positive("tensor_parallel_size", args.tensor_parallel_size)
    external_lb = _check_data_parallel(args)
    if args.pipeline_parallel_size != 1:
        raise ValueError(
            f"pipeline_parallel_size: {args.pipeline_parallel_size} is not supported (1 only)"
        )
    return external_lb


def _check_data_parallel(args: ParallelArgs) -> bool:
    one_of("data_parallel_backend", args.data_parallel_backend, DP_BACKENDS)
    rank, size = args.data_parallel_rank, args.data_parallel_size
    external_lb = args.data_parallel_external_lb
    if rank is not None:
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < size:
            raise ValueError(
                f"data_parallel_rank: {rank!r} is not a rank of data_parallel_size={size}; "
                f"allowed: 0 to {size - 1}"
            )
        external_lb = True
    elif external_lb:
        raise ValueError(
            "data_parallel_external_lb: one server per rank needs this server's rank; "
            f"set data_parallel_rank (0 to {size - 1})"
        )
    if external_lb and args.data_parallel_backend != "mp":
        raise ValueError(
            f"data_parallel_backend: {args.data_parallel_backend!r} places every rank from one "
            "server; with external load balancing (data_parallel_rank) each server runs its own "
            "rank: allowed: 'mp'"
        )
    return external_lb


def check_tensor_parallel_model(size: int, device: str, model: ModelConfig) -> None:
    """`size` ranks can shard `model` on `device` (the CPU: gloo), else a ValueError."""
    if size <= 1:
        return
    if device != "cpu":
        raise ValueError(f"tensor_parallel_size: {size} runs on device='cpu' only (gloo)")
    check_tensor_parallel(size, model.num_heads, model.num_kv_heads, model.intermediate_size)
