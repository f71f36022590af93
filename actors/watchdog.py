"""`Watchdog`: an engine core that is alive but silent is dead.

Busy is not hung. The core loop (actors/core_loop.py) sends a message after every step it runs,
a heartbeat when the step had no outputs (a prompt chunk that is not the prompt's last, a wait
for grammars), so a core that steps is heard however long its work: a prompt prefilled over many
minutes in many chunks is never silent. What stays silent is a core whose step does not end (a
deadlocked forward pass, a stopped process) or that stopped stepping with work queued. A single
step longer than `timeout` reads as a hang too, which is why the scheduler bounds a step's
prompt tokens by time as well as by count (`MAX_PREFILL_STEP_S`, engine/scheduling/scheduler.py);
without chunked prefill a whole prompt is one step, and `engine_output_timeout_s` must exceed the
longest prompt's time.

With work pending (`pending()`: utility calls awaiting an answer, or sequences the core should be
stepping) and no message from the core for `timeout` seconds (`engine_output_timeout_s`), it
calls `on_hung` with the `EngineDeadError` to declare, like any other death (`EngineDeadError`
on every stream, `errored`, new requests refused, `check_health` raises). The core itself is
torn down by the usual bounded teardown at shutdown (a hung in-process step's thread is
abandoned; a hung child is killed). It checks every `timeout / 8`, so the death is declared
between `timeout` and `1.125 * timeout` after the last message.

One watchdog is one clock. The frontend runs one over everything the core client delivers;
with data parallel (`actors/data_parallel.py`) each rank's forwarder runs one more over that
rank alone (its `pending`: the rank owes a message), so a rank that hangs while the others
produce is found too, and its death names the rank.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import anyio

from triollm.actors.errors import EngineDeadError

__all__ = ["Watchdog"]

log = logging.getLogger("triollm")


class Watchdog:
    def __init__(
        self, timeout: float, pending: Callable[[], bool], on_hung: Callable[[EngineDeadError], None]
    ) -> None:
        self.timeout = timeout
        self._pending = pending
        self._on_hung = on_hung
        self._scope = anyio.CancelScope()
        self._last = 0.0  # when the core last sent anything (the event loop's clock)

    def heard(self) -> None:
        """The core sent something (the output actor calls this for every message, heartbeats
        included; a data-parallel forwarder for every message of its rank it delivered)."""
        self._last = anyio.current_time()

    def cancel(self) -> None:
        self._scope.cancel()

    async def run(self) -> None:
        timeout = self.timeout
        with self._scope:
            self._last = anyio.current_time()
            while True:
                await anyio.sleep(timeout / 8)
                now = anyio.current_time()
                if not self._pending():
                    self._last = now
                elif now - self._last >= timeout:
                    silent = now - self._last
                    log.error("no output from the engine core for %.1f s with work pending", silent)
                    self._on_hung(
                        EngineDeadError(
                            f"the engine core sent nothing for {silent:.1f} s with work pending "
                            f"(engine_output_timeout_s={timeout}): it is hung"
                        )
                    )
                    return
