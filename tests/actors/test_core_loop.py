"""The engine-core loop over memory streams, with a fake core: inputs between steps are bounded.

The fake records, at each step, how many aborts it had been given, so a test can tell whether
the loop stepped in the middle of a burst of inputs.
"""

from __future__ import annotations

import math
from typing import Any

import anyio
import pytest

from triollm.actors.compute import compute_thread
from triollm.actors.core_loop import MAX_INPUTS_PER_STEP, serve_engine_core
from triollm.actors.messages import (
    AbortRequests,
    CoreInput,
    CoreOutput,
    OutputBatch,
    Shutdown,
    UtilityCall,
    UtilityOp,
    UtilityResult,
)
from triollm.engine.core_protocol import EngineCoreStats

pytestmark = pytest.mark.anyio


class FakeCore:
    """What the loop calls on a core; one request that never finishes keeps it stepping."""

    def __init__(self, running: bool = True) -> None:
        self.running = running
        self.num_steps = 0
        self.aborted = 0  # request ids aborted so far
        self.aborts_at_step: list[int] = []

    def has_unfinished_requests(self) -> bool:
        return self.running

    def step(self) -> list[Any]:
        self.num_steps += 1
        self.aborts_at_step.append(self.aborted)
        return []

    def add_request(self, request: Any) -> None:
        raise AssertionError("not used here")

    def abort_requests(self, request_ids: list[str]) -> None:
        self.aborted += len(request_ids)

    def statistics(self) -> EngineCoreStats:
        return EngineCoreStats(num_running=int(self.running), num_preemptions=self.num_steps)


async def serve(core: FakeCore, messages: list[CoreInput]) -> list[CoreOutput]:
    """Queue every message, then run the loop until it ends; return what it sent."""
    send_in, receive_in = anyio.create_memory_object_stream[CoreInput](math.inf)
    send_out, receive_out = anyio.create_memory_object_stream[CoreOutput](math.inf)
    with send_in:
        for msg in messages:
            send_in.send_nowait(msg)
    with anyio.fail_after(30), compute_thread() as compute:
        await serve_engine_core(core, receive_in, send_out, compute)  # type: ignore[arg-type]
    with receive_out:
        return [msg async for msg in receive_out]


async def test_a_burst_of_aborts_does_not_stop_stepping() -> None:
    core = FakeCore()
    burst = 10_000
    await serve(core, [*(AbortRequests([f"r{i}"]) for i in range(burst)), Shutdown()])
    assert core.aborted == burst
    assert core.aborts_at_step and core.aborts_at_step[0] < burst  # stepped during the burst
    gaps = [b - a for a, b in zip([0, *core.aborts_at_step], core.aborts_at_step)]
    assert max(gaps) <= MAX_INPUTS_PER_STEP
    assert core.num_steps >= burst // MAX_INPUTS_PER_STEP


async def test_an_abort_counts_once_per_request_id() -> None:
    core = FakeCore()
    ids = [f"r{i}" for i in range(100)]
    await serve(core, [*(AbortRequests(ids) for _ in range(10)), Shutdown()])
    assert core.aborted == 1_000
    gaps = [b - a for a, b in zip([0, *core.aborts_at_step], core.aborts_at_step)]
    assert max(gaps) <= MAX_INPUTS_PER_STEP + len(ids)  # a message is applied whole


async def test_idle_and_paused_cores_apply_inputs_without_stepping() -> None:
    idle = FakeCore(running=False)
    await serve(idle, [*(AbortRequests([f"r{i}"]) for i in range(1_000)), Shutdown()])
    assert (idle.aborted, idle.num_steps) == (1_000, 0)

    paused = FakeCore()
    pause, resume = UtilityCall(1, UtilityOp.PAUSE), UtilityCall(2, UtilityOp.RESUME)
    aborts = [AbortRequests([f"r{i}"]) for i in range(1_000)]
    out = await serve(paused, [pause, *aborts, resume, *aborts[:10], Shutdown()])
    assert paused.aborted == 1_010
    assert paused.aborts_at_step and paused.aborts_at_step[0] == 1_000  # nothing while paused
    assert [m for m in out if isinstance(m, UtilityResult)] == [
        UtilityResult(1, True),
        UtilityResult(2, True),
    ]


class StuckCore(FakeCore):
    """Requests it cannot schedule: its step counts no step (the scheduler found nothing to run)."""

    def step(self) -> list[Any]:
        return []


async def test_every_step_is_heard_and_a_stuck_core_is_silent() -> None:
    """A step without outputs (a prompt chunk that is not the last, a wait for grammars) sends a
    heartbeat, an `OutputBatch` with no entries and the statistics after that step; a core that
    could schedule nothing sends nothing and waits for input, so the watchdog sees it silent."""
    core = FakeCore()
    aborts = [AbortRequests([f"r{i}"]) for i in range(3 * MAX_INPUTS_PER_STEP)]
    out = await serve(core, [*aborts, Shutdown()])
    beats = [m for m in out if isinstance(m, OutputBatch)]
    assert len(beats) == len(out) == core.num_steps >= 3  # one message per step, nothing else
    assert all(b.is_heartbeat for b in beats)
    assert [b.stats.num_preemptions for b in beats if b.stats] == list(range(1, core.num_steps + 1))

    stuck = StuckCore()
    assert await serve(stuck, [*aborts, Shutdown()]) == []
