"""Threads under trio's `MockClock(autojump_threshold=0)`.

An engine's start-up and teardown wait on threads (the tokenizer loads in a worker thread, the
core is built in its compute thread, teardown joins them). While a task waits on a thread every
task is blocked, so a clock with autojump threshold 0 polls without sleeping until the thread is
done, and the poll loop takes the GIL from the very thread it waits for: start-up then takes
many times longer than without the clock. `mock_clock_patience()` raises the threshold for
a block (a jump then waits for that much real idleness, and the loop sleeps meanwhile) and
restores it after; anywhere else it does nothing. `open_asgi_client` applies it to the app's
lifespan startup and shutdown; apply it around `llm.start()` / `llm.shutdown()` yourself when
you drive an `AsyncLLM` directly under a MockClock.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import sniffio

if TYPE_CHECKING:
    from trio.testing import MockClock

__all__ = ["mock_clock_patience"]


@contextmanager
def mock_clock_patience(real_s: float = 0.02) -> Iterator[None]:
    """Inside the block, the running trio `MockClock` (if any) jumps only after `real_s`
    seconds of real idleness (not at once). A deadline pending meanwhile can still be jumped to
    while a thread works for longer: set deadlines after the engine started."""
    clock = _mock_clock()
    if clock is None or clock.autojump_threshold >= real_s:
        yield
        return
    previous = clock.autojump_threshold
    clock.autojump_threshold = real_s
    try:
        yield
    finally:
        clock.autojump_threshold = previous


def _mock_clock() -> MockClock | None:
    try:
        if sniffio.current_async_library() != "trio":
            return None
    except sniffio.AsyncLibraryNotFoundError:
        return None
    import trio
    from trio.testing import MockClock

    clock = trio.lowlevel.current_clock()
    return clock if isinstance(clock, MockClock) else None
