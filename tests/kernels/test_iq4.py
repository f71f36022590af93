"""IQ4_NL and IQ4_XS kept 4-bit (kernels/kquants.py, kernels/csrc/quant_linear.cpp `kIq4`): the
file's nibbles stored as they are, the kernel's byte-shuffle lookup against the plain loops on
every compiled path and against the same weight widened to 8-bit codes (the form IQ4 had before:
the same bits, half the bytes), the torch reference and gguf's dense product; and an all-IQ4 GGUF
run through the engine with every projection in 4-bit IQ4 blocks."""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from kquant_ref import quantize_low_bit
from stack_spy import stack_against_layers
from test_quant import _perplexity
from tiny_gguf import write_tiny_gguf
from tinymodel import make_tiny_model

from triollm.engine.config import EngineArgs
from triollm.engine.loading.model_files import resolve_model
from triollm.kernels import cpu_native
from triollm.kernels.quant import IQ4, PackedWeight, QuantWeight, packed_linear, reference_linear

IQ4_NL, IQ4_XS = GGMLQuantizationType.IQ4_NL, GGMLQuantizationType.IQ4_XS
needs_native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels unavailable")
# Batches above the kernel's 8 rows per pass, partial groups of 16 outputs, odd block counts.
_SHAPES = [(1, 1, 256), (1, 1536, 512), (3, 7, 256), (9, 33, 768), (17, 5, 256), (520, 33, 256)]  # the last: AMX's


def _case(kind: GGMLQuantizationType, m: int, n: int, k: int) -> tuple[np.ndarray, QuantWeight, torch.Tensor]:
    rng = np.random.default_rng(m * 1000 + n + k + int(kind))
    raw = quantize_low_bit(rng.standard_normal((n, k)).astype(np.float32) * 0.05, kind)
    x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)) * 3
    x[0, :5] = 0.0  # a partly zero block
    x[-1, 32:64] = 0.0  # a whole zero block: scale 0
    return raw, QuantWeight.from_ggml(raw, int(kind), (n, k)), x


