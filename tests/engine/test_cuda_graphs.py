"""Decode steps through `DecodeGraphs` (engine/execution/cuda_graphs.py) on CPU: the capture is
`eager_capture` (replay re-runs the recorded forward on the static buffers), so everything but the
CUDA driver runs for real: static inputs, padding rows in the spare block, the choice of the
captured size, eager fallback for prefills and for batches larger than every size. Greedy tokens
must equal the plain eager engine's, on the native CPU kernel and on the Triton path (the CUDA
code path, under the interpreter)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from triollm import SamplingParams
from triollm.engine.config import EngineArgs
from triollm.engine.execution.cuda_graphs import DecodeGraphs, default_capture_sizes, eager_capture
from triollm.engine.execution.model_runner import ModelRunner
from triollm.engine.sync_engine import SyncEngine
from triollm.kernels import allocate_kv_cache, cpu_native

SIZES = (1, 2, 4)
PROMPTS = ["hello there", "a", "the quick brown fox", "one two three four five", "x y", "seven"]


def _engine(model: Path) -> SyncEngine:
    return SyncEngine.from_engine_args(EngineArgs(model=str(model), max_model_len=256, dtype="float32", num_threads=1))


def _run(engine: SyncEngine) -> dict[str, list[int]]:
    for i, prompt in enumerate(PROMPTS):  # different lengths: the batch shrinks as they finish
        engine.add_request(
            prompt, SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True), request_id=str(i)
        )
    outs: dict[str, list[int]] = {}
    for _ in range(200):
        if not engine.has_unfinished_requests():
            break
        for o in engine.step():
            if o.finished:
                outs[o.request_id] = list(o.outputs[0].token_ids)
    return outs


def _with_graphs(engine: SyncEngine) -> tuple[list[int], torch.Tensor]:
    """Give the engine's core a runner with decode graphs (a spare KV block for the padding);
    returns the list the batch size of every replay is appended to, and the first layer's V
    cache."""
    core = engine.core
    mc, bs = core.config.model, core.config.cache.block_size
    kv = allocate_kv_cache(
        mc.num_layers, core.num_blocks + 1, bs, core.executor.num_kv_heads, mc.head_dim, mc.dtype, "cpu"
    )
    assert core.model is not None
    graphs = DecodeGraphs(
        core.model, kv, torch.device("cpu"), SIZES, -(-mc.max_model_len // bs), core.num_blocks, eager_capture()
    )
    replays: list[int] = []
    run = graphs.run

    def counted(*args: list) -> torch.Tensor:  # type: ignore[type-arg]
        replays.append(len(args[0]))
        return run(*args)

    graphs.run = counted  # type: ignore[method-assign]
    core.runner = ModelRunner(core.model, kv, "cpu", None, graphs)
    return replays, kv.v[0]


@pytest.mark.parametrize("kernels", ["native", "triton"])
def test_decode_graphs_give_the_eager_tokens(
    tiny_model_dir: Path, kernels: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    if kernels == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    elif not cpu_native.available():
        pytest.skip("the native CPU kernels are not available")
    eager = _run(_engine(tiny_model_dir))
    engine = _engine(tiny_model_dir)
    replays, v_cache = _with_graphs(engine)
    pad_block = engine.core.num_blocks
    v_cache[:, pad_block].zero_()  # what the capture's own run wrote
    assert _run(engine) == eager
    assert replays and max(replays) <= max(SIZES)  # 6 decodes ran eagerly, fewer through graphs
    assert 3 in replays  # a batch padded to the captured size 4
    assert v_cache[:, pad_block, 0].abs().sum() > 0  # the padding row wrote there, nowhere else


def test_default_capture_sizes() -> None:
    assert default_capture_sizes(1) == (1,)
    assert default_capture_sizes(20) == (1, 2, 4, 8, 16, 20)
    assert default_capture_sizes(128)[-3:] == (112, 120, 128)
    assert default_capture_sizes(4096)[-1] == 512


def test_graphs_are_for_cuda_and_off_when_eager_is_enforced(tiny_model_dir: Path) -> None:
    base = {"model": str(tiny_model_dir), "max_model_len": 256}
    assert EngineArgs(**base).create_engine_config().cuda_graph_sizes == ()  # CPU  # type: ignore[arg-type]
    args = EngineArgs(**base, max_num_seqs=16, compilation_config={"cudagraph_capture_sizes": [4, 1, 4]})  # type: ignore[arg-type]
    assert args._cuda_graph_sizes("cuda") == (1, 4)
    assert EngineArgs(**base, max_num_seqs=16)._cuda_graph_sizes("cuda") == (1, 2, 4, 8, 16)  # type: ignore[arg-type]
    assert EngineArgs(**base, enforce_eager=True)._cuda_graph_sizes("cuda") == ()  # type: ignore[arg-type]
    assert EngineArgs(**base, compilation_config={"use_cudagraph": False})._cuda_graph_sizes("cuda") == ()  # type: ignore[arg-type]
