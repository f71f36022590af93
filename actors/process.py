"""The engine core in a child process, linked to the frontend by ZMQ.

Parent side: `open_process_core(config)` yields the same `CoreClient` as the in-process
transport. Child side: `main()` below, run as `python -c "...main()" SPEC`. SPEC (JSON) holds
the parent's resolved `EngineConfig` itself (`child_config`: multiprocess off, the threads
counted; MessagePack inside, engine/config_codec.py), the two socket addresses, the log level
and, for tests and benchmarks only, an `EngineCoreFactory` ("module:function" and its keyword
arguments) that builds the core in place of `build_engine_core(config)`. The child never resolves
anything again (no `create_engine_config`: no second reading of the machine or the model's
files, and no second warning about ignored vLLM arguments), so the two processes cannot
disagree about dtype, quantization, threads or the KV cache's dtype.

```
parent                                              child (`process.main()`, its own interpreter)
client.inputs ─▶ pump_to_socket ─▶ PUSH ══ipc/tcp══▶ PULL ─▶ pump_from_socket ─▶ serve_engine_core
client.outputs ◀─ output actor ◀── PULL ◀═ipc/tcp═══ PUSH ◀─ pump_to_socket ◀──┘   (steps in a thread)
                   (+ watcher on proc.wait())
stderr pipe ─▶ forwarded to our stderr (tail kept)   stdin pipe ─▶ watchdog: EOF = the parent is gone
```

Start-up is a handshake on the output socket: the child sends `Ready` (what it measured) or
`StartupError` (message and traceback), and the parent raises `EngineStartupError` for the
latter, or when the child exits first (exit code and the tail of its stderr), or when the
handshake is not one of those. The parent binds, the child connects, so the child never needs
a free port or a path of its own.

Failure and shutdown, decided by structure rather than flags:

- The output actor runs the socket pump and a watcher on `proc.wait()` side by side. If the
  child forwards `EngineDead` (an exception in a step, with the traceback), that message ends
  the stream. If the child exits without one, the watcher waits briefly for its last words, then
  puts its own `EngineDead` (exit code or signal, and the tail of the child's stderr) and the
  stream ends.
- Teardown (shielded, bounded) first cancels the output actor's scope, so the exit it is about
  to cause is not reported as a death; then `Shutdown` (on the socket, and `STOP_BYTE` on the
  child's stdin for when the event loop is ending and has cancelled the socket pump) → wait →
  SIGTERM → wait → SIGKILL → wait → close the sockets and the ZMQ context → remove the ipc
  directory.
- The child exits when its stdin reaches EOF, which happens when the parent dies in any way
  (SIGKILL included), since only the parent holds the pipe's write end. Rejected: `PR_SET_PDEATHSIG`
  (fires when the *thread* that spawned the child exits, and trio spawns from worker threads)
  and `multiprocessing` (blocking start, re-imported `__main__`, pickled arguments).
- The child ignores SIGINT: a Ctrl-C in a terminal reaches the whole process group, and the
  parent decides how the engine stops (it may want to drain first).

The child runs on trio: its worker threads are daemon threads, so a child whose parent died
mid-load exits at once instead of waiting for the load to finish (anyio's asyncio workers are
not daemon threads); steps per second measured the same on both backends. Torch runs
`num_threads` intra-op threads. Unset (AsyncLLM, the server): every core torch would use on a
machine of up to `SHARED_CORES_UP_TO` cores, one fewer above. On the 2-core machine the server
with 2 engine threads beat 1 at every concurrency tried (docs/benchmarks.md, Threads); the
streaming frontend's share is small next to half the forward pass. On larger
machines one core stays with the frontend (vLLM's reserve): an OpenMP region waits for its
slowest thread, and a thread that shares its core with the frontend is that thread (not measured
here). The offline `LLM` always takes every core (docs/benchmarks.md, Threads).
"""

from __future__ import annotations

import codecs
import dataclasses
import gc
import logging
import math
import os
import signal
import sys
import traceback
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from subprocess import DEVNULL, PIPE
from typing import Any, Protocol

import anyio
import anyio.lowlevel
import msgspec
import zmq
from anyio.abc import ByteReceiveStream, Process
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from triollm.actors import zmq_io
from triollm.actors.compute import ComputeThread, compute_thread
from triollm.actors.core_client import OUTPUT_BUFFER, SHUTDOWN_GRACE_S, CoreClient
from triollm.actors.errors import unwrap_single_error
from triollm.actors.messages import (
    AddRequest,
    CoreInput,
    CoreOutput,
    EngineDead,
    Ready,
    RequestError,
    Shutdown,
    StartupError,
    input_decoder,
    output_decoder,
)
from triollm.engine.config import EngineConfig
from triollm.engine.config_codec import decode_config, encode_config
from triollm.engine.core import EngineCoreFactory

