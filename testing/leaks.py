"""Leak checks: child processes, threads, native threads and file descriptors (Linux, /proc).

`Snapshot.take()` records what this process holds; `after.leaks_since(before)` says what is
new, in words. `wait_for_no_leaks(before)` polls (with `gc.collect()`) until nothing is, since
a teardown may still be settling for a moment after `AsyncLLM` returned. `check_no_leaks()` is
the context-manager form. Children are counted recursively; Python threads ignore the idle
workers that trio's thread cache and anyio's asyncio pool keep for a while (not leaks).

Take the baseline after one engine has run once in the process (the pytest plugin's
`no_leaks` does): torch and the tokenizer create process-lifetime thread pools lazily.
"""

from __future__ import annotations

import gc
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import anyio

__all__ = [
    "Snapshot",
    "check_no_leaks",
    "child_pids",
    "run_in_own_thread",
    "wait_for_no_leaks",
    "wait_no_new_children",
]

_WORKER_THREAD_PREFIXES = ("Trio thread", "AnyIO worker thread")


def child_pids(pid: int | None = None) -> set[int]:
    """Every live descendant of `pid` (default: this process), from /proc."""
    root = os.getpid() if pid is None else pid
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # exited meanwhile
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name may hold spaces and ")"
        parents.setdefault(ppid, []).append(int(name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for child in parents.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    return found


async def wait_no_new_children(before: set[int], within: float = 5.0) -> None:
    """Wait until no child process that is not in `before` lives (TimeoutError after
    `within` seconds, real time: use it with real child processes only)."""
    with anyio.fail_after(within):
        while child_pids() - before:  # noqa: ASYNC110 - polling other processes
            await anyio.sleep(0.01)


def _describe(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmdline = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return str(pid)
    return f"{pid} ({state}: {cmdline[:120]})"


def _is_cached_worker(thread: threading.Thread) -> bool:
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
        return cls(
            children=child_pids(),
            threads={t for t in threading.enumerate() if not _is_cached_worker(t)},
            native_threads=_native_threads(),
            fds=_fd_targets(),
        )

    def leaks_since(self, before: Snapshot) -> list[str]:
        """What this snapshot holds that `before` did not, one sentence per kind."""
        problems = []
        new_children = self.children - before.children
        if new_children:
            described = [_describe(pid) for pid in sorted(new_children)]
            problems.append(f"child processes left behind: {described}")
        new_threads = self.threads - before.threads
        if new_threads:
            problems.append(f"threads left behind: {sorted(t.name for t in new_threads)}")
        new_native = {t: n for t, n in self.native_threads.items() if t not in before.native_threads}
        if new_native:
            problems.append(f"native threads left behind (tid: name): {new_native}")
        if len(self.fds) > len(before.fds):
            new = {fd: t for fd, t in self.fds.items() if before.fds.get(fd) != t}
            problems.append(f"file descriptors: {len(before.fds)} -> {len(self.fds)}; new: {new}")
        return problems


def wait_for_no_leaks(before: Snapshot, timeout: float = 5.0) -> list[str]:
    """Poll until nothing leaked since `before`, or `timeout` seconds passed: the leaks left
    (an empty list: none). Blocking: call it outside the event loop (or at its end)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        problems = Snapshot.take().leaks_since(before)
        if not problems or time.monotonic() > deadline:
            return problems
        time.sleep(0.02)


@contextmanager
def check_no_leaks(timeout: float = 5.0) -> Iterator[None]:
    """Raise AssertionError at the end of the block if it left a child process, a thread or a
    file descriptor behind (after polling for up to `timeout` seconds)."""
    gc.collect()
    before = Snapshot.take()
    yield
    problems = wait_for_no_leaks(before, timeout)
    assert not problems, "leaked: " + "; ".join(problems)


def run_in_own_thread(fn: Callable[[], Awaitable[object]], name: str = "triollm-warm-up") -> None:
    """Run `fn()` under trio in a thread of its own and re-raise its error: for a warm-up that
    may be set up while a test runner's event loop exists already. A warm-up before the first
    leak baseline makes the lazily created, process-lifetime resources (torch's thread pools,
    imports, caches) exist before anything is counted."""
    errors: list[BaseException] = []

    def target() -> None:
        try:
            anyio.run(fn, backend="trio")
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            errors.append(exc)

    thread = threading.Thread(target=target, name=name)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
