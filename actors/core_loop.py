"""The engine-core loop: the one place an engine core is driven, in-process or in a child process
(a `Core`: `EngineCore`, or `PoolingEngineCore` for a pooling model).

It owns the core. Between steps it applies the queued inputs without waiting (adds, aborts, utility
calls), then runs `step()` in the core's compute thread (`actors/compute.py`: the one thread that
built the core) so the event loop stays free for the transport's actors; with nothing to do it waits
on the input stream (no polling). One message per step that runs: its outputs, or, when it has
none (a prompt chunk that is not the prompt's last, a wait for grammars compiling in their
threads: the core counts that wait as a step, engine/core.py), a heartbeat (an `OutputBatch`
with no entries, carrying the core's statistics: actors/messages.py). So the core is heard after
every step, however many steps a long prompt takes, and the watchdogs (actors/watchdog.py) see
silence only when a step does not end, or when the loop waits for input with requests it cannot
schedule (`stuck`: nothing to step, so nothing to report). The rate is at most one message per
step, and a step with nothing to report is a prompt chunk (long) or a wait for grammars (at most
one per `_GRAMMAR_WAIT_S` of engine/core.py). While requests run, at most
`MAX_INPUTS_PER_STEP` inputs (an abort counting once per request id) are applied between two steps,
then the loop steps before taking more: a burst of a million aborts or adds delays the running
requests by a step per batch instead of stopping them until the whole burst is applied. With nothing
to step (idle, stuck or paused) it applies inputs as they come. `UtilityOp.PAUSE` stops stepping
(requests keep their place and their KV blocks; adds and aborts are still applied) until
`UtilityOp.RESUME`. The utility calls that reach the device (sleep, wake-up, weight reload,
`collective_rpc`, the profiler: `_METHODS`) run in the compute thread, as steps do, with a
heartbeat every `BUSY_HEARTBEAT_S` while they run; the others are bookkeeping and run here. A
`Shutdown` message or the end of the input stream ends it cleanly.

A step still running when the loop is cancelled (a hung forward pass, after the transport's
grace period) is abandoned in its thread and logged, so the teardown stays bounded.

A bad request is answered with `RequestError` and the loop goes on. An exception in a step is the
engine's death: `EngineDead` (with the traceback) is sent, and the exception propagates so a
child process exits non-zero. Callers that must not raise (the in-process transport) catch it.
"""

from __future__ import annotations

import logging
import pickle
import time
import traceback
from typing import Any

import anyio
import cloudpickle
from anyio.abc import ObjectSendStream
from anyio.streams.memory import MemoryObjectReceiveStream

from triollm.actors.compute import ComputeThread
from triollm.actors.messages import (
    AbortRequests,
    AddRequest,
    CoreInput,
    CoreOutput,
    EngineDead,
    OutputBatch,
    RequestError,
    Shutdown,
    UtilityCall,
    UtilityOp,
    UtilityResult,
)
from triollm.engine.core_protocol import Core, EngineCoreStats
from triollm.engine.log_safe import log_safe
from triollm.engine.request import EngineCoreOutput

__all__ = ["BUSY_HEARTBEAT_S", "MAX_INPUTS_PER_STEP", "serve_engine_core"]

log = logging.getLogger("triollm")

# Inputs applied between two steps while requests run. An add or a utility call costs one, an
# abort one per request id (a message is applied whole, so one large abort may exceed it).
# Applying one input costs microseconds, a step milliseconds: 256 keeps the added latency per
# step small and still drains a burst at ~256 inputs per step.
MAX_INPUTS_PER_STEP = 256
# While a utility call runs on the device: a heartbeat this often (`_device_call`), well inside
# any `engine_output_timeout_s` a user would set.
BUSY_HEARTBEAT_S = 0.5


async def serve_engine_core(
    core: Core,
    inputs: MemoryObjectReceiveStream[CoreInput],
    outputs: ObjectSendStream[CoreOutput],
    compute: ComputeThread,
) -> None:
    async with inputs, outputs:
        stuck = False  # the last step scheduled nothing: wait for input rather than spin
        paused = False
        applied = 0  # the cost of the inputs applied since the last step
        while True:
            if core.has_unfinished_requests() and not stuck and not paused:
                msg: CoreInput | None = None
                if applied < MAX_INPUTS_PER_STEP:
                    try:
                        msg = inputs.receive_nowait()
                    except anyio.WouldBlock:
                        pass
                    except anyio.EndOfStream:
                        return
                if msg is None:  # stepping outside the except block keeps tracebacks clean
                    before = core.num_steps
                    result = await _step(core, outputs, compute)
                    stuck = core.num_steps == before
                    if result or not stuck:  # its outputs, or a heartbeat: the core steps
                        await outputs.send(OutputBatch.from_outputs(result, core.statistics(), time.monotonic()))
                    applied = 0
                    continue
            else:
                try:
                    msg = await inputs.receive()
                except anyio.EndOfStream:
                    return
            applied += max(1, len(msg.request_ids)) if isinstance(msg, AbortRequests) else 1
            match msg:
                case Shutdown():
                    return
                case UtilityCall(call_id=cid, op=UtilityOp.PAUSE | UtilityOp.RESUME as op):
                    paused = op == UtilityOp.PAUSE
                    await outputs.send(UtilityResult(cid, True))
                    continue
            stuck = False
            if isinstance(msg, UtilityCall) and msg.op in _METHODS:  # the device's work: its thread
                reply: CoreOutput | None = await _device_call(core, msg, outputs, compute)
            else:
                reply = _apply(core, msg)
            if reply is not None:
                await outputs.send(reply)


