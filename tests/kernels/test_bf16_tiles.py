"""Large inputs on AMX bf16 tiles (kernels/quant.py `tile_linear`, `TILE_MIN_ROWS`;
kernels/csrc/quant_linear.cpp `quant_linear_bf16`): the tile kernel against a torch reference
over the same bf16 roundings, a row's bits alone and in any batch, which inputs take it, the
native decode stack's bits with it, and the engine's numbers through it. The kernel tests run
where the CPU has AMX bf16 tiles (the machines change: an AMX Xeon runs them)."""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
from stack_spy import StackSpy

from triollm.engine.execution.layers import quantized as quantized_module
from triollm.engine.execution.layers.quantized import QuantLinear
from triollm.kernels import cpu_native
from triollm.kernels.envs import ISA_ENV
from triollm.kernels.quant import (
    IQ4,
    TILE_MIN_ROWS,
    PackedWeight,
    QuantWeight,
    packed_linear,
    packed_swiglu,
    tile_linear,
    tiles_available,
)

needs_tiles = pytest.mark.skipif(
    not (cpu_native.available() and torch.ops.triollm_cpu.bf16_tiles()), reason="no AMX bf16 tiles on this CPU"
)

# Part-filled row tiles (1, 5, 17, 33), partial groups of 16 outputs (17, 33, 70), an odd group
# count (a group pair with one left over), odd block counts (3, 19), rows past one tile pair (70),
# an input taken in chunks (48 blocks: the sums kept between chunks, several group pairs).
_SHAPES = [(1, 16, 32), (5, 17, 96), (17, 33, 608), (33, 70, 64), (70, 48, 160), (40, 112, 1536)]


def _weight(bits: int, n: int, k: int, seed: int, scale: float = 1.0) -> PackedWeight:
    gen = torch.Generator().manual_seed(seed)
    w = QuantWeight.quantize(torch.randn(n, k, generator=gen) * scale, 8 if bits == 8 else 4)
    if bits == IQ4:  # the same nibbles read as IQ4 indices
        w = QuantWeight(w.q, w.d, w.m, IQ4)
    return PackedWeight.pack(w)


@needs_tiles
@pytest.mark.parametrize("bits", [4, 8, IQ4])
@pytest.mark.parametrize(("m", "n", "k"), _SHAPES)
def test_the_tiles_are_the_bf16_product(bits: int, m: int, n: int, k: int) -> None:
    """Weights d * code + m and activations each rounded to bf16 once, products summed in fp32:
    only the summation order differs from the reference."""
    w = _weight(bits, n, k, m + n + k)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(k)) * 3
    got = tile_linear(x, w)
    ref = x.bfloat16().double() @ w.dequantize().bfloat16().double().T
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * math.sqrt(k) * float(ref.abs().max()))


@needs_tiles
@pytest.mark.parametrize("bits", [4, 8, IQ4])
def test_a_row_has_the_same_bits_at_every_batch_size(bits: int) -> None:
    """Alone, in every place of a part-filled or full tile pair, and past the first pair: the
    same bits (prompt tokens keep their numbers whatever else is in the step)."""
    w = _weight(bits, 40, 608, 1)
    x = torch.randn(70, 608, generator=torch.Generator().manual_seed(2))
    whole = tile_linear(x, w)
    for i in range(70):
        assert torch.equal(tile_linear(x[i : i + 1], w)[0], whole[i]), i
    for m in (2, 16, 17, 31, 32, 33, 48):
        assert torch.equal(tile_linear(x[70 - m :], w), whole[70 - m :]), m


