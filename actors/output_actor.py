"""The output actor: the engine core's messages, applied to the frontend as they arrive.

One task reads the core client's output stream until it ends. Every message is the watchdog's
news that the core lives (`on_message`), a heartbeat (an `OutputBatch` with no entries) too, and
a heartbeat is nothing more: its statistics become `last_stats`, and it reaches no request and
wakes no waiting add. Step outputs go to
`Frontend.on_outputs` in chunks of `output_chunk_size` with a checkpoint between chunks, so
that one large step does not hold the event loop; stop strings come back as aborts. Per-request
errors fail their request alone; utility results wake their callers (`CoreLink`). The core's
death (an `EngineDead` message, the stream ending while nobody shuts down, or a bug here) is
declared once: `EngineDeadError` into every stream (the data path) and to every waiting call.
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Callable

import anyio
import anyio.lowlevel
from anyio.abc import TaskStatus
from anyio.streams.memory import MemoryObjectReceiveStream

from triollm.actors.core_link import CoreLink
from triollm.actors.errors import EngineDeadError, EngineGenerateError
from triollm.actors.messages import (
    CoreOutput,
    EngineDead,
    OutputBatch,
    RequestError,
    UtilityResult,
)
from triollm.engine.core_protocol import EngineCoreStats
from triollm.engine.frontend import Frontend

__all__ = ["OutputActor"]

log = logging.getLogger("triollm")


class OutputActor:
    def __init__(
        self,
        frontend: Frontend,
        link: CoreLink,
        chunk_size: int,
        *,
        on_message: Callable[[], None],
        on_progress: Callable[[], None],
    ) -> None:
        """`on_message` runs for every message (the watchdog's clock); `on_progress` after each
        one that may have ended requests or freed queue room (adds waiting for room retry)."""
        self.frontend = frontend
        self.link = link
        self.chunk_size = chunk_size
        self.last_stats: EngineCoreStats | None = None
        self._on_message = on_message
        self._on_progress = on_progress

    async def run(
        self,
        outputs: MemoryObjectReceiveStream[CoreOutput],
        *,
        task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED,
    ) -> None:
        task_status.started()
        try:
            async with outputs:
                async for msg in outputs:
                    self._on_message()
                    match msg:
                        case OutputBatch() if msg.is_heartbeat:
                            self.last_stats = msg.stats or self.last_stats
                            continue  # no request advanced: no progress to report
                        case OutputBatch():
                            await self._on_batch(msg)
                        case RequestError(request_id=core_id, kind=kind, message=message):
                            error = ValueError(message) if kind == "ValueError" else EngineGenerateError(message)
                            self.link.abort(self.frontend.on_request_error(core_id, error))
                        case UtilityResult():
                            self.link.on_result(msg)
                        case EngineDead(message=message, traceback=tb):
                            self.die(EngineDeadError(f"{message}\n{tb}".rstrip()))
                            return
                        case _:
                            log.warning("unexpected message from the engine core: %r", msg)
                    self._on_progress()
            if not self.link.stopping:
                self.die(EngineDeadError("the engine core stopped unexpectedly"))
        except Exception as exc:  # a bug here must not hang the requests: it kills the engine
            log.exception("output actor failed")
            self.die(EngineDeadError(f"output processing failed: {exc!r}\n{traceback.format_exc()}"))
        finally:
            self.link.wake_calls()

    async def _on_batch(self, batch: OutputBatch) -> None:
        if batch.stats is not None:
            self.last_stats = batch.stats
        outputs = batch.to_outputs()
        if batch.pooled is not None:  # a pooling model's step: embeddings, no tokens
            self.frontend.on_pooled(outputs)
            return
        size = self.chunk_size
        for start in range(0, len(outputs), size):
            if start:
                await anyio.lowlevel.checkpoint()
            processed = self.frontend.on_outputs(outputs[start : start + size], batch.timestamp or None)
            self.link.abort(processed.reqs_to_abort)

    def die(self, error: EngineDeadError) -> None:
        """Declare the core dead (once): every request's stream and every call get the error."""
        if not self.link.die(error):
            return
        log.error("engine core died: %s", error)
        self.frontend.fail(lambda: EngineDeadError(str(error)))
        self._on_progress()
