"""`EngineRuntime`: the running parts of one `AsyncLLM`, owned by one task group.

```
EngineRuntime ── task group ──┬── core client (actors/transport.py: in-process task, a child
   │                          │     process over ZMQ, or data-parallel ranks)
   │                          ├── OutputActor (core outputs -> Frontend -> RequestStreams)
   │                          └── Watchdog (a silent core with work pending is dead)
   ├── CoreLink (sending, utility calls, the core's death)
   └── Frontend (the request table; engine/frontend/, no awaits)
```

A request's way in is `admit`: process it (in a worker thread when `AsyncLLM` says so), wait for
queue room on the events the output actor sets (`notify_room`), send it; any failure discards it.

Ownership: `async with` on the `AsyncLLM` (or `start()` ... `shutdown()` from one task) enters
the task group here; when nobody entered it, the first use hands the same `start` and
`stop` to a root task of the running loop (`EngineHost`, actors/host.py). Actors never raise
into the task group: the core's death is declared by the output actor on the data path.
Shutdown is cancellation: stop accepting, drain for up to `timeout`, abort the rest (every
stream ends with "abort"), then leave the task group (the transport's teardown is shielded
and bounded).
"""

from __future__ import annotations

import gc
import logging
from collections.abc import Callable
from contextlib import AsyncExitStack

import anyio
from anyio.abc import TaskGroup

from triollm.actors.core_link import CoreLink, InputTap
from triollm.actors.errors import EngineBusyError, EngineDeadError
from triollm.actors.host import EngineHost, ShutdownCall
from triollm.actors.messages import AddRequest
from triollm.actors.output_actor import OutputActor
from triollm.actors.transport import open_core_client
from triollm.actors.watchdog import Watchdog
from triollm.engine.config import EngineConfig
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.frontend import Frontend, InputProcessor, ProcessedRequest, RequestState
from triollm.engine.processing.tokenizer import Tokenizer

__all__ = ["EngineRuntime"]

log = logging.getLogger("triollm")


