"""A data-parallel rank that hangs while another produces is a dead engine: each rank has its own
output-progress clock (actors/data_parallel.py), so the hang is declared within
`engine_output_timeout_s` of that rank's last message, naming the rank, although the engine as a
whole never goes quiet; every stream and every utility call in flight then end with
`EngineDeadError`, and the hung rank is killed at shutdown.

Two ranks of `FakeCore` (scripted tokens, no weights), child processes: rank 1's core hangs in
its forward pass (a `FakeCore` hang, on that rank only) while rank 0 goes on stepping. With Ray
(skipped where Ray is not installed), one actor's process is SIGSTOPped. Real time, a 1 s
timeout: the ranks are processes, so no MockClock.
"""

from __future__ import annotations

import dataclasses
import os
import signal
import time
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from hypothesis import given, settings
from local_ray import local_ray

import triollm.actors.process as process_module
from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.sampling_params import SamplingParams
from triollm.testing import FakeCore, kill_core_process
from triollm.testing.strategies import HangRank, hang_ranks

pytestmark = pytest.mark.anyio

TIMEOUT_S = 1.0
STEP_S = 0.02  # the healthy rank's cadence: 240 tokens take ~5 s, far past the timeout
TOKENS = 240
# A `FakeCore` whose hang happens on one data-parallel rank only (the factory runs in each
# rank's child, which imports this module through PYTHONPATH).
RANK_FAULTS = """
from triollm.testing import build_fake_core


def build(config, *, rank, **spec):
    if config.actor.data_parallel_rank != rank:
        spec["hang_at_step"] = None
    return build_fake_core(config, **spec)
"""


@pytest.fixture
def hang_on_rank_1(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> EngineCoreFactory:
    (tmp_path / "rank_faults.py").write_text(RANK_FAULTS)
    monkeypatch.setenv("PYTHONPATH", f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    fake = FakeCore(step_s=STEP_S, hang_at_step=3)
    return EngineCoreFactory("rank_faults:build", {"rank": 1, **dataclasses.asdict(fake)})


def dp_args(model_dir: Path, **overrides: Any) -> AsyncEngineArgs:
    kwargs: dict[str, Any] = {
        "model": str(model_dir),
        "max_model_len": 256,
        "seed": 0,
        "multiprocess": True,
        "data_parallel_size": 2,
        "engine_output_timeout_s": TIMEOUT_S,
    }
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)


async def run_hung_rank(llm: AsyncLLM, hang: Any, rank: int) -> None:
    """Four streams (two per rank: the router alternates on equal loads) and, once rank `rank`
    has hung, a statistics call (it fans out to every rank); `hang(llm)` hangs that rank, or
    does nothing when its core hangs by itself. Checks when and how everything ends."""
    tokens = [0, 0, 0, 0]
    ends: dict[int, BaseException | None] = {}
    first = anyio.Event()
    call: list[BaseException | None] = []

    async def consume(i: int) -> None:
        params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
        try:
            async with aclosing(llm.generate("hello there", params, f"s{i}")) as agen:
                async for out in agen:
                    tokens[i] = len(out.outputs[0].token_ids)
                    first.set()
        except EngineDeadError as exc:
            ends[i] = exc
        else:
            ends[i] = None

    async def statistics() -> None:
        try:
            await llm.get_engine_stats()
        except EngineDeadError as exc:
            call.append(exc)
        else:
            call.append(None)

    with anyio.fail_after(30):
        async with anyio.create_task_group() as tg:
            for i in range(4):
                tg.start_soon(consume, i)
            await first.wait()
            hang(llm)
            t0 = time.monotonic()
            await anyio.sleep(0.3)  # the rank is hung by now, and the other goes on
            tg.start_soon(statistics)
            at_call = sum(tokens)
            dead = await llm.wait_errored()
            waited = time.monotonic() - t0
    assert TIMEOUT_S * 0.9 <= waited <= TIMEOUT_S * 1.125 + 1.0, waited
    assert sum(tokens) > at_call  # the healthy rank was producing all along
    assert max(tokens) < TOKENS  # nothing ran to its end: the hang was found first
    assert f"data parallel rank {rank}" in str(dead)
    assert f"engine_output_timeout_s={TIMEOUT_S}" in str(dead)
    assert sorted(ends) == [0, 1, 2, 3]
    for i, error in ends.items():
        assert isinstance(error, EngineDeadError), f"stream {i}: {error!r}"
        assert f"data parallel rank {rank}" in str(error)
    assert len(call) == 1 and isinstance(call[0], EngineDeadError), call
    assert f"data parallel rank {rank}" in str(call[0])
    with pytest.raises(EngineDeadError, match=f"data parallel rank {rank}"):
        await llm.check_health()


@pytest.mark.usefixtures("no_leaks")
async def test_a_hung_rank_is_declared_dead_while_another_produces(
    tiny_model_dir: Path, hang_on_rank_1: EngineCoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rank 1's forward pass hangs at its third step; rank 0 keeps stepping."""
    monkeypatch.setattr(process_module, "TERM_GRACE_S", 0.5)
    llm = AsyncLLM.from_engine_args(dp_args(tiny_model_dir), engine_core_factory=hang_on_rank_1)
    async with llm:
        await run_hung_rank(llm, lambda _: None, rank=1)
        t0 = time.monotonic()
        await llm.shutdown()
        # The hung rank gets no grace: SIGTERM at once (the healthy one stops by itself).
        assert time.monotonic() - t0 < process_module.TERM_GRACE_S + 3.0


@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    with local_ray() as ray:
        yield ray


@pytest.mark.parametrize("anyio_backend", ["trio"])
async def test_a_stopped_ray_actor_is_declared_dead_while_another_produces(
    ray_cluster: Any, tiny_model_dir: Path
) -> None:
    """Rank 0's Ray actor is SIGSTOPped; rank 1's keeps stepping. Every actor is gone after."""
    args = dp_args(tiny_model_dir, data_parallel_backend="ray", num_threads=2)
    factory = FakeCore(step_s=STEP_S).factory()
    pids: tuple[int, ...] = ()

    def stop_rank_0(llm: AsyncLLM) -> None:  # the fault plans' HangRank(0)
        kill_core_process(llm, signal.SIGSTOP, rank=0)

    async with AsyncLLM.from_engine_args(args, engine_core_factory=factory) as llm:
        pids = llm.statistics().core_pids
        await run_hung_rank(llm, stop_rank_0, rank=0)
    with anyio.fail_after(10):  # each actor's process ends with the engine (a zombie is gone)
        while any(_alive(pid) for pid in pids):  # noqa: ASYNC110 - polling other processes
            await anyio.sleep(0.1)


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@settings(max_examples=20, database=None)
@given(step=hang_ranks(3))
def test_the_fault_plans_hang_a_rank_of_the_engine(step: HangRank) -> None:
    assert 0 <= step.rank < 3


def test_hang_ranks_needs_a_number_of_ranks() -> None:
    with pytest.raises(ValueError, match="size: must be a number of data-parallel ranks >= 1, got 0"):
        hang_ranks(0)