@pytest.mark.parametrize("kind", [IQ4_NL, IQ4_XS], ids=lambda t: t.name)
def test_iq4_keeps_the_files_nibbles(kind: GGMLQuantizationType) -> None:
    """4.5 bits a weight in memory (nibbles, fp16 d and m per 32): the stored bytes are the
    file's index bytes, and the packed layout holds 256 bytes per block of 16 rows, as Q4's."""
    raw, w, _ = _case(kind, 1, 16, 512)
    assert (w.bits, w.q.shape) == (IQ4, (16, 256))
    per, size, at = (32, 18, 2) if kind == IQ4_NL else (256, 136, 8)
    indices = raw.reshape(16, 512 // per, size)[..., at:]
    assert np.array_equal(w.q.numpy(), indices.reshape(16, 256))
    packed = PackedWeight.pack(w)
    assert packed.qp.shape == (1, 16, 256) and packed.bits == IQ4
    assert torch.equal(packed.dequantize(), w.dequantize())
    idx = torch.tensor([15, 0, 7, 7])
    assert torch.equal(packed.dequantize_rows(idx, torch.bfloat16), w.dequantize()[idx].bfloat16())
    if cpu_native.available():  # the native lookup (QuantEmbedding's): the same values
        native = torch.ops.triollm_cpu.packed_rows(packed.qp, packed.dp, packed.mp, packed.bits, idx)
        assert torch.equal(native, packed.dequantize_rows(idx))


@needs_native
@pytest.mark.parametrize("kind", [IQ4_NL, IQ4_XS], ids=lambda t: t.name)
def test_the_lookup_kernel_gives_the_8_bit_forms_bits_on_every_path(kind: GGMLQuantizationType) -> None:
    """Per path this CPU runs (a path it lacks runs on a machine that has it), the 4-bit IQ4
    weight gives the bits of the plain loops and of the same weight widened to 8-bit codes
    (level + 128), at every shape, and a row the same bits alone as in its batch."""
    for m, n, k in _SHAPES:
        _, w, x = _case(kind, m, n, k)
        packed, wide = PackedWeight.pack(w), PackedWeight.pack(w.widened())
        scalar = packed_linear(x, packed, isa="scalar")
        for isa in cpu_native.supported_isas():
            got = packed_linear(x, packed, isa=isa)
            assert torch.equal(got, scalar), (isa, m, n, k)
            assert torch.equal(got, packed_linear(x, wide, isa=isa)), (isa, m, n, k)
            for i in range(0, m, 4):
                assert torch.equal(got[i : i + 1], packed_linear(x[i : i + 1], packed, isa=isa)), (isa, m, n, k, i)


@pytest.mark.parametrize("kind", [IQ4_NL, IQ4_XS], ids=lambda t: t.name)
def test_the_lookup_kernel_is_the_dense_product(kind: GGMLQuantizationType) -> None:
    """Against the torch reference (exact integer block sums: the fp32 accumulation order only)
    where the native kernels are built, and within the int8 activation rounding of the product
    with gguf's own dequantized weight everywhere (without them: the dense fallback)."""
    for m, n, k in _SHAPES:
        raw, w, x = _case(kind, m, n, k)
        got = packed_linear(x, PackedWeight.pack(w))
        if cpu_native.available():
            torch.testing.assert_close(got, reference_linear(x, w), rtol=1e-5, atol=1e-4 * math.sqrt(k))
        dense = x @ torch.from_numpy(dequantize(raw, kind).reshape(n, k)).T
        assert float((got - dense).norm() / dense.norm()) < 0.01, (m, n, k)


@needs_native
def test_a_bad_code_format_is_refused_by_the_kernel() -> None:
    _, w, x = _case(IQ4_NL, 1, 16, 256)
    packed = PackedWeight.pack(w)
    with pytest.raises(RuntimeError, match="bits must be 4, 8 or -4 \\(IQ4 indices\\), got 5"):
        packed_linear(x, dataclasses.replace(packed, bits=5))
    with pytest.raises(RuntimeError, match="the packed weight does not match"):
        packed_linear(x, dataclasses.replace(packed, bits=8))  # 256 bytes a block: not 8-bit codes


# ------------------------------------------------------------------------ an all-IQ4 model

_NAMES = ["attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"]
# llama.cpp's IQ4_XS recipe with IQ4_NL in layer 1 (both formats through the fused projections).
MIX = {"token_embd.weight": IQ4_XS, "output.weight": IQ4_NL} | {
    f"blk.{i}.{name}.weight": (IQ4_XS, IQ4_NL)[i] for i in range(2) for name in _NAMES
}


@pytest.fixture(scope="module")
def engines(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from triollm.engine.sync_engine import SyncEngine

    root = tmp_path_factory.mktemp("iq4")
    hf_dir = make_tiny_model(root / "hf", hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=2)
    path = root / "tiny-iq4.gguf"
    write_tiny_gguf(hf_dir, path, types=MIX)
    out = resolve_model(str(path), root / "cache")
    # No prefix caching: a rerun's prefills are then the first run's (the native-stack test).
    args = EngineArgs(
        model=str(path),
        cache_dir=str(out.parent),
        max_model_len=256,
        num_threads=1,
        quantization="gguf",
        enable_prefix_caching=False,
    )  # fmt: skip  (no cache hits: a rerun's prefills are the first run's)
    return SyncEngine.from_engine_args(args), SyncEngine.from_engine_args(
        dataclasses.replace(args, quantization="none")
    )


def test_an_iq4_gguf_runs_on_4_bit_iq4_blocks_near_its_dense_import(engines: Any) -> None:
    """Every projection and the head hold IQ4 nibbles (256 bytes per block of 16 rows, half the
    8-bit form's), and the perplexity of the dense import's greedy continuations is within 10% of
    the dense model's (a wrong lookup table or nibble order gives orders of magnitude)."""
    from triollm.engine.execution.layers.quantized import QuantLinear
    from triollm.engine.sampling_params import SamplingParams

    quant, dense = engines
    layers = {n: m for n, m in quant.core.model.named_modules() if isinstance(m, QuantLinear)}
    assert len(layers) == 2 * 4 + 1
    assert all(m.bits == IQ4 and m.qp.shape[-1] == 256 for m in layers.values()), {n: m.bits for n, m in layers.items()}
    greedy = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.0)
    prompts = [{"prompt_token_ids": [s, s + 1]} for s in (40, 100, 200)]
    runs = dense.generate(prompts, greedy)
    assert all(len(o.outputs[0].token_ids) == 24 for o in quant.generate(prompts, greedy))
    texts = [[*p["prompt_token_ids"], *r.outputs[0].token_ids] for p, r in zip(prompts, runs, strict=True)]
    log_ratio = sum(math.log(_perplexity(quant, t) / _perplexity(dense, t)) for t in texts) / len(texts)
    assert abs(log_ratio) < math.log(1.1), math.exp(log_ratio)


def test_the_iq4_model_decodes_in_the_native_stack_as_layer_by_layer(engines: Any) -> None:
    """The native decoder stack (kernels/csrc/decoder.cpp) reads the IQ4 format too: its tokens
    and logprobs are the layer-by-layer path's, to the bit."""
    from triollm.engine.sampling_params import SamplingParams

    quant, _ = engines
    model = quant.core.model
    if model.decode_stack is None:
        pytest.skip("no native decoder stack here (native kernels unavailable)")
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 17)]
    params = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.0, logprobs=2)
    assert stack_against_layers(quant, prompts, params).calls
