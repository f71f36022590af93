"""`build_engine_core(config)`: the engine core a configuration needs, as a `Core`.

`Core` (engine/core_protocol.py) is what the actor shell drives; it has two implementations,
and the model's runner type picks one: "generate" builds `EngineCore` (engine/core.py: scheduler,
paged KV cache, sampler), "pooling" builds `PoolingEngineCore` (engine/pooling_core.py: one
encoder pass per request). Every place that builds the core from a configuration alone (the
in-process transport, the engine-core process, `SyncEngine`) calls this; tests and benchmarks
that inject a runner build `EngineCore(config, runner=...)` themselves, and an
`EngineCoreFactory` replaces this function where they name one.
"""

from __future__ import annotations

from triollm.engine.config import EngineConfig
from triollm.engine.core import EngineCore
from triollm.engine.core_protocol import Core, EngineCoreStats
from triollm.engine.pooling_core import PoolingEngineCore

__all__ = ["Core", "EngineCoreStats", "build_engine_core"]


def build_engine_core(config: EngineConfig) -> Core:
    """Load the model `config` names and return its core (blocks while the weights load)."""
    runner = config.model.runner_type
    if runner == "pooling":
        return PoolingEngineCore(config)
    if runner == "generate":
        return EngineCore(config)
    raise ValueError(f"runner: {runner!r} has no engine core; expected 'generate' or 'pooling'")
