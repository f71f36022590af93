"""`AsyncLLM` under faults: a hypothesis plan of submit / cancel / abort / break / death /
shutdown steps, and targeted tests of the death and shutdown paths.

The plan (`test_fault_plan_*`) runs under `anyio.fail_after` and asserts, for every example:
nothing hangs; every request ends exactly once (a finished output, EngineDeadError, a
`ValueError` for its own bad input or reused id, or the consumer's own cancellation / break) and
only in a way something in the plan explains; a stream that ran to its end has exactly its
tokens, and no stop string in its text; no core request is aborted twice, and none that
finished; after the plan the engine (if alive) has no request left and every KV block free;
no child process survives the example. Threads and fds are checked once per test (`no_leaks`).

What a plan submits: short and long prompts (the long ones take the tokenizer-thread path: the
threshold is lowered for the plan), stop strings, priorities, ids reused from earlier requests
(refused while the earlier one is unfinished), and inputs over a limit (a prompt longer than
the model, too many stop strings, `n` over `max_n`, sampling params broken after construction,
`max_tokens` that cannot fit the KV cache), each of which must fail alone. Some examples run
under preemption pressure (a KV cache of 10 blocks, where requests of several priorities evict
each other).

Deaths come from `FakeCore(model=True, fail_at_step=n)` (an engine core whose real forward
pass raises at step n: a real exception, in this process or in the engine-core child), from
`FakeCore(model=True, hang_at_step=n)` (a forward pass that blocks its thread for good: the
output watchdog must declare the engine dead) and, with the multiprocess transport, from
SIGKILL of the engine process at a step of the plan.

The seams (fake cores, the input tap's recorder, the plan's client steps, leak checks, fake
core loops) are `triollm.testing`'s: the module users test their own shutdown paths with.

Targeted tests: outputs made before a death reach a lagging consumer before the error; a death
ends a draining shutdown; a hung (SIGSTOPped) engine process is killed at shutdown; a cancelled
draining shutdown must still end every stream; every caller's EngineDeadError carries its own
short traceback; the death message shows only the step's failure.

Fakes appear only where the fake is the point: an engine-core loop that stops without a word,
one that sends an unreadable output, one that hangs and ignores Shutdown (under trio's
MockClock, the one place here without real I/O to race the clock).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
import traceback
from collections.abc import Callable
from contextlib import aclosing, nullcontext
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.abc
import anyio.lowlevel
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from trio.testing import MockClock

import triollm.actors.async_llm as async_llm_module
import triollm.actors.process as process_module
import triollm.actors.transport as transport_module
from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.actors.messages import AddRequest, EngineDead, OutputBatch, Shutdown
from triollm.engine.outputs import RequestOutput
from triollm.engine.sampling_params import (
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)
from triollm.testing import (
    FakeCore,
    InputRecorder,
    child_pids,
    hold_hung_steps,
    kill_core_process,
    mock_clock_patience,
    wait_no_new_children,
)
from triollm.testing.strategies import (
    HangRank,
    Kill,
    Stop,
    Wait,
    client_steps,
    fake_cores,
    hang_ranks,
    stops,
    waits,
)

pytestmark = [pytest.mark.anyio, pytest.mark.usefixtures("no_leaks")]

DELTA, CUMULATIVE, FINAL_ONLY = (
    RequestOutputKind.DELTA,
    RequestOutputKind.CUMULATIVE,
    RequestOutputKind.FINAL_ONLY,
)
PROMPT = "Once upon a time there was"  # 11 tokens
# 48 tokens; over the plan's tokenizer-thread threshold (PLAN_LARGE_PROMPT characters).
LONG_PROMPT = "Once upon a time there was a small engine that served many requests at once."
PLAN_LARGE_PROMPT = 64
# KV blocks of 16 under preemption pressure: 96 slots, where three short sequences fill the
# cache (a request of the plan needs at most 48 + 20 - 1 slots, so each alone fits).
PRESSURE_BLOCKS = 6
STOPS = ["e", "th", "a b", "\n", "never-generated-stop"]
BAD_INPUTS = ["long_prompt", "many_stops", "big_n", "mutated", "kv", "big_schema", "huge_id", "fanout"]
# The plan's max_request_tokens: its largest good request holds 3 x 48 tokens; "fanout" 3,022.
PLAN_REQUEST_TOKENS = 2000
# trio warns about async generators collected unexhausted: the plan does that on purpose.
IGNORE_GC_WARNING = pytest.mark.filterwarnings(
    "ignore:Async generator .* was garbage collected:ResourceWarning"
)


def params(
    max_tokens: int, kind: RequestOutputKind = DELTA, n: int = 1, stop: list[str] | None = None
) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, output_kind=kind, n=n, stop=stop)


async def assert_idle(llm: AsyncLLM) -> None:
    """Once the frontend holds no request (consumers collected by GC included), one statistics
    call must find the engine idle: every abort was sent before the frontend let go of its
    request, and the core applies its inputs in order, so no polling of the engine is needed
    (polling would let an unaborted short request finish by itself and hide the leak)."""
    with anyio.fail_after(2):
        while llm.num_unfinished_requests:  # noqa: ASYNC110 - waits for GC finalizers
            await anyio.sleep(0.005)
    s = await llm.get_engine_stats()
    assert (s.num_running, s.num_waiting) == (0, 0), s
    assert s.num_free_blocks == s.num_blocks, s
    await llm.check_integrity()


# ============================================================================== the plan


@dataclass(frozen=True)
class Submit:
    kind: RequestOutputKind
    max_tokens: int
    n: int
    aclosing: bool  # the consumer wraps the stream in aclosing (else a break aborts at GC)
    long: bool = False  # LONG_PROMPT (tokenized in a thread) instead of PROMPT
    stop: tuple[str, ...] = ()
    priority: int = 0
    reuse: int | None = None  # take the id of an earlier request (index modulo their number)
    bad: str | None = None  # one of BAD_INPUTS: must fail alone with a ValueError
    grammar: int | None = None  # a regex of its own (a new grammar for the core to compile)

    def prompt(self) -> str:
        if self.bad == "long_prompt":
            return "x" * 9000  # 9,000 tokens: over max_model_len (and tokenized in a thread)
        return LONG_PROMPT if self.long else PROMPT

    def sampling_params(self, max_n: int) -> SamplingParams:
        stop = list(self.stop) or None
        if self.bad == "many_stops":
            stop = [f"stop{i}" for i in range(65)]  # max_stop_strings is 64
        sp = params(
            10**6 if self.bad == "kv" else self.max_tokens,
            self.kind,
            max_n + 1 if self.bad == "big_n" else self.n,
            stop,
        )
        if self.bad == "mutated":
            sp.top_p = 2.0  # valid when built, broken before submission
        elif self.bad == "big_schema":  # an integer msgpack cannot carry, set after construction
            so = StructuredOutputsParams(json={"type": "integer"})
            assert isinstance(so.json, dict)
            so.json["maximum"] = 2**64 + 5
            sp.structured_outputs = so
        elif self.bad == "fanout":  # n x (prompt + lists) over the plan's max_request_tokens
            sp.n, sp.stop_token_ids = 2, [1] * 1500
        if self.grammar is not None and self.bad != "big_schema":
            sp.structured_outputs = StructuredOutputsParams(regex=f"(ab|c){{1,{self.grammar}}}d")
        return sp


@dataclass(frozen=True)
class Stats:
    pass


def submits() -> st.SearchStrategy[Submit]:
    # n>1 only with DELTA and FINAL_ONLY: CUMULATIVE n>1 loses completions when the consumer
    # lags (see test_async_llm.py::test_cumulative_n3_slow_consumer_keeps_every_completion).
    return st.builds(
        Submit,
        kind=st.sampled_from([DELTA, CUMULATIVE, FINAL_ONLY]),
        max_tokens=st.integers(1, 20),
        n=st.sampled_from([1, 1, 2, 3]),
        aclosing=st.booleans(),
        long=st.sampled_from([False, False, True]),
        stop=st.sampled_from([(), (), ()] + [(s,) for s in STOPS] + [tuple(STOPS[:3])]),
        priority=st.sampled_from([0, 0, -1, 1]),
        reuse=st.none() | st.none() | st.none() | st.integers(0, 40),
        bad=st.none() | st.none() | st.none() | st.none() | st.sampled_from(BAD_INPUTS),
        grammar=st.none() | st.none() | st.none() | st.integers(1, 400),
    ).map(lambda s: s if s.kind != CUMULATIVE else dataclasses.replace(s, n=1))


def plan_steps(kill: bool, hang_rank: bool = False) -> st.SearchStrategy[list[Any]]:
    """Submits (twice as likely), stops (cancel / abort / break), waits, stats and kills (and,
    with data parallel, a rank that hangs: SIGSTOP)."""
    return client_steps(
        submits(),
        stop=stops(("cancel", "abort", "break"), 40),
        wait=waits(("tick", "sleep", "output"), 40),
        extra=[st.just(Stats()), *([hang_ranks(2)] if hang_rank else [])],
        kill=kill,
        max_size=24,
    )


@dataclass
class Req:
    rid: str
    submit: Submit
    scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    progress: anyio.Event = field(default_factory=anyio.Event)  # an output, or the end
    done: anyio.Event = field(default_factory=anyio.Event)
    outputs: list[RequestOutput] = field(default_factory=list)
    ends: list[str] = field(default_factory=list)
    wants: set[str] = field(default_factory=set)

    @property
    def core_ids(self) -> list[str]:
        n = self.submit.n
        return [self.rid] if n == 1 else [f"{i}_{self.rid}" for i in range(n)]

    def completions(self) -> dict[int, tuple[int, str | None]]:
        return {i: (tokens, reason) for i, (tokens, _, reason) in self.texts().items()}

    def texts(self) -> dict[int, tuple[int, str, str | None]]:
        """Per completion index: (number of tokens, text, finish reason)."""
        tokens: dict[int, int] = {}
        text: dict[int, str] = {}
        reason: dict[int, str | None] = {}
        for out in self.outputs:
            for c in out.outputs:
                if self.submit.kind == DELTA:
                    tokens[c.index] = tokens.get(c.index, 0) + len(c.token_ids)
                    text[c.index] = text.get(c.index, "") + c.text
                else:
                    tokens[c.index] = len(c.token_ids)
                    text[c.index] = c.text
                assert reason.get(c.index) is None, (
                    f"{self.rid}: completion {c.index} went on after its end"
                )
                reason[c.index] = c.finish_reason
        return {i: (tokens[i], text[i], reason[i]) for i in tokens}


async def consume(llm: AsyncLLM, req: Req, max_n: int) -> None:
    s = req.submit
    with req.scope:
        try:
            sp = s.sampling_params(max_n)
            agen = llm.generate(s.prompt(), sp, req.rid, priority=s.priority)
            async with aclosing(agen) if s.aclosing else nullcontext(agen) as stream:
                async for out in stream:
                    req.outputs.append(out)
                    req.progress.set()
                    if "break" in req.wants:
                        req.ends.append("break")
                        break
                else:
                    req.ends.append("finished")
        except EngineDeadError:
            req.ends.append("dead")
        except ValueError as exc:
            req.ends.append("duplicate" if "already in use" in str(exc) else f"rejected: {exc}")
        except RuntimeError as exc:
            # The consumer first ran after shutdown() began: the request never existed.
            req.ends.append("refused" if "not running" in str(exc) else f"error: {exc!r}")
        except Exception as exc:  # noqa: BLE001 - any other error breaks an invariant below
            req.ends.append(f"error: {exc!r}")
    if req.scope.cancelled_caught and not req.ends:
        req.ends.append("cancelled")
    req.progress.set()
    req.done.set()


async def run_plan(
    engine_args: Callable[..., AsyncEngineArgs],
    steps: list[Any],
    fault: FakeCore,
    chunk: int,
    ending: str,
    pressure: bool = False,
) -> None:
    before = child_pids()
    overrides: dict[str, Any] = {
        "output_chunk_size": chunk,
        "scheduling_policy": "priority",
        "max_request_tokens": PLAN_REQUEST_TOKENS,
    }
    if pressure:
        overrides["num_gpu_blocks_override"] = PRESSURE_BLOCKS
    if fault.hang_at_step is not None or any(isinstance(s, HangRank) for s in steps):
        overrides["engine_output_timeout_s"] = 1.0
    tap = InputRecorder()
    llm = AsyncLLM.from_engine_args(
        engine_args(**overrides), engine_core_factory=fault.factory(), input_tap=tap
    )
    reqs: list[Req] = []
    killed = False
    large_prompt = async_llm_module._LARGE_PROMPT
    async_llm_module._LARGE_PROMPT = PLAN_LARGE_PROMPT
    try:
        # At the end, an abandoned in-process step thread (a hung step) returns. The start has a
        # bound of its own: an engine-core child imports torch and loads the model, which on a
        # starved machine (a soak beside other work) takes longer than any step of the plan may
        # (the handshake's own deadline is tested apart); from then on, 30 s: nothing hangs.
        with hold_hung_steps(), anyio.fail_after(START_BOUND_S) as bound:
            async with anyio.create_task_group() as tg:
                await llm.start()
                bound.deadline = anyio.current_time() + 30
                try:
                    assert llm.config is not None
                    max_n = llm.config.limits.max_n
                    for step in steps:
                        killed |= await run_step(llm, tg, step, reqs, killed, max_n, pressure)
                    await end_plan(llm, reqs, ending, fault.dies or killed)
                finally:
                    await llm.shutdown()
    finally:
        async_llm_module._LARGE_PROMPT = large_prompt
    await wait_no_new_children(before)
    check_outcomes(llm, reqs, tap, fault.dies or killed, ending)


async def run_step(
    llm: AsyncLLM,
    tg: anyio.abc.TaskGroup,
    step: Any,
    reqs: list[Req],
    killed: bool,
    max_n: int,
    pressure: bool,
) -> bool:
    """Run one step of the plan; True if it killed the engine process."""
    match step:
        case Submit():
            if step.bad == "kv" and not pressure:  # the default cache fits any max_tokens
                step = dataclasses.replace(step, bad="big_n")
            rid = f"r{len(reqs)}"
            if step.bad == "huge_id":
                rid = "x" * 600 + rid  # over MAX_REQUEST_ID_LEN (512)
            elif step.reuse is not None and reqs and reqs[step.reuse % len(reqs)].submit.bad != "huge_id":
                rid = reqs[step.reuse % len(reqs)].rid
            req = Req(rid, step)
            reqs.append(req)
            tg.start_soon(consume, llm, req, max_n)
        case Stop(what, target) if reqs:
            req = reqs[target % len(reqs)]
            req.wants.add(what)
            if what == "cancel":
                req.scope.cancel()
            elif what == "abort":
                await llm.abort(req.rid)
        case Wait("tick", _):
            await anyio.lowlevel.checkpoint()
        case Wait("sleep", _):
            await anyio.sleep(0.005)
        case Wait("output", target) if reqs:
            with anyio.move_on_after(2):
                await reqs[target % len(reqs)].progress.wait()
        case Stats():
            try:
                s = await llm.get_engine_stats()
            except EngineDeadError:
                assert llm.errored
            else:
                assert 0 <= s.num_free_blocks <= s.num_blocks
        case Kill() if not killed:
            kill_core_process(llm)  # SIGKILL (of rank 0's process, with data parallel)
            return True
        case HangRank(rank) if not killed:  # SIGSTOP one rank: its watchdog must find it
            kill_core_process(llm, signal.SIGSTOP, rank)
            return True
    return False


async def end_plan(llm: AsyncLLM, reqs: list[Req], ending: str, death_possible: bool) -> None:
    if ending == "shutdown_now":  # in-flight requests end with "abort"
        await llm.shutdown(timeout=0)
    elif ending == "shutdown_wait":  # in-flight requests run to their end
        await llm.shutdown(timeout=10)
    else:  # "drain": every consumer ends, then the engine must be idle
        with anyio.fail_after(10):
            for req in reqs:
                await req.done.wait()
        try:
            await assert_idle(llm)
            stats = await llm.get_engine_stats()
            event(f"drained; requests were preempted: {stats.num_preemptions > 0}")
        except EngineDeadError:  # a request aborted at GC could still step into it
            assert death_possible
        await llm.shutdown()


def check_outcomes(
    llm: AsyncLLM, reqs: list[Req], tap: InputRecorder, death_possible: bool, ending: str
) -> None:
    # Shown by --hypothesis-show-statistics: what the examples exercised.
    event(f"engine {'died' if llm.errored else 'lived'}, {ending}")
    for req in reqs:
        end = req.ends[0].split(":")[0] if req.ends else "?"
        if end == "finished":
            end += ", " + "/".join(sorted({str(r) for _, r in req.completions().values()}))
        event(f"a request ended: {end}")
    if llm.errored:
        assert death_possible, f"the engine died without a cause: {llm.dead_error}"
        hung = "engine_output_timeout_s" in str(llm.dead_error)
        event(f"the engine died: {'hung (watchdog)' if hung else 'failed or killed'}")
    assert max(tap.aborted_core.values(), default=0) <= 1, "a core request was aborted twice"
    holders: dict[str, list[Req]] = {}
    for req in reqs:
        holders.setdefault(req.rid, []).append(req)
    for req in reqs:
        s = req.submit
        where = f"{req.rid} {s} wants={sorted(req.wants)} ends={req.ends}"
        assert len(req.ends) == 1, f"{where}: not exactly one end"
        end = req.ends[0].split(":")[0]
        shared = holders[req.rid]
        # llm.abort(rid) aborts whichever request holds the id then.
        abort_wanted = any("abort" in r.wants for r in shared)
        finished_flags = [o.finished for o in req.outputs]
        assert True not in finished_flags[:-1], f"{where}: output after a finished one"
        assert all(o.request_id == req.rid for o in req.outputs), where
        got = req.texts()
        assert all(tokens <= s.max_tokens for tokens, _, _ in got.values()), f"{where}: {got}"
        if len(shared) == 1:  # with a reused id, tap.aborted cannot tell the holders apart
            aborted = max(tap.aborted[c] for c in req.core_ids)
            assert aborted <= 1, f"{where}: aborted {aborted} times"
        else:
            aborted = None
        if end == "finished":
            assert s.bad is None, f"{where}: a bad input was accepted"
            assert finished_flags[-1], where
            assert set(got) == set(range(s.n)), f"{where}: {got}"
            if s.kind == FINAL_ONLY:
                assert len(req.outputs) == 1, where
            for tokens, text, reason in got.values():
                if reason == "length":
                    assert tokens == s.max_tokens, f"{where}: {got}"
                elif reason == "stop":  # a stop string, or the end of its grammar
                    assert s.stop or s.grammar is not None, f"{where}: stopped without a stop string"
                else:
                    assert reason == "abort", f"{where}: {got}"
                    assert abort_wanted or ending == "shutdown_now", f"{where}: unexplained abort"
                if reason in ("length", "stop"):
                    hit = [stop for stop in s.stop if stop in text]
                    assert not hit, f"{where}: {hit} in the text {text!r}"
            # A stop string is found by the frontend, which then aborts the core request (once).
            if {r for _, _, r in got.values()} == {"length"}:
                assert not aborted, f"{where}: a finished request was aborted"
        elif end == "dead":
            assert llm.errored, where
        elif end == "refused":  # its consumer first ran after shutdown() began
            assert ending != "drain" and not req.outputs, where
        elif end == "cancelled":
            assert "cancel" in req.wants, where
        elif end == "break":
            assert "break" in req.wants, where
        elif end == "rejected":
            assert s.bad is not None, f"{where}: a good input was rejected"
            assert not req.outputs, where
        elif end == "duplicate":
            # Another request held the id then: the consumers start in any order, and one that
            # was refused by shutdown may have held the id while its prompt was tokenized.
            holders_then = [r for r in shared if r is not req and r.ends[0] != "duplicate"]
            assert holders_then, f"{where}: refused an id nobody held"
            assert not req.outputs, where
        else:
            pytest.fail(f"{where}: unexpected end")
        if s.bad is not None:
            assert end in ("rejected", "duplicate", "cancelled", "dead", "refused"), where
        quiet = not req.wants and not abort_wanted and end not in ("refused", "duplicate")
        if quiet and s.bad is None and not llm.errored and ending != "shutdown_now":
            reasons = {r for _, _, r in got.values()}
            assert end == "finished" and reasons <= {"length", "stop"}, where


# Examples of the plan per backend. A multiprocess example starts an engine-core child and
# takes ~3.5 s on the 2-core development machine (a data-parallel one ~8 s): `make test` runs
# 4 (and 1) per backend, to stay within CI's time (the in-process plan, ~0.2 s an example,
# walks the same actors 40 times); the soak profile runs many more.
# TRIOLLM_SOAK=1 selects the soak profile: 1,000 examples of each plan per backend (about an
# hour and a half here; not run by `make test`; see docs/reliability.md).
# TRIOLLM_SOAK_EXAMPLES=N sets another count for the soak.
SOAK = os.environ.get("TRIOLLM_SOAK", "") == "1"
START_BOUND_S = 300  # an engine (and its child) starting; the plan itself has 30 s
SOAK_EXAMPLES = int(os.environ.get("TRIOLLM_SOAK_EXAMPLES", "1000"))
INPROC_EXAMPLES = SOAK_EXAMPLES if SOAK else 40
MULTIPROCESS_EXAMPLES = SOAK_EXAMPLES if SOAK else 4
DATA_PARALLEL_EXAMPLES = SOAK_EXAMPLES if SOAK else 1  # two children per example


def faults() -> st.SearchStrategy[FakeCore]:
    """The real model, healthy, or with a forward pass that raises or hangs at step n (a plan
    runs ~5-40 steps)."""
    return fake_cores(model=True, faults=("fail", "fail", "hang"), max_step=12)


PLAN_SETTINGS = {
    "deadline": None,
    "database": None,
    "suppress_health_check": [HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
}


@IGNORE_GC_WARNING
@pytest.mark.parametrize("transport", ["inproc"], indirect=True)
@settings(max_examples=INPROC_EXAMPLES, **PLAN_SETTINGS)
@given(
    steps=plan_steps(kill=False),
    fault=faults(),
    chunk=st.sampled_from([1, 3, 128]),
    ending=st.sampled_from(["drain", "shutdown_now", "shutdown_wait"]),
    pressure=st.booleans(),
)
async def test_fault_plan_inproc(
    engine_args: Callable[..., AsyncEngineArgs],
    steps: list[Any],
    fault: FakeCore,
    chunk: int,
    ending: str,
    pressure: bool,
) -> None:
    await run_plan(engine_args, steps, fault, chunk, ending, pressure)


@IGNORE_GC_WARNING
@pytest.mark.parametrize("transport", ["multiprocess"], indirect=True)
@settings(max_examples=MULTIPROCESS_EXAMPLES, **PLAN_SETTINGS)
@given(
    steps=plan_steps(kill=True),
    fault=faults(),
    chunk=st.sampled_from([1, 128]),
    ending=st.sampled_from(["drain", "shutdown_now", "shutdown_wait"]),
    pressure=st.booleans(),
)
async def test_fault_plan_multiprocess(
    engine_args: Callable[..., AsyncEngineArgs],
    steps: list[Any],
    fault: FakeCore,
    chunk: int,
    ending: str,
    pressure: bool,
) -> None:
    await run_plan(engine_args, steps, fault, chunk, ending, pressure)


@IGNORE_GC_WARNING
@pytest.mark.parametrize("transport", ["multiprocess"], indirect=True)
@settings(max_examples=DATA_PARALLEL_EXAMPLES, **PLAN_SETTINGS)
@given(
    steps=plan_steps(kill=True, hang_rank=True),
    fault=faults(),
    ending=st.sampled_from(["drain", "shutdown_now", "shutdown_wait"]),
    pressure=st.booleans(),
)
async def test_fault_plan_data_parallel(
    engine_args: Callable[..., AsyncEngineArgs],
    steps: list[Any],
    fault: FakeCore,
    ending: str,
    pressure: bool,
) -> None:
    # Two ranks: the kill step kills rank 0's process, a fault hits each rank at its step n.
    def two_ranks(**overrides: Any) -> AsyncEngineArgs:
        return engine_args(data_parallel_size=2, **overrides)

    # A SIGSTOPped rank ignores SIGTERM: do not wait the full grace before its SIGKILL.
    grace = process_module.TERM_GRACE_S
    process_module.TERM_GRACE_S = 0.3
    try:
        await run_plan(two_ranks, steps, fault, 1, ending, pressure)
    finally:
        process_module.TERM_GRACE_S = grace


# ============================================================================== death, in detail


async def test_outputs_made_before_the_death_are_delivered_before_engine_dead_error(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    """A consumer that lags still gets every token produced before the death (merged), then the
    error; and utility calls racing the death return stats or raise EngineDeadError, never hang."""
    fault_at = 6
    async with AsyncLLM.from_engine_args(
        engine_args(), engine_core_factory=FakeCore(model=True, fail_at_step=fault_at).factory()
    ) as llm:
        with anyio.fail_after(10):
            async with aclosing(llm.generate(PROMPT, params(100))) as agen:
                first = await agen.__anext__()
                while True:  # hammer the utility path until the death reaches it
                    try:
                        await llm.get_engine_stats()
                    except EngineDeadError:
                        break
                assert llm.errored
                rest = []
                with pytest.raises(EngineDeadError, match="injected fault"):
                    async for out in agen:
                        rest.append(out)
        tokens = sum(len(o.outputs[0].token_ids) for o in [first, *rest])
        assert tokens == fault_at - 1  # one per step before the failing one
        assert not any(o.finished for o in [first, *rest])


async def test_a_death_during_a_draining_shutdown_ends_it_promptly(
    engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    outcomes: dict[int, str] = {}
    started = [anyio.Event() for _ in range(10)]

    async def consume(llm: AsyncLLM, i: int) -> None:
        try:
            async with aclosing(llm.generate(PROMPT, params(200), f"q{i}")) as agen:
                async for _ in agen:
                    started[i].set()
        except EngineDeadError:
            outcomes[i] = "dead"
        else:
            outcomes[i] = "finished"
        finally:
            started[i].set()

    llm = AsyncLLM.from_engine_args(
        engine_args(), engine_core_factory=FakeCore(model=True, fail_at_step=15).factory()
    )
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            await llm.start()
            try:
                for i in range(10):
                    tg.start_soon(consume, llm, i)
                for event in started:
                    await event.wait()
                t0 = time.monotonic()
                await llm.shutdown(timeout=10)  # the death, not the timeout, ends the wait
                assert time.monotonic() - t0 < 5
            finally:
                await llm.shutdown()
    assert outcomes == dict.fromkeys(range(10), "dead")
    assert llm.errored


async def test_a_cancelled_draining_shutdown_still_ends_every_stream(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    results: dict[int, Any] = {}
    started = [anyio.Event() for _ in range(3)]
    release = anyio.Event()  # the consumers stop reading until then: the drain must wait
    all_ended = anyio.Event()

    async def consume(llm: AsyncLLM, i: int) -> None:
        outs = []
        try:
            async for out in llm.generate(PROMPT, params(200), f"x{i}"):
                outs.append(out)
                started[i].set()
                await release.wait()
        except Exception as exc:  # noqa: BLE001 - checked below
            results[i] = exc
        else:
            results[i] = outs
        if len(results) == 3:
            all_ended.set()

    llm = AsyncLLM.from_engine_args(inproc_engine_args())
    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            with anyio.CancelScope() as scope:  # entered before start(): LIFO-safe
                await llm.start()
                for i in range(3):
                    tg.start_soon(consume, llm, i)
                for event in started:
                    await event.wait()
                scope.deadline = anyio.current_time()  # cancel the shutdown in its drain wait
                await llm.shutdown(timeout=5)
            release.set()
            with anyio.move_on_after(0.5):  # the abort outputs are delivered at once
                await all_ended.wait()
            ended = all_ended.is_set()
            tg.cancel_scope.cancel()  # free consumers that still wait
    assert scope.cancelled_caught
    assert ended, "streams still open after shutdown() was cancelled"
    for i in range(3):
        outs = results[i]
        assert isinstance(outs, list), f"stream {i} raised {outs!r}"
        assert outs[-1].finished


@pytest.mark.parametrize("transport", ["multiprocess"], indirect=True)
async def test_a_hung_engine_process_is_killed_at_shutdown(
    engine_args: Callable[..., AsyncEngineArgs], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A stopped (SIGSTOP) child ignores Shutdown and SIGTERM: shutdown still ends, by SIGKILL
    after the (here shortened) grace periods; in-flight streams end with "abort"."""

    monkeypatch.setattr(process_module, "SHUTDOWN_GRACE_S", 0.5)
    monkeypatch.setattr(process_module, "TERM_GRACE_S", 0.5)
    results: dict[int, Any] = {}
    started = [anyio.Event() for _ in range(5)]

    async def consume(llm: AsyncLLM, i: int) -> None:
        outs = []
        try:
            async with aclosing(llm.generate(PROMPT, params(200), f"h{i}")) as agen:
                async for out in agen:
                    outs.append(out)
                    started[i].set()
        except Exception as exc:  # noqa: BLE001 - checked below
            results[i] = exc
        else:
            results[i] = outs

    llm = AsyncLLM.from_engine_args(engine_args())
    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            async with llm:
                for i in range(5):
                    tg.start_soon(consume, llm, i)
                for event in started:
                    await event.wait()
                kill_core_process(llm, signal.SIGSTOP)
                t0 = time.monotonic()
            assert time.monotonic() - t0 < 10
    for i in range(5):
        outs = results[i]
        assert isinstance(outs, list), f"stream {i} raised {outs!r}"
        assert outs[-1].finished and outs[-1].outputs[0].finish_reason == "abort"


