"""How the model is compiled (`compilation_config`) and the CUDA graphs it captures."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Protocol

from triollm.engine.config.checks import positive

__all__ = ["CompilationConfig", "cuda_graph_sizes"]


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
                "compilation_config: expected an int level, a dict or a CompilationConfig, "
                f"got {type(value).__name__}"
            )
        if isinstance(value, int):
            return cls(level=value)
        known = {f.name for f in dataclasses.fields(cls)}
        for key in value:
            if key not in known:
                raise ValueError(
                    f"compilation_config: unknown key {key!r}; "
                    f"allowed keys: {', '.join(sorted(known))}"
                )
        kwargs = dict(value)
        if kwargs.get("cudagraph_capture_sizes") is not None:
            kwargs["cudagraph_capture_sizes"] = tuple(kwargs["cudagraph_capture_sizes"])
        return cls(**kwargs)


class GraphArgs(Protocol):
    """The `EngineArgs` fields `cuda_graph_sizes` reads."""

    @property
    def compilation_config(self) -> CompilationConfig | int | dict[str, Any] | None: ...
    @property
    def enforce_eager(self) -> bool: ...
    @property
    def tensor_parallel_size(self) -> int: ...
    @property
    def max_num_seqs(self) -> int: ...


def cuda_graph_sizes(args: GraphArgs, device: str) -> tuple[int, ...]:
    """The decode batch sizes replayed from captured CUDA graphs; empty where every step runs
    eagerly (CPU, enforce_eager, use_cudagraph=False, tensor parallelism)."""
    cc = CompilationConfig.coerce(args.compilation_config)  # coerced already by EngineArgs
    if device != "cuda" or args.enforce_eager or not cc.use_cudagraph:
        return ()
    if args.tensor_parallel_size > 1:
        return ()
    if cc.cudagraph_capture_sizes:
        for size in cc.cudagraph_capture_sizes:
            positive("compilation_config.cudagraph_capture_sizes", size)
        return tuple(sorted(set(cc.cudagraph_capture_sizes)))
    from triollm.engine.execution.cuda_graphs import default_capture_sizes

    return default_capture_sizes(args.max_num_seqs)
