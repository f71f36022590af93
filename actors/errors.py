from __future__ import annotations

__all__ = ["EngineBusyError", "EngineDeadError", "EngineGenerateError"]


class EngineDeadError(RuntimeError):
    """The engine core died (crash, kill, failed forward pass); every in-flight and later request
    fails with this. Create a new engine to go on."""


class EngineGenerateError(RuntimeError):
    """One request failed unexpectedly inside the engine; the engine itself goes on."""


class EngineBusyError(RuntimeError):
    """The request was refused because the engine's queue is full (`max_num_queued_reqs` /
    `max_num_queued_tokens`); nothing was added. Retry later (the server answers HTTP 429 with
    `Retry-After`)."""

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
