"""Tensor parallelism (engine/distributed): the sharding math against the unsharded layers, greedy
tokens equal to one rank's through the real engine, validation, and a worker killed mid-run."""

from __future__ import annotations

import os
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import torch
from tinymodel import make_tiny_model

from triollm import LLM, SamplingParams
from triollm.actors.errors import EngineDeadError
from triollm.engine.config import EngineArgs
from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.models import load_model
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.sync_engine import SyncEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
PROMPTS = ["Hello world", "The capital of France is Paris. The capital of Germany is", "def add(a, b):"]
WORKER = "triollm.engine.distributed.worker"


def _workers() -> list[psutil.Process]:
    found = []
    for p in psutil.Process().children(recursive=True):
        try:
            if WORKER in " ".join(p.cmdline()):
                found.append(p)
        except psutil.NoSuchProcess:
            pass
    return found


def _wait_no_workers(timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while _workers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _workers(), "tensor-parallel workers outlived their engine"


def _generate(
    model: Path, tp: int, params: SamplingParams = GREEDY, prompts: list[str] = PROMPTS, **kw: object
) -> list[list[int]]:
    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(model), tensor_parallel_size=tp, num_threads=2, max_model_len=256, **kw)  # type: ignore[arg-type]
    )
    try:
        outs = engine.generate(prompts, params)
    finally:
        engine.core.close()
    return [list(o.outputs[0].token_ids) for o in outs]


# ------------------------------------------------------------------------------ sharding math


def test_shard_ranges() -> None:
    # 4 query heads, 2 KV heads: 2 ranks hold one KV head each; 4 ranks replicate them.
    assert [TPShard(r, 2).split(4) for r in range(2)] == [(0, 2), (2, 2)]
    assert [TPShard(r, 2).kv_heads(4, 2) for r in range(2)] == [(0, 1), (1, 1)]
    assert [TPShard(r, 4).kv_heads(4, 2) for r in range(4)] == [(0, 1), (0, 1), (1, 1), (1, 1)]
    # SmolLM2-135M: 9 heads, 3 KV heads over 3 ranks.
    assert [TPShard(r, 3).kv_heads(9, 3) for r in range(3)] == [(0, 1), (1, 1), (2, 1)]
    # A vocabulary of 10 over 3 ranks: slices of 4, the last one short.
    assert [TPShard(r, 3).vocab(10) for r in range(3)] == [(0, 4), (4, 8), (8, 10)]


