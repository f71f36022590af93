"""GGUF K-quants kept quantized (kernels/kquants.py): decoded blocks against gguf's own
dequantizer (exact where the fp16 scales are, within the stated bounds otherwise), the quantized
kernel over them, and a tiny `Q4_K_M`-like GGUF (Q4_K, Q5_K, Q6_K and Q8_0 tensors, fused
projections of mixed widths) imported and run through the engine against its dense import."""

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
from kquant_ref import KQUANTS, quantize_kquant
from safetensors.torch import load_file
from test_quant import _perplexity
from tiny_gguf import write_tiny_gguf
from tinymodel import make_tiny_model

from triollm.engine.config import EngineArgs
from triollm.engine.loading.model_files import resolve_model
from triollm.kernels import cpu_native
from triollm.kernels.quant import (
    QUANT_GGML_TYPES,
    PackedWeight,
    QuantWeight,
    packed_linear,
    reference_linear,
)

Q4_K, Q5_K, Q6_K, Q8_0 = (GGMLQuantizationType[n] for n in ("Q4_K", "Q5_K", "Q6_K", "Q8_0"))
U16 = 2.0**-11  # fp16's unit roundoff
SUBNORMAL = 2.0**-25  # half of fp16's smallest spacing


def _random_blocks(
    rng: np.random.Generator, kind: GGMLQuantizationType, n: int, k: int, scales: np.ndarray
) -> np.ndarray:
    """Every byte random (all code, scale and high-bit patterns), the fp16 super-block scales
    (d, and dmin for Q4_K/Q5_K) drawn from `scales`: the raw uint8 `[n, k/256 * bytes]`."""
    size = GGML_QUANT_SIZES[kind][1]
    raw = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    fields = [slice(208, 210)] if kind == Q6_K else [slice(0, 2), slice(2, 4)]
    for field in fields:
        values = rng.choice(scales, (n, k // 256)).astype(np.float16)
        raw[..., field] = values[..., None].view(np.uint8)
    return raw.reshape(n, -1)


def _gguf(raw: np.ndarray, kind: GGMLQuantizationType, n: int, k: int) -> np.ndarray:
    return dequantize(raw, kind).reshape(n, k)


def test_the_k_quants_are_kept_quantized() -> None:
    assert {int(Q4_K), int(Q5_K), int(Q6_K)} <= QUANT_GGML_TYPES


@pytest.mark.parametrize("kind", [Q4_K, Q5_K], ids=lambda t: t.name)
def test_q4_k_and_q5_k_decode_to_ggufs_values(kind: GGMLQuantizationType) -> None:
    """Power-of-two super-block scales make every d * sc and dmin * mn exact in fp16: the
    decoded weight is then gguf's to the bit, over random bytes (every layout bit exercised)."""
    rng = np.random.default_rng(1)
    n, k = 6, 768
    raw = _random_blocks(rng, kind, n, k, np.array([2.0**-e * s for e in range(4, 9) for s in (1, -1)]))
    w = QuantWeight.from_ggml(raw, int(kind), (n, k))
    assert (w.bits, w.q.shape) == ((4, (n, k // 2)) if kind == Q4_K else (8, (n, k)))
    assert int(w.codes().max()) == (15 if kind == Q4_K else 31)
    np.testing.assert_array_equal(w.dequantize().numpy(), _gguf(raw, kind, n, k))


@pytest.mark.parametrize("kind", [Q4_K, Q5_K], ids=lambda t: t.name)
def test_q4_k_and_q5_k_round_their_scales_once(kind: GGMLQuantizationType) -> None:
    """Any fp16 super-block scales (normal and subnormal products): per weight the error is
    within 2^-11 * (q |d| + |m|) + 2^-25 (q + 1) (the one fp16 rounding of d * sc and dmin * mn),
    plus the fp32 rounding of both sides. The codes are the file's, exactly."""
    rng = np.random.default_rng(2)
    n, k = 8, 512
    scales = np.concatenate([rng.uniform(1e-4, 0.05, 64), -rng.uniform(1e-4, 0.05, 8), [1e-7, 3e-6]])
    raw = _random_blocks(rng, kind, n, k, scales)
    w = QuantWeight.from_ggml(raw, int(kind), (n, k))
    ref = _gguf(raw, kind, n, k).astype(np.float64)
    q = w.codes().double().numpy()
    d, m = (t.double().repeat_interleave(32, dim=1).numpy() for t in (w.d, w.m))
    bound = U16 * (1 + U16) * (q * np.abs(d) + np.abs(m)) + SUBNORMAL * (q + 1) + 2.0**-23 * np.abs(ref)
    err = np.abs(w.dequantize().double().numpy() - ref)
    assert (err <= bound).all(), float((err / bound).max())
    dense = rng.standard_normal((n, k)).astype(np.float32)
    raw, codes = quantize_kquant(dense, kind)
    assert torch.equal(QuantWeight.from_ggml(raw, int(kind), (n, k)).codes(), torch.from_numpy(codes).int())


def test_q6_k_is_requantized_within_half_an_8_bit_step() -> None:
    """Q6_K's 16-weight sub-blocks requantized per 32 (symmetric, 8-bit): D = amax / 127 rounded
    up to fp16, so no code clips and |ours - exact| <= D / 2 <= amax / 254 (1 + 2^-10) + 2^-25,
    tiny (subnormal) scales and all-zero blocks included."""
    rng = np.random.default_rng(3)
    n, k = 8, 512
    raw = _random_blocks(rng, Q6_K, n, k, np.concatenate([rng.uniform(1e-4, 0.02, 32), [-3e-3, 2e-7, 5e-6]]))
    raw.reshape(n, k // 256, 210)[0, 1, 192:208] = 0  # every sub-block scale zero: a zero super-block
    w = QuantWeight.from_ggml(raw, int(Q6_K), (n, k))
    assert w.bits == 8 and w.q.shape == (n, k)
    ref = _gguf(raw, Q6_K, n, k).astype(np.float64).reshape(n, k // 32, 32)
    amax = np.abs(ref).max(-1)
    big_d = w.d.double().numpy()
    assert (big_d >= amax / 127).all() and (big_d <= amax / 127 * (1 + 2 * U16) + 2 * SUBNORMAL).all()
    assert torch.equal(w.m, (w.d.float() * -128).half())
    assert int(w.codes().min()) >= 1 and int(w.codes().max()) <= 255
    err = np.abs(w.dequantize().double().numpy().reshape(n, k // 32, 32) - ref)
    assert (err <= big_d[..., None] / 2 * (1 + 1e-6)).all()
    assert (w.dequantize()[0, 256:512] == 0).all()
    assert (big_d < 2.0**-14).any(), "a subnormal scale"


@pytest.mark.parametrize("kind", KQUANTS, ids=lambda t: t.name)
def test_the_kernel_over_k_quants_is_the_dense_product(kind: GGMLQuantizationType) -> None:
    """The quantized linear over decoded K-quant blocks: the kernel's integer arithmetic (where
    the native kernels are built), and within the int8 activation rounding of the product with
    gguf's dequantized weight."""
    rng = np.random.default_rng(4)
    n, k = 37, 512
    raw, _ = quantize_kquant(rng.standard_normal((n, k)).astype(np.float32) * 0.05, kind)
    w = QuantWeight.from_ggml(raw, int(kind), (n, k))
    x = torch.from_numpy(rng.standard_normal((3, k)).astype(np.float32))
    got = packed_linear(x, PackedWeight.pack(w))
    if cpu_native.available():
        torch.testing.assert_close(got, reference_linear(x, w), rtol=1e-5, atol=1e-4 * math.sqrt(k))
    dense = x @ torch.from_numpy(_gguf(raw, kind, n, k)).T
    assert float((got - dense).norm() / dense.norm()) < 0.01


def test_malformed_k_quant_tensors_are_refused() -> None:
    raw, _ = quantize_kquant(np.ones((2, 256), np.float32), Q4_K)
    with pytest.raises(ValueError, match="row width 128 is not a multiple of 256"):
        QuantWeight.from_ggml(raw, int(Q4_K), (4, 128))
    with pytest.raises(ValueError, match="288 bytes of Q4_K do not hold a \\[3, 256\\] tensor"):
        QuantWeight.from_ggml(raw, int(Q4_K), (3, 256))
    with pytest.raises(ValueError, match="GGML type 16 is not kept quantized .*Q4_K, Q5_K, Q6_K, IQ4_NL, IQ4_XS are"):
        QuantWeight.from_ggml(raw, 16, (2, 256))  # IQ2_XXS
    huge = raw.reshape(2, 144).copy()
    huge[:, 0:2] = np.full((2, 1), 60000.0, np.float16).view(np.uint8)  # d * sc beyond fp16
    with pytest.raises(ValueError, match="Q4_K block scales outside float16's range"):
        QuantWeight.from_ggml(huge, int(Q4_K), (2, 256))


# ------------------------------------------------------------------------ a Q4_K_M-like model

# llama.cpp's Q4_K_M: mostly Q4_K, Q6_K for the output and some attn_v / ffn_down; here also a
# Q5_K attn_v and a Q8_0 ffn_down, so q|k|v fuse 4-bit with 8-bit parts in both layers.
_LAYER_TYPES = [(Q6_K, Q6_K), (Q5_K, Q8_0)]
MIX = {"token_embd.weight": Q4_K, "output.weight": Q6_K} | {
    f"blk.{i}.{name}": kind
    for i, (v, down) in enumerate(_LAYER_TYPES)
    for name, kind in [
        ("attn_q.weight", Q4_K), ("attn_k.weight", Q4_K), ("attn_v.weight", v), ("attn_output.weight", Q4_K),
        ("ffn_gate.weight", Q4_K), ("ffn_up.weight", Q4_K), ("ffn_down.weight", down),
    ]
}  # fmt: skip
_HF = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
       "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
       "ffn_down": "mlp.down_proj"}  # fmt: skip


def _hf_name(gguf_name: str) -> str:
    if gguf_name == "token_embd.weight":
        return "model.embed_tokens.weight"
    if gguf_name == "output.weight":
        return "lm_head.weight"
    _, layer, kind, _ = gguf_name.split(".")
    return f"model.layers.{layer}.{_HF[kind]}.weight"


@pytest.fixture(scope="module")
def mixed_gguf(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """(the .gguf, its import): hidden and intermediate 256, the K-quants' super-block width."""
    root = tmp_path_factory.mktemp("q4-k-m")
    hf_dir = make_tiny_model(root / "hf", hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2)
    path = root / "tiny-q4_k_m.gguf"
    write_tiny_gguf(hf_dir, path, types=MIX)
    return path, resolve_model(str(path), root / "cache")


def test_a_mixed_gguf_imports_every_block_tensor_quantized(mixed_gguf: tuple[Path, Path]) -> None:
    """Each tensor of the mix in the quantized file, its dequantization the dense import's (gguf's
    own, rows un-permuted alike) within its type's bound; q and k widened to 8-bit codes where
    their v is 8-bit (exactly: the same error as unwidened), gate and up left at 4."""
    from triollm.engine.execution.layers.quantized import read_gguf_quantized

    _, out = mixed_gguf
    quant, dense = read_gguf_quantized(out), load_file(str(out / "model.safetensors"))
    assert quant.keys() == {_hf_name(n) for n in MIX}
    for gguf_name, kind in MIX.items():
        name = _hf_name(gguf_name)
        w = quant[name]
        widened = ".q_proj." in name or ".k_proj." in name
        assert w.bits == (4 if kind == Q4_K and not widened else 8), name
        err = (w.dequantize().double() - dense[name].double()).abs().view(w.shape[0], -1, 32)
        scale = w.d.double().abs().unsqueeze(-1)
        if kind == Q6_K:
            bound = scale / 2 * (1 + 1e-6)
        elif kind == Q8_0:
            bound = torch.zeros_like(scale)
        else:  # the fp16 rounding of the scales: 2^-11 (31 |d| + |m|), plus fp32's
            bound = U16 * 1.001 * (31 * scale + w.m.double().abs().unsqueeze(-1)) + 32 * SUBNORMAL + 1e-7
        assert (err <= bound).all(), name


@pytest.fixture(scope="module")
def engines(mixed_gguf: tuple[Path, Path]) -> Any:
    from triollm.engine.sync_engine import SyncEngine

    path, out = mixed_gguf
    args = EngineArgs(model=str(path), cache_dir=str(out.parent), max_model_len=256, num_threads=1, quantization="gguf")
    return SyncEngine.from_engine_args(args), SyncEngine.from_engine_args(
        dataclasses.replace(args, quantization="none")
    )


def test_a_mixed_gguf_runs_quantized_near_its_dense_import(engines: Any) -> None:
    """One model over 4- and 8-bit layers (fused q|k|v of mixed parts, an 8-bit head). Greedy
    tokens of a random model are not a stable yardstick (near-ties: even an all-Q8_0 file
    departs from its dense import within a few tokens, by the int8 activation rounding), so
    the bound is the perplexity, on the dense model's own greedy continuations: the ratio within
    10% (measured 1.03, as for an all-Q8_0 file; a wrong code order or scale gives orders of
    magnitude)."""
    from triollm.engine.execution.layers.quantized import QuantLinear
    from triollm.engine.sampling_params import SamplingParams

    quant, dense = engines
    bits = {n: m.bits for n, m in quant.core.model.named_modules() if isinstance(m, QuantLinear)}
    for i in range(2):
        assert {k.removeprefix(f"layers.{i}."): b for k, b in bits.items() if k.startswith(f"layers.{i}.")} == {
            "self_attn.qkv_proj": 8, "self_attn.o_proj": 4, "mlp.gate_up_proj": 4, "mlp.down_proj": 8,
        }  # fmt: skip
    assert bits["lm_head"] == 8
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompts = [{"prompt_token_ids": [s, s + 1]} for s in (40, 100, 200)]
    runs = dense.generate(prompts, greedy)
    ours = quant.generate(prompts, greedy)
    assert all(len(o.outputs[0].token_ids) == 24 for o in ours)
    texts = [[*p["prompt_token_ids"], *r.outputs[0].token_ids] for p, r in zip(prompts, runs, strict=True)]
    log_ratio = sum(math.log(_perplexity(quant, t) / _perplexity(dense, t)) for t in texts) / len(texts)
    assert abs(log_ratio) < math.log(1.1), math.exp(log_ratio)
