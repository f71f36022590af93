"""A root task for an engine that a plain coroutine uses without `async with` (vLLM's style).

vLLM scripts write

    engine = AsyncLLM.from_engine_args(args)
    async for out in engine.generate(prompt, params, request_id="1"): ...
    engine.shutdown()

with no block that could own the engine's task group. `AsyncLLM` then starts on first use by
handing its own `async with` to one *root task* of the running event loop, made here: a trio
system task (`trio.lowlevel.spawn_system_task`) or an asyncio task of the running loop. That task
enters the engine (the same task group, actors and teardown as the structured form), reports
readiness or the start-up error, and waits until it is told to stop. So the engine is still
supervised, by the event loop's own root:

- `shutdown()` (sync or awaited) tells the root task to leave its `async with`;
- when the loop ends first (`trio.run` / `asyncio.run` returning), the loop cancels its root
  tasks and the engine's shielded, bounded teardown runs before the loop closes;
- the root task never raises into the loop: a start-up error goes to whoever waits for the
  start, a later failure is the engine's death, delivered on the data path as always.

Rejected: a thread with its own event loop (a second lifecycle, and every call crossing
threads), and starting a task from `__init__` only if a loop happens to be running (what vLLM
does; it makes construction order-dependent).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Generator
from typing import Any

import anyio
import sniffio

__all__ = ["EngineHost", "ShutdownCall", "spawn_root_task"]

log = logging.getLogger("triollm")

_asyncio_roots: set[asyncio.Task[None]] = set()  # strong references: asyncio keeps weak ones


def spawn_root_task(fn: Callable[[], Awaitable[None]], name: str) -> None:
    """Run `fn()` as a root task of the running event loop. `fn` must not raise (other than the
    loop's own cancellation when the loop ends)."""
    library = sniffio.current_async_library()
    if library == "trio":
        import trio.lowlevel

        trio.lowlevel.spawn_system_task(fn, name=name)
    elif library == "asyncio":

        async def run() -> None:
            await fn()

        task = asyncio.get_running_loop().create_task(run(), name=name)
        _asyncio_roots.add(task)
        task.add_done_callback(_asyncio_roots.discard)
    else:
        raise RuntimeError(f"AsyncLLM runs on trio or asyncio, not {library}")


class ShutdownCall:
    """What `AsyncLLM.shutdown()` returns: the shutdown has begun when the call returns (vLLM's
    sync form); awaiting it waits until the engine has stopped (the structured form)."""

    def __init__(self, finish: Callable[[float], Awaitable[None]], timeout: float) -> None:
        self._finish = finish
        self._timeout = timeout

    def __await__(self) -> Generator[Any, None, None]:
        return self._finish(self._timeout).__await__()


class EngineHost:
    """The root task that owns an engine nobody entered: it starts the engine (`start`),
    reports readiness or the start-up error, and stops it (`stop(timeout)`) when told to or
    when the event loop ends (the loop cancels its root tasks; the engine's teardown is
    shielded and bounded)."""

    def __init__(self, start: Callable[[], Awaitable[None]], stop: Callable[[float], Awaitable[None]]) -> None:
        self._start = start
        self._stop_engine = stop
        self.ready = anyio.Event()
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self._stop = anyio.Event()
        self._timeout = 0.0
        self._task: int | None = None

    def spawn(self, name: str) -> None:
        spawn_root_task(self._run, name=name)

    def stop(self, timeout: float) -> None:
        self._timeout = timeout
        self._stop.set()

    def in_host_task(self) -> bool:
        return self._task is not None and self._task == anyio.get_current_task().id

    async def _run(self) -> None:
        self._task = anyio.get_current_task().id
        try:
            try:
                await self._start()
            except Exception as exc:  # reported to whoever waits for the start; never raised here
                self.error = exc
                return
            finally:
                self.ready.set()
            try:
                await self._stop.wait()
            finally:
                await self._stop_engine(self._timeout)
        except Exception:  # never into the loop: a root task that raises crashes trio's run
            log.exception("the engine's root task failed")
        finally:
            self.done.set()
