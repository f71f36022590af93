"""The native prefill attention (kernels/csrc/cpu_attention.cpp, `prefill_tile_bf16`): a step's
prompt chunks over the paged cache, each row's arithmetic the decode kernel's.

The contract is bit-identity with the decode kernel run on each prompt row as a decode row of its
own (its block table, context length = position + 1): over bf16, fp8 and int8 caches, float32 or
bf16 queries, GQA groups, rows split into parts (past 1,024 tokens) and chunks with earlier
context. Then closeness to fp64 dense attention over what the cache holds (so both kernels are
right, not only alike), the dispatch in `prefill_attention_chunks`, and refusals."""

from __future__ import annotations

import random

import pytest
import torch

from triollm.kernels import allocate_kv_cache, cpu_native, write_kv
from triollm.kernels.attention import gather_kv, plan_prefill, prefill_attention_chunks
from triollm.kernels.kv_quant import cache_scale

Chunks = list[tuple[int, int]]  # (earlier tokens, new rows) per chunk


def _supported() -> bool:
    q, k_cache = torch.empty(1, 4, 64), torch.empty(2, 1, 64, 16, dtype=torch.int8)
    return cpu_native.available() and cpu_native.prefill_attention_supported(q, k_cache)


pytestmark = pytest.mark.skipif(not _supported(), reason="no native prefill here (needs AVX-512 BF16 and VBMI)")