__all__ = [
    "ChildSpec",
    "CoreChild",
    "EngineStartupError",
    "StderrTail",
    "child_config",
    "child_spec",
    "default_num_threads",
    "link_core",
    "main",
    "open_process_core",
]

log = logging.getLogger("triollm")

CHILD_BACKEND = "trio"
TERM_GRACE_S = 2.0  # after SIGTERM
KILL_WAIT_S = 5.0  # after SIGKILL (only a process stuck in the kernel takes longer)
LAST_WORDS_S = 0.5  # a child that exited by itself: time for its last message to arrive
FLUSH_S = 2.0  # child: time to hand its last messages to the parent
STDERR_TAIL_CHARS = 4000
STOP_BYTE = b"q"  # parent -> child stdin: stop after the current step (see _request_stop)
# The child must answer the handshake (Ready or StartupError) within this many seconds, or it is
# killed and start-up fails naming this setting. Generous: loading a large model from a slow disk
# takes minutes.
HANDSHAKE_TIMEOUT_S = 600.0
CURVE_KEYS_ENV = "TRIOLLM_ZMQ_CURVE_KEYS"  # parent -> child: zmq_io.ClientKeys for tcp


class EngineStartupError(RuntimeError):
    """The engine-core process could not start. The message names the cause; `child_traceback`
    holds the child's traceback (or the tail of its stderr), also shown by `str()`."""

    def __init__(self, message: str, child_traceback: str = "") -> None:
        super().__init__(message)
        self.message = message
        self.child_traceback = child_traceback

    def __str__(self) -> str:
        if not self.child_traceback:
            return self.message
        return f"{self.message}\n\n--- engine core process ---\n{self.child_traceback.rstrip()}"


class ChildSpec(msgspec.Struct):
    """Everything the child needs, JSON-encoded as its only argument."""

    # The parent's resolved EngineConfig as the core runs it (`child_config`), encoded by
    # engine/config_codec.py: MessagePack (base64 in the JSON), so every float is exact.
    config: bytes
    inputs: str  # address of the parent's PUSH socket (the child connects a PULL)
    outputs: str  # address of the parent's PULL socket (the child connects a PUSH)
    log_level: int = logging.WARNING
    core_factory: EngineCoreFactory | None = None  # tests and benchmarks: builds the core

    def engine_config(self) -> EngineConfig:
        """The config to run, as the parent resolved it (never resolved again here)."""
        return decode_config(self.config)


_encoder = msgspec.msgpack.Encoder()


# ====================================================================== parent


@asynccontextmanager
async def open_process_core(
    config: EngineConfig, *, core_factory: EngineCoreFactory | None = None
) -> AsyncIterator[CoreClient]:
    """Start an engine-core child process that runs `config` (the parent's, resolved once; the
    child gets `child_config(config)`) and link it; see the module docstring.

    Raises `EngineStartupError` if the child cannot start. The yielded client's output stream
    ends after `EngineDead` (the child failed or died) or when the context exits.
    """
    actor = config.actor
    ends = zmq_io.Endpoints.bind(actor.zmq_address, insecure_tcp=actor.zmq_insecure_tcp)
    try:
        command = _child_command(config, ends, core_factory)
        env = {k: v for k, v in os.environ.items() if k != CURVE_KEYS_ENV}
        if ends.client_keys is not None:
            env[CURVE_KEYS_ENV] = ends.client_keys.encode()  # not on the command line (ps)
        proc = await anyio.open_process(command, stdin=PIPE, stdout=DEVNULL, stderr=PIPE, env=env)
        async with link_core(_Subprocess(proc), ends) as client:
            yield client
    finally:
        ends.close()


class CoreChild(Protocol):
    """An engine core running outside this process, as `link_core` watches and stops it: a child
    process here (`_Subprocess`), or a Ray actor (`actors/ray_core.py`)."""

    pid: int | None
    name: str  # for logs: "process 1234"
    stderr: StderrTail  # what it printed (a Ray actor's output goes to Ray's logs: empty)

    @property
    def returncode(self) -> int | None: ...

    async def forward_output(self) -> None:
        """Forward what it prints until it exits (sets `stderr.eof`)."""

    async def wait(self) -> int:
        """Its exit code (negative: the signal that killed it)."""

    async def request_stop(self) -> None:
        """Ask for an orderly stop by a way that does not need the socket pumps."""

    def terminate(self) -> None: ...

    def kill(self) -> None: ...

    def describe_exit(self, code: int) -> str:
        """What `wait()`'s `code` means, after "the engine core "."""

    async def aclose(self) -> None: ...


