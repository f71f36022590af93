"""The quantized KV caches (fp8 e4m3 / e5m2, int8: kernels/kv_quant.py) through every attention
path against the torch reference, and prefill over the cache's own representation.

The reference semantics: whatever the cache dtype, attention sees exactly the values the cache
holds (`gather_kv`: the codes times their scales), in prefill as in decode. So each kernel is
compared with dense attention over those dequantized values (tight tolerances: the same numbers,
in another order), and the round trip itself is bounded by the format's precision."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from triollm.kernels import allocate_kv_cache, cpu_native, prefill_attention, write_kv
from triollm.kernels.attention import KVCache, decode_attention, gather_kv, plan_decode
from triollm.kernels.kv_quant import cache_scale, dequantize_kv, quantize_kv

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
QUANTIZED = [*FP8, torch.int8]
IDS = {torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2", torch.int8: "int8", torch.bfloat16: "bf16"}
native_only = pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")


def _name(dtype: object) -> str:
    return IDS.get(dtype, str(dtype))  # type: ignore[call-overload]


def dense(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: int,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q [n, H, d] at positions offset.., k/v [L, kvh, d] at 0..L-1; fp64 dense attention."""
    group = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1)
    s = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    qpos = torch.arange(q.shape[0])[:, None] + offset
    kpos = torch.arange(k.shape[0])[None, :]
    allowed = kpos <= qpos
    if window is not None:
        allowed &= kpos > qpos - window
    s = s.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", s.softmax(-1), v).float()


def _dot_path(native: bool, group: int, bs: int, d: int, softcap: float | None) -> bool:
    """Whether the native kernel runs this case on `vdpbf16ps` (AVX-512 BF16 and VBMI, no
    forced path; kernels/csrc/cpu_attention.cpp): the query and the probabilities then meet the
    cache's values rounded to bf16."""
    return (
        native
        and cpu_native.decode_attention_dot(quantized=True) == "bf16"
        and bs == 16
        and d in (64, 128)
        and group in (1, 2, 3, 4, 6, 7, 8)
        and softcap is None
    )