async def test_every_caller_gets_an_engine_dead_error_with_its_own_short_traceback(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    frames: list[int] = []

    def record(exc: BaseException) -> None:
        assert "injected fault" in str(exc)
        frames.append(len(traceback.extract_tb(exc.__traceback__)))

    async def consume(llm: AsyncLLM, i: int) -> None:
        try:
            async with aclosing(llm.generate(PROMPT, params(50), f"t{i}")) as agen:
                async for _ in agen:
                    pass
        except EngineDeadError as exc:
            record(exc)

    async with AsyncLLM.from_engine_args(
        inproc_engine_args(), engine_core_factory=FakeCore(model=True, fail_at_step=3).factory()
    ) as llm:
        with anyio.fail_after(10):
            async with anyio.create_task_group() as tg:
                for i in range(50):
                    tg.start_soon(consume, llm, i)
        for _ in range(20):  # say, a server still taking requests after the death
            try:
                await llm.generate(PROMPT, params(4)).__anext__()
            except EngineDeadError as exc:
                record(exc)
    assert len(frames) == 70
    assert max(frames) < 40, frames


# Only trio chains the handled WouldBlock to the step's exception (the engine-core child runs on
# trio); on asyncio the message is clean.
@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_the_death_message_shows_only_the_failure_in_the_step(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
) -> None:
    async with AsyncLLM.from_engine_args(
        inproc_engine_args(), engine_core_factory=FakeCore(model=True, fail_at_step=2).factory()
    ) as llm:
        with anyio.fail_after(10), pytest.raises(EngineDeadError) as info:
            async with aclosing(llm.generate(PROMPT, params(10))) as agen:
                async for _ in agen:
                    pass
    message = str(info.value)
    assert "injected fault in the forward pass" in message
    assert "WouldBlock" not in message, message


# ============================================================================== fake engine-core loops


async def _all_dead(llm: AsyncLLM, count: int) -> list[BaseException | None]:
    errors: list[BaseException | None] = [None] * count

    async def consume(i: int) -> None:
        try:
            async with aclosing(llm.generate(PROMPT, params(5), f"f{i}")) as agen:
                async for _ in agen:
                    pass
        except Exception as exc:  # noqa: BLE001 - checked by the caller
            errors[i] = exc

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            for i in range(count):
                tg.start_soon(consume, i)
    return errors


async def test_an_engine_core_that_stops_without_a_word_is_a_death(
    inproc_engine_args: Callable[..., AsyncEngineArgs], fake_core_loop: Callable[[Any], None]
) -> None:
    async def quits_on_first_request(core: Any, inputs: Any, outputs: Any, compute: Any) -> None:
        async with inputs, outputs:
            async for msg in inputs:
                if isinstance(msg, AddRequest):
                    return

    fake_core_loop(quits_on_first_request)
    async with AsyncLLM.from_engine_args(inproc_engine_args()) as llm:
        errors = await _all_dead(llm, 5)
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert llm.errored and "stopped unexpectedly" in str(llm.dead_error)


async def test_a_bug_in_output_processing_is_a_death_not_a_hang(
    inproc_engine_args: Callable[..., AsyncEngineArgs],
    fake_core_loop: Callable[[Any], None],
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def unreadable_outputs(core: Any, inputs: Any, outputs: Any, compute: Any) -> None:
        async with inputs, outputs:
            async for msg in inputs:
                match msg:
                    case AddRequest(request=req):
                        # finish reason 99 does not exist: building the output fails.
                        await outputs.send(OutputBatch([req.request_id], [[1]], [99], [None], [0]))
                    case Shutdown():
                        return

    fake_core_loop(unreadable_outputs)
    async with AsyncLLM.from_engine_args(inproc_engine_args()) as llm:
        errors = await _all_dead(llm, 5)
        assert all(isinstance(e, EngineDeadError) for e in errors), errors
        assert "output processing failed" in str(llm.dead_error)
    assert any("output actor failed" in r.getMessage() for r in caplog.records)


async def test_a_call_that_finds_the_core_gone_raises_the_death_with_its_cause(
    inproc_engine_args: Callable[..., AsyncEngineArgs], fake_core_loop: Callable[[Any], None]
) -> None:
    """The core stops taking inputs a moment before its death report arrives (found by the soak
    profile: a statistics call raced a fault at step 1). A caller in that window must get the
    death itself, cause included, with `errored` already true."""

    async def dies_slowly(core: Any, inputs: Any, outputs: Any, compute: Any) -> None:
        async with outputs:
            async with inputs:
                async for msg in inputs:
                    if isinstance(msg, AddRequest):
                        break
            await anyio.sleep(0.2)  # inputs closed, death not yet reported
            await outputs.send(EngineDead("the forward pass failed: boom"))

    fake_core_loop(dies_slowly)
    async with AsyncLLM.from_engine_args(inproc_engine_args()) as llm:
        with anyio.fail_after(5):
            stream = await llm.add_request("victim", PROMPT, params(5))
            with stream:
                while llm.statistics().core_accepting:  # noqa: ASYNC110
                    await anyio.sleep(0.01)
                for call in (llm.get_engine_stats, llm.check_integrity):
                    with pytest.raises(EngineDeadError, match="boom"):
                        await call()
                    assert llm.errored
                with pytest.raises(EngineDeadError, match="boom"):
                    await llm.add_request("later", PROMPT, params(5))


@pytest.mark.parametrize(
    "anyio_backend",
    [pytest.param(("trio", {"clock": MockClock(autojump_threshold=0)}), id="trio-mockclock")],
)
async def test_a_hung_in_process_core_is_cancelled_after_the_grace_period(
    inproc_engine_args: Callable[..., AsyncEngineArgs], fake_core_loop: Callable[[Any], None]
) -> None:
    """No real I/O runs while the (virtual) clock matters: the fake core only sleeps."""

    async def hangs(core: Any, inputs: Any, outputs: Any, compute: Any) -> None:
        async with inputs, outputs:
            await anyio.sleep_forever()  # ignores every message, Shutdown included

    fake_core_loop(hangs)
    results: list[list[RequestOutput]] = []

    async def consume(llm: AsyncLLM) -> None:
        async with aclosing(llm.generate(PROMPT, params(5), "hung")) as agen:
            results.append([out async for out in agen])

    llm = AsyncLLM.from_engine_args(inproc_engine_args())
    async with anyio.create_task_group() as tg:
        with mock_clock_patience():  # start-up waits on threads: no busy autojump polling
            await llm.start()
        try:
            tg.start_soon(consume, llm)
            while not llm.num_unfinished_requests:  # noqa: ASYNC110 - polling
                await anyio.sleep(0.01)
            # No fail_after here: a deadline pending while start() ran real threads would make
            # the clock jump; and one entered after start() would break the LIFO order of
            # cancel scopes that shutdown() relies on. pytest-timeout guards against a hang.
            t0 = anyio.current_time()
            await llm.shutdown()
            waited = anyio.current_time() - t0
        finally:
            await llm.shutdown()
    assert transport_module.SHUTDOWN_GRACE_S <= waited < transport_module.SHUTDOWN_GRACE_S + 1
    assert not llm.errored
    [outs] = results
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].finish_reason == "abort"
