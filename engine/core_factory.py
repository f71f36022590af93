"""`EngineCoreFactory`: a test or benchmark hook that builds the engine core by name.

Plain data (a "module:function" string and JSON-able keyword arguments), so the same value
builds the core in this process and in the engine-core child process. It is no user setting:
neither an `EngineArgs` field nor a CLI flag.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

from triollm.engine.config import EngineConfig
from triollm.engine.core_protocol import Core

__all__ = ["EngineCoreFactory"]


@dataclass(frozen=True)
class EngineCoreFactory:
    """Builds the engine core in place of `build_engine_core(config)`: a test or benchmark hook.

    `target` names a function, "package.module:function", called as `function(config, **kwargs)`
    and returning a `Core` (an `EngineCore`, say). Both parts are plain data (`kwargs` JSON-able), so the same
    value builds the core in this process and in the engine-core child process.
    """

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, sep, name = self.target.partition(":")
        if not (sep and module and name.isidentifier()):
            raise ValueError(
                f"engine_core_factory: {self.target!r} is not 'package.module:function'"
            )

    @classmethod
    def coerce(cls, value: EngineCoreFactory | str | None) -> EngineCoreFactory | None:
        """A "module:function" string is a factory without keyword arguments."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        raise ValueError(
            f"engine_core_factory: expected 'module:function' or an EngineCoreFactory, got {type(value).__name__}"
        )

    def build(self, config: EngineConfig) -> Core:
        module, _, name = self.target.partition(":")
        function = getattr(importlib.import_module(module), name)
        core = function(config, **self.kwargs)
        if not isinstance(core, Core):
            raise TypeError(
                f"engine_core_factory: {self.target} returned {type(core).__name__}, not an "
                "EngineCore (or another engine core: see the Core protocol in engine/core_protocol.py)"
            )
        return core
