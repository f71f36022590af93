"""Busy is not hung (issue 40): the engine core is heard after every step, so the watchdogs
(`engine_output_timeout_s`) let a prompt prefill for as long as it takes in many chunks, and
still find a core that stops stepping.

- In virtual time (trio's MockClock; the steps run in the event loop, `steps_in_event_loop`): a
  ten-minute prefill under a 60 s timeout finishes, and a core that hangs in the middle of one is
  declared hung a timeout after its last step. On asyncio the same in real time, scaled down.
- On the real path (the tiny model's real forward pass, each step slowed in the core's thread):
  a prompt of many chunks whose prefill lasts several timeouts finishes in process, in an
  engine-core child process, over data parallel and through the sync `LLM`.
- While the core waits for a grammar compiling in its thread (a slow compile, in real time).
- On the wire: the heartbeats an engine-core child sends, one per chunk, with its statistics.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import pytest

from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.actors.llm import LLM
from triollm.actors.messages import AddRequest, OutputBatch
from triollm.actors.process import open_process_core
from triollm.engine.config import EngineArgs
from triollm.engine.outputs import RequestOutput
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams, StructuredOutputsParams
from triollm.engine.structured_outputs import GrammarCompiler
from triollm.testing import FakeCore, mock_clock_patience, steps_in_event_loop
from triollm.testing.pytest_plugin import trio_mock_clock

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

BACKENDS = [trio_mock_clock(), pytest.param("asyncio", id="asyncio")]
CHUNK = 4  # max_num_batched_tokens in virtual time: a prompt of n tokens is n / 4 steps


def _scale(anyio_backend: Any) -> tuple[float, float, int]:
    """(engine_output_timeout_s, seconds per step, prompt chunks): ten virtual minutes under
    trio's MockClock; on asyncio real seconds, the prefill still six timeouts long."""
    if anyio_backend == "asyncio":
        return 0.5, 0.1, 30
    return 60.0, 10.0, 60


def _prompt(n: int) -> dict[str, list[int]]:
    return {"prompt_token_ids": [10 + i % 200 for i in range(n)]}


async def _generate(llm: AsyncLLM, prompt: Any, max_tokens: int) -> list[RequestOutput]:
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    async with aclosing(llm.generate(prompt, params, "long")) as outputs:
        return [out async for out in outputs]


@pytest.mark.parametrize("anyio_backend", BACKENDS)
async def test_a_ten_minute_prefill_is_busy_not_hung(
    inproc_engine_args: Callable[..., AsyncEngineArgs], anyio_backend: Any
) -> None:
    timeout, step_s, chunks = _scale(anyio_backend)
    args = inproc_engine_args(engine_output_timeout_s=timeout, max_num_batched_tokens=CHUNK)
    seen: list[int] = []  # requests running, from the statistics heard while nothing came out

    async def watch(llm: AsyncLLM) -> None:
        while True:
            await anyio.sleep(timeout / 2)
            if llm.last_stats is not None:
                seen.append(llm.last_stats.num_running)

    with steps_in_event_loop():
        llm = AsyncLLM.from_engine_args(args, engine_core_factory=FakeCore(step_s=step_s).factory())
        with mock_clock_patience():
            await llm.start()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(watch, llm)
                t0 = anyio.current_time()
                outs = await _generate(llm, _prompt(CHUNK * chunks), max_tokens=2)
                elapsed = anyio.current_time() - t0
                tg.cancel_scope.cancel()
            assert not llm.errored
        finally:
            with mock_clock_patience():
                await llm.shutdown()
    # The first token came out of the last chunk's step: `chunks` steps of silence before it.
    assert elapsed >= chunks * step_s > 5 * timeout, elapsed
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 2
    assert seen and max(seen) == 1  # each step's heartbeat carried the core's statistics


@pytest.mark.parametrize("anyio_backend", BACKENDS)
async def test_a_core_that_stops_stepping_mid_prefill_is_still_declared_hung(
    inproc_engine_args: Callable[..., AsyncEngineArgs], anyio_backend: Any
) -> None:
    timeout, step_s, chunks = _scale(anyio_backend)
    hang = chunks // 2  # steps 1 .. hang - 1 run and are heard; step `hang` never ends
    args = inproc_engine_args(engine_output_timeout_s=timeout, max_num_batched_tokens=CHUNK)
    with steps_in_event_loop():
        llm = AsyncLLM.from_engine_args(args, engine_core_factory=FakeCore(step_s=step_s, hang_at_step=hang).factory())
        with mock_clock_patience():
            await llm.start()
        try:
            t0 = anyio.current_time()
            with pytest.raises(EngineDeadError, match="it is hung"):
                await _generate(llm, _prompt(CHUNK * chunks), max_tokens=2)
            elapsed = anyio.current_time() - t0
        finally:
            with mock_clock_patience():
                await llm.shutdown()
    last_heard = (hang - 1) * step_s
    if anyio_backend == "asyncio":  # real time: the steps' own overhead adds up
        assert last_heard + timeout <= elapsed <= 1.5 * last_heard + 1.5 * timeout, elapsed
    else:  # checked every eighth of the timeout
        assert last_heard + timeout <= elapsed <= last_heard + 1.125 * timeout + 1, elapsed


