from __future__ import annotations

__all__ = ["EngineDeadError", "EngineGenerateError"]


class EngineDeadError(RuntimeError):
    """The engine core died (crash, kill, failed forward pass); every in-flight and later request
    fails with this. Create a new engine to go on."""


class EngineGenerateError(RuntimeError):
    """One request failed unexpectedly inside the engine; the engine itself goes on."""
