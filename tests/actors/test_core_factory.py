"""The test/benchmark hook that builds the engine core (`engine_core_factory`): not a user setting,
yet it reaches the engine core in this process and in the engine-core child process alike."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

import pytest

from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.actors.process import EngineStartupError
from triollm.engine.config import EngineArgs, EngineConfig
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.execution.scripted_runner import SCRIPTED, fault_at_step
from triollm.engine.sampling_params import SamplingParams

pytestmark = pytest.mark.anyio

PROMPT = {"prompt_token_ids": [10] * 16}
PARAMS = SamplingParams(max_tokens=8, ignore_eos=True)


def not_a_core(config: EngineConfig) -> object:
    return "nope"


@pytest.mark.parametrize("factory", [SCRIPTED, SCRIPTED.target])
async def test_a_scripted_core_reaches_every_transport(
    engine_args: Callable[..., AsyncEngineArgs], factory: EngineCoreFactory | str
) -> None:
    async with AsyncLLM.from_engine_args(engine_args(), engine_core_factory=factory) as llm:
        async with aclosing(llm.generate(PROMPT, PARAMS)) as stream:
            outs = [out async for out in stream]
    # ScriptedRunner: token i is (prompt length + i) % vocab: no model ran.
    assert list(outs[-1].outputs[0].token_ids) == list(range(16, 24))


async def test_an_injected_fault_kills_the_engine(engine_args: Callable[..., AsyncEngineArgs]) -> None:
    llm = AsyncLLM.from_engine_args(engine_args(), engine_core_factory=fault_at_step(3, scripted=True))
    async with llm:
        with pytest.raises(EngineDeadError, match="injected fault in the forward pass at step 3"):
            async with aclosing(llm.generate(PROMPT, PARAMS)) as stream:
                async for _ in stream:
                    pass
    assert llm.errored


async def test_a_factory_that_cannot_build_fails_the_start(
    engine_args: Callable[..., AsyncEngineArgs], transport: str
) -> None:
    expected = EngineStartupError if transport == "multiprocess" else ModuleNotFoundError
    with pytest.raises(expected, match="no_such_module"):
        async with AsyncLLM.from_engine_args(engine_args(), engine_core_factory="no_such_module:build"):
            pytest.fail("the engine started")
    if transport == "inproc":  # (a child process cannot import this test module)
        with pytest.raises(TypeError, match="returned str, not an EngineCore"):
            async with AsyncLLM.from_engine_args(engine_args(), engine_core_factory=f"{__name__}:not_a_core"):
                pytest.fail("the engine started")


def test_the_factory_is_validated_and_is_no_engine_arg() -> None:
    for bad in ("no-colon", "module:", ":function", "module:not an identifier"):
        with pytest.raises(ValueError, match="engine_core_factory: .* is not 'package.module:function'"):
            AsyncLLM(EngineArgs(), engine_core_factory=bad)
    with pytest.raises(ValueError, match="engine_core_factory: expected"):
        AsyncLLM(EngineArgs(), engine_core_factory=3)  # type: ignore[arg-type]
    assert "engine_core_factory" not in EngineArgs.field_names()
    assert fault_at_step(2) == EngineCoreFactory(
        "triollm.engine.execution.scripted_runner:faulty_engine_core", {"step": 2, "scripted": False}
    )