@asynccontextmanager
async def link_core(child: CoreChild, ends: zmq_io.Endpoints) -> AsyncIterator[CoreClient]:
    """The handshake, the socket pumps, the watcher and the teardown around a started `child`
    that connects to `ends` (the module docstring tells the rules)."""
    stderr = child.stderr
    try:
        with unwrap_single_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(child.forward_output)
                ready = await _handshake(ends.outputs, child)

                in_send, in_recv = anyio.create_memory_object_stream[CoreInput](math.inf)
                out_send, out_recv = anyio.create_memory_object_stream[CoreOutput](OUTPUT_BUFFER)
                own_in = in_send.clone()  # Shutdown goes through, whatever the user did
                tg.start_soon(_pump_inputs, ends.inputs, in_recv, out_send)
                output_scope = anyio.CancelScope()
                tg.start_soon(_output_actor, output_scope, ends.outputs, out_send, child)
                try:
                    yield (client := CoreClient(ready, in_send, out_recv, child.pid, SHUTDOWN_GRACE_S))
                finally:
                    with anyio.CancelScope(shield=True):
                        output_scope.cancel()  # the exit we are about to cause is no death
                        with own_in:
                            try:
                                own_in.send_nowait(Shutdown())
                            except (anyio.ClosedResourceError, anyio.BrokenResourceError):
                                pass
                        in_send.close()
                        pending = await _absorb_pending_cancellation()
                        await child.request_stop()
                        await _stop(child, client.shutdown_grace_s)
                        with anyio.move_on_after(0.5):
                            await stderr.eof.wait()  # its last lines
                        tg.cancel_scope.cancel()
                        if pending is not None:
                            raise pending
    finally:
        with anyio.CancelScope(shield=True):
            await _stop(child, 0)  # already done unless start-up failed
            with anyio.move_on_after(1):
                await child.aclose()
        code = child.returncode
        if code is not None:
            level = logging.DEBUG if code == 0 else logging.WARNING
            log.log(level, "engine core %s %s", child.name, _describe_exit(code))


class _Subprocess:
    """A child process started by `open_process_core`: stdin is its lifeline, stderr forwarded."""

    def __init__(self, proc: Process) -> None:
        self.proc = proc
        self.pid: int | None = proc.pid
        self.name = f"process {proc.pid}"
        self.stderr = StderrTail()

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    async def forward_output(self) -> None:
        assert self.proc.stderr is not None
        await self.stderr.forward(self.proc.stderr)

    async def wait(self) -> int:
        return await self.proc.wait()

    async def request_stop(self) -> None:
        """`STOP_BYTE` on the child's stdin: the `Shutdown` message needs the socket pump, and a
        loop that ends (`asyncio.run` returning) cancels every task, the pump included."""
        assert self.proc.stdin is not None
        try:
            await self.proc.stdin.send(STOP_BYTE)
        except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
            pass  # already gone

    def terminate(self) -> None:
        self.proc.terminate()

    def kill(self) -> None:
        self.proc.kill()

    def describe_exit(self, code: int) -> str:
        return f"process {_describe_exit(code)}"

    async def aclose(self) -> None:
        await self.proc.aclose()


def _child_command(
    config: EngineConfig, ends: zmq_io.Endpoints, core_factory: EngineCoreFactory | None
) -> list[str]:
    spec = child_spec(config, ends, core_factory)
    # `-c` rather than `-m triollm.actors.process`: importing the package imports this module
    # (AsyncLLM -> transport -> process), so runpy would run a second copy as __main__ (and warn).
    return [sys.executable, "-c", _CHILD_MAIN, msgspec.json.encode(spec).decode()]


def child_config(config: EngineConfig) -> EngineConfig:
    """The config an engine core started elsewhere (a child process, a Ray actor) runs with:
    the parent's resolved `config`, with what is decided here rather than there: it is the
    engine core itself (`multiprocess` off) and its torch threads are counted
    (`default_num_threads()` when `num_threads` is unset). Everything else, dtype, quantization
    and the KV cache's dtype included, is the parent's decision, sent as it is."""
    threads = config.num_threads or default_num_threads()
    actor = dataclasses.replace(config.actor, multiprocess=False)
    return dataclasses.replace(config, num_threads=threads, actor=actor)


