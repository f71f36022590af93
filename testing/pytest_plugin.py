"""pytest fixtures for tests around an `AsyncLLM`, on trio and asyncio (needs pytest).

List it in your top-level conftest.py, beside anyio's own plugin (which runs the async tests):

    pytest_plugins = ["triollm.testing.pytest_plugin"]

Fixtures:
- `anyio_backend`: "trio" and "asyncio" (module-scoped, as anyio's; override it to narrow).
  `trio_mock_clock()` is the parameter for trio with `MockClock(autojump_threshold=0)`:
  `@pytest.mark.parametrize("anyio_backend", [trio_mock_clock()])`.
- `fake_model_dir` (session): `write_model_dir()`'s directory, no weights.
- `fake_args(**overrides)`: `AsyncEngineArgs` on it, in-process.
- `inline_steps`: the test runs inside `steps_in_event_loop()`.
- `fake_core_loop(loop)`: in-process cores started in the test run `loop` (`replace_core_loop`).
- `input_recorder`: a fresh `InputRecorder`, for `input_tap=`.
- `no_leaks`: fails the test if it leaves a child process, a thread or a file descriptor
  behind. Process-lifetime thread pools are created lazily, so `triollm_warm_up` (session)
  runs one fake-core engine before the first baseline: override it if your tests run more
  (a real model). Request `no_leaks` first, before async fixtures, so that its check runs
  after their teardown; a step a `FakeCore` hung in a thread is released before the check.
Every test also runs inside `hold_hung_steps()`: steps hung in a thread return at its end.

Works under `filterwarnings = error`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from triollm.testing.cores import (
    CoreLoop,
    FakeCore,
    hold_hung_steps,
    release_hung_steps,
    replace_core_loop,
    steps_in_event_loop,
)
from triollm.testing.leaks import check_no_leaks, run_in_own_thread
from triollm.testing.model_dir import fake_engine_args, write_model_dir
from triollm.testing.taps import InputRecorder

__all__ = [
    "anyio_backend",
    "fake_args",
    "fake_core_loop",
    "fake_model_dir",
    "inline_steps",
    "input_recorder",
    "no_leaks",
    "trio_mock_clock",
    "triollm_warm_up",
]


def trio_mock_clock(autojump_threshold: float = 0) -> Any:
    """The `anyio_backend` parameter for trio under a fresh `trio.testing.MockClock`."""
    from trio.testing import MockClock

    clock = MockClock(autojump_threshold=autojump_threshold)
    return pytest.param(("trio", {"clock": clock}), id="trio-mockclock")


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> Any:
    return request.param


@pytest.fixture(scope="session")
def fake_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_model_dir(tmp_path_factory.mktemp("triollm-fake-model"))


@pytest.fixture(scope="session")
def fake_args(fake_model_dir: Path) -> Callable[..., Any]:
    """`fake_args(**overrides)`: `AsyncEngineArgs` on `fake_model_dir`, in-process."""

    def make(**overrides: Any) -> Any:
        return fake_engine_args(fake_model_dir, **overrides)

    return make


@pytest.fixture
def inline_steps() -> Iterator[None]:
    with steps_in_event_loop():
        yield


@pytest.fixture
def fake_core_loop() -> Iterator[Callable[[CoreLoop], None]]:
    with ExitStack() as stack:

        def install(loop: CoreLoop) -> None:
            stack.enter_context(replace_core_loop(loop))

        yield install


@pytest.fixture
def input_recorder() -> InputRecorder:
    return InputRecorder()


@pytest.fixture(autouse=True)
def _triollm_hung_steps() -> Iterator[None]:
    with hold_hung_steps():
        yield


@pytest.fixture(scope="session")
def triollm_warm_up(fake_model_dir: Path) -> None:
    """Run one fake-core request once per session, in a thread of its own (a test runner's
    event loop may exist already). Override it to warm up what your tests run (a real model:
    torch's thread pools)."""
    from triollm import AsyncLLM, SamplingParams

    async def run() -> None:
        factory = FakeCore().factory()
        async with AsyncLLM(fake_engine_args(fake_model_dir), engine_core_factory=factory) as llm:
            async for _ in llm.generate("warm up", SamplingParams(max_tokens=2)):
                pass

    run_in_own_thread(run)


@pytest.fixture
def no_leaks(triollm_warm_up: None) -> Iterator[None]:
    with check_no_leaks():
        yield
        release_hung_steps()  # a thread hung by a FakeCore is no leak of the code under test
