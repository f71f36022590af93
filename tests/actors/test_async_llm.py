"""`AsyncLLM` through the real engine (the tiny random model), on trio and asyncio, over the
in-process and the multiprocess transport.

What is pinned (DESIGN.md, "Failure semantics"):

- streams: exact token counts for DELTA / CUMULATIVE / FINAL_ONLY with 100 concurrent requests,
  `finished` only on the last output, n=3 fan-out;
- a consumer that stops (cancelled scope, `break` with and without `aclosing`, `aclose()`, or
  `llm.abort(rid)`) aborts its request exactly once, the engine frees everything, the others
  are undisturbed; request ids: duplicates of a running request are refused, reuse after the
  end works;
- a bad request fails alone with a ValueError, in the frontend (before anything reaches the
  core) or from the core (through the data path);
- the engine's death (a fault in the forward pass, SIGKILL of the child) reaches every stream
  as `EngineDeadError` within seconds, and everything after it fails fast;
- a clean shutdown never looks like a death, aborts or drains in-flight requests as asked, and
  refuses later use with a RuntimeError that explains how to use the engine.

Non-destructive tests share one engine per (backend, transport) (`llm` fixture, checked idle
before and after every test); tests that kill, stop or misconfigure the engine start their own.
Every test runs under `no_leaks` (no child process, thread or fd left behind).
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import aclosing, contextmanager
from pathlib import Path
from typing import Any

if sys.version_info < (3, 11):
    from exceptiongroup import BaseExceptionGroup

import anyio
import psutil
import pytest
from input_tap import InputTap

from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.actors.messages import AddRequest
from triollm.engine.execution.scripted_runner import fault_at_step
from triollm.engine.outputs import RequestOutput
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

DELTA, CUMULATIVE, FINAL_ONLY = (
    RequestOutputKind.DELTA,
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.FINAL_ONLY,
)
KINDS = [DELTA, CUMULATIVE, FINAL_ONLY]
PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "def add(a, b):",
    "The quick brown fox",
    "Héllo wörld! Ça va?",
]
LONG = 240  # max_tokens of requests meant to be still running when the test acts on them


def params(
    max_tokens: int, kind: RequestOutputKind = DELTA, n: int = 1, **kw: Any
) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=kind, n=n, **kw)


# ------------------------------------------------------------------------------ helpers


async def collect(
    llm: AsyncLLM, prompt: Any, sp: SamplingParams, request_id: str | None = None
) -> list[RequestOutput]:
    outs: list[RequestOutput] = []
    async with aclosing(llm.generate(prompt, sp, request_id)) as agen:
        async for out in agen:
            outs.append(out)
    return outs


def completions_by_index(
    outs: list[RequestOutput], kind: RequestOutputKind
) -> dict[int, tuple[int, str | None]]:
    """Per completion index: (tokens generated in total, the last finish_reason seen)."""
    tokens: dict[int, int] = {}
    reason: dict[int, str | None] = {}
    seen: dict[int, list[int]] = {}
    for out in outs:
        for c in out.outputs:
            if kind == DELTA:
                tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
            else:
                previous = seen.get(c.index, [])
                assert c.token_ids[: len(previous)] == previous, "a cumulative output lost tokens"
                seen[c.index] = list(c.token_ids)
                tokens[c.index] = len(c.token_ids)
            assert reason.get(c.index) is None, f"completion {c.index} went on after finishing"
            reason[c.index] = c.finish_reason
    return {i: (tokens[i], reason[i]) for i in tokens}


def check_complete(
    outs: list[RequestOutput],
    kind: RequestOutputKind,
    max_tokens: int,
    n: int = 1,
    reason: str = "length",
) -> None:
    """A stream that ran to its end: `finished` exactly on the last output, every completion with
    exactly `max_tokens` tokens (`reason` "length"), one output for FINAL_ONLY."""
    assert outs, "the stream yielded nothing"
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    assert len({o.request_id for o in outs}) == 1
    if kind == FINAL_ONLY:
        assert len(outs) == 1
    got = completions_by_index(outs, kind)
    assert got == {i: (max_tokens, reason) for i in range(n)}, got


async def wait_idle(llm: AsyncLLM, within: float = 5.0) -> None:
    """The engine has no request left and every KV block is free (polled), and its block
    manager is consistent; the frontend has no unfinished request."""
    with anyio.fail_after(within):
        while True:  # polling: the engine has no "idle" event to wait on
            stats = await llm.get_engine_stats()
            if (
                stats.num_running == 0
                and stats.num_waiting == 0
                and stats.num_free_blocks == stats.num_blocks
                and llm.num_unfinished_requests == 0
            ):
                break
            await anyio.sleep(0.01)
    await llm.check_integrity()


async def wait_until(predicate: Callable[[], bool], within: float = 5.0) -> None:
    with anyio.fail_after(within):
        while not predicate():  # noqa: ASYNC110 - polling state that has no event
            await anyio.sleep(0.005)


@contextmanager
def raises_at_once(exc_type: type[BaseException], match: str | None = None) -> Iterator[Any]:
    with anyio.fail_after(2), pytest.raises(exc_type, match=match) as info:
        yield info


# ------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="module")
async def shared_llm(
    engine_args: Callable[..., AsyncEngineArgs], _warm_process: None, shared_tap: InputTap
) -> AsyncIterator[AsyncLLM]:
    async with AsyncLLM.from_engine_args(engine_args(), input_tap=shared_tap) as llm:
        [pid] = llm.statistics().core_pids or [None]
        yield llm
    assert not llm.errored
    if pid is not None:
        with anyio.fail_after(5):
            while psutil.pid_exists(pid):  # noqa: ASYNC110 - polling another process
                await anyio.sleep(0.01)


@pytest.fixture
async def llm(shared_llm: AsyncLLM) -> AsyncIterator[AsyncLLM]:
    assert shared_llm.is_running, "an earlier test broke the shared engine"
    await wait_idle(shared_llm)
    yield shared_llm
    # Leave it idle even after a failure, so that one failure does not cascade.
    await shared_llm.abort(shared_llm.unfinished_request_ids())
    await wait_idle(shared_llm)


@pytest.fixture(scope="module")
def shared_tap() -> InputTap:
    return InputTap()


@pytest.fixture
def tap(llm: AsyncLLM, shared_tap: InputTap) -> Iterator[InputTap]:
    yield shared_tap.start()
    shared_tap.remove()


# ============================================================================== streams


async def test_100_concurrent_streams_get_exact_token_counts(llm: AsyncLLM, tap: InputTap) -> None:
    """For each output kind, 100 concurrent ignore_eos requests with max_tokens 1..16 each get
    exactly their tokens; `finished` is set on the last output only; nothing is aborted."""
    for kind in KINDS:
        reqs = [(f"{kind.name}-{i}", PROMPTS[i % len(PROMPTS)], 1 + i % 16) for i in range(100)]
        results: dict[str, list[RequestOutput]] = {}

        async def run(
            rid: str,
            prompt: str,
            max_tokens: int,
            kind: RequestOutputKind = kind,
            results: dict[str, list[RequestOutput]] = results,
        ) -> None:
            results[rid] = await collect(llm, prompt, params(max_tokens, kind), rid)

        with anyio.fail_after(60):
            async with anyio.create_task_group() as tg:
                for req in reqs:
                    tg.start_soon(run, *req)
        for rid, prompt, max_tokens in reqs:
            check_complete(results[rid], kind, max_tokens)
            assert results[rid][-1].prompt == prompt
    assert not tap.aborted
    assert sum(tap.added.values()) == 300
    await wait_idle(llm)


async def test_n3_fan_out_gives_three_exact_completions(llm: AsyncLLM, tap: InputTap) -> None:
    # Not CUMULATIVE: with n>1 it loses completions whenever the children of one request land
    # in different outputs before the consumer reads (the strict xfail below pins that). Over
    # the multiprocess transport that happens in normal use: the children's AddRequests can
    # reach the core in different steps (seen in about 1 run in 6 of this test with CUMULATIVE).
    for kind in (DELTA, FINAL_ONLY):
        results: dict[str, list[RequestOutput]] = {}

        async def run(
            rid: str,
            max_tokens: int,
            kind: RequestOutputKind = kind,
            results: dict[str, list[RequestOutput]] = results,
        ) -> None:
            results[rid] = await collect(llm, PROMPTS[0], params(max_tokens, kind, n=3), rid)

        with anyio.fail_after(30):
            async with anyio.create_task_group() as tg:
                for i in range(20):
                    tg.start_soon(run, f"{kind.name}-n3-{i}", 1 + i % 8)
        for i in range(20):
            check_complete(results[f"{kind.name}-n3-{i}"], kind, 1 + i % 8, n=3)
    assert not tap.aborted
    assert len(tap.added) == 2 * 20 * 3  # one core request per completion
    await wait_idle(llm)


async def test_cumulative_n3_slow_consumer_keeps_every_completion(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    # One output per chunk: the children of one step reach the collector as separate outputs.
    # (The collector is on the frontend: the transport does not matter.)
    async with AsyncLLM.from_engine_args(inproc_engine_args(output_chunk_size=1)) as llm:
        with anyio.fail_after(10):
            async with aclosing(llm.generate(PROMPTS[0], params(5, CUMULATIVE, n=3))) as agen:
                outs = [await agen.__anext__()]
                # The stats reply travels behind every output of the request: once the engine is
                # idle, all of them sit in the collector, unread.
                while (await llm.get_engine_stats()).num_running:  # noqa: ASYNC110 - polling
                    await anyio.sleep(0.01)
                outs += [out async for out in agen]
        check_complete(outs, CUMULATIVE, 5, n=3)


# ============================================================================== consumers that stop


async def test_cancelling_10_of_20_consumers_aborts_exactly_those(
    llm: AsyncLLM, tap: InputTap
) -> None:
    scopes = {f"c{i}": anyio.CancelScope() for i in range(20)}
    started = {rid: anyio.Event() for rid in scopes}
    results: dict[str, Any] = {}
    victims = [f"c{i}" for i in range(0, 20, 2)]

    async def consume(rid: str) -> None:
        max_tokens = LONG if rid in victims else 24
        outs: list[RequestOutput] = []
        with scopes[rid]:
            # No aclosing on purpose: cancellation alone must abort the request.
            async for out in llm.generate(PROMPTS[int(rid[1:]) % 5], params(max_tokens), rid):
                outs.append(out)
                started[rid].set()
            results[rid] = outs
        if scopes[rid].cancelled_caught:
            results[rid] = "cancelled"

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for rid in scopes:
                tg.start_soon(consume, rid)
            for rid in scopes:
                await started[rid].wait()
            for rid in victims:
                scopes[rid].cancel()
            await anyio.lowlevel.checkpoint()
            # The abort runs synchronously in the consumer's `finally`.
            await wait_until(lambda: all(rid in results for rid in victims), within=2)
            assert dict(tap.aborted) == dict.fromkeys(victims, 1)
    for rid in scopes:
        if rid in victims:
            assert results[rid] == "cancelled"
        else:
            check_complete(results[rid], DELTA, 24)
    await wait_idle(llm)
    assert dict(tap.aborted) == dict.fromkeys(victims, 1)  # and never again


# trio warns about every async generator collected unexhausted: that is this test's subject.
@pytest.mark.filterwarnings("ignore:Async generator .* was garbage collected:ResourceWarning")
async def test_break_without_aclosing_aborts_when_the_generator_is_collected(
    llm: AsyncLLM, tap: InputTap
) -> None:
    agen = llm.generate(PROMPTS[1], params(LONG), "break-gc")
    seen = 0
    async for out in agen:
        seen += len(out.outputs[0].token_ids)
        if seen >= 3:
            break
    assert seen < LONG
    del agen  # the last reference: the event loop's async-generator finalizer closes it
    await wait_until(lambda: llm.num_unfinished_requests == 0, within=2)
    await wait_idle(llm)
    assert dict(tap.aborted) == {"break-gc": 1}


async def test_break_inside_aclosing_aborts_at_once(llm: AsyncLLM, tap: InputTap) -> None:
    async with aclosing(llm.generate(PROMPTS[2], params(LONG), "break-now")) as agen:
        async for _ in agen:
            break
    assert llm.num_unfinished_requests == 0  # synchronously, no waiting for GC
    assert dict(tap.aborted) == {"break-now": 1}
    await wait_idle(llm)
    assert dict(tap.aborted) == {"break-now": 1}


async def test_aclose_aborts_once_and_only_a_started_unfinished_request(
    llm: AsyncLLM, tap: InputTap
) -> None:
    # aclose() after a few outputs: aborted at once.
    agen = llm.generate(PROMPTS[3], params(LONG, n=3), "aclose")
    await agen.__anext__()
    await agen.aclose()
    assert llm.num_unfinished_requests == 0
    assert dict(tap.aborted) == {f"{i}_aclose": 1 for i in range(3)}
    await agen.aclose()  # again: nothing more
    # aclose() of a generator never started: the request never existed.
    never = llm.generate(PROMPTS[3], params(LONG), "never-started")
    await never.aclose()
    # aclose() after the stream finished: nothing to abort.
    done = llm.generate(PROMPTS[3], params(2), "finished")
    outs = [out async for out in done]
    await done.aclose()
    check_complete(outs, DELTA, 2)
    await wait_idle(llm)
    assert dict(tap.aborted) == {f"{i}_aclose": 1 for i in range(3)}
    assert "never-started" not in tap.added


@pytest.mark.parametrize(("kind", "n"), [(DELTA, 1), (CUMULATIVE, 1), (FINAL_ONLY, 3), (DELTA, 3)])
async def test_abort_ends_the_stream_normally_with_finish_reason_abort(
    llm: AsyncLLM, tap: InputTap, kind: RequestOutputKind, n: int
) -> None:
    rid = f"abort-{kind.name}-{n}"
    other = f"other-{kind.name}-{n}"
    results: dict[str, list[RequestOutput]] = {}

    async def run(request_id: str, max_tokens: int) -> None:
        results[request_id] = await collect(
            llm, PROMPTS[0], params(max_tokens, kind, n=n), request_id
        )

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run, rid, LONG)
            tg.start_soon(run, other, 20)
            # Abort once the engine runs the long request (FINAL_ONLY has no output to wait
            # for); `other` may or may not have finished by then.
            while (await llm.get_engine_stats()).num_running < n:  # noqa: ASYNC110 - polling
                await anyio.sleep(0.005)
            await llm.abort(rid)
            await llm.abort(rid)  # a second abort is a no-op
            await llm.abort("no-such-request")  # so is an unknown id
    outs = results[rid]
    assert [o.finished for o in outs] == [False] * (len(outs) - 1) + [True]
    got = completions_by_index(outs, kind)
    assert set(got) == set(range(n))
    for tokens, reason in got.values():
        assert reason == "abort"
        assert tokens < LONG
    check_complete(results[other], kind, 20, n=n)
    await wait_idle(llm)
    core_ids = [rid] if n == 1 else [f"{i}_{rid}" for i in range(n)]
    assert dict(tap.aborted) == dict.fromkeys(core_ids, 1)


async def test_duplicate_id_of_a_running_request_is_refused_and_ids_are_reusable_after_the_end(
    llm: AsyncLLM, tap: InputTap
) -> None:
    results: dict[str, list[RequestOutput]] = {}
    started = anyio.Event()

    async def first() -> None:
        outs = []
        async with aclosing(llm.generate(PROMPTS[0], params(60), "dup")) as agen:
            async for out in agen:
                outs.append(out)
                started.set()
        results["first"] = outs

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(first)
            await started.wait()
            with raises_at_once(ValueError, match="already in use"):
                await llm.generate(PROMPTS[1], params(5), "dup").__anext__()
            assert llm.num_unfinished_requests == 1  # the running one is untouched
    check_complete(results["first"], DELTA, 60)
    # Reuse after the end: a fresh request with exactly its own tokens.
    for kind in KINDS:
        check_complete(await collect(llm, PROMPTS[1], params(7, kind), "dup"), kind, 7)
    assert not tap.aborted
    assert tap.added == Counter({"dup": 4})
    await wait_idle(llm)


@pytest.mark.parametrize("how", ["abort", "break"])
async def test_id_reused_right_after_an_abort_gets_exactly_its_own_tokens(
    llm: AsyncLLM, how: str
) -> None:
    counts = []
    for _ in range(3):
        async with aclosing(llm.generate(PROMPTS[0], params(LONG), "reuse")) as agen:
            async for _out in agen:
                # Let the core finish a step the output actor has not seen yet.
                time.sleep(0.01)  # noqa: ASYNC251 - blocking the loop on purpose
                if how == "break":
                    break
                await llm.abort("reuse")  # the stream ends with the abort output
        outs = await collect(llm, PROMPTS[1], params(10), "reuse")
        counts.append(completions_by_index(outs, DELTA)[0])
    await wait_idle(llm)
    assert counts == [(10, "length")] * 3


# ============================================================================== bad requests


async def _background(
    llm: AsyncLLM, tg: Any, results: dict[str, list[RequestOutput]], count: int
) -> None:
    started = [anyio.Event() for _ in range(count)]

    async def run(i: int) -> None:
        outs = []
        async with aclosing(llm.generate(PROMPTS[i % 5], params(40), f"bg-{i}")) as agen:
            async for out in agen:
                outs.append(out)
                started[i].set()
        results[f"bg-{i}"] = outs

    for i in range(count):
        tg.start_soon(run, i)
    for event in started:
        await event.wait()


async def test_bad_requests_fail_alone_in_the_frontend(llm: AsyncLLM, tap: InputTap) -> None:
    vocab = llm.get_model_config().vocab_size
    limit = llm.get_model_config().max_model_len
    cases: list[tuple[str, Any, SamplingParams | None, str]] = [
        ("long-text", "word " * 400, None, "exceeds max_model_len"),
        ("long-ids", {"prompt_token_ids": [5] * limit}, None, "exceeds max_model_len"),
        ("large-text", "x" * 9000, None, "exceeds max_model_len"),  # tokenized in a thread
        ("empty-text", "", None, "must not be empty"),
        ("empty-ids", {"prompt_token_ids": []}, None, "must not be empty"),
        ("oov-id", {"prompt_token_ids": [1, vocab]}, None, "prompt_token_ids"),
        ("negative-id", {"prompt_token_ids": [-1]}, None, "prompt_token_ids"),
        ("not-ids", {"prompt_token_ids": ["a"]}, None, "prompt_token_ids"),
        ("unknown-key", {"prompt": "x", "foo": 1}, None, "unsupported keys"),
        ("logprobs", PROMPTS[0], params(4, logprobs=21), "logprobs"),
        ("prompt-logprobs", PROMPTS[0], params(4, prompt_logprobs=21), "prompt_logprobs"),
        ("stop-id", PROMPTS[0], params(4, stop_token_ids=[vocab]), "stop_token_ids"),
        ("allowed-id", PROMPTS[0], params(4, allowed_token_ids=[vocab]), "allowed_token_ids"),
    ]
    results: dict[str, list[RequestOutput]] = {}
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await _background(llm, tg, results, 10)
            for rid, prompt, sp, match in cases:
                with raises_at_once(ValueError, match=match):
                    await llm.generate(prompt, sp or params(4), rid).__anext__()
                assert llm.num_unfinished_requests <= 10, rid  # the bad one holds nothing
            # The longest prompt that leaves room for one token is fine: exactly one token.
            edge = await collect(llm, {"prompt_token_ids": [5] * (limit - 1)}, params(16), "edge")
            check_complete(edge, DELTA, 1)
    for i in range(10):
        check_complete(results[f"bg-{i}"], DELTA, 40)
    # Nothing of a bad request reached the core; its id is free.
    assert set(tap.added) == {f"bg-{i}" for i in range(10)} | {"edge"}
    for rid, *_ in cases[:3]:
        check_complete(await collect(llm, PROMPTS[2], params(6), rid), DELTA, 6)
    assert not tap.aborted
    await wait_idle(llm)


@pytest.mark.parametrize("prompt", [123, [1, 2, 3]])
async def test_a_prompt_of_the_wrong_type_is_a_value_error(llm: AsyncLLM, prompt: Any) -> None:
    with raises_at_once(ValueError, match="prompt"):
        await llm.generate(prompt, params(4)).__anext__()
    assert llm.num_unfinished_requests == 0


@pytest.mark.parametrize("n", [1, 3])
async def test_a_request_the_core_rejects_fails_alone(
    llm: AsyncLLM, tap: InputTap, n: int
) -> None:
    """The tap makes good prompts bad past the frontend's checks, so that they reach the core, whose
    own validation answers with a per-request error: a ValueError from the stream, nothing else."""
    vocab = llm.get_model_config().vocab_size
    cases = [
        (f"core-empty-{n}", {"prompt_token_ids": []}, "empty"),
        (f"core-oov-{n}", {"prompt_token_ids": [1, vocab + 5]}, "token ids must be in"),
    ]
    bad = {rid: prompt["prompt_token_ids"] for rid, prompt, _ in cases}

    def send_bad_prompt(msg: AddRequest) -> AddRequest:
        user_id = msg.request.request_id.rsplit("#", 1)[0]
        user_id = user_id.partition("_")[2] or user_id if n > 1 else user_id
        if user_id in bad:
            msg.request.prompt_token_ids = list(bad[user_id])
        return msg

    tap.rewrite = send_bad_prompt
    results: dict[str, list[RequestOutput]] = {}
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await _background(llm, tg, results, 10)
            for rid, _, match in cases:  # a good prompt, made bad past the frontend's checks
                with pytest.raises(ValueError, match=match):
                    await collect(llm, PROMPTS[0], params(8, n=n), rid)
            # The next request gets exactly its own tokens.
            check_complete(await collect(llm, PROMPTS[1], params(9, n=n), "after"), DELTA, 9, n=n)
    for i in range(10):
        check_complete(results[f"bg-{i}"], DELTA, 40)
    for rid, _, _ in cases:
        core_ids = [rid] if n == 1 else [f"{i}_{rid}" for i in range(n)]
        assert all(tap.added[c] == 1 for c in core_ids)  # it did reach the core
        assert all(tap.aborted[c] <= 1 for c in core_ids)
    assert not llm.errored
    await wait_idle(llm)
    tap.rewrite = None
    for rid, _, _ in cases:  # the ids are free again
        check_complete(await collect(llm, PROMPTS[0], params(3), rid), DELTA, 3)
    await wait_idle(llm)


# ============================================================================== death


async def _streams_until_death(
    llm: AsyncLLM, count: int, on_all_started: Callable[[], None] | None = None
) -> dict[int, tuple[str, int]]:
    """`count` DELTA streams; each ends as ("dead", tokens seen) or ("finished", tokens)."""
    outcomes: dict[int, tuple[str, int]] = {}
    started = [anyio.Event() for _ in range(count)]

    async def consume(i: int) -> None:
        seen = 0
        try:
            async with aclosing(llm.generate(PROMPTS[i % 5], params(LONG), f"d{i}")) as agen:
                async for out in agen:
                    seen += len(out.outputs[0].token_ids)
                    started[i].set()
        except EngineDeadError:
            outcomes[i] = ("dead", seen)
        else:
            outcomes[i] = ("finished", seen)
        finally:
            started[i].set()

    async with anyio.create_task_group() as tg:
        for i in range(count):
            tg.start_soon(consume, i)
        if on_all_started is not None:
            for event in started:
                await event.wait()
            on_all_started()
    return outcomes


async def _check_dead(llm: AsyncLLM, cause: str) -> None:
    assert llm.errored
    assert not llm.is_running
    assert isinstance(llm.dead_error, EngineDeadError)
    assert cause in str(llm.dead_error)
    with raises_at_once(EngineDeadError):
        await llm.generate(PROMPTS[0], params(4)).__anext__()
    with raises_at_once(EngineDeadError):
        await llm.check_health()
    with raises_at_once(EngineDeadError):
        await llm.get_engine_stats()
    await llm.abort("d0")  # harmless
    assert llm.num_unfinished_requests == 0


@pytest.mark.parametrize("fault_step", [1, 4])
async def test_a_fault_in_the_forward_pass_fails_every_stream_with_engine_dead_error(
    engine_args: Callable[..., AsyncEngineArgs], transport: str, fault_step: int
) -> None:
    if transport == "multiprocess" and fault_step == 1:
        pytest.skip("time: a death before the first output is the same message path in a child")
    llm = AsyncLLM.from_engine_args(engine_args(), engine_core_factory=fault_at_step(fault_step))
    async with llm:
        with anyio.fail_after(5):
            outcomes = await _streams_until_death(llm, 50)
        assert sorted(outcomes) == list(range(50))
        assert {kind for kind, _ in outcomes.values()} == {"dead"}
        assert all(seen < fault_step for _, seen in outcomes.values())
        await _check_dead(llm, "injected fault")
    # Leaving `async with` after the death raises nothing: it was reported on the data path
    # (a deliberate departure from CONCURRENCY.md's "__aexit__ re-raises"; docs/architecture.md).
    assert llm.errored
    with raises_at_once(EngineDeadError):  # still the death, not "not running"
        await llm.generate(PROMPTS[0], params(4)).__anext__()


@pytest.mark.parametrize("transport", ["multiprocess"], indirect=True)
async def test_sigkill_of_the_engine_process_fails_every_stream_with_engine_dead_error(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    llm = AsyncLLM.from_engine_args(engine_args())
    async with llm:
        [pid] = llm.statistics().core_pids
        with anyio.fail_after(5):
            outcomes = await _streams_until_death(llm, 50, lambda: os.kill(pid, signal.SIGKILL))
        assert {kind for kind, _ in outcomes.values()} == {"dead"}
        assert all(0 < seen < LONG for _, seen in outcomes.values())
        await _check_dead(llm, "SIGKILL")
    assert llm.errored


# ============================================================================== clean shutdown


async def test_leaving_async_with_aborts_in_flight_streams_without_a_death(
    engine_args: Callable[..., AsyncEngineArgs], caplog: pytest.LogCaptureFixture
) -> None:
    results: dict[int, Any] = {}
    started = [anyio.Event() for _ in range(20)]

    async def consume(llm: AsyncLLM, i: int) -> None:
        outs = []
        try:
            async with aclosing(
                llm.generate(PROMPTS[i % 5], params(LONG, n=1 + i % 2), f"s{i}")
            ) as agen:
                async for out in agen:
                    outs.append(out)
                    started[i].set()
        except Exception as exc:  # noqa: BLE001 - recorded and checked below
            results[i] = exc
        else:
            results[i] = outs

    llm = AsyncLLM.from_engine_args(engine_args())
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            async with llm:
                for i in range(20):
                    tg.start_soon(consume, llm, i)
                for event in started:
                    await event.wait()
            # shutdown(timeout=0) has run: every stream ends, normally, with "abort".
    for i in range(20):
        outs = results[i]
        assert isinstance(outs, list), f"stream {i} raised {outs!r}"
        assert outs[-1].finished and [o.finished for o in outs].count(True) == 1
        got = completions_by_index(outs, DELTA)
        assert {reason for _, reason in got.values()} == {"abort"}
    assert not llm.errored
    assert not [r for r in caplog.records if r.levelname in ("ERROR", "CRITICAL")]
    with raises_at_once(RuntimeError, match="async with") as info:
        await llm.generate(PROMPTS[0], params(4)).__anext__()
    assert not isinstance(info.value, EngineDeadError)
    with raises_at_once(RuntimeError, match="not running"):
        await llm.get_engine_stats()
    await llm.shutdown()  # idempotent


async def test_shutdown_with_a_timeout_lets_in_flight_requests_finish(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    results: dict[int, list[RequestOutput]] = {}
    started = [anyio.Event() for _ in range(20)]

    async def consume(llm: AsyncLLM, i: int) -> None:
        outs = []
        async with aclosing(llm.generate(PROMPTS[i % 5], params(30, n=1 + i % 2), f"w{i}")) as agen:
            async for out in agen:
                outs.append(out)
                started[i].set()
        results[i] = outs

    llm = AsyncLLM.from_engine_args(engine_args())
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            await llm.start()
            try:
                for i in range(20):
                    tg.start_soon(consume, llm, i)
                for event in started:
                    await event.wait()
                t0 = time.monotonic()
                await llm.shutdown(timeout=5)
                assert time.monotonic() - t0 < 4  # it waited for the requests, not the timeout
                with raises_at_once(RuntimeError, match="async with"):
                    await llm.generate(PROMPTS[0], params(4)).__anext__()
            finally:
                await llm.shutdown()
    for i in range(20):
        check_complete(results[i], DELTA, 30, n=1 + i % 2)
    assert not llm.errored


async def test_using_the_engine_outside_its_lifetime_raises_runtime_error(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    # (Before the first use it is not running; the first use starts it: test_vllm_surface.py.)
    llm = AsyncLLM.from_engine_args(inproc_engine_args())
    assert not llm.is_running and not llm.errored
    await llm.shutdown()  # not started: a no-op
    async with llm:
        await llm.check_health()
        with raises_at_once(RuntimeError, match="already started"):
            await llm.start()
        check_complete(await collect(llm, PROMPTS[0], params(3)), DELTA, 3)
    assert not llm.is_running and not llm.errored
    with raises_at_once(RuntimeError, match="async with"):
        await llm.check_health()


async def test_start_after_shutdown_either_refuses_or_works(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    llm = AsyncLLM.from_engine_args(inproc_engine_args())
    async with llm:
        pass
    try:
        await llm.start()
    except RuntimeError:
        return  # refusing a restart is fine
    try:
        check_complete(await collect(llm, PROMPTS[0], params(3)), DELTA, 3)
    finally:
        await llm.shutdown()


async def test_start_up_failures_raise_an_error_that_names_the_cause(
    engine_args: Callable[..., AsyncEngineArgs], tmp_path: Path, tiny_model_dir: Path
) -> None:
    with raises_at_once(ValueError, match="not found"):
        async with AsyncLLM.from_engine_args(engine_args(model=str(tmp_path / "missing"))):
            pass
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    with anyio.fail_after(60), pytest.raises(Exception) as info:  # noqa: B017 - checked below
        async with AsyncLLM.from_engine_args(engine_args(model=str(broken))):
            pass
    assert not isinstance(info.value, BaseExceptionGroup)
    text = "".join(traceback.format_exception(info.value))
    assert "header" in text.lower(), text


async def test_a_start_up_failure_after_the_core_started_closes_its_output_stream(
    engine_args: Callable[..., AsyncEngineArgs], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The core is up, then start-up fails (here the input processor): the core stops and the
    stream of its outputs, never handed to the output actor, is closed (no ResourceWarning)."""
    import gc
    import warnings

    from triollm.actors import runtime

    def refuse(*args: object, **kwargs: object) -> None:
        raise ValueError("input processor: refused by the test")

    monkeypatch.setattr(runtime, "InputProcessor", refuse)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        with anyio.fail_after(60), pytest.raises(ValueError, match="refused by the test"):
            async with AsyncLLM.from_engine_args(engine_args()):
                pass
        gc.collect()
    unclosed = [w for w in caught if issubclass(w.category, ResourceWarning) and "Stream" in str(w.message)]
    assert not unclosed, [str(w.message) for w in unclosed]
