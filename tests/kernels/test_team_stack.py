"""The quantized decoder stack on one team of threads (kernels/csrc/decoder.cpp `team_stack`): its
tokens and logprobs are the layer-by-layer path's to the bit, at any thread count (more threads
than this machine has cores included), over every cache dtype, with rows long enough to be cut
into parts and merged, in batches that mix decodes with prefills."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from stack_spy import StackSpy, stack_against_layers
from tinymodel import make_tiny_model

from triollm.engine.config import EngineArgs
from triollm.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels unavailable")


@pytest.fixture(scope="module")
def long_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # head_dim 64 (the grouped kernels' instance; the default tiny model's 16 takes the wide one)
    # and room for rows of more than 64 blocks (a row in parts).
    return make_tiny_model(
        tmp_path_factory.mktemp("tiny-team"),
        hidden_size=128,
        num_heads=4,
        num_kv_heads=2,
        intermediate_size=256,
        num_layers=3,
        max_position_embeddings=2048,
    )


def _run(model_dir: Path, threads: int, kv: str, fused: bool) -> tuple[list[Any], int]:
    from triollm.engine.sampling_params import SamplingParams
    from triollm.engine.sync_engine import SyncEngine

    engine = SyncEngine.from_engine_args(
        EngineArgs(
            model=str(model_dir),
            max_model_len=1400,
            num_threads=threads,
            quantization="int4",
            kv_cache_dtype=kv,
            enable_prefix_caching=False,
            seed=0,
        )
    )
    model = engine.core.model
    assert model is not None and model.decode_stack is not None
    spy = StackSpy(model.decode_stack)
    model.decode_stack = spy if fused else None  # type: ignore[assignment]
    prompts = [{"prompt_token_ids": [3 + (7 * i) % 200 for i in range(n)]} for n in (1100, 9, 300)]
    params = [SamplingParams(max_tokens=t, ignore_eos=True, temperature=0.0, logprobs=2) for t in (12, 20, 7)]
    return engine.generate(prompts, params), len(spy.calls)


@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("kv", ["auto", "bfloat16", "fp8", "int8"])
def test_the_team_stack_is_the_layers_bit_for_bit(long_model_dir: Path, threads: int, kv: str) -> None:
    before, teams = torch.get_num_threads(), torch.ops.triollm_cpu.team_stack_calls()
    try:
        fused, calls = _run(long_model_dir, threads, kv, fused=True)
        assert torch.ops.triollm_cpu.team_stack_calls() - teams == calls  # every stack call ran on the team
        layered, _ = _run(long_model_dir, threads, kv, fused=False)
    finally:
        torch.set_num_threads(before)
    assert calls > 0
    for a, b in zip(fused, layered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_the_team_stack_is_the_op_by_op_stack_bit_for_bit(long_model_dir: Path) -> None:
    """Called directly: the team's result equals the per-op loop's (which the stack runs with
    adapters), for a batch of rows of different lengths, one of them in parts."""
    from triollm.engine.sampling_params import SamplingParams
    from triollm.engine.sync_engine import SyncEngine

    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(long_model_dir), max_model_len=1400, quantization="int4", enable_prefix_caching=False)
    )
    model = engine.core.model
    assert model is not None and model.decode_stack is not None
    stack = model.decode_stack
    spy = StackSpy(stack)
    model.decode_stack = spy  # type: ignore[assignment]
    prompts = [{"prompt_token_ids": [5 + (3 * i) % 100 for i in range(n)]} for n in (1050, 4)]
    engine.generate(prompts, [SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)] * 2)
    assert spy.calls  # the last step's arguments: no step wrote the caches after it
    x, cos, sin, slots, plan, k, v, _ = spy.calls[-1]
    assert x.shape[0] == 2
    args = (x, stack.weights, stack.shapes, k, v, cos, sin, slots, plan[0], plan[1], stack.num_heads,
            stack.num_kv_heads, stack.eps, stack.scale)  # fmt: skip
    op = torch.ops.triollm_cpu.quant_decoder_stack
    # The K/V the step wrote are rewritten with the same values by each call.
    teams = torch.ops.triollm_cpu.team_stack_calls()
    team = op(*args, [], [], [], [], [], [], [], False)
    assert torch.ops.triollm_cpu.team_stack_calls() == teams + 1
    # A LoRA group with no adapter on any projection: the per-op loop, nothing added.
    empty = torch.empty(0)
    layers = len(k)
    per_op = op(*args, [empty] * (8 * layers), [0] * (8 * layers), [1, 0, 1, 1, 1] * (4 * layers), [0, 0], [empty],
                [], [], False)  # fmt: skip
    assert torch.ops.triollm_cpu.team_stack_calls() == teams + 1  # adapters take the per-op loop
    assert torch.equal(team, per_op)


@pytest.mark.parametrize(("max_model_len", "stacked"), [(512, True), (5000, False)])
def test_a_window_no_sequence_reaches_keeps_the_stack(
    tmp_path_factory: pytest.TempPathFactory, max_model_len: int, stacked: bool
) -> None:
    """Mistral's config carries a 4,096-token window (HF's default where the file names none): with
    max_model_len within it the layers attend in full, and the stack takes their steps with their
    bits; beyond it the window binds and the layers keep the steps."""
    from triollm.engine.sampling_params import SamplingParams
    from triollm.engine.sync_engine import SyncEngine

    model_dir = make_tiny_model(
        tmp_path_factory.mktemp("tiny-mistral"), architecture="MistralForCausalLM", max_position_embeddings=8192
    )
    engine = SyncEngine.from_engine_args(
        EngineArgs(model=str(model_dir), max_model_len=max_model_len, quantization="int4", enable_prefix_caching=False)
    )
    model = engine.core.model
    assert model is not None and (model.decode_stack is not None) == stacked
    if not stacked:
        return
    prompts = [{"prompt_token_ids": [3 + (11 * i) % 200 for i in range(n)]} for n in (40, 7)]
    params = [SamplingParams(max_tokens=9, ignore_eos=True, temperature=0.0, logprobs=2)] * 2
    assert stack_against_layers(engine, prompts, params).calls