class EngineRuntime:
    def __init__(
        self,
        config: EngineConfig,
        *,
        chat_template: str | None,
        core_factory: EngineCoreFactory | None,
        input_tap: InputTap | None,
    ) -> None:
        self.config = config
        self.link = CoreLink(input_tap)
        self.frontend: Frontend | None = None  # set once started
        self.tokenizer: Tokenizer | None = None
        self.outputs: OutputActor | None = None
        self._chat_template = chat_template
        self._core_factory = core_factory
        self._stack: AsyncExitStack | None = None
        self._watchdog: Watchdog | None = None
        self._host: EngineHost | None = None  # owns the engine when nobody entered it
        self.idle = anyio.Event()  # set while the request table is empty
        self.idle.set()
        self.room = anyio.Event()  # set (and replaced) when the queue may have shrunk
        self.room_waiters = 0  # adds waiting on it: no new Event per batch when there are none

    @property
    def hosted(self) -> bool:
        """Started on first use: a root task owns it (its start may still be under way)."""
        return self._host is not None

    @property
    def running(self) -> bool:
        link = self.link
        return link.client is not None and link.dead is None and not link.stopping

    # ------------------------------------------------------------------ start

    async def start(self) -> None:
        """Load the tokenizer, start the core (the model loads there), start the actors."""
        if self._stack is not None or self.link.stopping:
            raise RuntimeError("AsyncLLM is already started (or was shut down: create a new one)")
        config = self.config
        stack = AsyncExitStack()
        try:
            self.tokenizer = await anyio.to_thread.run_sync(
                Tokenizer.from_pretrained, config.tokenizer, self._chat_template
            )
            tg: TaskGroup = await stack.enter_async_context(anyio.create_task_group())
            client = await stack.enter_async_context(open_core_client(config, core_factory=self._core_factory))
            self.link.client = client
            processor = InputProcessor(
                config.model,
                self.tokenizer,
                max_logprobs=config.actor.max_logprobs,
                limits=config.limits,
                kv_cache_tokens=client.ready.num_kv_blocks * client.ready.block_size,
                scheduling_policy=config.scheduler.policy,
            )
            self.frontend = Frontend(processor, limits=config.limits, max_num_seqs=config.scheduler.max_num_seqs)
            timeout = config.actor.engine_output_timeout_s
            if timeout is not None:
                self._watchdog = Watchdog(timeout, self._work_pending, self._hung)
            self.outputs = OutputActor(
                self.frontend,
                self.link,
                config.actor.output_chunk_size,
                on_message=self._watchdog.heard if self._watchdog else lambda: None,
                on_progress=self.notify_room,
            )
            await tg.start(self.outputs.run, client.outputs)
            if self._watchdog is not None:
                tg.start_soon(self._watchdog.run)
            gc.collect()  # what is alive after start-up leaves the collector's view: no long
            gc.freeze()  # pauses of the event loop walking torch and the tokenizer under load
        except BaseException:
            # No shield around aclose(): the stack holds a task group entered outside it, and
            # cancel scopes must be left in LIFO order. The transport shields its own teardown.
            try:
                await stack.aclose()
            finally:
                if self.link.client is not None:  # the output actor may never have taken it
                    self.link.client.outputs.close()
                    self.link.client = None
            raise
        self._stack = stack

    async def ensure_started(self) -> None:
        """Start on first use when nobody entered the engine (vLLM's plain-coroutine style): one
        root task of the running loop owns it (actors/host.py). Raises the start-up error."""
        if self._stack is None and self._host is None and not self.link.stopping and self.link.dead is None:
            self._host = EngineHost(self.start, self._shutdown)
            self._host.spawn("triollm AsyncLLM")
        if self._host is not None:
            await self._host.ready.wait()
            if self._host.error is not None:
                raise RuntimeError(f"AsyncLLM failed to start: {self._host.error}") from self._host.error

    def require_running(self) -> None:
        """Raise unless the engine serves: its death (`EngineDeadError`), else not started."""
        if self.link.dead is not None:
            raise self.link.dead_error()
        if not self.running:
            raise RuntimeError(
                "AsyncLLM is not running: use `async with AsyncLLM.from_engine_args(args) as llm:` "
                "(or `await llm.start()` ... `await llm.shutdown()`)"
            )

    # ------------------------------------------------------------------ admission

    async def admit(
        self,
        state: RequestState,
        process: Callable[[], ProcessedRequest],
        *,
        in_thread: bool,
        wait_for_room: bool,
    ) -> None:
        """The way in of a request the frontend has opened (`state`): `process` it (in a worker
        thread when `in_thread`), wait while the frontend says the engine is busy (or raise
        `EngineBusyError` unless `wait_for_room`), send it to the core. On any failure,
        cancellation included, the request is discarded (its id free again) and it re-raises."""
        table = self.frontend
        assert table is not None
        if self.idle.is_set():
            self.idle = anyio.Event()
        try:
            if in_thread:
                processed = await anyio.to_thread.run_sync(process)
                self.require_running()
            else:
                processed = process()
            while not state.abort_requested and (busy := table.busy(processed)) is not None:
                if not wait_for_room:
                    raise EngineBusyError(f"the engine is busy: {busy}; retry later")
                self.room_waiters += 1
                try:
                    await self.room.wait()
                finally:
                    self.room_waiters -= 1
                self.require_running()
            for core_request in table.add(processed):
                await self.link.send_or_raise(AddRequest(core_request))
        except BaseException:
            table.discard(state.request_id)
            self.check_idle()
            raise

    # ------------------------------------------------------------------ shutdown

    def shutdown(self, timeout: float) -> ShutdownCall:
        if self._stack is not None or self._host is not None:  # never started: a no-op
            self.link.stopping = True
        if self._host is not None:
            self._host.stop(timeout)
        return ShutdownCall(self._shutdown, timeout)

    async def _shutdown(self, timeout: float) -> None:  # noqa: ASYNC109
        host = self._host
        if host is not None and not host.in_host_task():
            await host.done.wait()
            return
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self.link.stopping = True
        try:
            if timeout > 0:
                with anyio.move_on_after(timeout):
                    await self.idle.wait()
        finally:
            if self.frontend is not None:  # even when the drain was cancelled: every stream ends
                self.link.abort(self.frontend.abort(self.frontend.request_ids()))
                self.notify_room()
            if self._watchdog is not None:
                self._watchdog.cancel()
            try:
                await stack.aclose()  # not shielded: see start()
            finally:
                self.link.client = None
        if self.link.dead is not None:
            log.warning("engine was dead at shutdown: %s", self.link.dead)

    # ------------------------------------------------------------------ wake-ups

    def notify_room(self) -> None:
        """Wake the adds waiting for room (they check again); free when nobody waits."""
        if self.room_waiters:
            self.room.set()
            self.room = anyio.Event()

    def check_idle(self) -> None:
        if self.frontend is None or not self.frontend.num_requests:
            self.idle.set()

    def _work_pending(self) -> bool:
        """What the watchdog waits on: utility calls, or sequences the core should be stepping
        (requests frozen by `pause_generation(mode="keep")` are not)."""
        return self.link.calls_pending or (self.frontend is not None and self.frontend.has_pending_work)

    def _hung(self, error: EngineDeadError) -> None:
        if self.link.client is not None:
            self.link.client.shutdown_grace_s = 0.0  # its step will not end: no grace
        if self.outputs is not None:
            self.outputs.die(error)
