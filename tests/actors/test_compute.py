"""The engine core's compute thread (actors/compute.py): every job in one thread, results and
errors delivered, cancellation abandons the job, and the thread ends with its context.

And the reason it exists: torch work in any other thread of an engine process starts a second
OpenMP team. Importing triollm must not (it once probed SDPA at import time), and the engine
must build and step its core in one thread.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import anyio
import pytest

from triollm.actors.compute import compute_thread

pytestmark = pytest.mark.anyio


async def test_jobs_run_in_one_thread_other_than_the_loops() -> None:
    with compute_thread() as compute:
        idents = [await compute.run(threading.get_ident) for _ in range(5)]
    assert len(set(idents)) == 1
    assert idents[0] != threading.get_ident()
    assert idents[0] == compute.ident


async def test_results_and_errors_come_back() -> None:
    def boom(x: int) -> int:
        raise ValueError(f"bad {x}")

    with compute_thread() as compute:
        assert await compute.run(pow, 2, 10) == 1024
        with pytest.raises(ValueError, match="bad 3"):
            await compute.run(boom, 3)
        assert await compute.run(len, "still alive") == 11


async def test_a_cancelled_job_is_abandoned_and_the_context_exit_does_not_wait_for_it() -> None:
    release = threading.Event()
    finished = threading.Event()

    def blocked() -> None:
        release.wait(30)
        finished.set()

    t0 = time.monotonic()
    with compute_thread() as compute:
        with anyio.move_on_after(0.2) as scope:
            await compute.run(blocked)
        assert scope.cancelled_caught
        thread = next(t for t in threading.enumerate() if t.ident == compute.ident)
    assert time.monotonic() - t0 < 5  # the busy thread was not joined
    assert thread.is_alive() and not finished.is_set()
    release.set()  # the abandoned job ends; the thread then takes the stop and ends
    thread.join(10)
    assert finished.is_set() and not thread.is_alive()


async def test_an_idle_thread_has_ended_when_its_context_exits() -> None:
    with compute_thread() as compute:
        await compute.run(int)
        thread = next(t for t in threading.enumerate() if t.ident == compute.ident)
    assert not thread.is_alive()


async def test_the_core_is_built_and_stepped_in_one_thread(
    inproc_engine_args, monkeypatch: pytest.MonkeyPatch
) -> None:
    from triollm.actors.async_llm import AsyncLLM
    from triollm.engine import core as core_module
    from triollm.engine.sampling_params import SamplingParams

    seen: dict[str, set[int]] = {"init": set(), "step": set()}
    init, step = core_module.EngineCore.__init__, core_module.EngineCore.step

    def record_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        seen["init"].add(threading.get_ident())
        init(self, *args, **kwargs)

    def record_step(self):  # type: ignore[no-untyped-def]
        seen["step"].add(threading.get_ident())
        return step(self)

    monkeypatch.setattr(core_module.EngineCore, "__init__", record_init)
    monkeypatch.setattr(core_module.EngineCore, "step", record_step)
    async with AsyncLLM.from_engine_args(inproc_engine_args()) as llm:
        for i in range(3):
            async for _ in llm.generate("hello", SamplingParams(max_tokens=4), f"r{i}"):
                pass
    assert len(seen["init"]) == 1
    assert seen["step"] == seen["init"]
    assert threading.get_ident() not in seen["step"]


IMPORT_PROBE = """
import os, sys
tasks = lambda: len(os.listdir("/proc/self/task"))
import torch
torch.set_num_threads(2)
before = tasks()
import triollm
from triollm import LLM, AsyncLLM, SamplingParams
import triollm.kernels, triollm.engine.core, triollm.actors.process, triollm.api.server
after = tasks()
torch.ones(1 << 20).exp_()  # the probe's own check: a parallel region here does start a team
print(before, after, tasks())
"""


def test_importing_triollm_starts_no_openmp_team() -> None:
    # A second OpenMP team in an engine process (any thread but the compute thread running a
    # parallel region) makes libgomp stop spin-waiting, and every step slows (docs/benchmarks.md).
    env = {**os.environ, "OMP_NUM_THREADS": "2", "TRIOLLM_CPU_KERNELS": "0"}
    out = subprocess.run(
        [sys.executable, "-c", IMPORT_PROBE], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    before, after, with_team = map(int, out.stdout.split())
    assert with_team > before, "the probe cannot see an OpenMP team start"
    assert after == before, f"importing triollm started {after - before} thread(s)"
