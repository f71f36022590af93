"""An engine that is alive but silent is dead: the output-progress watchdog, with an in-process
core whose forward pass blocks a real thread (`hang_at_step`), and a shutdown that abandons that
thread instead of waiting for it; and with an engine-core child process stopped by SIGSTOP, which
the shutdown kills.

On trio the clock is trio's MockClock (a 60 s timeout costs nothing) for the in-process core: it
hangs at its first step, so no real step runs while virtual time matters. On asyncio, and for the
child process, the timeout is short and real.
"""

from __future__ import annotations

import logging
import os
import signal
import time
from collections.abc import Callable
from contextlib import aclosing
from typing import Any

import anyio
import psutil
import pytest
from trio.testing import MockClock

import triollm.actors.process as process_module
import triollm.actors.transport as transport_module
from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.engine.execution.scripted_runner import HUNG_STEP_RELEASE, SCRIPTED, hang_at_step
from triollm.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

BACKENDS = [
    pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock"),
    pytest.param("asyncio", id="asyncio"),
]


def _timeout(anyio_backend: Any) -> float:
    return 60.0 if anyio_backend != "asyncio" else 0.5


@pytest.fixture
def release_hung_steps() -> Any:
    HUNG_STEP_RELEASE.clear()
    yield
    HUNG_STEP_RELEASE.set()  # the abandoned thread returns: nothing outlives the test


@pytest.mark.parametrize("anyio_backend", BACKENDS)
async def test_a_silent_engine_is_declared_dead_and_shutdown_abandons_its_thread(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
    anyio_backend: Any,
    release_hung_steps: None,
    caplog: pytest.LogCaptureFixture,
) -> None:
    timeout = _timeout(anyio_backend)
    args = inproc_engine_args(engine_output_timeout_s=timeout)
    llm = AsyncLLM.from_engine_args(args, engine_core_factory=hang_at_step(1, scripted=True))
    errors: list[BaseException] = []

    async def consume() -> None:
        try:
            async with aclosing(llm.generate("hello", SamplingParams(max_tokens=5), "hung")) as agen:
                async for _ in agen:
                    pass
        except EngineDeadError as exc:
            errors.append(exc)

    async with anyio.create_task_group() as tg:
        await llm.start()
        try:
            t0 = anyio.current_time()
            tg.start_soon(consume)
            dead = await llm.wait_errored()
            waited = anyio.current_time() - t0
            assert timeout <= waited <= 1.5 * timeout, waited
            assert "engine_output_timeout_s" in str(dead)
            assert llm.errored
            with pytest.raises(EngineDeadError):
                await llm.check_health()
            with pytest.raises(EngineDeadError):
                await llm.add_request("later", "hello", SamplingParams(max_tokens=2))
            # Shutdown is bounded although the step's thread never returns.
            t0 = anyio.current_time()
            await llm.shutdown()
            assert anyio.current_time() - t0 < transport_module.SHUTDOWN_GRACE_S + 2
        finally:
            HUNG_STEP_RELEASE.set()
            await llm.shutdown()
    assert len(errors) == 1
    assert any("abandoned" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("anyio_backend", BACKENDS)
async def test_an_idle_or_paused_engine_is_not_declared_dead(
    inproc_engine_args: Callable[..., AsyncEngineArgs], anyio_backend: Any
) -> None:
    timeout = _timeout(anyio_backend)
    args = inproc_engine_args(engine_output_timeout_s=timeout)
    async with AsyncLLM.from_engine_args(args, engine_core_factory=SCRIPTED) as llm:
        await anyio.sleep(3 * timeout)  # idle
        assert not llm.errored
        await llm.pause_generation(mode="keep")
        stream = await llm.add_request("held", "hello", SamplingParams(max_tokens=3, ignore_eos=True))
        await anyio.sleep(3 * timeout)  # work frozen by the pause is not pending
        assert not llm.errored
        if anyio_backend != "asyncio":
            # Under MockClock real steps (threads) would let virtual time jump past the timeout.
            stream.close()
            await llm.resume_generation()
            return
        await llm.resume_generation()
        with stream:
            outs = [out async for out in stream]
        assert len(outs[-1].outputs[0].token_ids) == 3
        assert not llm.errored


@pytest.mark.parametrize("anyio_backend", ["trio", "asyncio"])
@pytest.mark.parametrize("transport", ["multiprocess"], indirect=True)
async def test_a_stopped_engine_process_is_declared_dead_and_killed_at_shutdown(
    engine_args: Callable[..., AsyncEngineArgs],
    anyio_backend: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """An engine-core child stopped by SIGSTOP with requests in flight sends nothing: after
    `engine_output_timeout_s` every stream raises `EngineDeadError` naming that setting,
    `check_health()` raises it, and `shutdown()` ends within its (here shortened) grace periods
    by SIGKILL (a stopped process ignores `Shutdown` and SIGTERM), leaving no child."""
    monkeypatch.setattr(process_module, "SHUTDOWN_GRACE_S", 0.5)
    monkeypatch.setattr(process_module, "TERM_GRACE_S", 0.5)
    timeout = 1.0
    llm = AsyncLLM.from_engine_args(engine_args(engine_output_timeout_s=timeout))
    results: dict[int, BaseException | None] = {}
    started = [anyio.Event() for _ in range(3)]

    async def consume(i: int) -> None:
        sp = SamplingParams(max_tokens=240, ignore_eos=True)
        try:
            async with aclosing(llm.generate("hello there", sp, f"s{i}")) as agen:
                async for _ in agen:
                    started[i].set()
        except EngineDeadError as exc:
            results[i] = exc
        else:
            results[i] = None  # finished: it was not in flight after all

    with anyio.fail_after(60):
        async with anyio.create_task_group() as tg:
            await llm.start()
            try:
                for i in range(len(started)):
                    tg.start_soon(consume, i)
                for event in started:
                    await event.wait()
                [pid] = llm.statistics().core_pids
                os.kill(pid, signal.SIGSTOP)
                t0 = time.monotonic()
                dead = await llm.wait_errored()
                waited = time.monotonic() - t0
                assert timeout * 0.9 <= waited <= timeout * 1.125 + 1.0, waited
                assert "engine_output_timeout_s=1.0" in str(dead)
                with pytest.raises(EngineDeadError, match="engine_output_timeout_s"):
                    await llm.check_health()
                with pytest.raises(EngineDeadError):
                    await llm.add_request("later", "hello", SamplingParams(max_tokens=2))
                t0 = time.monotonic()
                await llm.shutdown()
                # Grace (0.5 s) + SIGTERM's grace (0.5 s) + SIGKILL, with room for a busy machine.
                assert time.monotonic() - t0 < 0.5 + 0.5 + 3.0
                assert not psutil.pid_exists(pid)  # killed and reaped
            finally:
                await llm.shutdown()
    assert sorted(results) == list(range(len(started)))
    for i, error in results.items():
        assert isinstance(error, EngineDeadError), f"stream {i}: {error!r}"
        assert "engine_output_timeout_s" in str(error)
    kills = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert any(f"{pid} did not exit; sending kill" in m for m in kills), kills