# ------------------------------------------------------------------------------ the real path

REAL_TIMEOUT_S = 1.0
REAL_STEP_S = 0.2
REAL_CHUNK = 16
REAL_PROMPT = 12 * REAL_CHUNK  # 12 silent steps of 0.2 s: 2.4 timeouts without an output


def _slowed(tiny_model_dir: Path, **overrides: Any) -> AsyncEngineArgs:
    kwargs: dict[str, Any] = {
        "model": str(tiny_model_dir),
        "max_model_len": 256,
        "seed": 0,
        "engine_output_timeout_s": REAL_TIMEOUT_S,
        "max_num_batched_tokens": REAL_CHUNK,
    }
    return AsyncEngineArgs(**(kwargs | overrides))


SLOWED = FakeCore(model=True, step_s=REAL_STEP_S).factory()


@pytest.mark.parametrize(
    "setup",
    [
        pytest.param({"multiprocess": False}, id="inproc"),
        pytest.param({"multiprocess": True}, id="multiprocess"),
        pytest.param({"multiprocess": True, "data_parallel_size": 2}, id="data-parallel"),
    ],
)
async def test_a_long_prompt_on_a_slowed_real_model_finishes(tiny_model_dir: Path, setup: dict[str, Any]) -> None:
    greedy = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0)
    with anyio.fail_after(120):
        async with AsyncLLM.from_engine_args(_slowed(tiny_model_dir, **setup), engine_core_factory=SLOWED) as llm:
            t0 = anyio.current_time()
            async with aclosing(llm.generate(_prompt(REAL_PROMPT), greedy, "long")) as outputs:
                outs = [out async for out in outputs]
            elapsed = anyio.current_time() - t0
            assert not llm.errored
            stats = llm.rank_stats or [llm.last_stats]
            await llm.check_health()
    assert elapsed > 2 * REAL_TIMEOUT_S  # the prompt's silent steps alone
    assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
    assert any(s is not None for s in stats)  # the statistics came with the steps


def test_the_sync_llm_waits_out_a_long_prompt(tiny_model_dir: Path) -> None:
    llm = LLM(
        str(tiny_model_dir),
        multiprocess=False,
        max_model_len=256,
        engine_output_timeout_s=REAL_TIMEOUT_S,
        max_num_batched_tokens=REAL_CHUNK,
        engine_core_factory=SLOWED,
    )
    try:
        [out] = llm.generate(_prompt(REAL_PROMPT), SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    finally:
        llm.shutdown()
    assert out.finished and len(out.outputs[0].token_ids) == 3


async def test_a_slow_grammar_compile_is_busy_not_hung(
    inproc_engine_args: Callable[..., AsyncEngineArgs], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The only request waits for its grammar, compiled in the compiler's thread for four
    timeouts: the core counts each wait (up to 50 ms) as a step, and each is heard."""
    timeout = 0.5
    compile_grammar = GrammarCompiler._compile

    def slow_compile(self: GrammarCompiler, *args: Any) -> Any:
        time.sleep(4 * timeout)
        return compile_grammar(self, *args)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow_compile)
    params = SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="[0-9]{3}"))
    args = inproc_engine_args(engine_output_timeout_s=timeout)
    with anyio.fail_after(60):
        async with AsyncLLM.from_engine_args(args) as llm:
            t0 = anyio.current_time()
            async with aclosing(llm.generate("digits: ", params, "structured")) as outputs:
                outs = [out async for out in outputs]
            elapsed = anyio.current_time() - t0
            assert not llm.errored
    assert elapsed >= 4 * timeout
    text = outs[-1].outputs[0].text
    assert outs[-1].finished and len(text) == 3 and text.isdigit(), text


async def test_an_engine_core_child_sends_a_heartbeat_per_silent_step(tiny_model_dir: Path) -> None:
    """A prompt of 100 tokens in chunks of 16: six steps with no output, each a heartbeat with
    the core's statistics (one request running), then the step that samples the first token."""
    config = EngineArgs(
        model=str(tiny_model_dir), multiprocess=True, max_model_len=256, max_num_batched_tokens=16
    ).create_engine_config()
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    async with open_process_core(config) as client:
        client.inputs.send_nowait(AddRequest(EngineCoreRequest("long", _prompt(100)["prompt_token_ids"], params)))
        got: list[OutputBatch] = []
        with anyio.fail_after(60):
            while not got or not any(got[-1].finish_reasons[i] >= 0 for i in range(len(got[-1].request_ids))):
                msg = await client.outputs.receive()
                assert isinstance(msg, OutputBatch), msg
                got.append(msg)
    client.outputs.close()
    beats = [m for m in got if m.is_heartbeat]
    assert len(beats) == math.ceil(100 / 16) - 1 == 6
    assert got[: len(beats)] == beats  # the prompt's chunks, then the tokens
    assert all(b.stats is not None and b.stats.num_running == 1 for b in beats)
    assert [m.request_ids for m in got[len(beats) :]] == [["long"]] * 3
