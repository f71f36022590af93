"""Shared fixtures for the actor tests: backends, transports, engine arguments, leak checks.

- `anyio_backend`: trio and asyncio (module-scoped, so a module may hold an engine across tests).
- `transport`: "inproc" and "multiprocess"; the multiprocess param is skipped while
  `triollm.actors.process` does not exist.
- `engine_args(**overrides)`: `AsyncEngineArgs` for the tiny random model on the transport.
- `no_leaks`: after the test, no new child process, no new non-worker thread, no new native
  thread and no new file descriptor (polled briefly: teardown may still be settling).
"""

from __future__ import annotations

import gc
import importlib.util
import os
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest

from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.engine.sampling_params import SamplingParams

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


# ------------------------------------------------------------------------------ leak checks

_WORKER_THREAD_PREFIXES = ("Trio thread", "AnyIO worker thread")


def _is_cached_worker(thread: threading.Thread) -> bool:
    # trio's thread cache and anyio's asyncio worker pool keep idle threads for ~10 s after the
    # event loop that used them: they are not leaks.
    return thread.name.startswith(_WORKER_THREAD_PREFIXES)


def _native_threads() -> dict[int, str]:
    """OS threads that are not Python threads (torch pools, ZMQ I/O threads): tid -> name."""
    python_tids = {t.native_id for t in threading.enumerate()}
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        if tid in python_tids:
            continue
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                out[tid] = f.read().strip()
        except OSError:
            pass  # exited meanwhile
    return out


def _fd_targets() -> dict[int, str]:
    out: dict[int, str] = {}
    for name in os.listdir("/proc/self/fd"):
        try:
            out[int(name)] = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            pass  # the fd of the listdir itself, or one closed meanwhile
    return out


@dataclass
class Snapshot:
    children: set[int]
    threads: set[threading.Thread]
    native_threads: dict[int, str]
    fds: dict[int, str]

    @classmethod
    def take(cls) -> Snapshot:
        proc = psutil.Process()
        threads = set(threading.enumerate())
        return cls(
            children={c.pid for c in proc.children(recursive=True)},
            threads={t for t in threads if not _is_cached_worker(t)},
            native_threads=_native_threads(),
            fds=_fd_targets(),
        )

    def leaks_since(self, before: Snapshot) -> list[str]:
        problems = []
        new_children = self.children - before.children
        if new_children:
            described = []
            for pid in sorted(new_children):
                try:
                    p = psutil.Process(pid)
                    described.append(f"{pid} ({p.status()}: {' '.join(p.cmdline())[:120]})")
                except psutil.Error:
                    described.append(str(pid))
            problems.append(f"child processes left behind: {described}")
        new_threads = self.threads - before.threads
        if new_threads:
            problems.append(f"threads left behind: {sorted(t.name for t in new_threads)}")
        new_native = {
            t: n for t, n in self.native_threads.items() if t not in before.native_threads
        }
        if new_native:
            problems.append(f"native threads left behind (tid: name): {new_native}")
        if len(self.fds) > len(before.fds):
            new = {fd: t for fd, t in self.fds.items() if before.fds.get(fd) != t}
            problems.append(f"file descriptors: {len(before.fds)} -> {len(self.fds)}; new: {new}")
        return problems


def wait_for_no_leaks(before: Snapshot, timeout: float = 5.0) -> list[str]:
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        problems = Snapshot.take().leaks_since(before)
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.02)


@pytest.fixture(scope="session")
def _warm_process(tiny_model_dir: Path) -> None:
    """Run one request once per session, so that lazily created, process-lifetime resources
    (torch's native thread pools, imports, caches) exist before the first leak baseline."""

    async def run() -> None:
        async with AsyncLLM.from_engine_args(make_engine_args(tiny_model_dir, "inproc")) as llm:
            async for _ in llm.generate("warm up", SamplingParams(max_tokens=2, ignore_eos=True)):
                pass

    # In a thread of its own: this may be set up while a test runner's event loop exists.
    errors: list[BaseException] = []

    def target() -> None:
        try:
            anyio.run(run, backend="trio")
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    thread = threading.Thread(target=target, name="warm-up")
    thread.start()
    thread.join()
    if errors:
        raise errors[0]


@pytest.fixture
def no_leaks(_warm_process: None) -> Iterator[None]:
    """Fails the test if it leaves a child process, a thread or a file descriptor behind.

    Children are checked strictly; threads ignore trio's / anyio's cached idle workers; every
    check is polled for a few seconds (gc included) so that settling teardown is no failure.
    Request it before any async fixture so that its teardown runs after theirs.
    """
    gc.collect()
    before = Snapshot.take()
    yield
    problems = wait_for_no_leaks(before)
    assert not problems, "leaked: " + "; ".join(problems)
