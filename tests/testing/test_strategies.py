"""The fault-plan strategies draw what they say, and each kind of fault is reachable."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from triollm.testing import FakeCore
from triollm.testing.strategies import (
    ENDINGS,
    FaultPlan,
    Kill,
    Stop,
    Submit,
    Wait,
    client_steps,
    fake_cores,
    fault_plans,
    stops,
    submits,
)


@settings(max_examples=200, database=None)
@given(plan=fault_plans())
def test_a_plan_is_a_core_client_steps_and_an_ending(plan: FaultPlan) -> None:
    assert isinstance(plan.core, FakeCore) and not plan.core.model
    assert plan.core.kill_at_step is None  # not drawn unless asked: it needs a child process
    faults = [f for f in ("fail_at_step", "hang_at_step", "stall_at_step") if getattr(plan.core, f) is not None]
    assert len(faults) + (plan.core.refuse_adds_after is not None) <= 1
    assert 1 <= len(plan.steps) <= 24
    assert all(isinstance(s, Submit | Stop | Wait) for s in plan.steps)
    assert plan.ending in ENDINGS


def test_every_fault_kind_is_drawn() -> None:
    seen: set[str] = set()

    @settings(max_examples=300, database=None)
    @given(core=fake_cores(faults=("fail", "hang", "stall", "refuse", "kill"), max_step=3))
    def draw(core: FakeCore) -> None:
        for name in ("fail_at_step", "hang_at_step", "stall_at_step", "kill_at_step", "refuse_adds_after"):
            value = getattr(core, name)
            if value is not None:
                seen.add(name)
                assert 0 <= value <= 3
        if not core.dies and core.stall_at_step is None and core.refuse_adds_after is None:
            seen.add("healthy")

    draw()
    assert seen == {"healthy", "fail_at_step", "hang_at_step", "stall_at_step", "kill_at_step", "refuse_adds_after"}


@settings(max_examples=100, database=None)
@given(
    steps=client_steps(
        submits(max_tokens=(5, 6)), stop=stops(("cancel",), max_target=2), kill=True, extra=[st.just("stats")]
    )
)
def test_client_steps_take_the_strategies_given(steps: list[object]) -> None:
    for step in steps:
        match step:
            case Submit(max_tokens=n):
                assert n in (5, 6)
            case Stop(how, target):
                assert how == "cancel" and 0 <= target <= 2
            case Wait() | Kill() | "stats":
                pass
            case _:
                pytest.fail(f"unexpected step {step!r}")


def test_unknown_fault_kinds_are_refused() -> None:
    with pytest.raises(ValueError, match="faults: 'crash' is not one of fail, hang, stall, refuse, kill"):
        fake_cores(faults=("crash",))
    with pytest.raises(ValueError, match="max_step: must be >= 1"):
        fake_cores(max_step=0)
