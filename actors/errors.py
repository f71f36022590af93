from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

__all__ = ["EngineBusyError", "EngineDeadError", "EngineGenerateError", "unwrap_single_error"]


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


@contextmanager
def unwrap_single_error() -> Iterator[None]:
    """Let the one exception of a task group out unwrapped, so that callers catch it by type:
    for task groups whose tasks never raise but for one (the body's, a start-up error). A group
    of several is re-raised as it is."""
    try:
        yield
    except BaseExceptionGroup as group:
        if len(group.exceptions) != 1:
            raise
        exc = group.exceptions[0]
        context, cause, suppress = exc.__context__, exc.__cause__, exc.__suppress_context__
        try:
            raise exc  # as it was raised: its own cause and context, not the group's
        finally:
            exc.__context__, exc.__cause__, exc.__suppress_context__ = context, cause, suppress
            del exc, group
