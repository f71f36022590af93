"""GGUF's low-bit types kept quantized (kernels/kquants.py): Q2_K and Q3_K decoded into the kernels'
8-bit block form, IQ4_NL and IQ4_XS kept as 4-bit indices (tests/kernels/test_iq4.py: their kernel),
against gguf's own dequantizer over random bytes (exact where
the module says so, within the stated bound elsewhere), the quantized kernel over them, and a
tiny GGUF of those types imported with every block tensor kept and run near its dense import."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize
from kquant_ref import LOW_BIT, quantize_low_bit
from safetensors.torch import load_file
from test_quant import _perplexity
from tiny_gguf import write_tiny_gguf
from tinymodel import make_tiny_model

from triollm.engine.config import EngineArgs
from triollm.engine.loading.model_files import resolve_model
from triollm.kernels import cpu_native
from triollm.kernels.quant import IQ4, QUANT_GGML_TYPES, PackedWeight, QuantWeight, packed_linear, reference_linear

Q2_K, Q3_K, IQ4_NL, IQ4_XS = LOW_BIT
U16 = 2.0**-11  # fp16's unit roundoff
# Where each type keeps its fp16 super-block scale(s): byte offsets in a block.
_SCALE_FIELDS = {Q2_K: (80, 82), Q3_K: (108,), IQ4_NL: (0,), IQ4_XS: (0,)}


def _random_blocks(rng: np.random.Generator, kind: GGMLQuantizationType, n: int, k: int, scales: Any) -> np.ndarray:
    """Every byte random (all code, scale and high-bit patterns) but the fp16 scales, drawn from
    `scales`: the raw uint8 `[n, k/per * bytes]`."""
    per, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, (n, k // per, size), dtype=np.uint8)
    for at in _SCALE_FIELDS[kind]:
        raw[..., at : at + 2] = rng.choice(scales, (n, k // per)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def _gguf(raw: np.ndarray, kind: GGMLQuantizationType, n: int, k: int) -> np.ndarray:
    return dequantize(raw, kind).reshape(n, k).astype(np.float64)


def test_the_low_bit_types_are_kept_quantized() -> None:
    assert {int(kind) for kind in LOW_BIT} <= QUANT_GGML_TYPES


@pytest.mark.parametrize("kind", [IQ4_NL, IQ4_XS], ids=lambda t: t.name)
def test_iq4_decodes_to_ggufs_values(kind: GGMLQuantizationType) -> None:
    """IQ4's indices kept, read as the 8-bit codes level + 128, m = -128 d: IQ4_NL to the bit with
    any fp16 scale; IQ4_XS to the bit where d * (ls - 32) is exact in fp16 (power-of-two d), else
    within the one fp16 rounding of that product (2^-11 of it per weight, 127 levels at most)."""
    rng = np.random.default_rng(11)
    n, k = 6, 512
    exact = np.array([2.0**-e * s for e in range(5, 12) for s in (1, -1)])
    raw = _random_blocks(rng, kind, n, k, exact if kind == IQ4_XS else rng.uniform(-0.05, 0.05, 64))
    w = QuantWeight.from_ggml(raw, int(kind), (n, k))
    assert (w.bits, w.q.shape) == (IQ4, (n, k // 2))
    assert torch.equal(w.m, (w.d.float() * -128).half())
    np.testing.assert_array_equal(w.dequantize().double().numpy(), _gguf(raw, kind, n, k))
    if kind == IQ4_XS:
        raw = _random_blocks(rng, kind, n, k, np.concatenate([rng.uniform(1e-4, 0.05, 64), [-3e-3, 2e-7]]))
        w = QuantWeight.from_ggml(raw, int(kind), (n, k))
        ref = _gguf(raw, kind, n, k)
        d = w.d.double().abs().repeat_interleave(32, dim=1).numpy()
        err = np.abs(w.dequantize().double().numpy() - ref)
        assert (err <= 127 * (U16 * d * 1.001 + 2.0**-25) + 1e-12).all()
        assert (err > 0).any(), "the rounding of d * (ls - 32) is exercised"


def test_q3_k_is_exact_but_where_a_block_holds_128() -> None:
    """Q3_K's integer s * c as an 8-bit code with the file's d: every block is gguf's to the bit but
    those holding s * c = 128 (scale -32, code -4), which are requantized within half their step."""
    rng = np.random.default_rng(12)
    n, k = 8, 512
    raw = _random_blocks(rng, Q3_K, n, k, rng.uniform(-0.05, 0.05, 64))
    w = QuantWeight.from_ggml(raw, int(Q3_K), (n, k))
    ref = _gguf(raw, Q3_K, n, k).reshape(n, k // 32, 32)
    got = w.dequantize().double().numpy().reshape(n, k // 32, 32)
    d_bytes = np.ascontiguousarray(raw.reshape(n, k // 256, 110)[..., 108:110])
    d_file = np.repeat(d_bytes.view(np.float16)[..., 0], 8, -1)
    kept = w.d.numpy() == d_file  # the file's scale: the block is exact
    assert kept.mean() > 0.5 and (~kept).any(), "both cases exercised"
    np.testing.assert_array_equal(got[kept], ref[kept])
    step = w.d.double().numpy()[~kept]
    assert (np.abs(got[~kept] - ref[~kept]) <= step[:, None] / 2 * (1 + 1e-6)).all()


def test_q2_k_is_requantized_within_half_an_8_bit_step() -> None:
    rng = np.random.default_rng(13)
    n, k = 8, 512
    raw = _random_blocks(rng, Q2_K, n, k, np.concatenate([rng.uniform(1e-4, 0.05, 32), [-2e-3, 3e-7]]))
    w = QuantWeight.from_ggml(raw, int(Q2_K), (n, k))
    assert w.bits == 8 and torch.equal(w.m, (w.d.float() * -128).half())
    ref = _gguf(raw, Q2_K, n, k).reshape(n, k // 32, 32)
    step = w.d.double().numpy()
    assert (step >= np.abs(ref).max(-1) / 127).all()
    err = np.abs(w.dequantize().double().numpy().reshape(n, k // 32, 32) - ref)
    assert (err <= step[..., None] / 2 * 1.000001).all()


@pytest.mark.parametrize("kind", LOW_BIT, ids=lambda t: t.name)
def test_the_kernel_over_low_bit_blocks_is_the_dense_product(kind: GGMLQuantizationType) -> None:
    rng = np.random.default_rng(14)
    n, k = 37, 512
    raw = quantize_low_bit(rng.standard_normal((n, k)).astype(np.float32) * 0.05, kind)
    w = QuantWeight.from_ggml(raw, int(kind), (n, k))
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    got = packed_linear(x, PackedWeight.pack(w))
    if cpu_native.available():
        torch.testing.assert_close(got, reference_linear(x, w), rtol=1e-5, atol=1e-4 * math.sqrt(k))
    dense = x @ torch.from_numpy(_gguf(raw, kind, n, k)).float().T
    assert float((got - dense).norm() / dense.norm()) < 0.01


def test_malformed_low_bit_tensors_are_refused() -> None:
    raw = quantize_low_bit(np.ones((2, 64), np.float32), IQ4_NL)
    with pytest.raises(ValueError, match="IQ4_NL tensor's row width 48 is not a multiple of 32"):
        QuantWeight.from_ggml(raw, int(IQ4_NL), (2, 48))
    with pytest.raises(ValueError, match="72 bytes of IQ4_NL do not hold a \\[3, 64\\] tensor"):
        QuantWeight.from_ggml(raw, int(IQ4_NL), (3, 64))


# ------------------------------------------------------------------------ a low-bit mixed model

# llama.cpp's Q2_K / Q3_K_M / IQ4_XS recipes mix these with Q4_K-Q6_K; here each projection of the
# two layers takes one of the four types, the embedding IQ4_NL and the head Q3_K.
_NAMES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
MIX = {"token_embd.weight": IQ4_NL, "output.weight": Q3_K} | {
    f"blk.{i}.{name}.weight": LOW_BIT[(i + j) % 4] for i in range(2) for j, name in enumerate(_NAMES)
}


@pytest.fixture(scope="module")
def low_bit_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("low-bit")
    hf_dir = make_tiny_model(root / "hf", hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2)
    path = root / "tiny-low-bit.gguf"
    write_tiny_gguf(hf_dir, path, types=MIX)
    return path, resolve_model(str(path), root / "cache")


def test_a_low_bit_gguf_keeps_every_block_tensor(low_bit_gguf: tuple[Path, Path]) -> None:
    """Every projection of the file kept in blocks (none dequantized to fp32): IQ4 alone as 4-bit
    indices, fused with other types (and Q2_K, Q3_K) as 8-bit codes; each within half an 8-bit
    step of the dense import (gguf's own dequantization)."""
    from triollm.engine.execution.layers.quantized import read_gguf_quantized

    _, out = low_bit_gguf
    quant, dense = read_gguf_quantized(out), load_file(str(out / "model.safetensors"))
    assert len(quant) == len(MIX)
    layers = ("0.self_attn.o_proj", "0.mlp.down_proj", "1.mlp.down_proj")
    alone = {"model.embed_tokens.weight"} | {f"model.layers.{p}.weight" for p in layers}
    assert {n for n, w in quant.items() if w.bits == IQ4} == alone
    assert all(w.bits == 8 for n, w in quant.items() if n not in alone)
    for name, w in quant.items():
        err = (w.dequantize().double() - dense[name].double()).abs().view(w.shape[0], -1, 32)
        assert (err <= w.d.double().abs().unsqueeze(-1) / 2 * 1.000001 + 1e-7).all(), name


@pytest.fixture(scope="module")
def engines(low_bit_gguf: tuple[Path, Path]) -> Any:
    from triollm.engine.sync_engine import SyncEngine

    path, out = low_bit_gguf
    args = EngineArgs(model=str(path), cache_dir=str(out.parent), max_model_len=256, num_threads=1, quantization="gguf")
    return SyncEngine.from_engine_args(args), SyncEngine.from_engine_args(
        dataclasses.replace(args, quantization="none")
    )


def test_a_low_bit_gguf_runs_quantized_near_its_dense_import(engines: Any) -> None:
    """The perplexity of the dense import's own greedy continuations, kept vs dense: within 10%
    (as for the K-quant mix: the int8 activation rounding, and Q2_K's requantization)."""
    from triollm.engine.sampling_params import SamplingParams

    quant, dense = engines
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompts = [{"prompt_token_ids": [s, s + 1]} for s in (40, 100, 200)]
    runs = dense.generate(prompts, greedy)
    assert all(len(o.outputs[0].token_ids) == 24 for o in quant.generate(prompts, greedy))
    texts = [[*p["prompt_token_ids"], *r.outputs[0].token_ids] for p, r in zip(prompts, runs, strict=True)]
    log_ratio = sum(math.log(_perplexity(quant, t) / _perplexity(dense, t)) for t in texts) / len(texts)
    assert abs(log_ratio) < math.log(1.1), math.exp(log_ratio)
