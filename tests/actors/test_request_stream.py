"""`RequestStream`, the public handle of one request (`await llm.add_request(...)`), on trio and
asyncio.

The contract alone (no engine): DELTA pieces merge while the consumer is away, CUMULATIVE and
FINAL_ONLY keep the newest completion per index, errors arrive after the outputs before them, the
first end wins, `get_nowait` / `get` / `async for` and closing (exactly once; `async for` left by
an exception closes, a cancelled `get()` does not).

Through the real engine (the tiny model, in-process: the handle lives in the frontend, so the
transport does not matter): iterate, poll with `get_nowait`, stop early in every way (`aclose`,
`close`, `with`, `async with`, `break`, a cancelled consumer) and see exactly one abort reach the
core, no abort after the end, a slow consumer getting one merged output, the id freed when the
end is read, and a request the core rejects failing through its handle.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import anyio
import anyio.lowlevel
import pytest
from input_tap import InputTap

from triollm import RequestStream
from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.actors.messages import AddRequest
from triollm.actors.request_stream import merge_output
from triollm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.anyio

DELTA, CUMULATIVE, FINAL_ONLY = (
    RequestOutputKind.DELTA,
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.FINAL_ONLY,
)
LONG = 200  # max_tokens of a request meant to be running when the test acts on it


# ================================================================================ the contract


def out(
    *completions: tuple[int, str, list[int]],
    finished: bool = False,
    reason: str | None = None,
    logprobs: bool = False,
) -> RequestOutput:
    return RequestOutput(
        request_id="r",
        prompt="p",
        prompt_token_ids=[1, 2],
        prompt_logprobs=None,
        outputs=[
            CompletionOutput(
                index,
                text,
                list(ids),
                None,
                [{t: Logprob(-1.0)} for t in ids] if logprobs else None,
                reason,
            )
            for index, text, ids in completions
        ],
        finished=finished,
    )


class Owner:
    """Stands in for AsyncLLM: records each `on_close` with whether the request had finished."""

    def __init__(self) -> None:
        self.closes: list[bool] = []

    def stream(self, kind: RequestOutputKind = DELTA) -> RequestStream:
        return RequestStream("r", kind, lambda s: self.closes.append(s.finished))


async def test_delta_pieces_merge_while_the_consumer_is_away() -> None:
    s = Owner().stream(DELTA)
    s.put(out((0, "a", [1]), logprobs=True))
    s.put(out((0, "b", [2]), (1, "x", [7]), logprobs=True))
    s.put(out((0, "c", [3]), finished=True, reason="length", logprobs=True))
    assert s.finished
    merged = s.get_nowait()
    assert merged is not None and merged.finished
    by_index = {c.index: c for c in merged.outputs}
    assert (by_index[0].text, by_index[0].token_ids) == ("abc", [1, 2, 3])
    assert by_index[0].logprobs is not None and len(by_index[0].logprobs) == 3
    assert by_index[0].finish_reason == "length"
    assert (by_index[1].text, by_index[1].token_ids) == ("x", [7])
    with pytest.raises(anyio.EndOfStream):
        s.get_nowait()


@pytest.mark.parametrize("kind", [CUMULATIVE, FINAL_ONLY])
async def test_cumulative_and_final_only_keep_the_newest_per_index(kind: RequestOutputKind) -> None:
    s = Owner().stream(kind)
    s.put(out((0, "a", [1]), (1, "x", [7])))
    s.put(out((1, "xy", [7, 8])))  # with n>1 an output carries only what advanced
    s.put(out((0, "ab", [1, 2]), finished=True))
    merged = s.get_nowait()
    assert merged is not None and merged.finished
    assert [(c.index, c.text, c.token_ids) for c in merged.outputs] == [
        (0, "ab", [1, 2]),
        (1, "xy", [7, 8]),
    ]


async def test_merge_output_is_the_one_rule_for_a_non_streamed_delta_response() -> None:
    first = out((0, "a", [1]))
    merge_output(first, out((0, "b", [2]), finished=True, reason="stop"), DELTA)
    assert (first.outputs[0].text, first.outputs[0].token_ids, first.finished) == ("ab", [1, 2], True)
    assert first.outputs[0].finish_reason == "stop"


async def test_an_error_comes_after_the_outputs_before_it_and_ends_the_stream() -> None:
    owner = Owner()
    s = owner.stream(DELTA)
    s.put(out((0, "a", [1])))
    s.put_error(ValueError("prompt_token_ids: bad"))
    assert s.finished
    first = s.get_nowait()
    assert first is not None and first.outputs[0].text == "a"
    with pytest.raises(ValueError, match="bad"):
        s.get_nowait()
    assert owner.closes == [True]  # released when the error was read, nothing to abort
    with pytest.raises(anyio.EndOfStream):
        await s.get()


async def test_the_first_end_wins() -> None:
    s = Owner().stream(DELTA)
    s.put(out((0, "a", [1]), finished=True, reason="length"))
    s.put_error(EngineDeadError("too late"))  # a finished request is not failed afterwards
    s.put(out((0, "b", [2]), finished=True, reason="abort"))
    got = [o async for o in s]
    assert [(o.outputs[0].text, o.outputs[0].finish_reason) for o in got] == [("a", "length")]

    s = Owner().stream(DELTA)
    s.put_error(EngineDeadError("dead"))
    s.put(out((0, "b", [2]), finished=True, reason="abort"))  # e.g. shutdown after a death
    with pytest.raises(EngineDeadError):
        await s.get()


async def test_get_nowait_get_and_iteration() -> None:
    owner = Owner()
    s = owner.stream(DELTA)
    assert s.get_nowait() is None
    got: list[str] = []

    async def consume() -> None:
        async for o in s:
            got.append(o.outputs[0].text)

    async with anyio.create_task_group() as tg:
        tg.start_soon(consume)
        for piece in "abc":
            await anyio.wait_all_tasks_blocked()
            s.put(out((0, piece, [1]), finished=piece == "c"))
    assert got == ["a", "b", "c"]  # the consumer kept up: nothing merged
    assert owner.closes == [True]  # the end was read: released, not aborted
    assert s.closed and [o async for o in s] == []


async def test_close_runs_once_and_aborts_only_an_unfinished_request() -> None:
    owner = Owner()
    s = owner.stream()
    s.put(out((0, "a", [1])))
    s.close()
    s.close()
    await s.aclose()
    assert owner.closes == [False]  # once, unfinished: the owner aborts
    with pytest.raises(anyio.ClosedResourceError):
        s.get_nowait()

    s = owner.stream()
    s.put(out((0, "a", [1]), finished=True))  # finished, not read yet
    with s:
        pass
    assert owner.closes == [False, True]

    s = owner.stream()
    async with s:
        pass
    assert owner.closes == [False, True, False]


async def test_close_wakes_a_waiting_get() -> None:
    s = Owner().stream()

    async def wait() -> None:
        with pytest.raises(anyio.ClosedResourceError):
            await s.get()

    async with anyio.create_task_group() as tg:
        tg.start_soon(wait)
        await anyio.wait_all_tasks_blocked()
        s.close()


async def test_a_cancelled_get_leaves_the_stream_open_a_cancelled_loop_closes_it() -> None:
    owner = Owner()
    s = owner.stream()
    with anyio.move_on_after(0.01):
        await s.get()
    assert owner.closes == [] and not s.closed  # a timeout around one read is not the end
    s.put(out((0, "a", [1])))
    assert (await s.get()).outputs[0].text == "a"

    with anyio.move_on_after(0.01):
        async for _ in s:
            pytest.fail("nothing was put")
    assert owner.closes == [False]  # the loop was left by cancellation: closed, once
    assert s.closed


async def test_get_checkpoints_for_cancellation_even_with_an_output_waiting() -> None:
    s = Owner().stream()
    s.put(out((0, "a", [1])))
    with anyio.CancelScope() as scope:
        scope.cancel()
        await s.get()
        pytest.fail("get() did not notice the cancellation")
    assert s.get_nowait() is not None  # and the output was not lost


# ================================================================================ the real path


def params(max_tokens: int, kind: RequestOutputKind = DELTA, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=kind, n=n)


@pytest.fixture(scope="module")
async def shared_llm(
    inproc_engine_args: Callable[..., AsyncEngineArgs], _warm_process: None, shared_tap: InputTap
) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.from_engine_args(inproc_engine_args(), input_tap=shared_tap) as llm:
        yield llm
    assert not llm.errored


async def _idle(llm: AsyncLLM) -> None:
    with anyio.fail_after(5):
        while True:
            stats = await llm.get_engine_stats()
            if stats.num_running == stats.num_waiting == 0 and llm.num_unfinished_requests == 0:
                return
            await anyio.sleep(0.01)


@pytest.fixture
async def llm(no_leaks: None, shared_llm: AsyncLLM) -> AsyncIterator[AsyncLLM]:
    await _idle(shared_llm)
    yield shared_llm
    await shared_llm.abort(shared_llm.unfinished_request_ids())
    await _idle(shared_llm)
    stats = await shared_llm.get_engine_stats()
    assert stats.num_free_blocks == stats.num_blocks


@pytest.fixture(scope="module")
def shared_tap() -> InputTap:
    return InputTap()


@pytest.fixture
def tap(llm: AsyncLLM, shared_tap: InputTap) -> Iterator[InputTap]:
    """Counts the aborts the frontend sends to the core, by user request id."""
    yield shared_tap.start()
    shared_tap.remove()


async def _running(stream: RequestStream) -> RequestOutput:
    """The first output: the request is in the engine and has produced a token."""
    with anyio.fail_after(5):
        return await stream.get()


async def test_add_request_returns_a_stream_that_ends_after_the_finished_output(
    llm: AsyncLLM, tap: InputTap
) -> None:
    stream = await llm.add_request("it", "Hello there", params(12))
    assert isinstance(stream, RequestStream) and stream.request_id == "it"
    with anyio.fail_after(10):
        outs = [o async for o in stream]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert sum(len(o.outputs[0].token_ids) for o in outs) == 12
    assert stream.finished and stream.closed
    assert llm.num_unfinished_requests == 0  # reading the end freed the id: no close needed
    stream.close()
    assert not tap.aborted


async def test_get_nowait_polls_until_the_end(llm: AsyncLLM, tap: InputTap) -> None:
    stream = await llm.add_request("poll", "Hello there", params(8))
    tokens = 0
    with anyio.fail_after(10):
        while True:
            o = stream.get_nowait()
            if o is None:
                await anyio.sleep(0.001)
                continue
            tokens += len(o.outputs[0].token_ids)
            if o.finished:
                break
    assert tokens == 8
    with pytest.raises(anyio.EndOfStream):
        stream.get_nowait()
    assert not tap.aborted


async def _stop_with_aclose(stream: RequestStream) -> None:
    await stream.aclose()
    await stream.aclose()


async def _stop_with_close(stream: RequestStream) -> None:
    stream.close()  # the sync variant, for `finally` blocks
    stream.close()


async def _stop_with_async_with(stream: RequestStream) -> None:
    async with stream:
        await stream.get()


async def _stop_with_with(stream: RequestStream) -> None:
    with stream:
        await stream.get()


async def _stop_with_break(stream: RequestStream) -> None:
    async with stream:
        async for _ in stream:
            break


async def _stop_with_cancel(stream: RequestStream) -> None:
    # No `with` on purpose: the cancelled `async for` alone must abort the request.
    with anyio.CancelScope() as scope:
        async for _ in stream:
            scope.cancel()
    assert scope.cancelled_caught


STOPS = {
    "aclose": _stop_with_aclose,
    "close": _stop_with_close,
    "async-with": _stop_with_async_with,
    "with": _stop_with_with,
    "break": _stop_with_break,
    "cancel": _stop_with_cancel,
}


@pytest.mark.parametrize("how", list(STOPS))
async def test_stopping_early_aborts_exactly_once(llm: AsyncLLM, tap: InputTap, how: str) -> None:
    rid = f"stop-{how}"
    stream = await llm.add_request(rid, "Once upon a time", params(LONG, n=2))
    await _running(stream)
    await STOPS[how](stream)
    assert stream.closed
    assert llm.num_unfinished_requests == 0  # synchronously
    assert dict(tap.aborted) == {f"0_{rid}": 1, f"1_{rid}": 1}
    stream.close()
    await _idle(llm)
    assert dict(tap.aborted) == {f"0_{rid}": 1, f"1_{rid}": 1}  # and never again


async def test_no_abort_after_the_end_even_unread(llm: AsyncLLM, tap: InputTap) -> None:
    stream = await llm.add_request("unread", "Hello", params(5))
    with anyio.fail_after(10):
        while not stream.finished:  # noqa: ASYNC110 - the handle has no "finished" event
            await anyio.sleep(0.005)
    await stream.aclose()  # the end arrived but was never read: nothing to abort
    assert llm.num_unfinished_requests == 0
    assert not tap.aborted


@pytest.mark.parametrize(("kind", "n"), [(DELTA, 1), (DELTA, 3), (CUMULATIVE, 3), (FINAL_ONLY, 1)])
async def test_a_slow_consumer_gets_one_merged_output(
    llm: AsyncLLM, kind: RequestOutputKind, n: int
) -> None:
    stream = await llm.add_request(f"slow-{kind.name}-{n}", "The quick brown fox", params(20, kind, n))
    with anyio.fail_after(10):
        while not stream.finished:  # noqa: ASYNC110 - the consumer is away on purpose
            await anyio.sleep(0.005)
    merged = stream.get_nowait()
    assert merged is not None and merged.finished
    assert sorted((c.index, len(c.token_ids), c.finish_reason) for c in merged.outputs) == [
        (i, 20, "length") for i in range(n)
    ]
    assert all(c.text for c in merged.outputs)
    with pytest.raises(anyio.EndOfStream):
        stream.get_nowait()


async def test_an_id_is_taken_until_the_consumer_is_done(llm: AsyncLLM) -> None:
    stream = await llm.add_request("dup", "Hello", params(LONG))
    with pytest.raises(ValueError, match="already in use"):
        await llm.add_request("dup", "Hello", params(3))
    await _running(stream)
    stream.close()
    again = await llm.add_request("dup", "Hello", params(3))
    with anyio.fail_after(10):
        assert sum([len(o.outputs[0].token_ids) async for o in again]) == 3


async def test_a_frontend_error_raises_from_add_request_holding_nothing(llm: AsyncLLM) -> None:
    with pytest.raises(ValueError, match="must not be empty"):
        await llm.add_request("empty", "", params(3))
    assert llm.num_unfinished_requests == 0


async def test_a_request_the_core_rejects_fails_through_its_stream(
    llm: AsyncLLM, tap: InputTap
) -> None:
    vocab = llm.get_model_config().vocab_size

    def out_of_vocab(msg: AddRequest) -> AddRequest:
        msg.request.prompt_token_ids = [1, vocab + 5]
        return msg

    # A good prompt made bad past the frontend's checks, so that the core's own validation answers.
    tap.rewrite = out_of_vocab
    stream = await llm.add_request("oov", {"prompt_token_ids": [1, 2]}, params(4))
    with anyio.fail_after(10), pytest.raises(ValueError, match="token ids must be in"):
        await stream.get()
    assert stream.finished and stream.closed
    assert llm.num_unfinished_requests == 0


async def test_add_request_after_shutdown_is_refused(
    no_leaks: None,
    inproc_engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    llm = AsyncLLM.from_engine_args(inproc_engine_args())
    async with llm:
        stream = await llm.add_request("in-flight", "Hello", params(LONG))
        await _running(stream)
    # shutdown aborted it: the stream ends normally, with "abort"
    outs: list[Any] = [o async for o in stream]
    assert outs and outs[-1].finished
    assert outs[-1].outputs[0].finish_reason == "abort"
    with pytest.raises(RuntimeError, match="async with"):
        await llm.add_request("x", "Hello", params(2))