@pytest.mark.parametrize("size", [2, 4])
def test_sharded_layers_sum_to_the_unsharded_ones(tiny_model_dir: Path, size: int) -> None:
    """Each rank's slices, loaded from the checkpoint: its QKV columns are the full projection's
    for its heads, and the row-parallel partial sums (what the all-reduce adds) equal the full
    o_proj and MLP."""
    cfg = ModelConfig.from_pretrained(tiny_model_dir, max_model_len=64)
    full = load_model(cfg)
    shards = [load_model(cfg, "cpu", TPShard(r, size)) for r in range(size)]  # no comm: partial sums
    x = torch.randn(3, cfg.hidden_size)
    h, kvh, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    with torch.inference_mode():
        attn = full.layers[0].self_attn
        qkv = attn.qkv_proj(x)
        heads_out = torch.randn(3, h * hd)
        o_sum = torch.zeros(3, cfg.hidden_size)
        mlp_sum = torch.zeros(3, cfg.hidden_size)
        for r, model in enumerate(shards):
            shard = TPShard(r, size)
            q0, nq = shard.split(h)
            k0, nk = shard.kv_heads(h, kvh)
            local = model.layers[0].self_attn.qkv_proj(x)
            torch.testing.assert_close(local[:, : nq * hd], qkv[:, q0 * hd : (q0 + nq) * hd])
            k_full = qkv[:, h * hd : (h + kvh) * hd]
            torch.testing.assert_close(local[:, nq * hd : (nq + nk) * hd], k_full[:, k0 * hd : (k0 + nk) * hd])
            o_sum += model.layers[0].self_attn.o_proj(heads_out[:, q0 * hd : (q0 + nq) * hd])
            mlp_sum += model.layers[0].mlp(x)
        torch.testing.assert_close(o_sum, attn.o_proj(heads_out), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(mlp_sum, full.layers[0].mlp(x), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------ the engine


def test_tp2_greedy_equals_tp1(tiny_model_dir: Path) -> None:
    assert _generate(tiny_model_dir, 2) == _generate(tiny_model_dir, 1)
    _wait_no_workers()


def test_tp2_with_ngram_speculation_equals_tp1(tiny_model_dir: Path) -> None:
    """The drafts' rows and their logits rows reach the other rank (StepInputs.logit_rows)."""
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    engine = SyncEngine.from_engine_args(
        EngineArgs(
            model=str(tiny_model_dir), tensor_parallel_size=2, num_threads=2, max_model_len=256, speculative_config=spec
        )
    )
    try:
        outs = [list(o.outputs[0].token_ids) for o in engine.generate(PROMPTS, GREEDY)]
        assert engine.core.statistics().spec.num_drafts > 0  # the rank-1 worker saw draft rows
    finally:
        engine.core.close()
    assert outs == _generate(tiny_model_dir, 1)
    _wait_no_workers()


def test_tp4_replicated_kv_heads_and_prompt_logprobs(tiny_model_dir: Path) -> None:
    """4 ranks over 2 KV heads (each held by 2 ranks), with small chunks (prefill beside
    decodes) and prompt logprobs (extra logits gathers)."""
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, prompt_logprobs=2, logprobs=1)
    kw = {"max_num_batched_tokens": 16, "enable_chunked_prefill": True}
    one = SyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=256, **kw))  # type: ignore[arg-type]
    four = SyncEngine.from_engine_args(
        EngineArgs(model=str(tiny_model_dir), max_model_len=256, tensor_parallel_size=4, num_threads=2, **kw)  # type: ignore[arg-type]
    )
    try:
        a, b = one.generate(PROMPTS, params), four.generate(PROMPTS, params)
    finally:
        four.core.close()
    for x, y in zip(a, b):
        assert x.outputs[0].token_ids == y.outputs[0].token_ids
        assert x.prompt_logprobs is not None and y.prompt_logprobs is not None
        for lx, ly in zip(x.prompt_logprobs[1:], y.prompt_logprobs[1:]):
            assert lx is not None and ly is not None
            assert lx.keys() == ly.keys()
            for tok in lx:
                assert lx[tok].logprob == pytest.approx(ly[tok].logprob, abs=1e-4)
    _wait_no_workers()


@pytest.mark.slow
def test_tp3_on_the_bundled_model(bundled_model_dir: Path) -> None:
    prompts = ["The capital of France is", "Write a haiku about the sea."]
    assert _generate(bundled_model_dir, 3, prompts=prompts) == _generate(bundled_model_dir, 1, prompts=prompts)
    _wait_no_workers()


# ------------------------------------------------------------------------------ validation


def test_validation_names_the_field(tmp_path: Path) -> None:
    nine = make_tiny_model(tmp_path / "nine-heads", hidden_size=72, num_heads=9, num_kv_heads=3, intermediate_size=144)
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 2 does not divide the model's 9 attention heads"):
        EngineArgs(model=str(nine), tensor_parallel_size=2).create_engine_config()
    twelve = make_tiny_model(
        tmp_path / "twelve-heads", hidden_size=96, num_heads=12, num_kv_heads=4, intermediate_size=192
    )
    with pytest.raises(ValueError, match=r"tensor_parallel_size: 6 must divide the model's 4 KV heads"):
        EngineArgs(model=str(twelve), tensor_parallel_size=6).create_engine_config()
    with pytest.raises(ValueError, match="tensor_parallel_size: must be a positive integer"):
        EngineArgs(model=str(nine), tensor_parallel_size=0)
    with pytest.raises(ValueError, match=r"pipeline_parallel_size: 2 is not supported \(1 only\)"):
        EngineArgs(model=str(nine), pipeline_parallel_size=2)
    config = EngineArgs(model=str(nine), tensor_parallel_size=3).create_engine_config()
    assert config.tensor_parallel_size == 3