async def _step(core: Core, outputs: ObjectSendStream[CoreOutput], compute: ComputeThread) -> list[EngineCoreOutput]:
    # A step blocked for good (a deadlocked forward pass) must not block the teardown past its
    # bound: on cancellation its thread is abandoned (it holds the core, which nobody touches
    # again) and reported.
    try:
        result = await compute.run(core.step)
    except anyio.get_cancelled_exc_class():
        log.warning("engine core step still running at cancellation: its thread is abandoned")
        raise
    except Exception as exc:
        log.error("engine core failed: %r", exc)
        with anyio.CancelScope(shield=True), anyio.move_on_after(1):
            await outputs.send(EngineDead(f"engine core failed: {exc!r}", traceback.format_exc()))
        raise
    return result


async def _device_call(
    core: Core, msg: UtilityCall, outputs: ObjectSendStream[CoreOutput], compute: ComputeThread
) -> CoreOutput | None:
    """Run a utility call that reaches the device in the compute thread, sending a heartbeat
    (an `OutputBatch` with no entries and no statistics) every `BUSY_HEARTBEAT_S` meanwhile: a
    wake-up or a weight reload reads a whole checkpoint, and a core that loads is busy, not hung
    (actors/watchdog.py). A `collective_rpc` bounds its own wait with `timeout`."""
    async with anyio.create_task_group() as tg:

        async def beat() -> None:
            while True:
                await anyio.sleep(BUSY_HEARTBEAT_S)
                await outputs.send(OutputBatch([], [], [], [], []))

        tg.start_soon(beat)
        reply = await compute.run(_apply, core, msg)
        tg.cancel_scope.cancel()
    return reply


def _apply(core: Core, msg: CoreInput) -> CoreOutput | None:
    match msg:
        case AddRequest(request=req):
            try:
                core.add_request(req)
            except ValueError as exc:
                return RequestError(req.request_id, str(exc))
            except Exception as exc:  # unexpected, but confined to this request
                log.exception("request %s failed", log_safe(req.request_id))
                core.abort_requests([req.request_id])
                return RequestError(req.request_id, repr(exc), kind=type(exc).__name__)
        case AbortRequests(request_ids=ids):
            core.abort_requests(ids)
        case UtilityCall(call_id=cid, op=op, payload=payload):
            try:
                return UtilityResult(cid, _utility(core, op, payload))
            except Exception as exc:
                return UtilityResult(cid, None, error=f"{type(exc).__name__}: {exc}")
    return None


# The ops that call the core's method of that name with the call's arguments (UtilityOp).
_METHODS = {
    UtilityOp.SLEEP: "sleep",
    UtilityOp.WAKE_UP: "wake_up",
    UtilityOp.IS_SLEEPING: "is_sleeping",
    UtilityOp.RELOAD_WEIGHTS: "reload_weights",
    UtilityOp.COLLECTIVE_RPC: "collective_rpc",
    UtilityOp.START_PROFILE: "start_profile",
    UtilityOp.STOP_PROFILE: "stop_profile",
}


def _utility(core: Core, op: UtilityOp, payload: bytes) -> EngineCoreStats | bool | bytes:
    name = _METHODS.get(op)
    if name is not None:
        args: tuple[Any, ...]
        kwargs: dict[str, Any]
        args, kwargs = pickle.loads(payload) if payload else ((), {})
        result: bytes = cloudpickle.dumps(getattr(core, name)(*args, **kwargs))
        return result
    match op:
        case UtilityOp.STATISTICS:
            return core.statistics()
        case UtilityOp.RESET_PREFIX_CACHE:
            return core.reset_prefix_cache()
        case UtilityOp.CHECK_INTEGRITY:
            core.check_integrity()
            return True
        case UtilityOp.PAUSE | UtilityOp.RESUME:
            raise RuntimeError(f"{op.name} is the loop's own state, not the core's")
    raise RuntimeError(f"{op.name}: no such utility call")