@needs_tiles
def test_large_inputs_take_the_tiles_where_allowed() -> None:
    """`tiles=True` (a layer's `tiles`, set by the model runner): inputs of `TILE_MIN_ROWS` rows
    or more take the tile kernel, smaller ones the int8 kernel, each row with that kernel's bits
    alone; without leave, every input the int8 kernel."""
    w = _weight(4, 33, 96, 3)
    layer = QuantLinear(QuantWeight.quantize(torch.randn(33, 96), 4), None)
    layer.qp, layer.dp, layer.mp = w.qp, w.dp, w.mp
    x = torch.randn(TILE_MIN_ROWS + 5, 96, generator=torch.Generator().manual_seed(4))
    tiles, int8 = tile_linear(x, w), packed_linear(x, w)
    assert not torch.equal(tiles, int8)  # the two kernels differ: the test can tell them apart
    for m in (1, TILE_MIN_ROWS - 1, TILE_MIN_ROWS, TILE_MIN_ROWS + 5):
        want = tiles[:m] if m >= TILE_MIN_ROWS else int8[:m]
        assert torch.equal(packed_linear(x[:m], w, tiles=True), want), m
        assert torch.equal(packed_linear(x[:m], w), int8[:m]), m
        assert torch.equal(layer(x[:m]), int8[:m]), m
        layer.tiles = True
        assert torch.equal(layer(x[:m]), want), m
        layer.tiles = False


@needs_tiles
@pytest.mark.parametrize("bits", [4, 8, IQ4])
@pytest.mark.parametrize(("m", "n", "k"), [(32, 32, 32), (33, 64, 96), (70, 96, 608), (100, 160, 64)])
def test_the_fused_swiglu_is_the_tile_projection_then_silu_and_mul(bits: int, m: int, n: int, k: int) -> None:
    """`quant_swiglu_bf16` pairs each gate group with its up group in the tiles and leaves
    silu(gate) * up: the unfused tile projection then `silu_and_mul`, bit for bit, with a row's
    bits the same at every row count (an odd gate-group count, 5 at n = 160, included). Weights
    and inputs of a model's magnitudes: where exp overflows (gate sums past ~88), -ffast-math's
    exp differs between the two loops."""
    w = _weight(bits, n, k, n + k, scale=0.05)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(m))
    got = packed_swiglu(x, w)
    assert got is not None and got.shape == (m, n // 2)
    assert torch.equal(got, cpu_native.silu_and_mul(tile_linear(x, w)))
    for rows in (TILE_MIN_ROWS, m - 1):
        if rows >= TILE_MIN_ROWS:
            part = packed_swiglu(x[m - rows :], w)
            assert part is not None and torch.equal(part, got[m - rows :]), rows
    assert packed_swiglu(x[: TILE_MIN_ROWS - 1], w) is None  # the int8 kernel's rows: unfused
    assert packed_swiglu(x, _weight(bits, n + 16, k, 1)) is None  # an intermediate size not of 16s


@needs_tiles
def test_a_quantized_gated_mlp_fuses_its_activation_on_the_tiles_only() -> None:
    """`QuantLinear.swiglu`: on the tiles, the fused kernel; without leave, with a bias, or with
    an input order, None (the caller applies the activation to the projection's output)."""
    layer = QuantLinear(QuantWeight.quantize(torch.randn(64, 96), 4), None)
    x = torch.randn(TILE_MIN_ROWS + 3, 96, generator=torch.Generator().manual_seed(5))
    assert layer.swiglu(x) is None
    layer.tiles = True
    fused = layer.swiglu(x)
    assert fused is not None and torch.equal(fused, cpu_native.silu_and_mul(layer(x)))
    biased = QuantLinear(QuantWeight.quantize(torch.randn(64, 96), 4), torch.zeros(64))
    biased.tiles = True
    assert biased.swiglu(x) is None
    ordered = QuantLinear(QuantWeight.quantize(torch.randn(64, 96), 4), None, torch.arange(96).flip(0))
    ordered.tiles = True
    assert ordered.swiglu(x) is None


def test_a_forced_kernel_path_keeps_every_row_on_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ISA_ENV, "scalar")
    assert not tiles_available()


