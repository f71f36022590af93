"""The engine core's compute thread: one thread runs every torch call of a core, build and steps.

Why one thread and not a worker from the event loop's pool: torch's intra-op threads are an
OpenMP team, and GNU OpenMP (torch's libgomp) keeps one team *per thread that starts parallel
regions*. Two such threads (the model built in one worker, steps run in another, or in the main
thread) leave two teams, more OpenMP threads than cores, and libgomp then stops spin-waiting
between parallel regions (its "throttled" spin): every region pays a futex wake-up, and a
batch-1 decode step runs markedly slower in any thread but the one that built the model
(`docs/benchmarks.md`, "one compute thread").

The event loop hands a job to the thread and awaits its end; the thread wakes the loop without
waiting for it (a loop that has ended is not woken). Cancellation abandons the job (as
`to_thread.run_sync(..., abandon_on_cancel=True)` did): a hung forward pass keeps its thread, nobody
touches its core again, and the teardown stays bounded. When its context exits, an idle thread is
ended and joined (a thread still ending while the process exits races the C++ teardown: "terminate
called without an active exception"); a busy one, abandoned, is a daemon and ends with the process.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import anyio
import sniffio

__all__ = ["ComputeThread", "compute_thread"]

T = TypeVar("T")

_STOP = None  # the sentinel that ends the thread
JOIN_S = 5.0  # an idle thread ends in microseconds; the bound is for a thread-exit that hangs


class ComputeThread:
    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[Callable[[], None] | None] = queue.SimpleQueue()
        self._pending = 0  # jobs handed over and not finished (the loop's side reads it)
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._work, name=name, daemon=True)
        self._thread.start()

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the compute thread; its result or its exception here."""
        done = anyio.Event()
        wake = _waker(done.set)
        result: list[T] = []
        error: list[BaseException] = []

        def job() -> None:
            try:
                result.append(fn(*args))
            except BaseException as exc:  # delivered to the awaiting task
                error.append(exc)
            with self._lock:
                self._pending -= 1
            wake()

        with self._lock:
            self._pending += 1
        self._jobs.put(job)
        await done.wait()  # on cancellation the job is abandoned, its result dropped
        if error:
            raise error[0]
        return result[0]

    def close(self) -> None:
        """End the thread: now if it is idle, else after the job in hand (not waited for: that
        job may be hung)."""
        self._jobs.put(_STOP)
        with self._lock:
            idle = self._pending == 0
        if idle:
            self._thread.join(JOIN_S)

    @property
    def ident(self) -> int | None:
        return self._thread.ident

    def _work(self) -> None:
        while (job := self._jobs.get()) is not _STOP:
            job()


def _waker(fn: Callable[[], object]) -> Callable[[], None]:
    """A thread-safe `fn()` in the running event loop, soon; nothing if that loop has ended."""
    if sniffio.current_async_library() == "trio":
        import trio

        token = trio.lowlevel.current_trio_token()

        def wake() -> None:
            try:
                token.run_sync_soon(fn)
            except trio.RunFinishedError:
                pass

    else:
        loop = asyncio.get_running_loop()

        def wake() -> None:
            try:
                loop.call_soon_threadsafe(fn)
            except RuntimeError:  # the loop is closed
                pass

    return wake


@contextmanager
def compute_thread(name: str = "triollm-engine-core") -> Iterator[ComputeThread]:
    thread = ComputeThread(name)
    try:
        yield thread
    finally:
        thread.close()
