"""Sleep mode, weight reload, `collective_rpc`, `apply_model` and the profiler, through `LLM` and
`AsyncLLM` on real tiny checkpoints, with the engine core in process and in a child process (the
default): engine/execution/sleep_mode.py.

Memory: `sleep(2)` is measured on a random Llama of ~100 MB of fp32 weights and a 32 MiB KV
cache, by the resident set size of the process the engine core runs in (read there through
`collective_rpc`, /proc/self/statm). In process, the idle interpreter is measured after a first
engine has run and shut down (so torch's kernels, the tokenizer and the native CPU kernels are
loaded: libraries, not the engine's memory); in a child process, against the weights and KV
bytes the engine itself reports (`apply_model`, the executor's block count)."""

from __future__ import annotations

import gzip
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cloudpickle
import pytest
from tinymodel import make_tiny_model

from triollm import LLM, SamplingParams
from triollm.actors.async_llm import AsyncLLM
from triollm.engine.config import EngineArgs

# The engine-core child cannot import this test module: its functions travel by value, as a
# script's (`__main__`) do.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

GREEDY = SamplingParams(temperature=0, max_tokens=8)
# The last one is several whole KV blocks long: with prefix caching, a stale cache would serve it.
PROMPTS = [
    "The capital of France is",
    "Once upon a time there was",
    "The quick brown fox jumps over the lazy dog. " * 4,
]
KV_BYTES = 32 << 20
BIG = dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4, intermediate_size=1536)


def rss_bytes(worker: object = None) -> int:
    """The resident set size of the calling process (a `collective_rpc` callable: the worker)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def weight_bytes(model: Any) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def kv_bytes(worker: Any) -> int:
    return int(worker.num_blocks * worker.bytes_per_block())


def tokens(llm: LLM, prompts: list[str] = PROMPTS) -> list[list[int]]:
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, GREEDY, use_tqdm=False)]


def build(path: Path, multiprocess: bool, **kwargs: Any) -> LLM:
    options: dict[str, Any] = dict(max_model_len=128, num_threads=1, seed=0, kv_cache_memory_bytes=KV_BYTES)
    return LLM(str(path), multiprocess=multiprocess, **{**options, **kwargs})


@pytest.fixture(scope="module")
def big_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("big") / "m", **BIG)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def other_weights(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model's architecture with other random weights (checkpoint B)."""
    return make_tiny_model(tmp_path_factory.mktemp("b") / "m", seed=1)


