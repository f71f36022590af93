"""`FakeCore`: scripted tokens at a cadence, faults on cue, in the compute thread and in the
event loop (under trio's MockClock, where a minute of engine time costs milliseconds)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest

import triollm.actors.transport as transport_module
import triollm.testing
from triollm import LLM, AsyncEngineArgs, AsyncLLM, EngineDeadError, SamplingParams
from triollm.engine.core_factory import EngineCoreFactory
from triollm.testing import (
    FakeCore,
    kill_core_process,
    mock_clock_patience,
    replace_core_loop,
    steps_in_event_loop,
)
from triollm.testing.pytest_plugin import trio_mock_clock

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

PROMPT = "Once upon a time"  # 16 bytes: 16 tokens of the fake model's byte tokenizer
MOCK_CLOCK = pytest.mark.parametrize("anyio_backend", [trio_mock_clock()])


@asynccontextmanager
async def started(llm: AsyncLLM) -> AsyncIterator[AsyncLLM]:
    """`async with llm`, with its start-up and teardown (threads) under mock_clock_patience."""
    with mock_clock_patience():
        await llm.start()
    try:
        yield llm
    finally:
        with mock_clock_patience():
            await llm.shutdown()


def params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens)


async def run(llm: AsyncLLM, max_tokens: int, prompt: str = PROMPT) -> list[Any]:
    async with aclosing(llm.generate(prompt, params(max_tokens))) as outputs:
        return [out async for out in outputs]


# ------------------------------------------------------------------------------ the value


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"fail_at_step": 0}, "fail_at_step: must be a step number >= 1"),
        ({"hang_at_step": True}, "hang_at_step: must be a step number >= 1"),
        ({"kill_at_step": 1.5}, "kill_at_step: must be a step number >= 1"),
        ({"step_s": -1}, "step_s: must be a finite number of seconds >= 0"),
        ({"stall_s": float("inf"), "stall_at_step": 1}, "stall_s: must be a finite number"),
        ({"stall_at_step": 2}, "stall_at_step, stall_s: set both or neither"),
        ({"stall_s": 1.0}, "stall_at_step, stall_s: set both or neither"),
        ({"refuse_adds_after": -1}, "refuse_adds_after: must be an integer >= 0"),
    ],
)
def test_a_fake_core_names_the_field_it_refuses(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FakeCore(**fields)


def test_the_factory_is_plain_data() -> None:
    fake = FakeCore(step_s=0.5, fail_at_step=3)
    assert repr(fake) == "FakeCore(step_s=0.5, fail_at_step=3)"
    assert repr(FakeCore()) == "FakeCore()"
    factory = fake.factory()
    assert factory.target == "triollm.testing.cores:build_fake_core"
    wire = json.loads(json.dumps({"target": factory.target, "kwargs": factory.kwargs}))
    assert EngineCoreFactory(**wire) == factory
    assert fake.dies and FakeCore(hang_at_step=1).dies and FakeCore(kill_at_step=1).dies
    assert not FakeCore(stall_at_step=1, stall_s=5).dies and not FakeCore(refuse_adds_after=0).dies


def test_the_public_names() -> None:
    assert sorted(triollm.testing.__all__) == sorted(
        [
            "ASGIClient", "ASGIResponse", "AppDidNotEnd", "CoreLoop", "EOS_TOKEN_ID",
            "FakeCore", "FakeEngineCore", "InputRecorder", "InputTap", "Snapshot", "VOCAB_SIZE",
            "build_fake_core", "chain_taps", "check_no_leaks", "child_pids", "fake_engine_args",
            "hold_hung_steps", "kill_core_process", "mock_clock_patience", "open_asgi_client",
            "release_hung_steps", "replace_core_loop", "rewrite_adds", "run_in_own_thread",
            "steps_in_event_loop",
            "user_request_id", "wait_for_no_leaks", "wait_no_new_children", "write_model_dir",
        ]
    )
    for name in triollm.testing.__all__:
        assert getattr(triollm.testing, name) is not None


# ------------------------------------------------------------------------------ in the compute thread


def test_the_fake_model_dir_has_no_weights(fake_model_dir: Path) -> None:
    assert sorted(p.name for p in fake_model_dir.iterdir()) == [
        "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"
    ]


async def test_a_scripted_core_needs_no_weights(fake_args: Callable[..., AsyncEngineArgs]) -> None:
    async with AsyncLLM(fake_args(), engine_core_factory=FakeCore().factory()) as llm:
        [*_, last] = await run(llm, 8)
    out = last.outputs[0]
    assert list(out.token_ids) == list(range(16, 24))  # (prompt length + i) % vocab
    assert out.text == "01234567" and out.finish_reason == "length"  # token k is byte k + 32


def test_the_sync_llm_takes_a_fake_core_too(fake_model_dir: Path) -> None:
    llm = LLM(str(fake_model_dir), multiprocess=False, engine_core_factory=FakeCore(fail_at_step=9).factory())
    try:
        [out] = llm.generate(PROMPT, params(8), use_tqdm=False)
        assert out.outputs[0].text == "01234567"
        with pytest.raises(EngineDeadError, match="at step 9"):
            llm.generate(PROMPT, params(8), use_tqdm=False)
    finally:
        llm.shutdown()


async def test_model_true_runs_the_real_forward_pass(tiny_model_dir: Path) -> None:
    args = AsyncEngineArgs(model=str(tiny_model_dir), multiprocess=False, max_model_len=256, seed=0)
    greedy = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    texts = []
    for factory in (None, FakeCore(model=True).factory()):
        async with AsyncLLM(args, engine_core_factory=factory) as llm:
            async with aclosing(llm.generate(PROMPT, greedy)) as outputs:
                texts.append([out async for out in outputs][-1].outputs[0].token_ids)
    assert texts[0] == texts[1] and texts[0] != list(range(4, 10))


async def test_a_fault_at_step_n_kills_the_engine_after_n_minus_1_tokens(
    fake_args: Callable[..., AsyncEngineArgs],
) -> None:
    got: list[Any] = []
    async with AsyncLLM(fake_args(), engine_core_factory=FakeCore(fail_at_step=3).factory()) as llm:
        with anyio.fail_after(10), pytest.raises(EngineDeadError, match="injected fault in the forward pass at step 3"):
            async with aclosing(llm.generate(PROMPT, params(8))) as outputs:
                async for out in outputs:
                    got.append(out)
        assert llm.errored
    assert len(got[-1].outputs[0].token_ids) == 2  # cumulative outputs: one token per step


async def test_refused_adds_fail_alone(fake_args: Callable[..., AsyncEngineArgs]) -> None:
    async with AsyncLLM(fake_args(), engine_core_factory=FakeCore(refuse_adds_after=2).factory()) as llm:
        with anyio.fail_after(10):
            for _ in range(2):
                assert (await run(llm, 3))[-1].finished
            with pytest.raises(ValueError, match=r"injected refusal \(refuse_adds_after=2\)"):
                await run(llm, 3)
        assert not llm.errored


async def test_a_step_hung_in_its_thread_is_declared_dead_and_released(
    fake_args: Callable[..., AsyncEngineArgs],
) -> None:
    """Real time: the watchdog's half second; the hung thread returns at the test's end
    (`no_leaks` releases it before its check)."""
    args = fake_args(engine_output_timeout_s=0.5)
    async with AsyncLLM(args, engine_core_factory=FakeCore(hang_at_step=2).factory()) as llm:
        with anyio.fail_after(10), pytest.raises(EngineDeadError, match="it is hung"):
            await run(llm, 8)


async def test_kill_at_step_refuses_to_kill_this_process(fake_args: Callable[..., AsyncEngineArgs]) -> None:
    with pytest.raises(ValueError, match="kill_at_step: the engine core would SIGKILL the process"):
        async with AsyncLLM(fake_args(), engine_core_factory=FakeCore(kill_at_step=1).factory()):
            pytest.fail("the engine started")


async def test_kill_at_step_kills_the_engine_core_child(fake_args: Callable[..., AsyncEngineArgs]) -> None:
    args = fake_args(multiprocess=True)
    async with AsyncLLM(args, engine_core_factory=FakeCore(kill_at_step=4).factory()) as llm:
        assert len(llm.statistics().core_pids) == 1
        with anyio.fail_after(30), pytest.raises(EngineDeadError):
            await run(llm, 8)


async def test_kill_core_process_needs_a_child(fake_args: Callable[..., AsyncEngineArgs]) -> None:
    async with AsyncLLM(fake_args(), engine_core_factory=FakeCore().factory()) as llm:
        assert llm.statistics().core_pids == ()
        with pytest.raises(ValueError, match="runs in this process"):
            kill_core_process(llm)


# ------------------------------------------------------------------------------ in the event loop


@MOCK_CLOCK
async def test_the_cadence_runs_in_virtual_time(fake_args: Callable[..., AsyncEngineArgs]) -> None:
    with steps_in_event_loop():
        async with started(AsyncLLM(fake_args(), engine_core_factory=FakeCore(step_s=10).factory())) as llm:
            t0 = anyio.current_time()
            outs = await run(llm, 8)
            elapsed = anyio.current_time() - t0
    assert len(outs) == 8 and outs[-1].finished  # one output per step
    assert 80 <= elapsed < 81, elapsed  # eight steps of 10 s


@MOCK_CLOCK
async def test_a_hang_is_declared_by_the_watchdog_in_virtual_time(
    fake_args: Callable[..., AsyncEngineArgs],
) -> None:
    args = fake_args(engine_output_timeout_s=60)
    with steps_in_event_loop():
        async with started(AsyncLLM(args, engine_core_factory=FakeCore(hang_at_step=3).factory())) as llm:
            t0 = anyio.current_time()
            with pytest.raises(EngineDeadError, match="it is hung"):
                await run(llm, 8)
            elapsed = anyio.current_time() - t0
    assert 60 <= elapsed <= 60 * 1.125 + 1, elapsed  # checked every eighth of the timeout


@MOCK_CLOCK
@pytest.mark.parametrize(("stall_s", "dies"), [(30.0, False), (120.0, True)])
async def test_a_stall_delays_the_outputs_or_trips_the_watchdog(
    fake_args: Callable[..., AsyncEngineArgs], stall_s: float, dies: bool
) -> None:
    args = fake_args(engine_output_timeout_s=60)
    fake = FakeCore(stall_at_step=3, stall_s=stall_s)
    with steps_in_event_loop():
        async with started(AsyncLLM(args, engine_core_factory=fake.factory())) as llm:
            t0 = anyio.current_time()
            try:
                outs = await run(llm, 8)
            except EngineDeadError:
                outs = None
            elapsed = anyio.current_time() - t0
    if dies:
        assert outs is None and 60 <= elapsed < 70, elapsed
    else:
        assert outs is not None and outs[-1].finished and stall_s <= elapsed < stall_s + 1, elapsed


async def test_replace_core_loop_is_undone(fake_args: Callable[..., AsyncEngineArgs]) -> None:
    real = transport_module.serve_engine_core
    calls: list[str] = []

    async def quiet_loop(core: Any, inputs: Any, outputs: Any, compute: Any) -> None:
        calls.append(type(core).__name__)
        async with inputs, outputs:
            async for _ in inputs:
                pass

    with replace_core_loop(quiet_loop):
        assert transport_module.serve_engine_core is quiet_loop
        async with AsyncLLM(fake_args(), engine_core_factory=FakeCore().factory()):
            pass
    assert transport_module.serve_engine_core is real
    assert calls == ["FakeEngineCore"]


@MOCK_CLOCK
async def test_mock_clock_patience_raises_the_autojump_threshold_for_its_block() -> None:
    import trio

    clock = trio.lowlevel.current_clock()
    assert clock.autojump_threshold == 0  # type: ignore[attr-defined]
    with mock_clock_patience(0.05):
        assert clock.autojump_threshold == 0.05  # type: ignore[attr-defined]
        t0 = anyio.current_time()
        await anyio.sleep(10)  # still virtual: jumped after 50 ms of real idleness
        assert anyio.current_time() - t0 == pytest.approx(10, abs=0.01)
    assert clock.autojump_threshold == 0  # type: ignore[attr-defined]


async def test_mock_clock_patience_is_a_no_op_without_a_mock_clock() -> None:
    t0 = anyio.current_time()
    with mock_clock_patience():
        await anyio.sleep(0.01)
    assert anyio.current_time() - t0 < 1
