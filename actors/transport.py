"""Connecting the frontend to an engine core: in this process, or in a child over ZMQ.

Both ways give the frontend the same thing, a `CoreClient`: what the engine measured at start-up
(`Ready`), a send stream for `CoreInput` messages and a receive stream of `CoreOutput`
messages. The choice is a value (`config.actor.multiprocess`), not a class hierarchy.

- In-process: `EngineCore` is built in its compute thread (`actors/compute.py`) and driven by
  `serve_engine_core` in a task of this event loop (each step in that same thread).
- Multiprocess: see `actors/process.py`.
- Data parallel (`data_parallel_size > 1`, or the Ray backend): N engine-core processes (or Ray
  actors) behind one client, see `actors/data_parallel.py`.
- External load balancing (`data_parallel_rank`): this server runs its one rank as above, with
  that rank's share of the threads (the ranks' servers are taken to share this node).

`core_factory` (tests and benchmarks only) builds the core instead of
`build_engine_core(config)`: a scripted runner, an injected fault. It is plain data, so it
crosses to the child process too.

The input stream is unbounded on purpose: adds are bounded by the callers waiting for them, and
an abort must be sendable synchronously from a `finally` block of a cancelled consumer.
The output stream ends after `EngineDead`, or when the core stops after `Shutdown`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio

from triollm.actors.compute import ComputeThread, compute_thread
from triollm.actors.core_client import OUTPUT_BUFFER, SHUTDOWN_GRACE_S, CoreClient
from triollm.actors.core_loop import serve_engine_core
from triollm.actors.data_parallel import open_data_parallel_client, rank_threads
from triollm.actors.messages import CoreInput, CoreOutput, Ready, Shutdown
from triollm.actors.process import open_process_core
from triollm.engine.config import EngineConfig
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.cores import build_engine_core

__all__ = ["open_core_client"]


@asynccontextmanager
async def open_core_client(
    config: EngineConfig, *, core_factory: EngineCoreFactory | None = None
) -> AsyncIterator[CoreClient]:
    """Start the engine core as `config.actor` says. `config` is resolved once, by the caller;
    a core started elsewhere (a child process, a Ray actor, a data-parallel rank) is sent it,
    with its own fields set here, and never resolves it again."""
    actor = config.actor
    if actor.data_parallel_world > 1 and actor.data_parallel_size == 1:  # external load balancing
        threads = rank_threads(config.num_threads, actor.data_parallel_world)
        config = dataclasses.replace(config, num_threads=threads)
    if actor.data_parallel_size > 1 or actor.data_parallel_backend == "ray":
        async with open_data_parallel_client(config, core_factory=core_factory) as client:
            yield client
    elif config.actor.multiprocess:
        async with open_process_core(config, core_factory=core_factory) as client:
            yield client
    else:
        with compute_thread() as compute:
            async with _open_in_process(config, core_factory, compute) as client:
                yield client


@asynccontextmanager
async def _open_in_process(
    config: EngineConfig, core_factory: EngineCoreFactory | None, compute: ComputeThread
) -> AsyncIterator[CoreClient]:
    build = build_engine_core if core_factory is None else core_factory.build
    core = await compute.run(build, config)
    in_send, in_recv = anyio.create_memory_object_stream[CoreInput](math.inf)
    out_send, out_recv = anyio.create_memory_object_stream[CoreOutput](OUTPUT_BUFFER)
    ready = Ready(core.num_blocks, config.cache.block_size, config.model.max_model_len, config.model.vocab_size)

    done = anyio.Event()

    async def run() -> None:
        try:
            await serve_engine_core(core, in_recv, out_send, compute)
        except Exception:  # EngineDead was sent; the frontend turns it into EngineDeadError
            pass
        finally:
            done.set()

    async with anyio.create_task_group() as tg:
        tg.start_soon(run)
        try:
            yield (client := CoreClient(ready, in_send, out_recv, None, SHUTDOWN_GRACE_S))
        finally:
            # Ask the loop to stop after its current step (it closes out_send when it does);
            # if it cannot within the grace period (say, blocked on a full output stream that
            # nobody reads any more), cancel it.
            try:
                in_send.send_nowait(Shutdown())
            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                pass
            in_send.close()
            with anyio.CancelScope(shield=True), anyio.move_on_after(client.shutdown_grace_s):
                await done.wait()
            tg.cancel_scope.cancel()
    with anyio.CancelScope(shield=True):  # its tensor-parallel workers, if any (bounded waits)
        await anyio.to_thread.run_sync(core.close)
