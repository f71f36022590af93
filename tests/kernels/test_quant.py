"""Weight-only quantized linears (kernels/quant.py, kernels/csrc/quant_linear.cpp): the native
kernel against the integer reference (exact block sums), the GGML block formats against gguf's
own dequantizer, quantization of float weights, and the model paths (`quantization=`)."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from stack_spy import stack_against_layers

from triollm.engine.config import EngineArgs
from triollm.kernels import cpu_native
from triollm.kernels.quant import (
    PackedWeight,
    QuantWeight,
    packed_linear,
    quantize_activations,
    reference_linear,
)

needs_native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels unavailable")


# The last ones reach the AMX path where the CPU has it (4-bit codes from 32 rows; 8-bit from 512,
# or 64 in a head of 16,384+ outputs): a part-filled last tile of rows, a partial group of 16
# outputs, an odd block count (19: a pair of blocks in flight with one left over).
_SHAPES = [(1, 1, 32), (1, 1536, 576), (3, 7, 96), (9, 33, 608), (17, 5, 64), (64, 40, 160)]
_SHAPES += [(33, 17, 96), (70, 33, 608), (520, 33, 160), (65, 16400, 64)]


def _case(bits: int, m: int, n: int, k: int) -> tuple[QuantWeight, torch.Tensor]:
    gen = torch.Generator().manual_seed(m * 1000 + n + k + bits)
    w = QuantWeight.quantize(torch.randn(n, k, generator=gen), bits)
    x = torch.randn(m, k, generator=gen) * 3
    x[0, :5] = 0.0  # a partly zero block
    if k >= 64:
        x[-1, 32:64] = 0.0  # a whole zero block: scale 0
    return w, x


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize(("m", "n", "k"), _SHAPES)
def test_kernel_equals_the_integer_reference(bits: int, m: int, n: int, k: int) -> None:
    """Odd block counts (96, 608, 160: 3, 19, 5 blocks), batches above the kernel's 8 rows per
    pass, output counts that leave a partial group of 16, one output row: the integer block sums
    are exact, so only the fp32 accumulation order differs from the fp64 reference."""
    w, x = _case(bits, m, n, k)
    got = packed_linear(x, PackedWeight.pack(w), isa="scalar")
    ref = reference_linear(x, w)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-4 * math.sqrt(k))


@needs_native
@pytest.mark.parametrize("isa", [i for i in cpu_native.QUANT_ISAS if i != "scalar"])
@pytest.mark.parametrize("bits", [4, 8])
def test_every_compiled_path_gives_the_scalar_paths_bits(isa: str, bits: int) -> None:
    """Each vector path this CPU runs against the plain loops, bit for bit, on every shape (a
    path the CPU lacks is skipped here and runs on a machine that has it)."""
    if isa not in cpu_native.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")
    for m, n, k in _SHAPES:
        w, x = _case(bits, m, n, k)
        packed = PackedWeight.pack(w)
        assert torch.equal(packed_linear(x, packed, isa=isa), packed_linear(x, packed, isa="scalar")), (m, n, k)


@needs_native
@pytest.mark.parametrize("isa", cpu_native.QUANT_ISAS)
@pytest.mark.parametrize("bits", [4, 8])
def test_a_row_has_the_same_bits_at_every_batch_size(isa: str, bits: int) -> None:
    """Row i of a batch equals that row alone (batch 1 takes its own, faster code): plain and
    speculative decoding, whose verification feeds several rows per request, then give the same
    greedy tokens (engine/speculative/)."""
    if isa not in cpu_native.supported_isas():
        pytest.skip(f"this CPU cannot run the {isa} path")
    for m, n, k in _SHAPES:
        w, x = _case(bits, max(m, 2), n, k)
        packed = PackedWeight.pack(w)
        batch = packed_linear(x, packed, isa=isa)
        for i in range(x.shape[0]):
            assert torch.equal(batch[i : i + 1], packed_linear(x[i : i + 1], packed, isa=isa)), (m, n, k, i)


@needs_native
def test_the_kernel_dispatches_by_the_cpu_flags(monkeypatch: pytest.MonkeyPatch) -> None:
    """The best path per CPU flags (a table), the C++ and Python choices agree, and a path the
    CPU cannot run is a clear error, not an illegal instruction."""
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx2", "fma", "f16c"}
    table = {
        frozenset(vnni | {"amx_tile", "amx_int8", "amx_bf16"}): "amx",  # Sapphire Rapids and later
        frozenset(vnni | {"amx_tile", "amx_bf16"}): "avx512_vnni",  # no int8 tiles
        frozenset(vnni): "avx512_vnni",
        frozenset({"avx512f", "avx512bw", "avx512vl", "avx2", "fma", "f16c"}): "avx2",  # Skylake-X: no VNNI
        frozenset({"avx2", "fma", "f16c", "bmi2"}): "avx2",  # Zen 1-3, Haswell
        frozenset({"avx", "f16c"}): "scalar",  # Sandy/Ivy Bridge
        frozenset({"avx2", "f16c"}): "scalar",  # no FMA
        frozenset(): "scalar",
    }
    for flags, best in table.items():
        assert cpu_native.best_isa(set(flags)) == best, sorted(flags)
    assert torch.ops.triollm_cpu.quant_isa() == cpu_native.quant_isa()
    w, x = _case(4, 2, 16, 64)
    lacking = [i for i in cpu_native.QUANT_ISAS if i not in cpu_native.supported_isas()]
    for isa in lacking:
        with pytest.raises(RuntimeError, match=f"'{isa}' needs CPU features this CPU lacks; allowed here: "):
            packed_linear(x, PackedWeight.pack(w), isa=isa)
    with pytest.raises(RuntimeError, match="allowed: auto, amx, avx512_vnni, avx2, scalar"):
        packed_linear(x, PackedWeight.pack(w), isa="neon")
    cpu_native.quant_isa.cache_clear()
    try:
        monkeypatch.setenv(cpu_native.ISA_ENV, "scalar")
        assert cpu_native.quant_isa() == "scalar" and not cpu_native.has_fast_quant()
        for isa in lacking:
            cpu_native.quant_isa.cache_clear()
            monkeypatch.setenv(cpu_native.ISA_ENV, isa)
            with pytest.raises(ValueError, match=f"TRIOLLM_CPU_ISA: '{isa}' is not a path this CPU can run"):
                cpu_native.quant_isa()
    finally:
        monkeypatch.delenv(cpu_native.ISA_ENV)
        cpu_native.quant_isa.cache_clear()


def test_packing_keeps_every_weight() -> None:
    for bits in (4, 8):
        w = QuantWeight.quantize(torch.randn(37, 96), bits)
        packed = PackedWeight.pack(w)
        assert packed.qp.shape == (3, 3, 256 if bits == 4 else 512) and packed.dp.shape == (3, 3, 16)
        assert torch.equal(packed.dequantize(), w.dequantize())
        idx = torch.tensor([36, 0, 17, 17])
        assert torch.equal(packed.dequantize_rows(idx, torch.bfloat16), w.dequantize()[idx].bfloat16())


@needs_native
@pytest.mark.parametrize("bits", [4, 8])
def test_the_native_row_lookup_is_torchs_to_the_bit(bits: int) -> None:
    """A quantized tied embedding's lookup (QuantEmbedding, `packed_rows`): every row of a packed
    weight with partial groups equals torch's dequantization bit for bit (the product rounded
    before the offset is added, as torch's two ops do), and an index out of range is refused."""
    w = QuantWeight.quantize(torch.randn(37, 96) * 3, bits)
    packed = PackedWeight.pack(w)
    idx = torch.tensor([36, 0, 17, 17, 5, 31, 32, 15, 16])
    native = torch.ops.triollm_cpu.packed_rows(packed.qp, packed.dp, packed.mp, packed.bits, idx)
    assert torch.equal(native, packed.dequantize_rows(idx))
    assert torch.equal(native, w.dequantize()[idx])
    with pytest.raises(RuntimeError, match="out of range"):
        torch.ops.triollm_cpu.packed_rows(packed.qp, packed.dp, packed.mp, packed.bits, torch.tensor([48]))


