"""The engine core in a child process, linked to the frontend by ZMQ: the parent's side.

`open_process_core(config)` yields the same `CoreClient` as the in-process transport. The child
is `python -m triollm.actors.child SPEC` (actors/child.py: its program, and the contract this
side writes: `ChildSpec`, the CURVE keys in its environment, `STOP_BYTE` on its stdin). SPEC
(JSON) holds the parent's resolved `EngineConfig` itself (`child_config`: multiprocess off, the
threads counted), the two socket addresses, the log level and, for tests and benchmarks only,
an `EngineCoreFactory`. The child never resolves anything again, so the two processes cannot
disagree about dtype, quantization, threads or the KV cache's dtype.

```
parent                                              child (actors/child.py, its own interpreter)
client.inputs ─▶ pump_to_socket ─▶ PUSH ══ipc/tcp══▶ PULL ─▶ pump_from_socket ─▶ serve_engine_core
client.outputs ◀─ output actor ◀── PULL ◀═ipc/tcp═══ PUSH ◀─ pump_to_socket ◀──┘   (steps in a thread)
                   (+ watcher on proc.wait())
stderr pipe ─▶ forwarded to our stderr (tail kept)   stdin pipe ─▶ watchdog: EOF = the parent is gone
```

Start-up is a handshake on the output socket: the child sends `Ready` (what it measured) or
`StartupError` (message and traceback), and the parent raises `EngineStartupError` for the
latter, or when the child exits first (exit code and the tail of its stderr), or when the
handshake is not one of those. The parent binds, the child connects, so the child never needs
a free port or a path of its own. `link_core` (the handshake, the pumps, the watcher, the
teardown) serves a child process and a Ray actor (actors/ray_core.py) alike: a `CoreChild`.

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
- The parent's death, however it dies, ends the child: only the parent holds the write end of
  the child's stdin, and the child exits on EOF (actors/child.py says what was rejected).

Torch runs `num_threads` intra-op threads in the child. Unset (AsyncLLM, the server): every core
torch would use on a machine of up to `SHARED_CORES_UP_TO` cores, one fewer above. On the 2-core
machine the server with 2 engine threads beat 1 at every concurrency tried (docs/benchmarks.md,
Threads); the streaming frontend's share is small next to half the forward pass. On larger
machines one core stays with the frontend (vLLM's reserve): an OpenMP region waits for its
slowest thread, and a thread that shares its core with the frontend is that thread (not measured
here). The offline `LLM` always takes every core (docs/benchmarks.md, Threads).
"""

from __future__ import annotations

import codecs
import dataclasses
import logging
import math
import os
import signal
import sys
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
from triollm.actors.child import CURVE_KEYS_ENV, STOP_BYTE, ChildSpec
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
    output_decoder,
)
from triollm.engine.config import EngineConfig
from triollm.engine.config_codec import encode_config
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.log_safe import log_safe

__all__ = [
    "CoreChild",
    "EngineStartupError",
    "StderrTail",
    "child_config",
    "child_spec",
    "default_num_threads",
    "link_core",
    "open_process_core",
]

log = logging.getLogger("triollm")

TERM_GRACE_S = 2.0  # after SIGTERM
KILL_WAIT_S = 5.0  # after SIGKILL (only a process stuck in the kernel takes longer)
LAST_WORDS_S = 0.5  # a child that exited by itself: time for its last message to arrive
STDERR_TAIL_CHARS = 4000
# The child must answer the handshake (Ready or StartupError) within this many seconds, or it is
# killed and start-up fails naming this setting. Generous: loading a large model from a slow disk
# takes minutes.
HANDSHAKE_TIMEOUT_S = 600.0
CHILD_MODULE = "triollm.actors.child"  # run with `python -m`


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


_encoder = msgspec.msgpack.Encoder()


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
                    yield (
                        client := CoreClient(ready, in_send, out_recv, child.pid, SHUTDOWN_GRACE_S)
                    )
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
    # runpy runs the child's module as __main__: nothing it imports may import it back (that
    # would be a second copy, and a warning), which the import-cycle test keeps true.
    return [sys.executable, "-m", CHILD_MODULE, msgspec.json.encode(spec).decode()]


def child_config(config: EngineConfig) -> EngineConfig:
    """The config an engine core started elsewhere (a child process, a Ray actor) runs with:
    the parent's resolved `config`, with what is decided here rather than there: it is the
    engine core itself (`multiprocess` off) and its torch threads are counted
    (`default_num_threads()` when `num_threads` is unset). Everything else, dtype, quantization
    and the KV cache's dtype included, is the parent's decision, sent as it is."""
    threads = config.num_threads or default_num_threads()
    actor = dataclasses.replace(config.actor, multiprocess=False)
    return dataclasses.replace(config, num_threads=threads, actor=actor)


SHARED_CORES_UP_TO = 4


def default_num_threads() -> int:
    """Torch threads in the engine-core process when `num_threads` is not set: every core on a
    small machine, else one core for the frontend and the rest for the forward pass."""
    import torch

    cores = torch.get_num_threads()
    return cores if cores <= SHARED_CORES_UP_TO else cores - 1


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
        log.warning("request %s cannot be encoded for the engine core: %r", log_safe(rid, 80), exc)
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
