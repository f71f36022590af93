"""`CoreLink`: the frontend's end of the link to its engine core, however the core runs.

It sends (through the optional input tap), makes utility calls and wakes their waiters, and
holds the core's death as the frontend learned it. `AsyncLLM` owns one from construction; the
transport's `CoreClient` is attached while the engine runs (`client`, None before start and
after shutdown). The output actor feeds it `UtilityResult`s and the death; nothing here waits
except the callers of `call`, `send_or_raise` and `wait_dead`.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import anyio

from triollm.actors.core_client import CoreClient
from triollm.actors.errors import EngineDeadError
from triollm.actors.messages import (
    AbortRequests,
    CoreInput,
    UtilityCall,
    UtilityOp,
    UtilityResult,
)
from triollm.engine.core_protocol import EngineCoreStats

__all__ = ["DEATH_REPORT_WAIT_S", "CoreLink", "InputTap"]

# A core that stopped taking inputs reports its death through the output stream: how long a
# caller that found the inputs closed waits for that report (it is normally there at once).
DEATH_REPORT_WAIT_S = 5.0
# Called with every message the frontend sends to the engine core; returns what to send.
InputTap = Callable[[CoreInput], CoreInput]


_VALUE_ERROR = "ValueError: "  # how the core loop writes a ValueError's text (actors/core_loop.py)


class CoreLink:
    def __init__(self, tap: InputTap | None = None) -> None:
        self.client: CoreClient | None = None
        self.dead: EngineDeadError | None = None
        self.stopping = False  # shutting down: a closed input is no death to wait for
        self._tap = tap
        self._dead_event = anyio.Event()
        self._calls: dict[int, tuple[anyio.Event, list[UtilityResult]]] = {}
        self._call_ids = itertools.count()

    # ------------------------------------------------------------------ death

    def dead_error(self) -> EngineDeadError:
        """A fresh error each time: one shared instance would collect every raiser's traceback."""
        assert self.dead is not None
        return EngineDeadError(str(self.dead))

    def die(self, error: EngineDeadError) -> bool:
        """Record the core's death (the first one counts); wakes every utility call. True if
        this was the death."""
        if self.dead is not None:
            return False
        self.dead = error
        self._dead_event.set()
        self.wake_calls()
        return True

    async def wait_dead(self) -> EngineDeadError:
        await self._dead_event.wait()
        assert self.dead is not None
        return self.dead

    # ------------------------------------------------------------------ sending

    def send(self, msg: CoreInput, quiet: bool = False) -> None:
        """Send without waiting (the input stream is unbounded). A closed link raises
        `EngineDeadError`, unless `quiet` (aborts: nothing to abort in a dead core)."""
        if self._tap is not None:
            msg = self._tap(msg)
        try:
            if self.client is None:
                raise anyio.ClosedResourceError
            self.client.inputs.send_nowait(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            if not quiet:
                if self.dead is not None:
                    raise self.dead_error() from None
                raise EngineDeadError("the engine core is not accepting requests") from None

    def abort(self, core_ids: list[str]) -> None:
        """Tell the core to abort these requests (nothing to do for a dead one)."""
        if core_ids and self.dead is None:
            self.send(AbortRequests(core_ids), quiet=True)

    async def send_or_raise(self, msg: CoreInput) -> None:
        """`send` for callers that can wait. A core that no longer takes inputs has died (or is
        being shut down): its death report follows on the output stream, so wait for it
        (briefly) before raising, so that the error carries the cause and the death is known."""
        try:
            self.send(msg)
        except EngineDeadError:
            if self.dead is None and not self.stopping:
                with anyio.move_on_after(DEATH_REPORT_WAIT_S):
                    await self._dead_event.wait()
            if self.dead is not None:
                raise self.dead_error() from None
            raise

    # ------------------------------------------------------------------ utility calls

    @property
    def calls_pending(self) -> bool:
        return bool(self._calls)

    async def call(self, op: UtilityOp, payload: bytes = b"") -> EngineCoreStats | bool | bytes | None:
        """Ask the core and wait for its answer; `EngineDeadError` if it dies first. A
        `ValueError` in the core (bad arguments) is raised as one here, anything else as a
        `RuntimeError` with the core's error text."""
        cid = next(self._call_ids)
        done = anyio.Event()
        slot: list[UtilityResult] = []
        self._calls[cid] = (done, slot)
        try:
            await self.send_or_raise(UtilityCall(cid, op, payload))
            await done.wait()
        finally:
            self._calls.pop(cid, None)
        if not slot:
            raise self.dead_error() if self.dead else EngineDeadError("the engine core stopped")
        error = slot[0].error
        if error is not None:
            if error.startswith(_VALUE_ERROR):
                raise ValueError(error.removeprefix(_VALUE_ERROR))
            raise RuntimeError(error)
        return slot[0].result

    def on_result(self, msg: UtilityResult) -> None:
        waiter = self._calls.get(msg.call_id)
        if waiter is not None:
            waiter[1].append(msg)
            waiter[0].set()

    def wake_calls(self) -> None:
        """No answer will come (the output stream ended): every waiting call ends now."""
        for done, _ in self._calls.values():
            done.set()
