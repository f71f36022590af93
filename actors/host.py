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
from collections.abc import Awaitable, Callable

import sniffio

__all__ = ["spawn_root_task"]

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
