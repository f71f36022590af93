"""Backpressure (`max_num_queued_reqs`, `max_num_queued_tokens`) through the real engine, and aborts
that arrive while a request is still being added.

The queue is held still with `pause_generation(mode="keep")`: nothing is stepped, so what waits is
exactly what the test added. Over a limit `add_request` raises `EngineBusyError`, adds nothing and
leaves the id free; the sync `LLM` waits for room instead (an offline batch larger than the queue
is normal).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from triollm import LLM
from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineBusyError
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

P = 10  # prompt tokens of every request here
PROMPT = {"prompt_token_ids": list(range(5, 5 + P))}


def params(max_tokens: int = 4, **kw: Any) -> SamplingParams:
    return SamplingParams(
        max_tokens=max_tokens, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY, **kw
    )


async def finish(stream: Any) -> int:
    tokens = -1
    async with stream:
        async for out in stream:
            tokens = len(out.outputs[0].token_ids)
            reason = out.outputs[0].finish_reason
    return tokens if reason == "length" else -1


async def test_over_max_num_queued_reqs_is_busy_and_holds_nothing(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    args = engine_args(max_num_seqs=2, max_num_queued_reqs=2)
    async with AsyncLLM.from_engine_args(args) as llm:
        await llm.pause_generation(mode="keep")
        streams = [await llm.add_request(f"r{i}", PROMPT, params()) for i in range(4)]
        with pytest.raises(EngineBusyError, match="max_num_queued_reqs=2") as info:
            await llm.add_request("extra", PROMPT, params())
        assert info.value.retry_after_s > 0
        with pytest.raises(EngineBusyError):  # n=2 counts twice
            await llm.add_request("extra", PROMPT, params(n=2))
        assert llm.num_unfinished_requests == 4 and "extra" not in llm.unfinished_request_ids()
        await llm.abort("r3")
        streams[3].close()
        streams.append(await llm.add_request("extra", PROMPT, params()))  # room again, id free
        await llm.resume_generation()
        with anyio.fail_after(30):
            results = [await finish(s) for s in streams[:3] + streams[4:]]
        assert results == [4, 4, 4, 4]
        assert not llm.errored


async def test_over_max_num_queued_tokens_is_busy_until_the_queue_moves(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    async with AsyncLLM.from_engine_args(engine_args(max_num_queued_tokens=2 * P)) as llm:
        await llm.pause_generation(mode="keep")
        streams = [await llm.add_request(f"t{i}", PROMPT, params(8)) for i in range(2)]
        with pytest.raises(EngineBusyError, match="max_num_queued_tokens=20"):
            await llm.add_request("t2", PROMPT, params())
        await llm.resume_generation()
        # Once both produced output they no longer wait for the scheduler: room again.
        with anyio.fail_after(30):
            while True:
                try:
                    streams.append(await llm.add_request("t2", PROMPT, params(8)))
                    break
                except EngineBusyError:
                    await anyio.sleep(0.01)
            assert [await finish(s) for s in streams] == [8, 8, 8]


async def test_one_request_larger_than_the_token_limit_is_not_refused_forever(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    async with AsyncLLM.from_engine_args(engine_args(max_num_queued_tokens=P // 2)) as llm:
        with anyio.fail_after(30):
            assert await finish(await llm.add_request("big", PROMPT, params())) == 4


async def test_an_abort_while_the_prompt_is_tokenized_in_a_thread_sticks(
    engine_args: Callable[..., AsyncEngineArgs], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The window is forced: the tokenizer blocks (in its worker thread) until the abort ran."""
    sent: list[Any] = []
    async with AsyncLLM.from_engine_args(engine_args(), input_tap=lambda msg: sent.append(msg) or msg) as llm:
        assert llm.tokenizer is not None
        encode = llm.tokenizer.encode
        entered, release = threading.Event(), threading.Event()

        def blocking_encode(text: str, *args: Any, **kw: Any) -> list[int]:
            if len(text) > 8192:
                entered.set()
                release.wait(10)
                return encode("a long prompt", *args, **kw)
            return encode(text, *args, **kw)

        monkeypatch.setattr(llm.tokenizer, "encode", blocking_encode)
        result: list[Any] = []

        async def add() -> None:
            result.append(await llm.add_request("big", "x" * 9000, params(200)))

        try:
            with anyio.fail_after(20):
                async with anyio.create_task_group() as tg:
                    tg.start_soon(add)
                    await anyio.to_thread.run_sync(entered.wait)
                    await llm.abort("big")
                    release.set()
                [stream] = result
                outs = [out async for out in stream]
        finally:
            release.set()
        assert len(outs) == 1 and outs[0].finished
        assert outs[0].outputs[0].finish_reason == "abort"
        assert not sent, "the aborted request reached the core"
        assert llm.num_unfinished_requests == 0
        with anyio.fail_after(30):  # the id is free again, the engine serves
            assert await finish(await llm.add_request("big", PROMPT, params())) == 4


async def test_an_abort_while_waiting_for_room_sticks(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    async with AsyncLLM.from_engine_args(engine_args(max_num_seqs=1, max_num_queued_reqs=1)) as llm:
        await llm.pause_generation(mode="keep")
        first = await llm.add_request("first", PROMPT, params())
        second = await llm.add_request("second", PROMPT, params())
        result: list[Any] = []

        async def add() -> None:
            result.append(await llm.add_request("waits", PROMPT, params(), wait_for_room=True))

        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(add)
                while "waits" not in llm.unfinished_request_ids():  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                await anyio.sleep(0.05)
                assert not result  # still waiting for room
                await llm.abort("waits")
            [stream] = result
            outs = [out async for out in stream]
            assert outs[-1].outputs[0].finish_reason == "abort"
            await llm.resume_generation()
            assert [await finish(first), await finish(second)] == [4, 4]


def test_the_sync_llm_waits_for_room_instead_of_failing(tiny_model_dir: Path) -> None:
    with LLM(
        str(tiny_model_dir), max_model_len=128, multiprocess=False, max_num_seqs=2,
        max_num_queued_reqs=1, max_num_queued_tokens=3 * P,
    ) as llm:
        outs = llm.generate([PROMPT] * 12, SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [3] * 12
        ids = llm.enqueue([PROMPT] * 8, SamplingParams(max_tokens=2, ignore_eos=True))
        done = llm.wait_for_completion(use_tqdm=False)
        assert [o.request_id for o in done] == ids
        assert all(len(o.outputs[0].token_ids) == 2 for o in done)
