"""Engine cores without a model, that fail on cue, and the loops that drive them.

`FakeCore` is a plain, frozen description of an engine core: scripted tokens (no weights are
read; or the real model with `model=True`), a cadence (`step_s` seconds per step) and at most a
few faults on cue, counted in engine steps (1-based: the first step that runs a forward pass is
step 1): raise in the forward pass, block the step for good, stall one step, refuse adds after
the first k, SIGKILL the engine-core process. `FakeCore(...).factory()` is the
`EngineCoreFactory` that `AsyncLLM(args, engine_core_factory=...)` and `LLM(...,
engine_core_factory=...)` accept; it is "module:function" plus JSON keyword arguments, so the
same fake is built in this process and in an engine-core child process.

Where the steps run, and what a fault then is:

- By default, in the core's compute thread (in-process) or in the child, as a real core's: the
  cadence and a stall are `time.sleep`, a hang blocks the thread until `release_hung_steps()`
  (in this process; a hung child is killed at shutdown). Real time.
- Inside `steps_in_event_loop()`, an in-process core steps in the event loop instead (the real
  core loop, `actors/core_loop.py`, with each step run inline after an `anyio.sleep`): the
  cadence, a stall and a hang are sleeps of the event loop, so trio's
  `MockClock(autojump_threshold=0)` runs a minute of cadence at once, and no thread
  races the clock once the engine has started.

`replace_core_loop(loop)` swaps the in-process core loop for any coroutine function with the
loop's signature, for faults that are the loop's own: a core that stops without a word, sends
something unreadable, or ignores `Shutdown`.

`replace_core_loop` (and so `steps_in_event_loop`) swaps the loop the in-process transport
(`actors/transport.py`) calls, for the block's duration and the whole process: meant for tests,
one engine setup at a time; a transport that took the loop as a value would need no swap.

Rejected: a fake `CoreClient` beside the transports. The point of these fakes is that
everything around the forward pass (scheduler, KV bookkeeping, core loop, wire, frontend) is the
real code, so a fault reaches the caller the way a real one would.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields
from typing import TYPE_CHECKING, Any, Protocol

import anyio
import anyio.lowlevel

from triollm.engine.core import EngineCore, EngineCoreFactory, Runner
from triollm.engine.execution.scripted_runner import ScriptedRunner

if TYPE_CHECKING:
    from anyio.abc import ObjectSendStream
    from anyio.streams.memory import MemoryObjectReceiveStream

    from triollm.actors.compute import ComputeThread
    from triollm.actors.messages import CoreInput, CoreOutput
    from triollm.engine.config import EngineConfig
    from triollm.engine.execution.model_runner import RunnerOutput
    from triollm.engine.request import EngineCoreRequest
    from triollm.engine.scheduling.scheduler import ScheduledRequest

__all__ = [
    "CoreLoop",
    "FakeCore",
    "FakeEngineCore",
    "build_fake_core",
    "hold_hung_steps",
    "kill_core_process",
    "release_hung_steps",
    "replace_core_loop",
    "steps_in_event_loop",
]

class CoreLoop(Protocol):
    """The in-process core loop's signature (that of `actors/core_loop.py`'s
    `serve_engine_core`): it owns both streams and returns when the core stops."""

    def __call__(
        self,
        core: Any,
        inputs: MemoryObjectReceiveStream[CoreInput],
        outputs: ObjectSendStream[CoreOutput],
        compute: ComputeThread,
        /,
    ) -> Awaitable[None]: ...


_STEP_FIELDS = ("fail_at_step", "hang_at_step", "stall_at_step", "kill_at_step")


@dataclass(frozen=True)
class FakeCore:
    """An engine core that runs without a model (unless `model`) and fails on cue.

    - `model`: run the checkpoint's real forward pass (it needs weights) instead of scripted
      tokens: token i of a request is `(prompt_len + i) % vocab_size`, skipping EOS ids
      (`ScriptedRunner`), so every request runs to `max_tokens`.
    - `step_s`: seconds each step takes (the cadence of the outputs); 0: as fast as it goes.
    - `fail_at_step`: that step's forward pass raises `RuntimeError("injected fault in the
      forward pass at step N")`: the engine dies (`EngineDeadError` on every stream).
    - `hang_at_step`: that step never returns (see the module docstring for what blocks).
    - `stall_at_step`, `stall_s`: that step takes `stall_s` seconds more (outputs stall, then
      resume: long enough, and `engine_output_timeout_s` declares the engine hung).
    - `refuse_adds_after`: the core accepts that many requests, then refuses every add as an
      invalid request (`ValueError` for that request alone, as the core's own checks would).
    - `kill_at_step`: the engine-core process SIGKILLs itself at that step. Only in a child
      (`multiprocess=True`): built in the process that made the factory, it refuses to start.
    """

    model: bool = False
    step_s: float = 0.0
    fail_at_step: int | None = None
    hang_at_step: int | None = None
    stall_at_step: int | None = None
    stall_s: float = 0.0
    refuse_adds_after: int | None = None
    kill_at_step: int | None = None

    def __post_init__(self) -> None:
        for name in _STEP_FIELDS:
            step = getattr(self, name)
            if step is not None and (isinstance(step, bool) or not isinstance(step, int) or step < 1):
                raise ValueError(f"{name}: must be a step number >= 1 or None, got {step!r}")
        for name in ("step_s", "stall_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < math.inf:
                raise ValueError(f"{name}: must be a finite number of seconds >= 0, got {value!r}")
        if (self.stall_at_step is None) != (self.stall_s == 0):
            raise ValueError(
                f"stall_at_step, stall_s: set both or neither, got {self.stall_at_step!r}, {self.stall_s!r}"
            )
        k = self.refuse_adds_after
        if k is not None and (isinstance(k, bool) or not isinstance(k, int) or k < 0):
            raise ValueError(f"refuse_adds_after: must be an integer >= 0 or None, got {k!r}")

    def __repr__(self) -> str:  # only what differs from the defaults: shrunk examples read well
        default = FakeCore.__new__(FakeCore)
        for f in fields(self):
            object.__setattr__(default, f.name, f.default)
        changed = [
            f"{f.name}={getattr(self, f.name)!r}"
            for f in fields(self)
            if getattr(self, f.name) != getattr(default, f.name)
        ]
        return f"FakeCore({', '.join(changed)})"

    @property
    def dies(self) -> bool:
        """Whether a fault of this core ends the engine (a stall or refusals do not by
        themselves)."""
        return any(getattr(self, name) is not None for name in ("fail_at_step", "hang_at_step", "kill_at_step"))

    def factory(self) -> EngineCoreFactory:
        """The `engine_core_factory` that builds this core, here or in an engine-core child."""
        kwargs = asdict(self)
        if self.kill_at_step is not None:
            kwargs["owner_pid"] = os.getpid()
        return EngineCoreFactory(f"{__name__}:build_fake_core", kwargs)


class FakeEngineCore(EngineCore):
    """The `EngineCore` a `FakeCore` builds: the real scheduler and KV bookkeeping, its runner
    wrapped by the faults (`runner` is a `FaultRunner`), adds refused on cue."""

    fake: FakeCore
    num_adds = 0

    def add_request(self, request: EngineCoreRequest) -> None:
        limit = self.fake.refuse_adds_after
        if limit is not None and self.num_adds >= limit:
            raise ValueError(f"request {request.request_id}: injected refusal (refuse_adds_after={limit})")
        super().add_request(request)
        self.num_adds += 1


def build_fake_core(config: EngineConfig, *, owner_pid: int | None = None, **spec: Any) -> FakeEngineCore:
    """`FakeCore.factory()`'s target: build the core `spec` (a `FakeCore`'s fields) describes."""
    fake = FakeCore(**spec)
    if fake.kill_at_step is not None and os.getpid() == owner_pid:
        raise ValueError(
            "kill_at_step: the engine core would SIGKILL the process that runs the test; it "
            "needs an engine-core child process (multiprocess=True)"
        )
    inner: Runner | None = None if fake.model else ScriptedRunner(config.model.vocab_size)
    core = FakeEngineCore(config, runner=inner)  # a real model is loaded when inner is None
    core.fake = fake
    core.runner = FaultRunner(core.runner, fake)
    return core


# ------------------------------------------------------------------------------ the faults

# Cleared: a hung step (in this process's compute thread) blocks. Set: it returns.
_HUNG_RELEASE = threading.Event()


def release_hung_steps() -> None:
    """Let every step hung in this process's compute thread return (and later ones not hang)."""
    _HUNG_RELEASE.set()


