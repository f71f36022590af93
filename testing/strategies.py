"""Hypothesis strategies that draw fault plans (needs `hypothesis`).

A plan has three parts, each a strategy here, and `fault_plans()` draws all three:

- the core: `fake_cores()` draws a `FakeCore` that fails on cue (raises or hangs at step n,
  stalls, refuses adds after k; or no fault at all);
- the clients: `client_steps()` draws a list of `Submit` (a request), `Stop` (the consumer
  cancels its scope, calls `llm.abort`, or breaks out at its next output; an HTTP client's
  disconnect is a cancel), `Wait` (one checkpoint, a short sleep, or the target's next output)
  and, with `kill=True`, `Kill` (SIGKILL the engine-core child: `kill_core_process`); with
  `extra=[hang_ranks(size)]`, `HangRank` (SIGSTOP one data-parallel rank's process: a rank
  that hangs while the others go on, for its watchdog to find). A
  step's `target` is an index into the requests submitted so far, taken modulo their number,
  so every drawn plan is valid and shrinks well;
- the ending: `endings()`: "drain" (every consumer ends, then shut down), "shutdown_now"
  (`shutdown(timeout=0)`: in-flight requests end with finish_reason "abort") or
  "shutdown_wait" (`shutdown(timeout=...)`: they may run to their end).

The plan is data: the test interprets it against its own subject (an `AsyncLLM`, or an app
in front of one: docs/testing.md has a worked example) and checks afterwards that every
request ended exactly once, in a way the plan explains, and that nothing leaked.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from hypothesis import strategies as st

from triollm.testing.cores import FakeCore

__all__ = [
    "ENDINGS",
    "FAULTS",
    "FaultPlan",
    "HangRank",
    "Kill",
    "Stop",
    "Submit",
    "Wait",
    "client_steps",
    "endings",
    "fake_cores",
    "fault_plans",
    "hang_ranks",
    "stops",
    "submits",
    "waits",
]

Ending = Literal["drain", "shutdown_now", "shutdown_wait"]
ENDINGS: tuple[Ending, ...] = ("drain", "shutdown_now", "shutdown_wait")
FAULTS = ("fail", "hang", "stall", "refuse")
PROMPTS = ("Once upon a time there was", "Hello", "The capital of France is")


@dataclass(frozen=True)
class Submit:
    max_tokens: int
    prompt: str = PROMPTS[0]


@dataclass(frozen=True)
class Stop:
    how: Literal["cancel", "abort", "break"]
    target: int


@dataclass(frozen=True)
class Wait:
    how: Literal["tick", "sleep", "output"]
    target: int


@dataclass(frozen=True)
class Kill:
    pass


@dataclass(frozen=True)
class HangRank:
    """Hang data-parallel rank `rank`: `kill_core_process(llm, signal.SIGSTOP, rank)`. Its
    streams stop while the other ranks' go on, until `engine_output_timeout_s` (set it short)
    declares the engine dead naming the rank; shutdown then kills the stopped process."""

    rank: int


@dataclass(frozen=True)
class FaultPlan:
    core: FakeCore
    steps: list[Any] = field(default_factory=list)
    ending: Ending = "drain"


def submits(max_tokens: tuple[int, int] = (1, 20), prompts: Sequence[str] = PROMPTS) -> st.SearchStrategy[Submit]:
    return st.builds(Submit, st.integers(*max_tokens), st.sampled_from(list(prompts)))


def stops(hows: Sequence[str] = ("cancel", "abort", "break"), max_target: int = 40) -> st.SearchStrategy[Stop]:
    return st.builds(Stop, st.sampled_from(list(hows)), st.integers(0, max_target))


def waits(hows: Sequence[str] = ("tick", "sleep", "output"), max_target: int = 40) -> st.SearchStrategy[Wait]:
    return st.builds(Wait, st.sampled_from(list(hows)), st.integers(0, max_target))


def hang_ranks(size: int = 2) -> st.SearchStrategy[HangRank]:
    """`HangRank` of one of `size` data-parallel ranks (pass it in `client_steps(extra=...)`)."""
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ValueError(f"size: must be a number of data-parallel ranks >= 1, got {size!r}")
    return st.builds(HangRank, st.integers(0, size - 1))


def client_steps(
    submit: st.SearchStrategy[Any] | None = None,
    *,
    kill: bool = False,
    extra: Sequence[st.SearchStrategy[Any]] = (),
    stop: st.SearchStrategy[Any] | None = None,
    wait: st.SearchStrategy[Any] | None = None,
    min_size: int = 1,
    max_size: int = 24,
) -> st.SearchStrategy[list[Any]]:
    """Lists of client steps: submits (drawn twice as often as the others), stops, waits,
    the `extra` strategies' steps, and `Kill()` if `kill`."""
    sub = submits() if submit is None else submit
    choices: list[st.SearchStrategy[Any]] = [
        sub,
        sub,
        stops() if stop is None else stop,
        waits() if wait is None else wait,
        *extra,
    ]
    if kill:
        choices.append(st.just(Kill()))
    return st.lists(st.one_of(choices), min_size=min_size, max_size=max_size)


def fake_cores(
    *,
    model: bool = False,
    faults: Sequence[str] = FAULTS,
    max_step: int = 12,
    step_s: Sequence[float] = (0.0,),
    stall_s: Sequence[float] = (0.01, 1.0),
) -> st.SearchStrategy[FakeCore]:
    """A `FakeCore` with no fault, or with one of `faults` (repeat a name to draw it more
    often) at a step in [1, max_step]: "fail" (raise), "hang", "stall" (by one of `stall_s`
    seconds), "refuse" (every add after the first step-1), "kill" (SIGKILL the engine-core
    child: multiprocess only). `step_s`: the cadences to draw from."""
    for name in faults:
        if name not in (*FAULTS, "kill"):
            raise ValueError(f"faults: {name!r} is not one of {', '.join((*FAULTS, 'kill'))}")
    if max_step < 1:
        raise ValueError(f"max_step: must be >= 1, got {max_step!r}")

    def build(cadence: float, fault: str | None, step: int, stall: float) -> FakeCore:
        match fault:
            case "fail":
                return FakeCore(model, cadence, fail_at_step=step)
            case "hang":
                return FakeCore(model, cadence, hang_at_step=step)
            case "stall":
                return FakeCore(model, cadence, stall_at_step=step, stall_s=stall)
            case "refuse":
                return FakeCore(model, cadence, refuse_adds_after=step - 1)
            case "kill":
                return FakeCore(model, cadence, kill_at_step=step)
        return FakeCore(model, cadence)

    cadence = st.sampled_from(list(step_s))
    healthy = st.builds(build, cadence, st.none(), st.just(1), st.just(0.0))
    if not faults:
        return healthy
    faulty = st.builds(
        build, cadence, st.sampled_from(list(faults)), st.integers(1, max_step), st.sampled_from(list(stall_s))
    )
    return healthy | faulty


def endings(choices: Sequence[Ending] = ENDINGS) -> st.SearchStrategy[Ending]:
    return st.sampled_from(list(choices))


def fault_plans(
    core: st.SearchStrategy[FakeCore] | None = None,
    steps: st.SearchStrategy[list[Any]] | None = None,
    ending: st.SearchStrategy[Ending] | None = None,
) -> st.SearchStrategy[FaultPlan]:
    """A whole plan: `fake_cores()`, `client_steps()` and `endings()` unless given."""
    return st.builds(
        FaultPlan,
        fake_cores() if core is None else core,
        client_steps() if steps is None else steps,
        endings() if ending is None else ending,
    )
