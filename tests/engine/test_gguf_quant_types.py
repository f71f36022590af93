"""GGUF block types beyond Q4_0/Q4_1/Q8_0 and the K-quants: Q5_0 and Q5_1 kept in blocks the CPU
kernels read (their 5-bit codes as 8-bit codes, exactly), any other type dequantized with a log
line naming it."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from tiny_gguf import write_tiny_gguf
from tinymodel import make_tiny_model

from triollm import LLM, SamplingParams
from triollm.engine.execution.layers.quantized import read_gguf_quantized
from triollm.engine.loading.gguf_import import import_gguf
from triollm.kernels.quant import QuantWeight

Q5 = (gguf.GGMLQuantizationType.Q5_0, gguf.GGMLQuantizationType.Q5_1)


@pytest.mark.parametrize("kind", Q5)
def test_q5_blocks_decode_as_gguf(kind: gguf.GGMLQuantizationType) -> None:
    w = np.random.default_rng(5).standard_normal((48, 256)).astype(np.float32) * 0.3
    raw = gguf.quants.quantize(w, kind)
    kept = QuantWeight.from_ggml(raw, int(kind), (48, 256))
    assert kept.bits == 8 and int(kept.codes().max()) <= 31
    torch.testing.assert_close(kept.dequantize(), torch.from_numpy(gguf.quants.dequantize(raw, kind)), rtol=0, atol=0)


def test_q5_gguf_runs_from_its_blocks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hf_dir = make_tiny_model(tmp_path / "hf", num_heads=4, num_kv_heads=2)
    types = {f"blk.{i}.{name}.weight": Q5[(i + j) % 2] for i in range(2) for j, name in enumerate(
        ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"])}
    path = tmp_path / "q5.gguf"
    write_tiny_gguf(hf_dir, path, types=types)
    monkeypatch.setenv("TRIOLLM_CACHE_DIR", str(tmp_path / "cache"))
    llm = LLM(model=str(path), max_model_len=64, quantization="gguf")
    try:
        (out,) = llm.generate(["The capital of France is"], SamplingParams(temperature=0.0, max_tokens=8))
    finally:
        llm.shutdown()
    assert len(out.outputs[0].token_ids) > 0
    (imported,) = (tmp_path / "cache").iterdir()
    kept, dense = read_gguf_quantized(imported), load_file(str(imported / "model.safetensors"))
    assert sorted(kept) == sorted(n for n in dense if ".layers." in n and n.endswith("proj.weight"))
    for name, weight in kept.items():
        assert weight.bits == 8
        torch.testing.assert_close(weight.dequantize(), dense[name], rtol=0, atol=1e-6, msg=name)


def test_other_types_are_dequantized_with_a_log_line(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    hf_dir = make_tiny_model(tmp_path / "hf", hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2)
    path = tmp_path / "tq.gguf"
    write_tiny_gguf(hf_dir, path, types={"blk.0.ffn_up.weight": gguf.GGMLQuantizationType.TQ2_0})
    with caplog.at_level(logging.INFO, logger="triollm"):
        import_gguf(path, tmp_path / "out")
    assert "tensors of type TQ2_0 are dequantized to float32" in caplog.text
    assert "model.layers.0.mlp.up_proj.weight" in load_file(str(tmp_path / "out" / "model.safetensors"))
