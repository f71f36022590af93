"""The engine core's side of the link: the program of the engine-core child process.

`python -m triollm.actors.child SPEC` is what `open_process_core` (actors/process.py, the
parent's side) starts; a Ray actor (actors/ray_core.py) runs the same `serve_core` in its own
process. This module is the child's contract as well as its program: `ChildSpec` (SPEC, JSON,
its only argument), `CURVE_KEYS_ENV` (the tcp link's keys, in the environment so that `ps` never
shows them) and `STOP_BYTE` (on stdin) are read here and written by the parent, which imports
this module for them; so torch and the engine core's builder are imported inside the functions
that need them, never at the top.

SPEC holds the parent's resolved `EngineConfig` itself (`process.child_config`: multiprocess
off, the threads counted; MessagePack inside, engine/config_codec.py), the two socket addresses,
the log level and, for tests and benchmarks only, an `EngineCoreFactory` ("module:function" and
its keyword arguments) that builds the core in place of `build_engine_core(config)`. The child
never resolves anything again (no `create_engine_config`: no second reading of the machine or
the model's files), so the two processes cannot disagree about dtype, quantization, threads or
the KV cache's dtype. It only refuses a model directory that lost its config.json meanwhile.

```
parent (actors/process.py)        child: serve_core (trio)
PUSH ══ipc/tcp══▶ PULL ─▶ pump_from_socket ─▶ serve_engine_core (steps in the compute thread)
PULL ◀═ipc/tcp═══ PUSH ◀─ pump_to_socket ◀──┘
stdin pipe ─────────────▶ watch_parent: STOP_BYTE = stop after this step, EOF = the parent is gone
```

- The child connects (the parent binds), builds the core in its compute thread and answers the
  handshake on the output socket: `Ready` (what it measured) or `StartupError` (message and
  traceback). After `Ready` the model and torch leave the garbage collector's view
  (`gc.freeze`): no long collections between steps.
- An exception in a step is sent as `EngineDead` (with the traceback) by the core loop; the
  child then flushes its output socket for up to `FLUSH_S` and exits 1.
- The child exits when its stdin reaches EOF, which happens when the parent dies in any way
  (SIGKILL included), since only the parent holds the pipe's write end. Rejected:
  `PR_SET_PDEATHSIG` (fires when the *thread* that spawned the child exits, and trio spawns from
  worker threads) and `multiprocessing` (blocking start, re-imported `__main__`, pickled
  arguments).
- It ignores SIGINT: a Ctrl-C in a terminal reaches the whole process group, and the parent
  decides how the engine stops (it may want to drain first). Its stdout joins its stderr, which
  the parent forwards (and keeps the tail of for error messages).

The child runs on trio: its worker threads are daemon threads, so a child whose parent died
mid-load exits at once instead of waiting for the load to finish (anyio's asyncio workers are
not daemon threads); steps per second measured the same on both backends.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import sys
import traceback
from typing import Any

import anyio
import msgspec
import zmq
from anyio.streams.memory import MemoryObjectSendStream

from triollm.actors import zmq_io
from triollm.actors.compute import ComputeThread, compute_thread
from triollm.actors.core_client import OUTPUT_BUFFER
from triollm.actors.messages import (
    CoreInput,
    CoreOutput,
    Ready,
    Shutdown,
    StartupError,
    input_decoder,
)
from triollm.engine.config import EngineConfig
from triollm.engine.config_codec import decode_config
from triollm.engine.core_factory import EngineCoreFactory

__all__ = [
    "CURVE_KEYS_ENV",
    "STOP_BYTE",
    "ChildSpec",
    "configure_core_process",
    "main",
    "serve_core",
]

log = logging.getLogger("triollm")

CHILD_BACKEND = "trio"
FLUSH_S = 2.0  # time to hand the last messages to the parent
STOP_BYTE = b"q"  # parent -> child stdin: stop after the current step
CURVE_KEYS_ENV = "TRIOLLM_ZMQ_CURVE_KEYS"  # parent -> child: zmq_io.ClientKeys for tcp


class ChildSpec(msgspec.Struct):
    """Everything the child needs, JSON-encoded as its only argument."""

    # The parent's resolved EngineConfig as the core runs it (`process.child_config`), encoded
    # by engine/config_codec.py: MessagePack (base64 in the JSON), so every float is exact.
    config: bytes
    inputs: str  # address of the parent's PUSH socket (the child connects a PULL)
    outputs: str  # address of the parent's PULL socket (the child connects a PUSH)
    log_level: int = logging.WARNING
    core_factory: EngineCoreFactory | None = None  # tests and benchmarks: builds the core

    def engine_config(self) -> EngineConfig:
        """The config to run, as the parent resolved it (never resolved again here)."""
        return decode_config(self.config)


_encoder = msgspec.msgpack.Encoder()


def main(argv: list[str] | None = None) -> int:
    """The engine-core process: `python -m triollm.actors.child SPEC_JSON`."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(
            "usage: python -m triollm.actors.child SPEC_JSON (started by the frontend)",
            file=sys.stderr,
        )
        return 2
    spec = msgspec.json.decode(argv[0], type=ChildSpec)
    config = spec.engine_config()
    keys = os.environ.pop(CURVE_KEYS_ENV, None)  # not inherited by anything we start
    curve = zmq_io.ClientKeys.decode(keys) if keys else None
    os.dup2(2, 1)  # nothing reads our stdout: stray prints join stderr, which the parent forwards
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    configure_core_process(spec, config)
    try:
        return anyio.run(serve_core, spec, config, curve, backend=CHILD_BACKEND)
    except Exception:
        # Our stderr goes to the parent, which forwards it and keeps its tail for the error.
        log.exception("the engine core process exits on an unexpected error")
        return 1