@contextmanager
def hold_hung_steps() -> Iterator[None]:
    """Steps hung in this process block until the block exits, then return: no thread
    outlives the test (the pytest plugin does this around every test)."""
    _HUNG_RELEASE.clear()
    try:
        yield
    finally:
        _HUNG_RELEASE.set()


class FaultRunner:
    """Runs `inner` (the scripted or the real runner) with the cadence and faults of `fake`."""

    def __init__(self, inner: Runner, fake: FakeCore) -> None:
        self.inner = inner
        self.fake = fake
        self.num_steps = 0
        self.inline = False  # set by steps_in_event_loop(): the waits happen in the event loop

    def wait_before(self, step: int) -> float:
        """Seconds to wait before `step` (math.inf: forever)."""
        if step == self.fake.hang_at_step:
            return math.inf
        return self.fake.step_s + (self.fake.stall_s if step == self.fake.stall_at_step else 0.0)

    async def wait_inline(self) -> None:
        wait = self.wait_before(self.num_steps + 1)
        if wait == math.inf:
            await anyio.sleep_forever()
        await anyio.sleep(wait)  # a checkpoint even when 0

    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        self.num_steps += 1
        step = self.num_steps
        if not self.inline:
            wait = self.wait_before(step)
            if wait == math.inf:
                _HUNG_RELEASE.wait()
            elif wait:
                time.sleep(wait)
        if step == self.fake.kill_at_step:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == self.fake.fail_at_step:
            raise RuntimeError(f"injected fault in the forward pass at step {step}")
        return self.inner.execute(scheduled)