def test_short_flag() -> None:
    import argparse

    parser = EngineArgs.add_cli_args(argparse.ArgumentParser())
    assert isinstance(parser, argparse.ArgumentParser)
    assert EngineArgs.from_cli_args(parser.parse_args(["-tp", "2"])).tensor_parallel_size == 2


# ------------------------------------------------------------------------------ a worker dies


@pytest.fixture
def tp2_engine(tiny_model_dir: Path) -> Iterator[SyncEngine]:
    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(tiny_model_dir), tensor_parallel_size=2, num_threads=2, max_model_len=256)
    )
    try:
        yield engine
    finally:
        engine.core.close()
        _wait_no_workers()


def test_killed_worker_makes_the_step_raise(tp2_engine: SyncEngine) -> None:
    tp2_engine.add_request("Hello world", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    tp2_engine.step()
    (worker,) = _workers()
    os.kill(worker.pid, signal.SIGKILL)
    worker.wait(10)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 1"):
        for _ in range(200):
            tp2_engine.step()
    assert time.monotonic() - start < 10


def test_killed_worker_mid_step_is_reported_not_hung(tp2_engine: SyncEngine) -> None:
    """The worker dies while rank 0 is inside a step's collectives: gloo raises, in bounded time."""
    from triollm.engine.distributed import group

    (worker,) = _workers()
    tp2_engine.add_request("Hello world", SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    real_send = group.TensorParallelGroup.send_step

    def send_then_kill(self: group.TensorParallelGroup, inputs: object) -> None:
        real_send(self, inputs)  # type: ignore[arg-type]
        os.kill(worker.pid, signal.SIGKILL)  # after the liveness check, before the collectives
        worker.wait(10)

    start = time.monotonic()
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(group.TensorParallelGroup, "send_step", send_then_kill)
        with pytest.raises(RuntimeError):
            tp2_engine.step()
    assert time.monotonic() - start < 20


def test_killed_worker_fails_every_request_through_llm(tiny_model_dir: Path) -> None:
    """Through `LLM` (engine core in its own process): EngineDeadError, and once the LLM is
    closed no engine-core or worker process remains."""
    with LLM(str(tiny_model_dir), max_model_len=256, tensor_parallel_size=2, num_threads=2) as llm:
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        (worker,) = _workers()
        os.kill(worker.pid, signal.SIGKILL)
        start = time.monotonic()
        with pytest.raises(EngineDeadError):
            llm.generate(PROMPTS, SamplingParams(max_tokens=50, ignore_eos=True), use_tqdm=False)
        assert time.monotonic() - start < 20
    deadline = time.monotonic() + 10
    while psutil.Process().children(recursive=True) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _workers()


@pytest.mark.parametrize("multiprocess", [False, True])
def test_workers_leave_when_the_engine_shuts_down(tiny_model_dir: Path, multiprocess: bool) -> None:
    """An orderly shutdown stops the workers (STOP), in-process or from the engine-core child,
    rather than leaving them to notice their parent's exit."""
    with LLM(
        str(tiny_model_dir), max_model_len=256, tensor_parallel_size=2, num_threads=2, multiprocess=multiprocess
    ) as llm:
        assert llm.generate("Hello", GREEDY, use_tqdm=False)[0].outputs[0].token_ids
        assert len(_workers()) == 1
    _wait_no_workers(5)


def test_a_worker_that_dies_before_joining_fails_start_up_at_once(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Not after the rendezvous timeout (60 s): rank 0 watches the workers while they join."""
    from triollm.engine.distributed import group

    monkeypatch.setattr(
        group, "WORKER_COMMAND", [sys.executable, "-c", "import time; time.sleep(0.3); raise SystemExit(3)"]
    )
    start = time.monotonic()
    with pytest.raises(RuntimeError, match=r"worker rank 1 \(pid \d+\) exited with code 3 before it joined the group"):
        SyncEngine.from_engine_args(
            EngineArgs(model=str(tiny_model_dir), tensor_parallel_size=2, num_threads=2, max_model_len=256)
        )
    assert time.monotonic() - start < 10
    _wait_no_workers()