@pytest.mark.parametrize("switch", ["", "1"])
def test_the_runner_takes_the_tiles_where_the_cpu_has_them(
    bundled_model_dir: object, switch: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundled (quantized) model's runner lets its quantized layers (and tied head) take the
    tiles where the CPU has them, never under `VLLM_BATCH_INVARIANT=1`."""
    from triollm.engine.config import EngineArgs
    from triollm.engine.envs import BATCH_INVARIANT_ENV
    from triollm.engine.sync_engine import SyncEngine

    if switch:
        monkeypatch.setenv(BATCH_INVARIANT_ENV, switch)
    else:
        monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
    args = EngineArgs(model=str(bundled_model_dir), quantization="gguf", max_model_len=256, num_threads=2)
    engine = SyncEngine.from_engine_args(args)
    runner = engine.core.runner
    assert runner is not None
    want = tiles_available() and not switch
    assert runner.tiles == runner.large_prompt_steps == want
    model = engine.core.model
    assert model is not None and model.embed_tokens.tiles == want
    assert all(m.tiles == want for m in model.modules() if isinstance(m, QuantLinear))


def test_a_dense_models_large_prompt_steps_attend_in_bf16(tiny_model_dir: object) -> None:
    """A dense model has no tiles to take, but its large prompt steps attend in bf16 where the CPU
    has AMX (the runner's `large_prompt_steps`); its prompt still gives the same greedy tokens as
    in steps too small for it (one 200-token prompt alone, then in 16-token chunks)."""
    from triollm import LLM, SamplingParams
    from triollm.engine.config import EngineArgs
    from triollm.engine.sync_engine import SyncEngine

    engine = SyncEngine.from_engine_args(EngineArgs(model=str(tiny_model_dir), max_model_len=256, num_threads=2))
    runner = engine.core.runner
    assert runner is not None and not runner.tiles
    assert runner.large_prompt_steps == tiles_available()
    prompt = {"prompt_token_ids": [(7 * i) % 300 + 3 for i in range(200)]}
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    outs = []
    for chunk in ({}, {"long_prefill_token_threshold": 16}):
        with LLM(str(tiny_model_dir), max_model_len=256, num_threads=2, multiprocess=False, **chunk) as llm:
            outs.append(llm.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids)
    assert outs[0] == outs[1] and len(outs[0]) == 8


@needs_tiles
def test_a_long_prompt_through_the_tiles_keeps_the_models_numbers(
    bundled_model_dir: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The bundled model, one 300-token prompt (one step of rows past `TILE_MIN_ROWS`):
    its prompt logprobs through the tiles (and the step's bf16 attention) are not the int8
    path's bits (the tiles ran), and they are as close to the same weights dequantized to fp32
    (dense) as the int8 path's."""
    from triollm import LLM, SamplingParams
    from triollm.engine.envs import BATCH_INVARIANT_ENV

    rng = random.Random(0)
    prompt = {"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(300)]}
    params = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=0)
    got = {}
    for name, switch, quant in (("tiles", "", "gguf"), ("int8", "1", "gguf"), ("dense", "", None)):
        if switch:
            monkeypatch.setenv(BATCH_INVARIANT_ENV, switch)
        else:
            monkeypatch.delenv(BATCH_INVARIANT_ENV, raising=False)
        kwargs = {"quantization": quant} if quant else {}
        with LLM(str(bundled_model_dir), max_model_len=512, num_threads=2, multiprocess=False, **kwargs) as llm:
            out = llm.generate([prompt], params, use_tqdm=False)[0]
        assert out.prompt_logprobs is not None and len(out.outputs[0].token_ids) == 8
        chosen = [next(iter(lp.values())).logprob for lp in out.prompt_logprobs[1:]]
        got[name] = torch.tensor(chosen, dtype=torch.float64)
    assert not torch.equal(got["tiles"], got["int8"])
    tiles_err, int8_err = ((got[k] - got["dense"]).abs().mean() for k in ("tiles", "int8"))
    assert tiles_err <= 1.2 * int8_err, (float(tiles_err), float(int8_err))


@needs_tiles
def test_the_native_decoder_stack_takes_the_tiles_with_the_layers_bits(tiny_model_dir: Path) -> None:
    """Steps of `TILE_MIN_ROWS` decodes or more run the native decoder stack on the tiles
    (kernels/csrc/decoder.cpp `tiles`): the tokens and logprobs of the layer-by-layer path, to
    the bit, and not the int8 kernel's (the tiles ran)."""
    from triollm.engine.config import EngineArgs
    from triollm.engine.sampling_params import SamplingParams
    from triollm.engine.sync_engine import SyncEngine

    args = EngineArgs(
        model=str(tiny_model_dir), max_model_len=128, num_threads=2, quantization="int4", enable_prefix_caching=False
    )
    engine = SyncEngine.from_engine_args(args)
    model = engine.core.model
    assert model is not None and model.decode_stack is not None
    prompts = [{"prompt_token_ids": [3 + (5 * i + j) % 200 for j in range(6)]} for i in range(TILE_MIN_ROWS + 4)]
    params = SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.0, logprobs=2)
    spy = StackSpy(model.decode_stack)
    model.decode_stack = spy  # type: ignore[assignment]
    fused = engine.generate(prompts, params)
    assert spy.calls and min(spy.rows()) >= TILE_MIN_ROWS
    model.decode_stack = None
    swiglu_rows: list[int] = []

    def counted_swiglu(x: torch.Tensor, w: PackedWeight) -> torch.Tensor | None:
        swiglu_rows.append(x.shape[0])
        return packed_swiglu(x, w)

    with pytest.MonkeyPatch.context() as patch:  # the layers' MLPs take the fused kernel too
        patch.setattr(quantized_module, "packed_swiglu", counted_swiglu)
        layered = engine.generate(prompts, params)
    assert swiglu_rows and min(swiglu_rows) >= TILE_MIN_ROWS
    for m in model.modules():
        if isinstance(m, QuantLinear):
            m.tiles = False
    int8 = engine.generate(prompts, params)
    for a, b in zip(fused, layered, strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert any(a.outputs[0].logprobs != c.outputs[0].logprobs for a, c in zip(fused, int8, strict=True))


@needs_tiles
def test_a_requests_numbers_through_the_tiles_do_not_depend_on_the_batch(bundled_model_dir: Path) -> None:
    """The bundled model: a request decoding beside `TILE_MIN_ROWS` others or beside twice as
    many, every step on the tiles, gets the same tokens and logprobs to the bit (the tiles give
    a row its bits whatever its neighbours; a request's numbers change only across the threshold)."""
    from triollm import LLM, SamplingParams

    rng = random.Random(1)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 20000) for _ in range(12)]} for _ in range(2 * TILE_MIN_ROWS)]
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=1)
    with LLM(str(bundled_model_dir), max_model_len=128, num_threads=2, multiprocess=False) as llm:
        small = llm.generate(prompts[:TILE_MIN_ROWS], params, use_tqdm=False)
        large = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(small, large[:TILE_MIN_ROWS], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs


def test_prompt_batches_group_whole_short_prompts_of_similar_lengths() -> None:
    """Whole prompts (no earlier context) of up to PROMPT_BATCH_WIDTH tokens, longest first, share
    a batch while its padding stays within PROMPT_BATCH_WASTE of the causal work; a chunk with
    context, a longer prompt or one with no partner is attended alone. Each prompt's blocks are
    padded to the batch's width with its last block, its query rows with its first row."""
    from triollm.kernels.attention import PROMPT_BATCH_WIDTH, PrefillPlan, _prompt_batches

    lengths = [(0, 200), (0, 190), (30, 100), (0, PROMPT_BATCH_WIDTH + 1), (0, 180), (0, 20), (0, 100), (0, 95)]
    chunks, start = [], 0
    for context, n in lengths:
        first_block = 100 * len(chunks)
        chunks.append((start, n, context, torch.arange(first_block, first_block + (context + n + 15) // 16)))
        start += n
    batches, alone = _prompt_batches(PrefillPlan(chunks, max(n for _, n in lengths)), 16)
    assert alone == [2, 3, 5]  # context; too long; 20 rows beside 95-100 would pad too much
    assert [(b.width, [s for s, _ in b.spans]) for b in batches] == [
        (200, [chunks[0][0], chunks[1][0], chunks[4][0]]),
        (100, [chunks[6][0], chunks[7][0]]),
    ]
    first = batches[1]
    assert first.blocks.tolist() == chunks[6][3].tolist() + chunks[7][3].tolist() + [705]  # 7 blocks each
    shorter = first.q_rows[100:].tolist()
    assert shorter == list(range(chunks[7][0], chunks[7][0] + 95)) + [chunks[7][0]] * 5


# (earlier tokens, new rows) per chunk: one whole prompt; then whole prompts of several lengths,
# which a bf16 cache attends in padded batches (`PromptBatch`), beside chunks with context.
PREFILL_CHUNKS = {
    "mixed": [(0, 37), (40, 90), (16, 1)],
    "prompt-batches": [(0, 37), (0, 33), (40, 20), (0, 40), (0, 5), (0, 3), (0, 64), (0, 1), (0, 60)],
}


@pytest.mark.parametrize("chunks", PREFILL_CHUNKS.values(), ids=PREFILL_CHUNKS.keys())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
def test_bf16_prefill_attention_is_dense_attention_over_the_cache(
    dtype: torch.dtype, chunks: list[tuple[int, int]]
) -> None:
    """`prefill_attention_bf16` (a large prompt step's attention on AMX): chunks with and without
    earlier context, a GQA group of 3, over what the cache holds; against fp64 dense attention
    the difference is the bf16 rounding of the queries and probabilities. Whole prompts of
    similar lengths go in padded batches: the padding changes no real row."""
    from triollm.kernels import allocate_kv_cache, write_kv
    from triollm.kernels.attention import _prompt_batches, gather_kv, plan_prefill, prefill_attention_bf16

    g = torch.Generator().manual_seed(7)
    kvh, group, hd = 2, 3, 64
    cache = allocate_kv_cache(1, 48, 16, kvh, hd, dtype, "cpu")
    kc, vc = cache.k[0], cache.v[0]
    order = torch.randperm(48, generator=g).tolist()
    planned, qs, tables, used = [], [], [], 0
    for c, n in chunks:
        blocks = order[used : used + (c + n + 15) // 16]
        used += len(blocks)
        slots = torch.tensor([blocks[i // 16] * 16 + i % 16 for i in range(c + n)])
        write_kv(kc, vc, torch.randn(c + n, kvh, hd, generator=g), torch.randn(c + n, kvh, hd, generator=g), slots)
        planned.append((n, c, blocks))
        tables.append(blocks)
        qs.append(torch.randn(n, kvh * group, hd, generator=g))
    q = torch.cat(qs)
    plan = plan_prefill(planned, "cpu")
    out = prefill_attention_bf16(q, kc, vc, plan, 0.125)
    assert out.dtype == torch.float32 and out.shape == q.shape
    batched = [sum(n for _, n in b.spans) for b in _prompt_batches(plan, 16)[0]]
    if dtype == torch.bfloat16 and len(chunks) > 3:  # 64+60 and 40+37+33 rows batched; 5, 3, 1 alone
        assert plan.prompt_batches is not None and sorted(batched) == [110, 124]
        assert plan.prompt_batches[1] == [2, 4, 5, 7]  # the chunk with context, and the short ones
    else:
        assert plan.prompt_batches is None or dtype != torch.bfloat16 or not plan.prompt_batches[0]
    row = 0
    for (c, n), blocks, qc in zip(chunks, tables, qs):
        k, v = gather_kv(kc, vc, torch.tensor(blocks), 0, c + n, torch.float64)
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        s = torch.einsum("nhd,hld->hnl", qc.double(), k) * 0.125
        allowed = torch.arange(c + n)[None, :] <= torch.arange(c, c + n)[:, None]
        ref = torch.einsum("hnl,hld->nhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)
        err = (out[row : row + n].double() - ref).abs().max().item()
        assert err < 0.03, (c, n, err)
        row += n
