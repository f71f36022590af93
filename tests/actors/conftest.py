"""Shared fixtures for the actor tests: backends, transports, engine arguments, leak checks.

- `anyio_backend`: trio and asyncio (module-scoped, so a module may hold an engine across tests).
- `transport`: "inproc" and "multiprocess"; the multiprocess param is skipped while
  `triollm.actors.process` does not exist.
- `engine_args(**overrides)`: `AsyncEngineArgs` for the tiny random model on the transport.
- `no_leaks`: after the test, no new child process, no new non-worker thread, no new native
  thread and no new file descriptor (polled briefly: teardown may still be settling).
- `fake_core_loop(loop)`: in-process cores run `loop` instead of the real core loop.

The seams come from `triollm.testing`, the module users test their own code with.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.engine.sampling_params import SamplingParams
from triollm.testing import CoreLoop, check_no_leaks, replace_core_loop, run_in_own_thread

TRANSPORTS = ["inproc", "multiprocess"]
MAX_MODEL_LEN = 256


def has_multiprocess_transport() -> bool:
    return importlib.util.find_spec("triollm.actors.process") is not None


@pytest.fixture(scope="module", params=["trio", "asyncio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module", params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    if request.param == "multiprocess" and not has_multiprocess_transport():
        pytest.skip("the multiprocess transport (triollm.actors.process) has not landed yet")
    return request.param


def make_engine_args(model_dir: Path, transport: str, **overrides: Any) -> AsyncEngineArgs:
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "multiprocess": transport == "multiprocess",
        "max_model_len": MAX_MODEL_LEN,
        "seed": 0,
    }
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)


@pytest.fixture(scope="module")
def engine_args(tiny_model_dir: Path, transport: str) -> Callable[..., AsyncEngineArgs]:
    """A factory for the tiny model on `transport`: `engine_args(output_chunk_size=1)`."""

    def make(**overrides: Any) -> AsyncEngineArgs:
        return make_engine_args(tiny_model_dir, transport, **overrides)

    return make


@pytest.fixture(scope="session")
def inproc_engine_args(tiny_model_dir: Path) -> Callable[..., AsyncEngineArgs]:
    """The same for tests whose subject does not depend on the transport."""

    def make(**overrides: Any) -> AsyncEngineArgs:
        return make_engine_args(tiny_model_dir, "inproc", **overrides)

    return make


# ------------------------------------------------------------------------------ leak checks and fakes


@pytest.fixture(scope="session")
def _warm_process(tiny_model_dir: Path) -> None:
    """Run one request once per session, so that lazily created, process-lifetime resources
    (torch's native thread pools, imports, caches) exist before the first leak baseline."""

    async def run() -> None:
        async with AsyncLLM.from_engine_args(make_engine_args(tiny_model_dir, "inproc")) as llm:
            async for _ in llm.generate("warm up", SamplingParams(max_tokens=2, ignore_eos=True)):
                pass

    run_in_own_thread(run, name="warm-up")


@pytest.fixture
def no_leaks(_warm_process: None) -> Iterator[None]:
    """Fails the test if it leaves a child process, a thread or a file descriptor behind
    (`triollm.testing.check_no_leaks`: children strictly, threads but trio's / anyio's cached
    idle workers, every check polled for a few seconds, gc included, so that a settling
    teardown is no failure). Request it before any async fixture so that its teardown runs
    after theirs."""
    with check_no_leaks():
        yield


@pytest.fixture
def fake_core_loop() -> Iterator[Callable[[CoreLoop], None]]:
    """`fake_core_loop(loop)`: in-process engine cores started in the test are driven by
    `loop` instead of the real core loop (the real EngineCore is still built):
    `triollm.testing.replace_core_loop`, undone at the end of the test."""
    with ExitStack() as stack:

        def install(loop: CoreLoop) -> None:
            stack.enter_context(replace_core_loop(loop))

        yield install