@pytest.fixture(params=[False, True], ids=["in-process", "multiprocess"])
def multiprocess(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


@pytest.fixture
def llm(tiny_model_dir: Path, multiprocess: bool) -> Iterator[LLM]:
    with build(tiny_model_dir, multiprocess) as engine:
        yield engine


# ------------------------------------------------------------------ sleep and wake-up


def test_sleep_2_frees_the_engines_memory_in_process(big_model: Path, tiny_model_dir: Path) -> None:
    """Measured in a fresh interpreter (this file run as a script): in a test worker, memory that
    earlier tests freed stays with the allocator, the engine's comes from it unseen and RSS does
    not move."""
    import subprocess

    path = os.pathsep.join(p for p in (str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH")) if p)
    done = subprocess.run(
        [sys.executable, __file__, str(big_model), str(tiny_model_dir)],
        env={**os.environ, "PYTHONPATH": path},
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def _sleep_2_in_process(big_model: Path, tiny_model_dir: Path) -> None:
    with build(tiny_model_dir, False) as warm:  # libraries loaded: the idle interpreter after
        tokens(warm)
    idle = rss_bytes()
    with build(big_model, False) as llm:
        before = tokens(llm)
        loaded = rss_bytes()
        held = loaded - idle
        assert held >= 120 << 20, held  # ~98 MiB of weights and 32 MiB of KV cache
        llm.sleep(level=2)
        asleep = rss_bytes()
        assert loaded - asleep >= 0.9 * held, (idle >> 20, loaded >> 20, asleep >> 20)
        assert llm.is_sleeping()
        llm.wake_up()
        assert not llm.is_sleeping()
        assert tokens(llm) == before


def test_sleep_2_frees_the_engines_memory_in_its_process(big_model: Path) -> None:
    with build(big_model, True) as llm:
        before = tokens(llm)
        (engine_pid,) = llm.collective_rpc(lambda worker: os.getpid())
        assert engine_pid != os.getpid()  # the child's memory is measured, not this process's
        (weights,) = llm.apply_model(weight_bytes)
        (kv,) = llm.collective_rpc(kv_bytes)
        assert weights > 95 << 20 and kv == KV_BYTES
        (loaded,) = llm.collective_rpc(rss_bytes)
        llm.sleep(1)
        (kv_asleep,) = llm.collective_rpc(rss_bytes)
        assert loaded - kv_asleep >= 0.9 * kv, ((loaded - kv_asleep) >> 20, kv >> 20)  # the KV cache only
        assert loaded - kv_asleep < kv + weights / 2  # the weights stayed
        llm.wake_up()
        (loaded,) = llm.collective_rpc(rss_bytes)
        llm.sleep(2)
        (asleep,) = llm.collective_rpc(rss_bytes)
        assert loaded - asleep >= 0.9 * (weights + kv), ((loaded - asleep) >> 20, (weights + kv) >> 20)
        llm.wake_up()
        (awake,) = llm.collective_rpc(rss_bytes)
        assert awake - asleep >= 0.9 * (weights + kv)  # read again from the checkpoint
        assert tokens(llm) == before


def test_sleep_1_frees_the_kv_cache_and_keeps_the_weights(llm: LLM) -> None:
    before = tokens(llm)
    (model_id,) = llm.apply_model(id)
    llm.sleep(1)
    assert llm.is_sleeping()
    assert llm.apply_model(id) == [model_id]  # the same model object: the weights stayed
    llm.wake_up()
    assert tokens(llm) == before


def test_wake_up_by_tags(llm: LLM) -> None:
    before = tokens(llm)
    llm.sleep(2)
    llm.wake_up(tags=["weights"])
    assert llm.is_sleeping()  # the KV cache still sleeps
    with pytest.raises(ValueError, match="KV cache freed"):
        tokens(llm)
    llm.wake_up(tags=["kv_cache"])
    assert not llm.is_sleeping()
    assert tokens(llm) == before


def test_a_request_while_asleep_names_the_state(llm: LLM) -> None:
    llm.sleep(2)
    with pytest.raises(ValueError, match=r"sleeping \(weights and KV cache freed\).*wake_up"):
        tokens(llm)
    llm.wake_up()
    assert len(tokens(llm)) == len(PROMPTS)


def test_sleep_resets_the_prefix_cache(tiny_model_dir: Path) -> None:
    long = ["The quick brown fox jumps over the lazy dog. " * 4]  # several whole KV blocks

    def cached() -> int:
        return llm.generate(long, GREEDY, use_tqdm=False)[0].num_cached_tokens or 0

    with build(tiny_model_dir, False, enable_prefix_caching=True) as llm:
        cached()
        assert cached() > 0  # the second time, the prompt's blocks are reused
        llm.sleep(1)
        llm.wake_up()
        assert cached() == 0  # the blocks' contents were freed: nothing may be reused


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda llm: llm.sleep(3), r"level: 3 .*allowed: 1"),
        (lambda llm: llm.wake_up(tags=["weights", "lora"]), r"tags: 'lora' not known; allowed: weights, kv_cache"),
        (lambda llm: llm.wake_up(tags="weights"), "tags: a list"),
    ],
    ids=["level", "tag", "tags-string"],
)
def test_bad_arguments_name_the_field(tiny_model_dir: Path, call: Any, match: str) -> None:
    with build(tiny_model_dir, False) as llm, pytest.raises(ValueError, match=match):
        call(llm)


def test_sleep_with_requests_in_flight_is_refused(tiny_model_dir: Path) -> None:
    with build(tiny_model_dir, False) as llm:
        engine = llm.llm_engine
        engine.add_request("r1", PROMPTS[0], SamplingParams(temperature=0, max_tokens=100, ignore_eos=True))
        with pytest.raises(ValueError, match="sleep: 1 requests are unfinished"):
            llm.sleep(1)
        while engine.has_unfinished_requests():
            engine.step()
        llm.sleep(1)
        assert llm.is_sleeping()


# ------------------------------------------------------------------ weight reload


def test_reload_from_another_checkpoint_gives_its_tokens(
    tiny_model_dir: Path, other_weights: Path, multiprocess: bool
) -> None:
    with build(other_weights, multiprocess) as b:
        expected = tokens(b)
    with build(tiny_model_dir, multiprocess, enable_prefix_caching=True) as llm:
        before = tokens(llm)
        assert before != expected  # other weights: other tokens
        llm.reload_weights(str(other_weights))
        assert tokens(llm) == expected  # the prefix cache of A's K/V was forgotten
        llm.collective_rpc("reload_weights", kwargs={"weights_path": str(tiny_model_dir)})
        assert tokens(llm) == before
        llm.reload_weights()  # the running checkpoint again
        assert tokens(llm) == before


def test_reload_while_asleep_stays_asleep(tiny_model_dir: Path, other_weights: Path) -> None:
    with build(other_weights, False) as b:
        expected = tokens(b)
    with build(tiny_model_dir, False) as llm:
        llm.sleep(2)
        llm.reload_weights(str(other_weights))
        assert llm.is_sleeping()
        llm.wake_up()
        assert tokens(llm) == expected


def test_reload_of_another_architecture_names_the_field(tiny_model_dir: Path, tmp_path: Path) -> None:
    wider = make_tiny_model(tmp_path / "wider", hidden_size=96, num_heads=4, num_kv_heads=2)
    with build(tiny_model_dir, False) as llm:
        before = tokens(llm)
        with pytest.raises(ValueError, match=r"weights_path: .* hidden_size is 96 there and 64"):
            llm.reload_weights(str(wider))
        with pytest.raises(ValueError, match="weights_path: .* has no config.json"):
            llm.reload_weights(str(tmp_path))
        assert tokens(llm) == before  # refused before anything was dropped


# ------------------------------------------------------------------ collective_rpc and apply_model


def test_collective_rpc_by_name_and_callable(llm: LLM) -> None:
    (blocks,) = llm.collective_rpc(lambda worker: worker.num_blocks)
    (per_block,) = llm.collective_rpc("bytes_per_block")
    assert 0 < blocks * per_block <= KV_BYTES
    assert llm.collective_rpc(kv_bytes) == [blocks * per_block]  # a module-level function too
    assert llm.collective_rpc("apply_model", args=(lambda model: type(model).__name__,)) == ["LlamaForCausalLM"]
    with pytest.raises(ValueError, match="method: 'no_such_method' is not a method of the worker; allowed: "):
        llm.collective_rpc("no_such_method")


def test_collective_rpc_sleep_goes_through_the_core(llm: LLM) -> None:
    before = tokens(llm)
    assert llm.collective_rpc("sleep", kwargs={"level": 2}) == [None]
    assert llm.is_sleeping()
    with pytest.raises(ValueError, match="sleeping"):
        tokens(llm)
    llm.collective_rpc("wake_up")
    assert tokens(llm) == before


def test_a_long_device_call_is_busy_not_hung(tiny_model_dir: Path, multiprocess: bool) -> None:
    # A reload of a large checkpoint outlasts engine_output_timeout_s; the core loop heartbeats.
    with build(tiny_model_dir, multiprocess, engine_output_timeout_s=1.0) as llm:
        assert llm.collective_rpc(lambda worker: __import__("time").sleep(3) or "done") == ["done"]
        assert len(tokens(llm)) == len(PROMPTS)  # not declared dead meanwhile


def test_apply_model(llm: LLM) -> None:
    assert llm.apply_model(lambda model: model.cfg.hidden_size) == [64]
    (n,) = llm.apply_model(weight_bytes)
    assert n > 0
    llm.sleep(2)
    with pytest.raises(ValueError, match="apply_model: no model is loaded"):
        llm.apply_model(weight_bytes)


def test_tensor_parallel_ranks_all_answer_sleep_and_reload(tiny_model_dir: Path, other_weights: Path) -> None:
    with build(other_weights, False) as b:
        expected = tokens(b)
    with build(tiny_model_dir, True, tensor_parallel_size=2, num_threads=2) as llm:
        before = tokens(llm)
        pids = llm.collective_rpc(lambda worker: os.getpid())
        assert len(set(pids)) == 2  # rank 0 (the engine core) and the worker, each its own process
        assert llm.collective_rpc("bytes_per_block") == llm.collective_rpc("bytes_per_block")[:1] * 2
        shards = llm.apply_model(lambda model: model.layers[0].mlp.gate_up_proj.weight.shape[0])
        assert shards[0] == shards[1] == 2 * 128 // 2  # gate and up, each half of 128 rows
        llm.sleep(2)
        assert llm.collective_rpc(lambda worker: worker.model is None) == [True, True]
        with pytest.raises(ValueError, match="rank 1: apply_model: no model is loaded|apply_model: no model"):
            llm.apply_model(weight_bytes)
        llm.wake_up()
        assert tokens(llm) == before
        llm.reload_weights(str(other_weights))
        assert tokens(llm) == expected


# ------------------------------------------------------------------ profiler


def test_profiler_writes_a_trace(
    tiny_model_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, multiprocess: bool
) -> None:
    monkeypatch.setenv("VLLM_TORCH_PROFILER_DIR", str(tmp_path / "traces"))
    with build(tiny_model_dir, multiprocess) as llm:
        llm.start_profile()
        tokens(llm)
        llm.stop_profile()
        with pytest.raises(ValueError, match="stop_profile: the profiler is not running"):
            llm.stop_profile()
    (trace,) = (tmp_path / "traces").glob("*.pt.trace.json.gz")
    events = json.loads(gzip.decompress(trace.read_bytes()))["traceEvents"]
    names = {e.get("name") for e in events}
    assert any(str(n).startswith("aten::") for n in names)  # the forward passes' ops


def test_profiler_without_its_folder_names_the_variable(tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("VLLM_TORCH_PROFILER_DIR", raising=False)
    with build(tiny_model_dir, False) as llm, pytest.raises(ValueError, match="VLLM_TORCH_PROFILER_DIR: not set"):
        llm.start_profile()


# ------------------------------------------------------------------ AsyncLLM


@pytest.mark.anyio
@pytest.mark.parametrize("anyio_backend", ["asyncio", "trio"])
async def test_async_llm_sleep_and_rpc(tiny_model_dir: Path, anyio_backend: str) -> None:
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=128, num_threads=1, seed=0)  # multiprocess
    async with AsyncLLM.from_engine_args(args) as llm:

        async def greedy() -> list[int]:
            outputs = [out async for out in llm.generate(PROMPTS[0], GREEDY, request_id="r")]
            return list(outputs[-1].outputs[0].token_ids)

        before = await greedy()
        assert not await llm.is_sleeping()
        await llm.sleep(2)
        assert await llm.is_sleeping()
        with pytest.raises(ValueError, match="sleeping"):
            await greedy()
        await llm.wake_up()
        assert await greedy() == before
        assert await llm.collective_rpc(lambda worker: worker.is_sleeping) == [False]
        with pytest.raises(TimeoutError):
            await llm.collective_rpc(lambda worker: __import__("time").sleep(2), timeout=0.1)


if __name__ == "__main__":  # test_sleep_2_frees_the_engines_memory_in_process's fresh interpreter
    _sleep_2_in_process(Path(sys.argv[1]), Path(sys.argv[2]))