@needs_native
def test_activation_quantization_matches_the_torch_reference() -> None:
    """The same codes and scales (the kernel is built with -ffast-math: a scale may differ in its
    last bit, and a code that sits on a rounding tie by one)."""
    x = torch.randn(5, 128) * torch.tensor([0.01, 1.0, 100.0, 1e4]).repeat(32)
    (qa, da, sa), (qb, db, sb) = torch.ops.triollm_cpu.quantize_activations(x), quantize_activations(x)
    diff = (qa.int() - qb.int()).abs()
    assert diff.max() <= 1 and (diff > 0).float().mean() < 0.01
    torch.testing.assert_close(da, db, rtol=1e-6, atol=0)
    torch.testing.assert_close(sa, sb, rtol=1e-2, atol=0)


@pytest.mark.parametrize(
    ("ggml", "bits"), [(GGMLQuantizationType.Q8_0, 8), (GGMLQuantizationType.Q4_0, 4), (GGMLQuantizationType.Q4_1, 4)]
)
def test_ggml_blocks_are_kept_as_shipped(ggml: GGMLQuantizationType, bits: int) -> None:
    """Blocks made by gguf's own quantizer: ours dequantize to exactly gguf's values, and the
    bytes kept are the GGUF's (plus a float16 offset per block where the format has none)."""
    rng = np.random.default_rng(0)
    dense = rng.standard_normal((12, 96)).astype(np.float32)
    try:
        raw = quantize(dense, ggml)
    except NotImplementedError:
        pytest.skip(f"this gguf cannot quantize {ggml.name}")
    w = QuantWeight.from_ggml(raw, int(ggml), (12, 96))
    assert w.bits == bits
    np.testing.assert_array_equal(w.dequantize().numpy(), dequantize(raw, ggml).reshape(12, 96))
    assert w.q.nbytes == 12 * 96 * bits // 8