# ------------------------------------------------------------------------------ the loops


def _transport() -> Any:
    import triollm.actors.transport as transport

    if not hasattr(transport, "serve_engine_core"):  # pragma: no cover - a refactor moved it
        raise RuntimeError("triollm.testing: the in-process transport no longer runs serve_engine_core")
    return transport


@contextmanager
def replace_core_loop(loop: CoreLoop) -> Iterator[None]:
    """While the block runs, in-process engine cores started in it are driven by `loop`
    (`async def loop(core, inputs, outputs, compute)`, the signature of
    `triollm.actors.core_loop.serve_engine_core`) instead of the real loop. The real core is
    still built (by the factory, if any). A loop owns both streams: `async with inputs,
    outputs:`. Process-wide: meant for tests, one at a time."""
    transport = _transport()
    previous = transport.serve_engine_core
    transport.serve_engine_core = loop
    try:
        yield
    finally:
        transport.serve_engine_core = previous


class _InlineCompute:
    """Stands in for the compute thread: runs each step in the event loop, after the fake's
    cadence (an anyio sleep, so a MockClock drives it)."""

    def __init__(self, runner: Runner) -> None:
        self.runner = runner

    async def run(self, fn: Callable[..., Any], *args: Any) -> Any:
        if isinstance(self.runner, FaultRunner):
            await self.runner.wait_inline()
        else:
            await anyio.lowlevel.checkpoint()
        return fn(*args)


async def _serve_inline(
    core: Any,
    inputs: MemoryObjectReceiveStream[CoreInput],
    outputs: ObjectSendStream[CoreOutput],
    compute: ComputeThread,
) -> None:
    from triollm.actors.core_loop import serve_engine_core

    runner = getattr(core, "runner", None)
    if isinstance(runner, FaultRunner):
        runner.inline = True
    await serve_engine_core(core, inputs, outputs, _InlineCompute(runner))  # type: ignore[arg-type]


@contextmanager
def steps_in_event_loop() -> Iterator[None]:
    """While the block runs, in-process engine cores started in it step in the event loop (the
    real core loop, each step inline) instead of their compute thread; a `FakeCore`'s cadence,
    stall and hang become event-loop sleeps. Start-up still builds the core in a thread: under
    a MockClock, start the engine before setting deadlines."""
    with replace_core_loop(_serve_inline):
        yield


def kill_core_process(llm: Any, sig: int = signal.SIGKILL, rank: int = 0) -> int:
    """Send `sig` to the engine-core child process of `llm` (of data-parallel rank `rank`);
    returns its pid. ValueError when the core runs in this process."""
    pids = llm.statistics().core_pids
    if not pids:
        raise ValueError("kill_core_process: this engine's core runs in this process (multiprocess=False)")
    if not 0 <= rank < len(pids):
        raise ValueError(f"rank: {rank!r} is not in [0, {len(pids)})")
    os.kill(pids[rank], sig)
    return int(pids[rank])
