"""A dense fp32 or bf16 model's all-decode steps of 1-4 rows run the whole decoder stack in one
native call (kernels/csrc/decoder.cpp `dense_decoder_stack`, `DenseDecodeStack`): its tokens and
logprobs are the layer-by-layer path's, to the bit, with a qkv bias (Qwen2) and without, tied head
or not, over batches whose decode steps have fewer and more rows than the stack takes."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from stack_spy import stack_against_layers
from tinymodel import make_tiny_model

from triollm.engine.config import EngineArgs
from triollm.engine.execution.layers.linear import packable
from triollm.engine.execution.layers.quantized import DenseDecodeStack
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine
from triollm.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize(
    ("architecture", "tied"), [("LlamaForCausalLM", False), ("Qwen2ForCausalLM", True)], ids=["llama", "qwen2-tied"]
)
def test_the_dense_stack_is_the_layers_bit_for_bit(tmp_path: Path, dtype: str, architecture: str, tied: bool) -> None:
    if not packable(torch.empty(2, 2, dtype=getattr(torch, dtype))):
        pytest.skip(f"oneDNN does not run {dtype} on this CPU")
    path = make_tiny_model(tmp_path / "m", architecture=architecture, tie_word_embeddings=tied, hidden_size=128)
    args = EngineArgs(model=str(path), dtype=dtype, max_model_len=256, num_threads=2, enable_prefix_caching=False)
    engine = SyncEngine.from_engine_args(args)
    model = engine.core.model
    assert model is not None
    stack = model.decode_stack
    if stack is None:  # oneDNN laid the weights out otherwise on this CPU: the layers run
        assert "avx512f" not in cpu_native._cpu_flags(), "on AVX-512 oneDNN's layout is the kernel's"
        pytest.skip("no packed weight the few-rows kernel reads")
    assert isinstance(stack, DenseDecodeStack)
    # Three requests of different lengths (decode steps of 3, 2, then 1 row) and then six (6
    # rows: the layers, until fewer than five are left).
    for n in (3, 6):
        prompts = [{"prompt_token_ids": [3 + (7 * i + j) % 200 for j in range(5 + 9 * i)]} for i in range(n)]
        params = [SamplingParams(max_tokens=6 + 4 * i, ignore_eos=True, temperature=0.0, logprobs=2) for i in range(n)]
        spy = stack_against_layers(engine, prompts, params)
        assert spy.calls and max(spy.rows()) <= cpu_native.FEW_ROWS
