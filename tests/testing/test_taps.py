"""Input taps: `InputRecorder` counts what reaches the core, `rewrite_adds` bypasses the
frontend's checks so that the core's own are seen to hold."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import aclosing

import anyio
import msgspec
import pytest

from triollm import AsyncEngineArgs, AsyncLLM, SamplingParams
from triollm.actors.messages import AbortRequests, AddRequest, Shutdown, UtilityCall
from triollm.engine.request import EngineCoreRequest
from triollm.testing import FakeCore, InputRecorder, chain_taps, rewrite_adds, user_request_id

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]


def test_user_request_ids_keep_the_child_prefix() -> None:
    assert user_request_id("r1#7") == "r1"
    assert user_request_id("2_r1#8") == "2_r1"
    assert user_request_id("a#b#3") == "a#b"


async def test_the_recorder_counts_adds_and_aborts_by_user_and_core_id(
    fake_args: Callable[..., AsyncEngineArgs], input_recorder: InputRecorder
) -> None:
    tap = input_recorder
    async with AsyncLLM(fake_args(), engine_core_factory=FakeCore(step_s=0.002).factory(), input_tap=tap) as llm:
        with anyio.fail_after(10):
            async with aclosing(llm.generate("Hi", SamplingParams(max_tokens=3), "done")) as outputs:
                async for _ in outputs:
                    pass
            async with aclosing(llm.generate("Hi", SamplingParams(max_tokens=300, n=2), "left")) as outputs:
                async for _ in outputs:
                    break  # both children are aborted, once each
            await llm.get_engine_stats()
    assert tap.added == {"done": 1, "0_left": 1, "1_left": 1}
    assert tap.aborted == {"0_left": 1, "1_left": 1}
    assert sorted(tap.aborted_core.values()) == [1, 1]
    assert {user_request_id(rid) for rid in tap.aborted_core} == {"0_left", "1_left"}
    kinds = {type(m) for m in tap.sent}
    assert {AddRequest, AbortRequests, UtilityCall} <= kinds
    assert all(kind in (AddRequest, AbortRequests, UtilityCall, Shutdown) for kind in kinds)


async def test_a_rewritten_add_meets_the_cores_own_checks(fake_args: Callable[..., AsyncEngineArgs]) -> None:
    """Token ids the frontend would refuse (out of the vocabulary) reach the core, which
    refuses that request alone."""

    def out_of_vocabulary(req: EngineCoreRequest) -> EngineCoreRequest:
        if req.request_id.startswith("bad"):
            return msgspec.structs.replace(req, prompt_token_ids=[10**6])
        return req

    recorder = InputRecorder()
    tap = chain_taps(rewrite_adds(out_of_vocabulary), recorder)
    async with AsyncLLM(fake_args(), engine_core_factory=FakeCore().factory(), input_tap=tap) as llm:
        with anyio.fail_after(10):
            with pytest.raises(ValueError, match=r"prompt_token_ids: token ids must be in \[0, 259\)"):
                async for _ in llm.generate("Hi", SamplingParams(max_tokens=3), "bad"):
                    pass
            outs = [o async for o in llm.generate("Hi", SamplingParams(max_tokens=3), "good")]
    assert outs[-1].finished and not llm.errored
    [bad] = [m for m in recorder.sent if isinstance(m, AddRequest) and m.request.request_id.startswith("bad")]
    assert bad.request.prompt_token_ids == [10**6]  # the recorder saw the rewritten message
