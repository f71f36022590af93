"""Data parallel on Ray (`data_parallel_backend="ray"`, actors/ray_core.py): each rank an
engine-core Ray actor in its own placement group, on a local Ray cluster.

Loopback only (`tests/local_ray.py`): the engine cores connect back over tcp://127.0.0.1. Skipped
where Ray is not installed (`pip install 'triollm[ray]'`); CI installs it.
"""

from __future__ import annotations

import os
import random
import signal
import sys
from collections.abc import Iterator
from contextlib import aclosing
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from local_ray import local_ray

from triollm.actors import ray_core
from triollm.actors.async_llm import AsyncEngineArgs, AsyncLLM
from triollm.actors.errors import EngineDeadError
from triollm.actors.process import EngineStartupError
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

pytestmark = pytest.mark.anyio

@pytest.fixture(scope="module")
def ray_cluster() -> Iterator[Any]:
    with local_ray() as ray:
        yield ray


def ray_args(tiny_model_dir: Path, size: int = 2, **overrides: object) -> AsyncEngineArgs:
    kwargs: dict[str, object] = {
        "model": str(tiny_model_dir),
        "max_model_len": 256,
        "seed": 0,
        "multiprocess": True,
        "data_parallel_size": size,
        "data_parallel_backend": "ray",
        "num_threads": size,  # one thread per rank
    }
    kwargs.update(overrides)
    return AsyncEngineArgs(**kwargs)  # type: ignore[arg-type]


async def _run(llm: AsyncLLM, i: int, tokens: int, out: dict[int, list[int]]) -> None:
    params = SamplingParams(max_tokens=tokens, ignore_eos=True, temperature=0, output_kind=RequestOutputKind.FINAL_ONLY)
    async for o in llm.generate(f"request {i} " * (1 + i % 5), params, f"r{i}"):
        out[i] = list(o.outputs[0].token_ids)


def _alive(pids: tuple[int, ...]) -> list[int]:
    alive = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.append(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


async def test_requests_are_balanced_over_ray_actors_and_match_one_core(ray_cluster: Any, tiny_model_dir: Path) -> None:
    rng = random.Random(0)
    tokens = {i: rng.randint(1, 12) for i in range(100)}
    out: dict[int, list[int]] = {}
    with anyio.fail_after(120):
        async with AsyncLLM.from_engine_args(ray_args(tiny_model_dir)) as llm:
            pids = llm.statistics().core_pids
            assert len(pids) == 2 and os.getpid() not in pids
            async with anyio.create_task_group() as tg:
                for i in range(100):
                    tg.start_soon(_run, llm, i, tokens[i], out)
                    await anyio.sleep(rng.random() * 0.005)  # staggered arrivals
            assigned = list(llm.statistics().requests_per_rank or [])
            stats = await llm.get_engine_stats()  # combined over the ranks
            assert stats.num_running == stats.num_waiting == 0
        for _ in range(50):  # the actors end with the engine
            if not _alive(pids):
                break
            await anyio.sleep(0.1)
        assert not _alive(pids)
    assert {i: len(t) for i, t in out.items()} == tokens
    # Least-loaded routing: a rank that finishes faster (two actors and Ray share two cores
    # here) rightly takes more; each must still take a real share (77/23 seen under load).
    assert sum(assigned) == 100 and min(assigned) >= 15, assigned

    reference: dict[int, list[int]] = {}  # one engine core, in this process
    async with AsyncLLM.from_engine_args(
        AsyncEngineArgs(model=str(tiny_model_dir), max_model_len=256, seed=0, multiprocess=False)
    ) as one:
        async with anyio.create_task_group() as tg:
            for i in range(10):
                tg.start_soon(_run, one, i, tokens[i], reference)
    assert {i: out[i] for i in range(10)} == reference


async def test_a_dead_actor_is_a_dead_engine(ray_cluster: Any, tiny_model_dir: Path) -> None:
    errors: list[BaseException] = []
    started = anyio.Event()

    async def consume(llm: AsyncLLM, i: int) -> None:
        params = SamplingParams(max_tokens=200, ignore_eos=True)
        try:
            async with aclosing(llm.generate("a long one", params, f"k{i}")) as agen:
                async for _ in agen:
                    started.set()
        except EngineDeadError as exc:
            errors.append(exc)

    with anyio.fail_after(60):
        async with AsyncLLM.from_engine_args(ray_args(tiny_model_dir)) as llm:
            pids = llm.statistics().core_pids
            async with anyio.create_task_group() as tg:
                for i in range(6):
                    tg.start_soon(consume, llm, i)
                await started.wait()
                os.kill(pids[1], signal.SIGKILL)  # the actor's process, as a crash or OOM kill
            assert llm.errored
            with pytest.raises(EngineDeadError, match="data parallel rank 1: the engine core Ray actor died"):
                await llm.check_health()
        for _ in range(50):
            if not _alive(pids):
                break
            await anyio.sleep(0.1)
        assert not _alive(pids)  # the other rank's actor was stopped too
    assert len(errors) == 6


async def test_a_cluster_without_room_fails_start_up_naming_the_resources(
    ray_cluster: Any, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(ray_core, "PLACEMENT_TIMEOUT_S", 1.0)
    args = ray_args(tiny_model_dir, num_threads=16)  # 8 CPUs per rank on a 4-CPU cluster
    with anyio.fail_after(60):
        with pytest.raises(
            EngineStartupError, match=r"data parallel rank 0: the Ray cluster found no room for \{'CPU': 8.0\}"
        ):
            async with AsyncLLM.from_engine_args(args):
                pass
    assert not ray_cluster.util.placement_group_table() or all(
        pg["state"] == "REMOVED" for pg in ray_cluster.util.placement_group_table().values()
    )


async def test_without_ray_installed_the_error_names_the_extra(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` raises ImportError
    with pytest.raises(
        ValueError,
        match=r"data_parallel_backend: 'ray' needs Ray, which is not installed: pip install 'triollm\[ray\]'",
    ):
        async with AsyncLLM.from_engine_args(ray_args(tiny_model_dir)):
            pass