def _setup(
    dtype: torch.dtype, kvh: int, group: int, hd: int, chunks: Chunks, qdtype: torch.dtype, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, list[list[int]]]:
    """A cache holding every chunk's context and rows in shuffled blocks; (q, k cache, v cache,
    block tables [N, M], each chunk's blocks)."""
    g = torch.Generator().manual_seed(seed)
    nb = sum((c + n + 15) // 16 for c, n in chunks) + 3
    cache = allocate_kv_cache(1, nb, 16, kvh, hd, dtype, "cpu")
    kc, vc = cache.k[0], cache.v[0]
    if dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        scales = cache_scale(kc), cache_scale(vc)
        assert scales[0] is not None and scales[1] is not None
        scales[0].fill_(0.02)
        scales[1].fill_(0.01)
    order = list(range(nb))
    random.Random(seed).shuffle(order)
    tables: list[list[int]] = []
    qs = []
    used = 0
    for c, n in chunks:
        total = c + n
        blocks = order[used : used + (total + 15) // 16]
        used += len(blocks)
        slots = torch.tensor([blocks[i // 16] * 16 + i % 16 for i in range(total)])
        k, v = torch.randn(total, kvh, hd, generator=g), torch.randn(total, kvh, hd, generator=g)
        write_kv(kc, vc, k.to(qdtype), v.to(qdtype), slots)
        tables.append(blocks)
        qs.append(torch.randn(n, kvh * group, hd, generator=g).to(qdtype))
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    return torch.cat(qs), kc, vc, bt, tables


def _prefill(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, chunks: Chunks) -> torch.Tensor:
    starts = torch.tensor([0, *torch.tensor([n for _, n in chunks]).cumsum(0).tolist()], dtype=torch.int32)
    contexts = torch.tensor([c for c, _ in chunks], dtype=torch.int32)
    return cpu_native.paged_prefill_attention(q, kc, vc, bt, starts, contexts, 0.125)


def _as_decode_rows(
    q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, bt: torch.Tensor, chunks: Chunks
) -> torch.Tensor:
    rows, lens = [], []
    for i, (c, n) in enumerate(chunks):
        rows += [bt[i].tolist()] * n
        lens += [c + j + 1 for j in range(n)]
    tables, lengths = torch.tensor(rows, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32)
    return cpu_native.paged_decode_attention(q, kc, vc, tables, lengths, 0.125)


CASES = [
    # (kv heads, group, head_dim, chunks): short rows, a 1-row chunk, context, parts (> 1,024 tokens)
    (3, 3, 64, [(0, 37), (20, 5), (0, 1), (400, 700)]),
    (2, 4, 128, [(1013, 31), (0, 600)]),
    (1, 8, 64, [(1000, 1100)]),
    (4, 1, 64, [(15, 17), (16, 16), (0, 33)]),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8], ids=str)
@pytest.mark.parametrize("case", range(len(CASES)))
def test_each_row_has_the_decode_kernels_bits(dtype: torch.dtype, case: int) -> None:
    kvh, group, hd, chunks = CASES[case]
    q, kc, vc, bt, _ = _setup(dtype, kvh, group, hd, chunks, torch.float32, seed=case)
    out = _prefill(q, kc, vc, bt, chunks)
    ref = _as_decode_rows(q, kc, vc, bt, chunks)
    assert torch.equal(out.view(torch.int32), ref.view(torch.int32))  # bits, signed zeros included


def test_bf16_queries_over_a_bf16_cache() -> None:
    chunks = [(0, 50), (31, 17)]
    q, kc, vc, bt, _ = _setup(torch.bfloat16, 2, 2, 64, chunks, torch.bfloat16, seed=7)
    out = _prefill(q, kc, vc, bt, chunks)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out.view(torch.int16), _as_decode_rows(q, kc, vc, bt, chunks).view(torch.int16))


def test_a_rows_bits_do_not_depend_on_its_chunk_or_the_threads() -> None:
    """One prompt of 300 rows whole, then as chunks of 7 / 93 / 200 (the later ones with context),
    on one thread and on two: the same bits."""
    q, kc, vc, bt, _ = _setup(torch.int8, 2, 3, 64, [(0, 300)], torch.float32, seed=3)
    whole = _prefill(q, kc, vc, bt, [(0, 300)])
    cuts = [(0, 7), (7, 93), (100, 200)]
    tables = bt.expand(len(cuts), -1).contiguous()
    threads = torch.get_num_threads()
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            assert torch.equal(_prefill(q, kc, vc, tables, cuts).view(torch.int32), whole.view(torch.int32))
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.int8], ids=str)
def test_close_to_dense_attention_over_what_the_cache_holds(dtype: torch.dtype) -> None:
    """fp64 attention over the cache's own values: the difference is bf16 rounding of the query
    and the probabilities (the dot products' operands), nothing else."""
    chunks = [(40, 90)]
    q, kc, vc, bt, tables = _setup(dtype, 2, 3, 64, chunks, torch.float32, seed=11)
    out = _prefill(q, kc, vc, bt, chunks)
    k, v = gather_kv(kc, vc, torch.tensor(tables[0]), 0, 130, torch.float64)  # [kvh, L, hd]
    k, v = k.repeat_interleave(3, 0), v.repeat_interleave(3, 0)
    s = torch.einsum("nhd,hld->hnl", q.double(), k) * 0.125
    allowed = torch.arange(130)[None, :] <= torch.arange(40, 130)[:, None]
    ref = torch.einsum("hnl,hld->nhd", s.masked_fill(~allowed, float("-inf")).softmax(-1), v)
    err = (out.double() - ref).abs().max().item()
    assert err < 0.03, err


def test_prefill_attention_chunks_takes_it_and_falls_back_for_a_window() -> None:
    """The plan carries the native tables on CPU; with a sliding window (which the kernel does
    not take) the torch path runs, and without one the result is the kernel's."""
    chunks = [(16, 40)]
    q, kc, vc, bt, tables = _setup(torch.bfloat16, 2, 2, 64, chunks, torch.float32, seed=5)
    plan = plan_prefill([(40, 16, tables[0])], "cpu")
    assert plan.native is not None
    k = v = torch.zeros(40, 2, 64)  # unread: prefill over a bf16 cache reads the cache
    got = prefill_attention_chunks(q, k, v, kc, vc, plan, 0.125)
    assert torch.equal(got, _prefill(q, kc, vc, bt, chunks))
    windowed = prefill_attention_chunks(q, k, v, kc, vc, plan, 0.125, window=8)
    assert not torch.equal(windowed, got)  # the torch path, with its window


def test_refusals_name_what_is_wrong() -> None:
    q, kc, vc, bt, _ = _setup(torch.bfloat16, 2, 2, 64, [(0, 4)], torch.float32, seed=1)
    starts, contexts = torch.tensor([0, 4], dtype=torch.int32), torch.tensor([0], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="query_starts run from 0 to q's rows"):
        cpu_native.paged_prefill_attention(q[:3], kc, vc, bt, starts, contexts, 0.125)
    with pytest.raises(RuntimeError, match="must fit its block-table row"):
        cpu_native.paged_prefill_attention(q, kc, vc, bt, starts, torch.tensor([60], dtype=torch.int32), 0.125)
    with pytest.raises(RuntimeError, match="float32 queries over a bfloat16, fp8 or int8 cache"):
        cpu_native.paged_prefill_attention(q.half(), kc, vc, bt, starts, contexts, 0.125)
    assert not cpu_native.prefill_attention_supported(torch.empty(1, 10, 64), kc)  # 5 query heads per kv head
