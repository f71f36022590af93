"""Runners for tests and benchmarks, and the factories that put them in an engine core.

- `ScriptedRunner` replays scripted tokens instead of running a model, for measuring everything
  around the forward pass (scheduler, KV bookkeeping, the actor pipeline, the wire) at full
  speed. The scheduler and block manager run exactly as with a real model; only `execute` is
  replaced. Token i of a request is `(prompt_len + i) % vocab_size`, skipping the EOS ids, so
  counts are exact and reproducible.
- `FaultyRunner` wraps a runner and raises at one step (1-based): a real exception in the
  forward pass, for the fault-injection tests.
- `HangingRunner` wraps a runner and blocks the step's thread at one step until
  `HUNG_STEP_RELEASE` is set: a deadlocked forward pass, for the hang tests (in this process;
  a test sets the event at its end so no thread outlives it).

Neither is a user setting. A test in this process passes one to `EngineCore(config,
runner=...)`; across processes the factories below are named by an `EngineCoreFactory`
(`SCRIPTED`, `fault_at_step(n)`), which `AsyncLLM(..., engine_core_factory=...)` hands to the
transport and, with the multiprocess transport, the child process builds its core with.
"""

from __future__ import annotations

import threading

from triollm.engine.config import EngineConfig
from triollm.engine.core import EngineCore, EngineCoreFactory, Runner
from triollm.engine.execution.model_runner import RunnerOutput
from triollm.engine.scheduling.scheduler import ScheduledRequest

__all__ = [
    "HUNG_STEP_RELEASE",
    "SCRIPTED",
    "FaultyRunner",
    "HangingRunner",
    "ScriptedRunner",
    "fault_at_step",
    "faulty_engine_core",
    "hang_at_step",
    "hanging_engine_core",
    "scripted_engine_core",
]


class ScriptedRunner:
    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size

    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        out = RunnerOutput({}, {}, {})
        for s in scheduled:
            if s.samples:
                req = s.request
                token = (req.num_prompt_tokens + req.num_output_tokens) % self.vocab_size
                while token in req.eos_token_ids:
                    token = (token + 1) % self.vocab_size
                out.sampled[req.request_id] = token
        return out


class _AtStep:
    """Runs `inner`, calling `at_step()` before step `step` (1-based)."""

    def __init__(self, inner: Runner, step: int) -> None:
        if step < 1:
            raise ValueError(f"step: must be a positive integer, got {step!r}")
        self.inner = inner
        self.step = step
        self.num_steps = 0

    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        self.num_steps += 1
        if self.num_steps == self.step:
            self.at_step()
        return self.inner.execute(scheduled)

    def at_step(self) -> None:
        raise NotImplementedError


class FaultyRunner(_AtStep):
    """Runs `inner`, except that step `step` (1-based) raises `RuntimeError`."""

    def at_step(self) -> None:
        raise RuntimeError(f"injected fault in the forward pass at step {self.num_steps}")


# Set to let every blocked `HangingRunner` step return (and later ones not block).
HUNG_STEP_RELEASE = threading.Event()


class HangingRunner(_AtStep):
    """Runs `inner`, except that step `step` (1-based) blocks its thread until
    `HUNG_STEP_RELEASE` is set (a real block, not cancellable from the event loop)."""

    def at_step(self) -> None:
        HUNG_STEP_RELEASE.wait()


def scripted_engine_core(config: EngineConfig) -> EngineCore:
    """An engine core with no model: tokens are replayed by `ScriptedRunner`."""
    return EngineCore(config, runner=ScriptedRunner(config.model.vocab_size))


def faulty_engine_core(config: EngineConfig, *, step: int, scripted: bool = False) -> EngineCore:
    """An engine core (the real model unless `scripted`) whose forward pass raises at `step`."""
    core = scripted_engine_core(config) if scripted else EngineCore(config)
    core.runner = FaultyRunner(core.runner, step)
    return core


SCRIPTED = EngineCoreFactory(f"{__name__}:scripted_engine_core")


def fault_at_step(step: int, *, scripted: bool = False) -> EngineCoreFactory:
    """The factory of an engine core whose forward pass raises at `step` (1-based)."""
    return EngineCoreFactory(f"{__name__}:faulty_engine_core", {"step": step, "scripted": scripted})


def hanging_engine_core(config: EngineConfig, *, step: int, scripted: bool = False) -> EngineCore:
    """An engine core whose forward pass blocks its thread at `step` (see `HangingRunner`)."""
    core = scripted_engine_core(config) if scripted else EngineCore(config)
    core.runner = HangingRunner(core.runner, step)
    return core


def hang_at_step(step: int, *, scripted: bool = False) -> EngineCoreFactory:
    """The factory of an engine core whose forward pass hangs at `step` (1-based)."""
    return EngineCoreFactory(f"{__name__}:hanging_engine_core", {"step": step, "scripted": scripted})