def test_quantized_float_weights_stay_within_half_a_step() -> None:
    w = torch.randn(6, 96) * torch.linspace(0.1, 10, 6).unsqueeze(1)
    for bits in (4, 8):
        q = QuantWeight.quantize(w, bits)
        step = q.d.float().repeat_interleave(32, dim=1)
        assert ((q.dequantize() - w).abs() <= step * 0.5 + 1e-3 * step).all()
    int8 = QuantWeight.quantize(w, 8)
    assert (int8.d == int8.d[:, :1]).all()  # one scale per output channel
    fused = QuantWeight.cat([q, q])
    assert fused.shape == (12, 96) and torch.equal(fused.rows([6, 7]).dequantize(), q.rows([0, 1]).dequantize())


def test_without_the_native_kernels_it_is_the_dense_product(monkeypatch: pytest.MonkeyPatch) -> None:
    w = QuantWeight.quantize(torch.randn(10, 64), 4)
    x = torch.randn(2, 3, 64)
    monkeypatch.setattr(cpu_native, "available", lambda: False)
    out = packed_linear(x, PackedWeight.pack(w), torch.ones(10))
    torch.testing.assert_close(out, x @ w.dequantize().T + 1, rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------ models


def test_quantization_is_checked_by_name(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization: .*'bitsandbytes'.*gguf, int8, int4"):
        EngineArgs(model=str(tiny_model_dir), quantization="bitsandbytes")
    with pytest.raises(ValueError, match="quantization: 'gguf' keeps a .gguf model's blocks"):
        EngineArgs(model=str(tiny_model_dir), quantization="gguf").create_engine_config()
    with pytest.raises(ValueError, match="quantization: 'int8' runs on the CPU only"):
        EngineArgs(model=str(tiny_model_dir), quantization="int8", device="cuda").create_engine_config()


def _perplexity(engine: object, ids: list[int]) -> float:
    from triollm.engine.sampling_params import SamplingParams

    (out,) = engine.generate(
        [{"prompt_token_ids": ids}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    )  # type: ignore[attr-defined]
    lps = [row[t].logprob for row, t in zip(out.prompt_logprobs[1:], ids[1:], strict=True)]
    return math.exp(-sum(lps) / len(lps))


@needs_native
def test_the_bundled_gguf_runs_as_shipped(bundled_model_dir: Path) -> None:
    """quantization="gguf": every linear layer and the tied head keep the GGUF's Q4_1 / Q8_0
    blocks (a fifth of the dense fp32 bytes), and the perplexity on 700 tokens of the shipped
    text stays within 1% of the dense model's (the same weights, dequantized). Without AVX-512
    VNNI the kernel is its scalar loop (issue 25), ~20x slower: 100 tokens there."""
    from triollm.engine.execution.layers.quantized import QuantEmbedding, QuantLinear
    from triollm.engine.sync_engine import SyncEngine

    text = (Path(__file__).parents[1] / "data" / "coriolanus.txt").read_text()
    args = EngineArgs(model=str(bundled_model_dir), max_model_len=1024, num_threads=2, quantization="gguf")
    quant = SyncEngine.from_engine_args(args)
    model = quant.core.model
    assert model is not None and isinstance(model.embed_tokens, QuantEmbedding)
    linears = [m for m in model.modules() if isinstance(m, QuantLinear)]
    assert len(linears) == 4 * len(model.layers) and {m.bits for m in linears} == {4}
    quant_bytes = sum(b.numel() * b.element_size() for b in model.buffers())
    ids = quant.tokenizer.encode(text)[: 700 if cpu_native.has_fast_quant() else 100]
    ppl_q = _perplexity(quant, ids)
    del quant, model
    dense = SyncEngine.from_engine_args(dataclasses.replace(args, quantization=None))
    assert dense.core.model is not None
    dense_bytes = sum(p.numel() * p.element_size() for p in dense.core.model.parameters())
    ppl_d = _perplexity(dense, ids)
    assert quant_bytes < dense_bytes / 4
    assert abs(ppl_q / ppl_d - 1) < 0.01, (ppl_q, ppl_d)


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_float_weights_quantized_at_load(tiny_model_dir: Path, scheme: str) -> None:
    """int8 / int4 on the tiny model through the real engine: its perplexity on a token prompt
    near the dense model's (the random model's logits are nearly flat, so greedy tokens are not
    a stable yardstick here; the bundled model's test above is the real-checkpoint one)."""
    from triollm.engine.execution.layers.quantized import QuantLinear
    from triollm.engine.sync_engine import SyncEngine

    args = EngineArgs(model=str(tiny_model_dir), max_model_len=256, num_threads=1)
    ids = list(range(5, 60))
    dense = SyncEngine.from_engine_args(args)
    ppl_d = _perplexity(dense, ids)
    # The dense model's fp32 KV cache, not a quantized model's default bf16 one: prefill attends
    # over the cache's values, and the weights are what this compares.
    quant = SyncEngine.from_engine_args(dataclasses.replace(args, quantization=scheme, kv_cache_dtype="float32"))
    assert quant.core.model is not None and any(isinstance(m, QuantLinear) for m in quant.core.model.modules())
    ppl_q = _perplexity(quant, ids)
    assert abs(ppl_q / ppl_d - 1) < (0.03 if scheme == "int8" else 0.1), (ppl_q, ppl_d)


def test_the_bundled_gguf_is_quantized_by_default_where_a_vector_path_makes_it_fast(bundled_model_dir: Path) -> None:
    """The default (quantization=None) keeps a .gguf model's blocks on a CPU whose quantized
    kernel has a vector path (AVX2 or AVX-512 VNNI) and dtype auto; "none", another dtype, or an
    HF directory give the dense model."""
    expected = "gguf" if cpu_native.has_fast_quant() else None
    default = EngineArgs().create_engine_config().model
    assert default.quantization == expected
    # Its fp32 activations over a bf16 KV cache (kv_cache_dtype auto), as llama.cpp keeps f16.
    assert default.cache_dtype == (torch.bfloat16 if expected else torch.float32)
    assert EngineArgs(quantization="none").create_engine_config().model.quantization is None
    assert EngineArgs(dtype="bfloat16").create_engine_config().model.quantization is None
    assert EngineArgs(model=str(bundled_model_dir)).create_engine_config().model.quantization is None


def test_an_engine_core_process_gets_the_resolved_scheme(bundled_model_dir: Path) -> None:
    """The child gets the parent's resolved config, never resolving it again (re-resolved from
    a directory, where the default is dense, the default bundled GGUF ran dense in the child
    once); tests/actors/test_process.py checks what a real child builds its core with."""
    from types import SimpleNamespace

    from triollm.actors.process import child_spec

    config = EngineArgs().create_engine_config()
    ends = SimpleNamespace(input_address="ipc:///tmp/x-in", output_address="ipc:///tmp/x-out")
    spec = child_spec(config, ends, None)  # type: ignore[arg-type]
    child = spec.engine_config()
    assert child.model.quantization == config.model.quantization
    assert child.model.cache_dtype == config.model.cache_dtype


@needs_native
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_the_native_decoder_stack_is_the_layers_bit_for_bit(tiny_model_dir: Path, scheme: str) -> None:
    """A quantized model's all-decode steps run the whole decoder stack in one native call
    (kernels/csrc/decoder.cpp); the tokens and logprobs are those of the layer-by-layer path,
    to the bit, over batches that mix decodes with prefills (which take the layers)."""
    from triollm.engine.sampling_params import SamplingParams
    from triollm.engine.sync_engine import SyncEngine

    args = EngineArgs(
        model=str(tiny_model_dir),
        max_model_len=256,
        num_threads=1,
        quantization=scheme,
        enable_prefix_caching=False,
    )  # no cache hits in the second run: its prefills must be the first run's
    engine = SyncEngine.from_engine_args(args)
    model = engine.core.model
    assert model is not None and model.decode_stack is not None
    prompts = [{"prompt_token_ids": list(range(3, 3 + n))} for n in (5, 40, 17)]
    params = [SamplingParams(max_tokens=t, ignore_eos=True, temperature=0.0, logprobs=2) for t in (30, 12, 21)]
    assert stack_against_layers(engine, prompts, params).calls


@pytest.mark.parametrize("bits", [8, 4])
def test_packing_never_widens_the_codes(bits: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Packing reads the codes as stored bytes: widened to int32 first, a 49152 x 576 tied
    embedding took a 113 MB copy and twice that in temporaries at load, which set the quantized
    model's peak RSS (0.50-0.59x the dense import's, against 0.37-0.43x without)."""
    w = QuantWeight.quantize(torch.randn(48, 64), bits)
    expected = PackedWeight.pack(w)
    for widening in ("codes", "nibbles"):
        monkeypatch.setattr(QuantWeight, widening, lambda self: pytest.fail("pack widened the codes"))
    got = PackedWeight.pack(w)
    assert torch.equal(got.qp, expected.qp) and torch.equal(got.dp, expected.dp) and torch.equal(got.mp, expected.mp)