def child_spec(
    config: EngineConfig, ends: zmq_io.Endpoints, core_factory: EngineCoreFactory | None
) -> ChildSpec:
    """What an engine core started elsewhere builds itself from: `child_config(config)` and
    the link's addresses. A data-parallel rank's own fields are set by the caller."""
    return ChildSpec(
        encode_config(child_config(config)),
        ends.input_address,
        ends.output_address,
        log.getEffectiveLevel(),
        core_factory,
    )


_CHILD_MAIN = "from triollm.actors.process import main; raise SystemExit(main())"


async def _handshake(sock: zmq.Socket[Any], child: CoreChild) -> Ready:
    stderr = child.stderr
    data: bytes | None = None
    exit_code: int | None = None
    with anyio.move_on_after(HANDSHAKE_TIMEOUT_S) as deadline:
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal exit_code
                exit_code = await child.wait()
                await anyio.sleep(LAST_WORDS_S)  # a StartupError sent just before exiting
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            data = await zmq_io.recv(sock)
            tg.cancel_scope.cancel()
    if deadline.cancelled_caught:
        # The caller's teardown stops the child (SIGTERM, then SIGKILL).
        raise EngineStartupError(
            f"the engine core {child.name} sent neither Ready nor StartupError within "
            f"HANDSHAKE_TIMEOUT_S={HANDSHAKE_TIMEOUT_S:g} s; it is killed",
            stderr.text,
        )
    if data is None:
        with anyio.move_on_after(1):
            await stderr.eof.wait()
        assert exit_code is not None
        raise EngineStartupError(
            f"the engine core {child.describe_exit(exit_code)} before it was ready",
            stderr.text or "(nothing on stderr)",
        )
    try:
        msg = output_decoder.decode(data)
    except msgspec.DecodeError as exc:
        raise EngineStartupError(
            f"the engine core process sent an unreadable handshake: {exc}"
        ) from None
    match msg:
        case Ready():
            return msg
        case StartupError(message=message, traceback=tb):
            raise EngineStartupError(f"the engine core failed to start: {message}", tb)
    raise EngineStartupError(f"the engine core process sent {type(msg).__name__} before Ready")


async def _pump_inputs(
    sock: zmq.Socket[Any],
    inputs: MemoryObjectReceiveStream[CoreInput],
    out_send: MemoryObjectSendStream[CoreOutput],
) -> None:
    """`inputs` → socket. A request the wire cannot carry fails alone, answered as the core
    answers a request it rejects (`RequestError` on the output stream), never the transport:
    the input processor refuses such values first, so this is a backstop."""

    async def refuse(msg: CoreInput, exc: Exception) -> None:
        if not isinstance(msg, AddRequest):
            raise exc
        rid = msg.request.request_id
        log.warning("request %.80s cannot be encoded for the engine core: %r", rid, exc)
        error = RequestError(rid, f"the request cannot be sent to the engine core: {exc}"[:500])
        try:
            await out_send.send(error)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass  # the link is closing: the request ends with it

    await zmq_io.pump_to_socket(sock, inputs, _encoder.encode, on_encode_error=refuse)


async def _output_actor(
    scope: anyio.CancelScope,
    sock: zmq.Socket[Any],
    out_send: MemoryObjectSendStream[CoreOutput],
    child: CoreChild,
) -> None:
    """Socket → `out_send`, and the child's death → `EngineDead`. Ends the stream when done."""
    with scope, out_send:
        exit_code: int | None = None
        async with anyio.create_task_group() as tg:

            async def watch() -> None:
                nonlocal exit_code
                exit_code = await child.wait()
                if exit_code >= 0:  # it exited by itself: let its last message arrive
                    await anyio.sleep(LAST_WORDS_S)
                tg.cancel_scope.cancel()

            tg.start_soon(watch)
            try:
                # Until the child says EngineDead, or nobody reads the stream any more.
                await zmq_io.pump_from_socket(
                    sock, out_send.clone(), output_decoder.decode, until=_is_dead
                )
            except msgspec.DecodeError as exc:
                await out_send.send(EngineDead(f"unreadable message from the engine core: {exc}"))
            tg.cancel_scope.cancel()
            return
        # Only reached when the watcher cancelled the pump: the child died without a word.
        assert exit_code is not None
        await out_send.send(
            EngineDead(f"the engine core {child.describe_exit(exit_code)}", child.stderr.text)
        )


def _is_dead(msg: CoreOutput) -> bool:
    return isinstance(msg, EngineDead)


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = str(-code)
        return f"was killed by signal {name}"
    return f"exited with code {code}"