def _slots(blocks: list[int], n: int, bs: int, start: int = 0) -> torch.Tensor:
    return torch.tensor([blocks[p // bs] * bs + p % bs for p in range(start, start + n)])


def _held(cache: KVCache, blocks: list[int], n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The first n positions of a sequence as the cache holds them, [n, kvh, d] fp32."""
    k, v = gather_kv(cache.k[0], cache.v[0], torch.tensor(blocks), 0, n, torch.float32)
    return k.transpose(0, 1), v.transpose(0, 1)


@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
def test_round_trip_is_the_formats_precision(dtype: torch.dtype) -> None:
    """write_kv then gather_kv: the codes times their scales, within the format's rounding
    (e4m3: 3 mantissa bits, e5m2: 2, int8: half a step of absmax / 127 per token and head)."""
    g = torch.Generator().manual_seed(0)
    bs, kvh, d, n = 16, 2, 64, 40
    cache = allocate_kv_cache(1, 8, bs, kvh, d, dtype, "cpu")
    assert cache.k[0].dtype == dtype and cache_scale(cache.k[0]) is not None
    k, v = torch.randn(n, kvh, d, generator=g) * 3, torch.randn(n, kvh, d, generator=g)
    k[5, 1] = 0.0  # an all-zero row: scale 0, codes 0, read back as zeros
    blocks = [6, 1, 3]
    write_kv(cache.k[0], cache.v[0], k, v, _slots(blocks, n, bs))
    kr, vr = _held(cache, blocks, n)
    assert torch.equal(kr[5, 1], torch.zeros(d))
    for x, xr in ((k, kr), (v, vr)):
        if dtype == torch.int8:
            step = x.abs().amax(-1, keepdim=True) / 127
            assert ((xr - x).abs() <= step * 0.5 + 1e-3 * step + 1e-12).all()
        else:
            rel = 2.0**-4 if dtype == torch.float8_e4m3fn else 2.0**-3  # half an ulp of the mantissa
            assert ((xr - x).abs() <= rel * x.abs() + 2.0**-9).all()
        assert not torch.equal(xr, x)  # it is quantized


@pytest.mark.parametrize("dtype", FP8, ids=_name)
def test_fp8_scale_divides_on_write_and_multiplies_on_read(dtype: torch.dtype) -> None:
    """A layer scale (vLLM's k_scale / v_scale) maps values past fp8's range into it."""
    x = torch.tensor([[[1000.0, -3000.0, 0.5, 7.0]]])
    scale = torch.tensor([16.0])
    codes, _ = quantize_kv(x, dtype, scale)
    back = dequantize_kv(codes, scale, torch.float32)
    torch.testing.assert_close(back, x, rtol=2.0**-3, atol=0.0)
    saturated = dequantize_kv(quantize_kv(x, dtype, torch.tensor([1.0]))[0], torch.tensor([1.0]), torch.float32)
    assert saturated.abs().max() <= (448.0 if dtype == torch.float8_e4m3fn else 57344.0)
    assert torch.isfinite(saturated).all()


def _decode_case(
    dtype: torch.dtype, lens: list[int], kvh: int, group: int, bs: int, d: int, seed: int
) -> tuple[KVCache, list[list[int]], list[torch.Tensor], list[torch.Tensor], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    need = [-(-n // bs) for n in lens]
    num_blocks = sum(need) + 3
    cache = allocate_kv_cache(1, num_blocks, bs, kvh, d, dtype, "cpu")
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, used, ks, vs = [], 0, [], []
    for n, m in zip(lens, need):
        tables.append(perm[used : used + m])
        used += m
        k, v = torch.randn(n, kvh, d, generator=g) * 2, torch.randn(n, kvh, d, generator=g)
        write_kv(cache.k[0], cache.v[0], k, v, _slots(tables[-1], n, bs))
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(lens), kvh * group, d, generator=g)
    return cache, tables, ks, vs, q


DECODE_SHAPES = [  # (lens, kv heads, group, block size, head dim)
    ([1, 17, 40], 2, 3, 16, 64),  # the block-16 x 64 GQA-group instance
    ([33, 5], 1, 8, 16, 128),  # block-16 x 128, group 8
    ([9, 30, 2], 3, 5, 16, 64),  # group 5: the block-16 instance without a group of its own
    ([7, 13], 2, 2, 4, 24),  # the generic instance
    ([40, 3], 1, 16, 16, 96),  # block 16, another head dim: the many-heads kernel (DeepSeek's latents)
    ([21], 2, 1, 16, 80),  # one head per kv head, head dim 80 (Phi-2)
]


@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
@pytest.mark.parametrize("shape", DECODE_SHAPES, ids=lambda s: f"bs{s[3]}-d{s[4]}-g{s[2]}")
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (11, None), (None, 5.0), (6, 3.0)])
@pytest.mark.parametrize("native", [False, pytest.param(True, marks=native_only)], ids=["torch", "native"])
def test_decode_reads_what_the_cache_holds(
    dtype: torch.dtype,
    shape: tuple[list[int], int, int, int, int],
    window: int | None,
    softcap: float | None,
    native: bool,
) -> None:
    """Decode over an fp8 or int8 cache (torch path and native kernel) equals dense attention
    over the cache's dequantized values; GQA, windows and soft-capping included. Where the
    native kernel's bf16 dot products run, the reference takes the query rounded to bf16 as
    the kernel does, and what is left is the probabilities' bf16 rounding (the fp32 path is
    held to 2e-5 on this CPU too: test_the_fp32_path_over_a_quantized_cache_where_a_path_is_forced)."""
    lens, kvh, group, bs, d = shape
    cache, tables, _, _, q = _decode_case(dtype, lens, kvh, group, bs, d, seed=len(lens) + d)
    plan = plan_decode(tables, lens, bs, "cpu", native=native)
    assert (plan.native is not None) == native
    out = decode_attention(q, cache.k[0], cache.v[0], plan, d**-0.5, window=window, softcap=softcap)
    dot = _dot_path(native, group, bs, d, softcap)
    for i, n in enumerate(lens):
        k, v = _held(cache, tables[i], n)
        qi = q[i : i + 1].bfloat16().float() if dot else q[i : i + 1]
        ref = dense(qi, k, v, n - 1, d**-0.5, window, softcap)
        tol = 4e-3 if dot else 2e-5
        torch.testing.assert_close(out[i : i + 1], ref, rtol=tol, atol=tol)


@native_only
@pytest.mark.skipif(
    not cpu_native.available() or cpu_native.decode_attention_dot(quantized=True) != "bf16",
    reason="the bf16 dot-product path over a quantized cache needs AVX-512 BF16 and VBMI",
)
def test_the_fp32_path_over_a_quantized_cache_where_a_path_is_forced() -> None:
    """$TRIOLLM_CPU_ISA turns the bf16 dot products off: the fp32 path that CPUs without
    AVX-512 BF16 / VBMI run is held to its tight tolerance on this CPU too (the native cases
    of the test above, in a subprocess with a forced path)."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    env = {
        **os.environ,
        "TRIOLLM_CPU_ISA": "scalar",
        "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", __file__,
         "-k", "decode_reads_what_the_cache_holds and native and not bs4"],
        env=env, capture_output=True, text=True, timeout=600, cwd=root,
    )
    assert proc.returncode == 0 and " passed" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-2000:]


@native_only
@pytest.mark.parametrize("dtype", FP8, ids=_name)
def test_fp8_layer_scales_reach_the_native_kernel(dtype: torch.dtype) -> None:
    """Scales other than 1.0 (a checkpoint's k_scale / v_scale): the native kernel folds them
    out of its loops and still equals the torch path."""
    lens, bs, d = [20, 3], 16, 64
    cache = allocate_kv_cache(1, 6, bs, 2, d, dtype, "cpu")
    scale_k, scale_v = cache_scale(cache.k[0]), cache_scale(cache.v[0])
    assert scale_k is not None and scale_v is not None
    scale_k.fill_(0.25)
    scale_v.fill_(4.0)
    g = torch.Generator().manual_seed(3)
    tables = [[4, 0], [2]]
    for t, n in zip(tables, lens):
        write_kv(
            cache.k[0],
            cache.v[0],
            torch.randn(n, 2, d, generator=g),
            torch.randn(n, 2, d, generator=g) * 8,
            _slots(t, n, bs),
        )
    q = torch.randn(2, 4, d, generator=g)
    dot = _dot_path(True, 2, bs, d, None)
    if dot:  # the query as the bf16 path rounds it; the probabilities' rounding is what is left
        q = q.bfloat16().float()
    outs = [
        decode_attention(q, cache.k[0], cache.v[0], plan_decode(tables, lens, bs, "cpu", native=n), d**-0.5)
        for n in (True, False)
    ]
    tol = 3e-2 if dot else 2e-5  # V's values here reach 30: the same relative error as above
    torch.testing.assert_close(outs[0], outs[1], rtol=tol, atol=tol)


@native_only
@pytest.mark.parametrize("dtype", [*QUANTIZED, torch.bfloat16], ids=_name)
@pytest.mark.parametrize(("heads", "d", "bs"), [((6, 2), 64, 16), ((4, 1), 8, 4), ((9, 3), 128, 16)])
def test_native_rotary_write_stores_the_same_codes_and_scales(
    dtype: torch.dtype, heads: tuple[int, int], d: int, bs: int
) -> None:
    """The fused rotary + cache write of the native kernel writes the bytes write_kv writes."""
    from triollm.kernels.rotary import apply_rotary_signed, rotary_cos_sin, rotary_sign

    g = torch.Generator().manual_seed(d)
    h, kvh = heads
    t = 7
    qkv = torch.randn(t, (h + 2 * kvh) * d, generator=g) * 4
    qkv[2, (h + kvh) * d : (h + kvh + 1) * d] = 0.0  # an all-zero V row
    cos, sin = rotary_cos_sin(d, 64, 10000.0)
    pos = torch.randint(0, 64, (t,), generator=g)
    c, sn = cos[pos].unsqueeze(1), (sin[pos] * rotary_sign(d)).unsqueeze(1)
    slots = torch.randperm(8 * bs, generator=g)[:t]
    caches = [allocate_kv_cache(1, 8, bs, kvh, d, dtype, "cpu") for _ in range(2)]
    qk = apply_rotary_signed(qkv[:, : (h + kvh) * d].view(t, h + kvh, d), c, sn)
    write_kv(caches[0].k[0], caches[0].v[0], qk[:, h:], qkv[:, (h + kvh) * d :].view(t, kvh, d), slots)
    q = cpu_native.rotary_write_kv(
        qkv, c.squeeze(1).contiguous(), sn.squeeze(1).contiguous(), caches[1].k[0], caches[1].v[0], slots, h, kvh
    )
    torch.testing.assert_close(q, qk[:, :h], rtol=1e-6, atol=1e-6)
    for a, b in ((caches[0].k[0], caches[1].k[0]), (caches[0].v[0], caches[1].v[0])):
        assert torch.equal(
            a.view(torch.uint8) if a.element_size() == 1 else a, b.view(torch.uint8) if b.element_size() == 1 else b
        )
        sa, sb = cache_scale(a), cache_scale(b)
        assert (sa is None) == (sb is None)
        if sa is not None and sb is not None:
            assert torch.equal(sa, sb)


PREFILL_DTYPES = [torch.bfloat16, *QUANTIZED]


@pytest.mark.parametrize("dtype", PREFILL_DTYPES, ids=_name)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (5, None), (None, 4.0)])
@pytest.mark.parametrize("num_context", [0, 13])
def test_prefill_attends_over_the_caches_values(
    dtype: torch.dtype, window: int | None, softcap: float | None, num_context: int
) -> None:
    """Prefill of fp32 activations over a bf16, fp8 or int8 cache sees the cache's values, with
    or without earlier context: the fresh K/V are not what later reads will see."""
    g = torch.Generator().manual_seed(num_context + 1)
    bs, kvh, h, d, n = 4, 2, 6, 16, 11
    total = num_context + n
    cache = allocate_kv_cache(1, 12, bs, kvh, d, dtype, "cpu")
    blocks = [7, 2, 9, 0, 11, 5, 3]
    k, v = torch.randn(total, kvh, d, generator=g) * 2, torch.randn(total, kvh, d, generator=g)
    write_kv(cache.k[0], cache.v[0], k, v, _slots(blocks, total, bs))
    q = torch.randn(n, h, d, generator=g)
    ids = torch.tensor(blocks[: -(-total // bs)])
    out = prefill_attention(
        q, k[num_context:], v[num_context:], cache.k[0], cache.v[0], ids, num_context, d**-0.5,
        window=window, softcap=softcap,
    )  # fmt: skip
    kh, vh = _held(cache, blocks, total)
    ref = dense(q, kh, vh, num_context, d**-0.5, window, softcap)
    torch.testing.assert_close(out, ref, rtol=2e-5, atol=2e-5)
    fresh = dense(q, k, v, num_context, d**-0.5, window, softcap)
    assert (out - fresh).abs().max() > 1e-4  # the cache's rounding shows: it was read


@pytest.mark.parametrize("dtype", PREFILL_DTYPES, ids=_name)
def test_chunked_prefill_equals_one_prefill(dtype: torch.dtype) -> None:
    """A prompt prefilled whole and prefilled in chunks of 5 gives the same attention outputs
    (to fp32 rounding): both attend over the cache's values."""
    g = torch.Generator().manual_seed(5)
    bs, kvh, h, d, n = 4, 2, 4, 16, 17
    blocks = [3, 8, 1, 6, 0]
    k, v, q = (
        torch.randn(n, kvh, d, generator=g),
        torch.randn(n, kvh, d, generator=g),
        torch.randn(n, h, d, generator=g),
    )
    ids = torch.tensor(blocks)
    whole_cache = allocate_kv_cache(1, 10, bs, kvh, d, dtype, "cpu")
    write_kv(whole_cache.k[0], whole_cache.v[0], k, v, _slots(blocks, n, bs))
    whole = prefill_attention(q, k, v, whole_cache.k[0], whole_cache.v[0], ids, 0, d**-0.5)
    cache = allocate_kv_cache(1, 10, bs, kvh, d, dtype, "cpu")
    parts = []
    for s in range(0, n, 5):
        e = min(n, s + 5)
        write_kv(cache.k[0], cache.v[0], k[s:e], v[s:e], _slots(blocks, e - s, bs, s))
        parts.append(prefill_attention(q[s:e], k[s:e], v[s:e], cache.k[0], cache.v[0], ids, s, d**-0.5))
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-5, atol=1e-5)


def test_bytes_per_block_halves_for_fp8_and_int8() -> None:
    """fp8 is exactly half of bf16; int8 adds its fp16 scale per token and kv head."""
    bf16 = KVCache.bytes_per_block(4, 2, 64, 16, torch.bfloat16)
    assert KVCache.bytes_per_block(4, 2, 64, 16, torch.float8_e4m3fn) * 2 == bf16
    assert KVCache.bytes_per_block(4, 2, 64, 16, torch.float8_e5m2) * 2 == bf16
    assert KVCache.bytes_per_block(4, 2, 64, 16, torch.int8) == 2 * 4 * 2 * 16 * (64 + 2)
    cache = allocate_kv_cache(4, 3, 16, 2, 64, torch.int8, "cpu")
    held = sum(t.nbytes + cache_scale(t).nbytes for t in cache.k + cache.v)  # type: ignore[union-attr]
    assert held == 3 * KVCache.bytes_per_block(4, 2, 64, 16, torch.int8)


# The Triton kernels, on the interpreter (tests/conftest.py sets TRITON_INTERPRET=1), against the
# same reference: dense attention over the values the cache holds. Both K storages are checked:
# head_dim innermost (the GPU's, `k_head_dim_last`) and the CPU's transposed blocks.
HAS_TRITON = importlib.util.find_spec("triton") is not None
triton_only = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")

if HAS_TRITON:
    import triton
    import triton.language as tl

    from triollm.kernels.triton.kv_quant import float_to_fp8, fp8_to_float

    @triton.jit
    def _fp8_round_trip(x_ptr, code_ptr, back_ptr, N: tl.constexpr, KV_QUANT: tl.constexpr):  # type: ignore[no-untyped-def]
        """fp8 codes of x, and the codes read back (a jit function finds its callees among
        the module's globals)."""
        i = tl.arange(0, N)
        tl.store(code_ptr + i, float_to_fp8(tl.load(x_ptr + i), KV_QUANT))
        tl.store(back_ptr + i, fp8_to_float(tl.load(code_ptr + i), KV_QUANT))


@triton_only
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
@pytest.mark.parametrize("head_dim_last", [True, False], ids=["gpu-layout", "cpu-layout"])
@pytest.mark.parametrize(("window", "softcap", "splits"), [(None, None, 1), (None, None, 2), (13, 4.0, 2)])
def test_triton_decode_reads_what_the_cache_holds(
    dtype: torch.dtype, head_dim_last: bool, window: int | None, softcap: float | None, splits: int
) -> None:
    from triollm.kernels.triton.attention import paged_decode_attention

    g = torch.Generator().manual_seed(11)
    bs, kvh, group, d, lens = 8, 2, 3, 16, [1, 20, 37]
    cache = allocate_kv_cache(1, 16, bs, kvh, d, dtype, "cpu", k_head_dim_last=head_dim_last)
    scale_k = cache_scale(cache.k[0])
    if dtype != torch.int8:  # a layer scale other than 1.0
        assert scale_k is not None
        scale_k.fill_(0.5)
    perm = torch.randperm(16, generator=g).tolist()
    tables, used = [], 0
    for n in lens:
        m = -(-n // bs)
        tables.append(perm[used : used + m])
        used += m
        k, v = torch.randn(n, kvh, d, generator=g) * 2, torch.randn(n, kvh, d, generator=g)
        write_kv(cache.k[0], cache.v[0], k, v, _slots(tables[-1], n, bs))
    q = torch.randn(len(lens), kvh * group, d, generator=g)
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    out = paged_decode_attention(
        q, cache.k[0], cache.v[0], table, torch.tensor(lens, dtype=torch.int32), d**-0.5,
        window=window, softcap=softcap, num_splits=splits,
    )  # fmt: skip
    for i, n in enumerate(lens):
        k, v = _held(cache, tables[i], n)
        torch.testing.assert_close(
            out[i : i + 1], dense(q[i : i + 1], k, v, n - 1, d**-0.5, window, softcap), rtol=1e-4, atol=1e-4
        )


@triton_only
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
@pytest.mark.parametrize(("window", "softcap"), [(None, None), (9, 3.0)])
def test_triton_prefill_reads_what_the_cache_holds(
    dtype: torch.dtype, window: int | None, softcap: float | None
) -> None:
    """The varlen prefill over two chunks: one with earlier context, one without."""
    from triollm.kernels.attention import plan_prefill
    from triollm.kernels.triton.attention import paged_prefill_attention_varlen

    g = torch.Generator().manual_seed(12)
    bs, kvh, group, d = 8, 2, 2, 16
    cache = allocate_kv_cache(1, 16, bs, kvh, d, dtype, "cpu", k_head_dim_last=True)
    chunks = [(10, 21, [3, 9, 0, 12]), (14, 0, [5, 1])]  # (new tokens, context, blocks)
    qs, held = [], []
    for n, ctx, blocks in chunks:
        k, v = torch.randn(ctx + n, kvh, d, generator=g) * 2, torch.randn(ctx + n, kvh, d, generator=g)
        write_kv(cache.k[0], cache.v[0], k, v, _slots(blocks, ctx + n, bs))
        qs.append(torch.randn(n, kvh * group, d, generator=g))
        held.append(_held(cache, blocks, ctx + n))
    width = max(len(b) for _, _, b in chunks)
    tables = torch.tensor([b + [0] * (width - len(b)) for _, _, b in chunks], dtype=torch.int32)
    starts = torch.tensor([0, 10, 24], dtype=torch.int32)
    contexts = torch.tensor([21, 0], dtype=torch.int32)
    q = torch.cat(qs)
    out = paged_prefill_attention_varlen(
        q, cache.k[0], cache.v[0], tables, starts, contexts, 14, d**-0.5, window=window, softcap=softcap
    )
    assert plan_prefill  # the engine's planner builds these tensors (kernels/attention.py)
    for (n, ctx, _), (k, v), s in zip(chunks, held, (0, 10)):
        ref = dense(q[s : s + n], k, v, ctx, d**-0.5, window, softcap)
        torch.testing.assert_close(out[s : s + n], ref, rtol=1e-4, atol=1e-4)


@triton_only
@pytest.mark.parametrize("dtype", [*QUANTIZED, torch.float32], ids=_name)
@pytest.mark.parametrize("head_dim_last", [True, False], ids=["gpu-layout", "cpu-layout"])
def test_triton_rotary_write_stores_the_same_codes_and_scales(dtype: torch.dtype, head_dim_last: bool) -> None:
    """The Triton rotary + cache write stores the bytes write_kv stores (fp8 as integer ops
    on bytes, int8 with its fp16 scales), a zero row and saturating values included."""
    from triollm.kernels.rotary import apply_rotary, rotary_cos_sin
    from triollm.kernels.triton.rotary import rotary_write_kv

    g = torch.Generator().manual_seed(13)
    h, kvh, d, bs, t = 4, 2, 16, 8, 9
    q, k, v = (
        torch.randn(t, h, d, generator=g),
        torch.randn(t, kvh, d, generator=g) * 3,
        torch.randn(t, kvh, d, generator=g),
    )
    v[4, 1] = 0.0
    k[2, 0, 3] = 5000.0  # past e4m3's 448: saturated, not NaN
    cos, sin = rotary_cos_sin(d, 64, 10000.0)
    positions = torch.randint(0, 64, (t,), generator=g)
    slots = torch.randperm(8 * bs, generator=g)[:t]
    caches = [allocate_kv_cache(1, 8, bs, kvh, d, dtype, "cpu", k_head_dim_last=head_dim_last) for _ in range(2)]
    for c in caches:
        if dtype in FP8:
            cache_scale(c.v[0]).fill_(0.25)  # type: ignore[union-attr]
    k_rot = apply_rotary(k, cos[positions], sin[positions])
    write_kv(caches[0].k[0], caches[0].v[0], k_rot, v, slots)
    _, k_out = rotary_write_kv(q, k, v, cos, sin, positions, caches[1].k[0], caches[1].v[0], slots)
    torch.testing.assert_close(k_out, k_rot, rtol=1e-5, atol=1e-4)
    if dtype == torch.float32:
        torch.testing.assert_close(caches[1].k[0], caches[0].k[0], rtol=1e-5, atol=1e-4)
        return
    # The rotation's rounding may differ in the last bit from apply_rotary's: compare codes of
    # the same rotated values by writing Triton's own rotated K with write_kv.
    write_kv(caches[0].k[0], caches[0].v[0], k_out, v, slots)
    for a, b in ((caches[0].k[0], caches[1].k[0]), (caches[0].v[0], caches[1].v[0])):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        sa, sb = cache_scale(a), cache_scale(b)
        assert sa is not None and sb is not None and torch.equal(sa, sb)


@triton_only
@pytest.mark.parametrize("dtype", FP8, ids=_name)
def test_triton_fp8_conversions_match_torch_on_every_code_and_tie(dtype: torch.dtype) -> None:
    """The Triton integer-op conversions (kernels/triton/kv_quant.py) against torch's `.to`:
    every finite code read back, every code and every midpoint between neighbours written
    (half to even), subnormals, zeros of both signs, and saturation."""
    big = 448.0 if dtype == torch.float8_e4m3fn else 57344.0
    codes = torch.arange(256, dtype=torch.uint8).view(dtype).float()
    codes = codes[torch.isfinite(codes)].sort().values
    mids = (codes[1:] + codes[:-1]) / 2
    g = torch.Generator().manual_seed(14)
    noise = torch.cat([torch.randn(256, generator=g) * s for s in (1e-4, 0.02, 3.0, 3000.0)])
    x = torch.cat([codes, mids, noise, torch.tensor([0.0, -0.0, 1e9, -1e9])])
    n = 1 << (x.numel() - 1).bit_length()
    x = torch.cat([x, torch.zeros(n - x.numel())])
    code, back = torch.empty(n, dtype=torch.uint8), torch.empty(n)
    _fp8_round_trip[(1,)](x, code, back, N=n, KV_QUANT=1 if dtype == torch.float8_e4m3fn else 2)
    expected = x.clamp(-big, big).to(dtype)
    assert torch.equal(code, expected.view(torch.uint8))
    assert torch.equal(back, expected.float())


@native_only
@pytest.mark.parametrize("dtype", QUANTIZED, ids=_name)
def test_native_decode_over_a_quantized_cache_gives_a_row_the_same_bits_alone(dtype: torch.dtype) -> None:
    """Batch invariance over fp8 and int8 caches (whichever dot-product path this CPU runs): a
    row's output is the same bits alone as in a batch, and on one thread as on two, rows longer
    than a part (64 blocks) included."""
    lens, kvh, group, bs, d = [1100, 1, 40, 2100], 2, 3, 16, 64
    cache, tables, _, _, q = _decode_case(dtype, lens, kvh, group, bs, d, seed=7)
    batch = decode_attention(q, cache.k[0], cache.v[0], plan_decode(tables, lens, bs, "cpu", native=True), d**-0.5)
    for row in range(len(lens)):
        plan = plan_decode([tables[row]], [lens[row]], bs, "cpu", native=True)
        alone = decode_attention(q[row : row + 1], cache.k[0], cache.v[0], plan, d**-0.5)
        assert torch.equal(alone, batch[row : row + 1])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = decode_attention(q, cache.k[0], cache.v[0], plan_decode(tables, lens, bs, "cpu", native=True), d**-0.5)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, batch)