def configure_core_process(spec: ChildSpec, config: EngineConfig) -> None:
    """What a process that hosts an engine core (this child, or a Ray actor) sets once, before
    any worker thread exists: the parent's log level, each line prefixed with our pid, and the
    torch threads the parent counted (`process.child_config`); threads started later inherit
    that setting."""
    logging.basicConfig(
        level=spec.log_level,
        format=f"(engine core pid {os.getpid()}) %(levelname)s %(name)s: %(message)s",
    )
    import torch

    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)


async def serve_core(
    spec: ChildSpec,
    config: EngineConfig,
    curve: zmq_io.ClientKeys | None = None,
    stop_requested: anyio.Event | None = None,
) -> int:
    """The engine core (`config`: `spec.engine_config()`, decoded once by the caller) behind its
    two sockets until it stops; the exit code. A child process watches its stdin
    (`_watch_parent`); a Ray actor passes `stop_requested` (set by its `stop()` call) instead,
    and Ray ends it with the process that created it."""
    ctx: zmq.Context[Any] = zmq.Context()
    outputs = zmq_io.connect(ctx, zmq.PUSH, spec.outputs, curve)
    inputs = zmq_io.connect(ctx, zmq.PULL, spec.inputs, curve)
    parent_alive = False
    code = 0
    try:
        async with anyio.create_task_group() as tg:
            if stop_requested is None:
                stop_requested = anyio.Event()
                tg.start_soon(_watch_parent, tg.cancel_scope, stop_requested)
            with compute_thread() as compute:
                code = await _serve(spec, config, inputs, outputs, stop_requested, compute)
            parent_alive = True
            tg.cancel_scope.cancel()
    finally:
        zmq_io.close(inputs)
        # Deliver what is still queued (Ready, StartupError, EngineDead) unless nobody listens.
        zmq_io.close(outputs, linger=int(FLUSH_S * 1000) if parent_alive else 0)
        ctx.term()
    return code


async def _watch_parent(scope: anyio.CancelScope, stop_requested: anyio.Event) -> None:
    """Our stdin is a pipe from the parent. `STOP_BYTE` asks for an orderly stop (as `Shutdown`
    does: the core loop ends after its current step); EOF means the parent is gone."""
    fd = 0
    while True:
        await anyio.wait_readable(fd)
        data = os.read(fd, 4096)
        if not data:
            break
        if STOP_BYTE in data:
            stop_requested.set()
    if not stop_requested.is_set():
        log.warning("the parent process is gone; the engine core exits")
    scope.cancel()


async def _serve(
    spec: ChildSpec,
    config: EngineConfig,
    inputs: zmq.Socket[Any],
    outputs: zmq.Socket[Any],
    stop_requested: anyio.Event,
    compute: ComputeThread,
) -> int:
    from triollm.actors.core_loop import serve_engine_core
    from triollm.engine.cores import build_engine_core

    try:
        _check_checkpoint(config)
        build = build_engine_core if spec.core_factory is None else spec.core_factory.build
        core = await compute.run(build, config)
    except Exception as exc:
        log.exception("the engine core failed to start")
        message = str(exc) if isinstance(exc, ValueError) else f"{type(exc).__name__}: {exc}"
        await zmq_io.send(outputs, _encoder.encode(StartupError(message, traceback.format_exc())))
        return 1
    gc.collect()
    gc.freeze()  # the model and torch leave the collector's view: no long GC pauses in the loop
    ready = Ready(
        core.num_blocks,
        config.cache.block_size,
        config.model.max_model_len,
        config.model.vocab_size,
    )
    await zmq_io.send(outputs, _encoder.encode(ready))

    in_send, in_recv = anyio.create_memory_object_stream[CoreInput](math.inf)
    out_send, out_recv = anyio.create_memory_object_stream[CoreOutput](OUTPUT_BUFFER)
    failed = False
    async with anyio.create_task_group() as tg:
        tg.start_soon(_shutdown_when_asked, stop_requested, in_send.clone())
        tg.start_soon(zmq_io.pump_from_socket, inputs, in_send, input_decoder.decode)
        async with anyio.create_task_group() as out_tg:
            out_tg.start_soon(zmq_io.pump_to_socket, outputs, out_recv, _encoder.encode)
            try:
                await serve_engine_core(core, in_recv, out_send, compute)
            except Exception:
                # serve_engine_core queued EngineDead with the traceback and closed out_send:
                # the output pump must still flush it, so this must not cancel the pump.
                log.exception("the engine core failed; the process exits")
                failed = True
            out_tg.cancel_scope.deadline = anyio.current_time() + FLUSH_S
        tg.cancel_scope.cancel()
    with anyio.CancelScope(shield=True):  # its tensor-parallel workers, if any (bounded waits)
        await anyio.to_thread.run_sync(core.close)
    return 1 if failed else 0


def _check_checkpoint(config: EngineConfig) -> None:
    """The parent resolved `config` from the model directory; one that has lost its config.json
    since (deleted, or being replaced) is no longer the checkpoint the parent read: refuse it,
    naming the file, rather than load whatever weights are left."""
    path = config.model.path
    if not (path / "config.json").is_file():
        raise ValueError(
            f"model: {path} has no config.json any more (the engine's configuration was resolved "
            "from it at start-up); the model directory changed while the engine started"
        )


async def _shutdown_when_asked(
    stop_requested: anyio.Event, inputs: MemoryObjectSendStream[CoreInput]
) -> None:
    with inputs:
        await stop_requested.wait()
        try:
            inputs.send_nowait(Shutdown())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass


if __name__ == "__main__":
    sys.exit(main())