async def _absorb_pending_cancellation() -> BaseException | None:
    """A native asyncio cancellation that was pending when a shielded teardown began (as when
    `asyncio.run` returns and cancels every task) surfaces at the first await even inside the
    shield. The teardown is owed anyway: take it here and let the caller re-raise it at the end.
    (On trio, and with no such cancellation, this is a plain checkpoint.)"""
    try:
        await anyio.lowlevel.checkpoint()
    except anyio.get_cancelled_exc_class() as exc:
        return exc
    return None


async def _stop(child: CoreChild, grace_s: float) -> None:
    """Wait `grace_s` for the child to exit, then terminate (SIGTERM), then kill (SIGKILL).
    Call shielded."""
    for signal_it, wait_s in (
        (None, grace_s),
        (child.terminate, TERM_GRACE_S),
        (child.kill, KILL_WAIT_S),
    ):
        if child.returncode is not None:
            return
        if signal_it is not None:
            log.warning("engine core %s did not exit; sending %s", child.name, signal_it.__name__)
            try:
                signal_it()
            except ProcessLookupError:
                pass
        with anyio.move_on_after(wait_s):
            await child.wait()
    if child.returncode is None:
        log.error("engine core %s did not exit after it was killed", child.name)


class StderrTail:
    """Forwards the child's stderr to ours and keeps its last characters for error messages."""

    def __init__(self) -> None:
        self.text = ""
        self.eof = anyio.Event()

    async def forward(self, stream: ByteReceiveStream) -> None:
        decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        try:
            async for chunk in stream:
                text = decoder.decode(chunk)
                self.text = (self.text + text)[-STDERR_TAIL_CHARS:]
                try:
                    sys.stderr.write(text)
                    sys.stderr.flush()
                except (OSError, ValueError):
                    pass
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass
        finally:
            self.eof.set()


# ====================================================================== child


def main(argv: list[str] | None = None) -> int:
    """The engine-core process: `python -m triollm.actors.process SPEC_JSON`."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(
            "usage: python -m triollm.actors.process SPEC_JSON (started by the frontend)",
            file=sys.stderr,
        )
        return 2
    spec = msgspec.json.decode(argv[0], type=ChildSpec)
    config = spec.engine_config()
    keys = os.environ.pop(CURVE_KEYS_ENV, None)  # not inherited by anything we start
    curve = zmq_io.ClientKeys.decode(keys) if keys else None
    os.dup2(2, 1)  # nothing reads our stdout: stray prints join stderr, which the parent forwards
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(
        level=spec.log_level,
        format=f"(engine core pid {os.getpid()}) %(levelname)s %(name)s: %(message)s",
    )
    import torch

    # Before any worker thread exists: threads started later inherit the setting (the parent
    # counted them: `child_config`).
    if config.num_threads is not None:
        torch.set_num_threads(config.num_threads)
    try:
        return anyio.run(_child_main, spec, config, curve, backend=CHILD_BACKEND)
    except Exception:
        # Our stderr goes to the parent, which forwards it and keeps its tail for the error.
        log.exception("the engine core process exits on an unexpected error")
        return 1


SHARED_CORES_UP_TO = 4


def default_num_threads() -> int:
    """Torch threads in the engine-core process when `num_threads` is not set: every core on a
    small machine, else one core for the frontend and the rest for the forward pass."""
    import torch

    cores = torch.get_num_threads()
    return cores if cores <= SHARED_CORES_UP_TO else cores - 1


async def _child_main(
    spec: ChildSpec,
    config: EngineConfig,
    curve: zmq_io.ClientKeys | None = None,
    stop_requested: anyio.Event | None = None,
) -> int:
    """The engine core (`config`: `spec.engine_config()`, decoded once by the caller) behind its
    two sockets until it stops. A child process watches its stdin
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
            code = await _run_engine(spec, config, inputs, outputs, stop_requested)
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


async def _run_engine(
    spec: ChildSpec,
    config: EngineConfig,
    inputs: zmq.Socket[Any],
    outputs: zmq.Socket[Any],
    stop_requested: anyio.Event,
) -> int:
    with compute_thread() as compute:
        return await _serve(spec, config, inputs, outputs, stop_requested, compute)


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


async def _shutdown_when_asked(stop_requested: anyio.Event, inputs: MemoryObjectSendStream[CoreInput]) -> None:
    with inputs:
        await stop_requested.wait()
        try:
            inputs.send_nowait(Shutdown())
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            pass


if __name__ == "__main__":
    sys.exit(main())
