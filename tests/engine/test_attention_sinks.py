"""Attention sinks (gpt-oss) and chunked local attention (Llama 4) in the paged attention, on every
path (the torch reference, the native CPU decode kernel, the Triton kernels under the
interpreter), against dense fp32 attention over the unpaged K/V.

A sink is a logit per query head that joins the softmax's denominator and carries no value; a
chunk of C positions limits the query at i to keys j <= i with j // C == i // C. The positions
before a row's first key are NaN where a path must not read them: the whole blocks before it
(every path skips them), and for the Triton kernels, which mask their loads per position, every
position before it.
"""

from __future__ import annotations

import pytest
import torch

from triollm.engine.execution.layers.attention import AttentionMetadata, PagedAttention
from triollm.kernels import attention as attention_module
from triollm.kernels import cpu_native
from triollm.kernels.attention import (
    allocate_kv_cache,
    decode_attention,
    paged_decode_attention,
    plan_decode,
    plan_prefill,
    prefill_attention,
    prefill_attention_chunks,
    write_kv,
)

SCALE = 0.7
KVH, GROUP, D = 2, 3, 16
NATIVE_OK = pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
BACKENDS = ["torch", pytest.param("native", marks=NATIVE_OK), "triton"]


def sinks_of(seed: int = 7) -> torch.Tensor:
    """Sinks of a few units: they take a large share of some rows' probability."""
    return 2.0 * torch.randn(KVH * GROUP, generator=torch.Generator().manual_seed(seed))


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: int,
    *,
    window: int | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """Dense fp32 attention as transformers' eager gpt-oss / Llama 4 code: q [n, H, d] at positions
    offset.., k/v [L, kvh, d] at 0..L-1; a sink as one more column of the softmax, dropped."""
    k, v = k.repeat_interleave(GROUP, dim=1), v.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * SCALE
    i = torch.arange(q.shape[0])[:, None] + offset
    j = torch.arange(k.shape[0])[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    if chunk is not None:
        allowed &= j // chunk == i // chunk
    scores = scores.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        scores = torch.cat((scores, sinks[:, None, None].expand(-1, q.shape[0], 1)), dim=-1)
    probs = scores.softmax(-1)[..., : k.shape[0]]
    return torch.einsum("hnl,lhd->nhd", probs, v)


class Paged:
    """Random K/V of sequences of the given lengths in shuffled blocks of a one-layer cache; `k`,
    `v` hold them as the cache stores them (rounded to its dtype), in fp32 (block 0 stays zero:
    the torch path pads its gathers with it)."""

    def __init__(self, lens: list[int], bs: int, seed: int = 0, d: int = D, dtype: torch.dtype = torch.float32) -> None:
        g = torch.Generator().manual_seed(seed)
        need = [-(-n // bs) for n in lens]
        num_blocks = sum(need) + 2
        cache = allocate_kv_cache(1, num_blocks, bs, KVH, d, dtype, "cpu")
        self.kc, self.vc, self.bs = cache.k[0], cache.v[0], bs
        free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
        self.tables = [[free.pop() for _ in range(m)] for m in need]
        self.k = [torch.randn(n, KVH, d, generator=g).to(dtype).float() for n in lens]
        self.v = [torch.randn(n, KVH, d, generator=g).to(dtype).float() for n in lens]
        for row, n in enumerate(lens):
            self.write(row, range(n), self.k[row], self.v[row])

    def write(self, row: int, positions: range, k: torch.Tensor, v: torch.Tensor) -> None:
        table, bs = self.tables[row], self.bs
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.long)
        write_kv(self.kc, self.vc, k, v, slots)

    def poison_blocks_before(self, row: int, first: int, whole_blocks: bool = True) -> None:
        """NaN at the row's positions before `first` (those of its whole blocks before it)."""
        upto = first // self.bs * self.bs if whole_blocks else first
        if upto > 0:
            nan = torch.full((upto, *self.k[row].shape[1:]), float("nan"))
            self.write(row, range(upto), nan, nan)


def first_key(pos: int, window: int | None, chunk: int | None) -> int:
    first = 0 if window is None else max(0, pos - window + 1)
    return first if chunk is None else max(first, pos // chunk * chunk)


def use_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """Select the backend; returns the `native` argument of the decode functions."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        monkeypatch.setenv("TRIOLLM_KERNELS", "triton")  # the interpreter (conftest.py)
        return False
    monkeypatch.setenv("TRIOLLM_KERNELS", "torch")
    return backend == "native"


# (block size, lengths, window, sinks, chunk): chunks below, at and across blocks, lengths at a
# chunk's first and last positions; sinks alone; all three together.
DECODE_CASES = [
    (4, [1, 5, 8, 9, 16, 23], None, False, 8),
    (4, [3, 6, 7, 13, 20], None, False, 3),
    (8, [1, 9, 16, 17, 40], None, True, None),
    (8, [2, 11, 24, 33, 41], 6, True, 10),
    (16, [1, 15, 16, 17, 40, 50], None, True, 16),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(("bs", "lens", "window", "with_sinks", "chunk"), DECODE_CASES)
def test_decode(
    backend: str,
    bs: int,
    lens: list[int],
    window: int | None,
    with_sinks: bool,
    chunk: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    native = use_backend(backend, monkeypatch)
    seqs = Paged(lens, bs)
    for row, n in enumerate(lens):
        seqs.poison_blocks_before(row, first_key(n - 1, window, chunk), whole_blocks=backend != "triton")
    sinks = sinks_of() if with_sinks else None
    q = torch.randn(len(lens), KVH * GROUP, D, generator=torch.Generator().manual_seed(1))
    width = max(map(len, seqs.tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in seqs.tables], dtype=torch.int32)
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(
        q, seqs.kc, seqs.vc, table, lens_t, SCALE, native=native, window=window, sinks=sinks, chunk=chunk
    )
    for row, n in enumerate(lens):
        expected = reference(q[row : row + 1], seqs.k[row], seqs.v[row], n - 1, window=window, sinks=sinks,
                             chunk=chunk)  # fmt: skip
        torch.testing.assert_close(out[row : row + 1], expected, rtol=1e-5, atol=1e-5)


@NATIVE_OK
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "fp32-over-bf16"])
@pytest.mark.parametrize("d", [64, 128])
def test_native_decode_block16_instances(d: int, cache_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """Block size 16 and head dim 64 or 128: the native kernel's GQA-group instances (group 3),
    with sinks and chunks, also over a bf16 cache under fp32 queries (on a CPU with AVX-512 BF16
    that cache takes `vdpbf16ps`, the query and probabilities rounded to bf16: bf16's tolerance)."""
    monkeypatch.setenv("TRIOLLM_KERNELS", "torch")
    bf16_dot = cache_dtype == torch.bfloat16 and cpu_native.decode_attention_dot() == "bf16"
    tol = 2e-2 if bf16_dot else 1e-5
    lens, chunk = [1, 15, 16, 17, 40, 50], 24
    seqs = Paged(lens, 16, d=d, dtype=cache_dtype)
    for row, n in enumerate(lens):
        seqs.poison_blocks_before(row, first_key(n - 1, None, chunk))
    sinks = sinks_of()
    q = torch.randn(len(lens), KVH * GROUP, d, generator=torch.Generator().manual_seed(2))
    plan = plan_decode(seqs.tables, lens, 16, "cpu", native=True)
    out = decode_attention(q, seqs.kc, seqs.vc, plan, SCALE, sinks=sinks, chunk=chunk)
    for row, n in enumerate(lens):
        expected = reference(q[row : row + 1], seqs.k[row], seqs.v[row], n - 1, sinks=sinks, chunk=chunk)
        torch.testing.assert_close(out[row : row + 1], expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("num_splits", [2, 3])
@pytest.mark.parametrize(("with_sinks", "chunk"), [(True, None), (False, 24), (True, 24)])
def test_triton_decode_split_kv(num_splits: int, with_sinks: bool, chunk: int | None) -> None:
    """Split-KV: the splits share the tiles from the chunk's start, and the reduce kernel adds the
    sink once to the combined denominator."""
    pytest.importorskip("triton", reason="triton is not installed")
    from triollm.kernels.triton.attention import paged_decode_attention as triton_decode

    lens, bs = [3, 40, 75], 8
    seqs = Paged(lens, bs, seed=2)
    for row, n in enumerate(lens):
        seqs.poison_blocks_before(row, first_key(n - 1, None, chunk), whole_blocks=False)
    sinks = sinks_of() if with_sinks else None
    q = torch.randn(len(lens), KVH * GROUP, D, generator=torch.Generator().manual_seed(3))
    width = max(map(len, seqs.tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in seqs.tables], dtype=torch.int32)
    out = triton_decode(
        q, seqs.kc, seqs.vc, table, torch.tensor(lens, dtype=torch.int32), SCALE, sinks=sinks, chunk=chunk,
        num_splits=num_splits,
    )  # fmt: skip
    for row, n in enumerate(lens):
        expected = reference(q[row : row + 1], seqs.k[row], seqs.v[row], n - 1, sinks=sinks, chunk=chunk)
        torch.testing.assert_close(out[row : row + 1], expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("native", [False, pytest.param(True, marks=NATIVE_OK)], ids=["torch", "native"])
def test_sinks_take_their_share(native: bool) -> None:
    """A sink far above every score leaves almost nothing for the values (and overflows nothing);
    one far below changes nothing: the sink is in the denominator, not the numerator."""
    seqs = Paged([9], 4)
    q = torch.randn(1, KVH * GROUP, D)
    plan = plan_decode(seqs.tables, [9], 4, "cpu", native=native)
    plain = decode_attention(q, seqs.kc, seqs.vc, plan, SCALE)
    low = decode_attention(q, seqs.kc, seqs.vc, plan, SCALE, sinks=torch.full((KVH * GROUP,), -1e4))
    high = decode_attention(q, seqs.kc, seqs.vc, plan, SCALE, sinks=torch.full((KVH * GROUP,), 1e2))
    torch.testing.assert_close(low, plain)
    assert high.abs().max() < 1e-20


def test_chunk_groups_are_built_once_per_limit() -> None:
    seqs = Paged([3, 9, 14], 4)
    plan = plan_decode(seqs.tables, [3, 9, 14], 4, "cpu", native=False)
    assert plan.window_groups(None, 16) is plan.groups  # every row inside its first chunk
    assert plan.window_groups(None, 8) is plan.window_groups(None, 8)
    assert plan.window_groups(None, 8) is not plan.window_groups(5, 8)


def check_prefill(backend: str, monkeypatch: pytest.MonkeyPatch, bs: int, num_context: int, n: int,
                  window: int | None, sinks: torch.Tensor | None, chunk: int | None) -> None:  # fmt: skip
    use_backend(backend, monkeypatch)
    total = num_context + n
    seqs = Paged([total], bs, seed=4)
    seqs.poison_blocks_before(0, first_key(num_context, window, chunk), whole_blocks=backend != "triton")
    q = torch.randn(n, KVH * GROUP, D, generator=torch.Generator().manual_seed(5))
    k_new, v_new = seqs.k[0][num_context:], seqs.v[0][num_context:]
    block_ids = torch.tensor(seqs.tables[0], dtype=torch.long)
    out = prefill_attention(
        q, k_new, v_new, seqs.kc, seqs.vc, block_ids, num_context, SCALE, window=window, sinks=sinks, chunk=chunk
    )
    expected = reference(q, seqs.k[0], seqs.v[0], num_context, window=window, sinks=sinks, chunk=chunk)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# (block size, context, new tokens, window, sinks, chunk): a fresh prompt over four chunks; a
# chunked-prefill piece starting mid-chunk; a window and a chunk together; sinks alone, fresh
# and after context; a prompt inside its first chunk (no chunk mask needed).
PREFILL_CASES = [
    (4, 0, 30, None, False, 8),
    (4, 13, 9, None, True, 8),
    (8, 20, 11, 5, True, 12),
    (4, 0, 11, None, True, None),
    (4, 9, 7, 6, True, None),
    (4, 2, 5, None, False, 16),
]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize(("bs", "num_context", "n", "window", "with_sinks", "chunk"), PREFILL_CASES)
def test_prefill(
    backend: str,
    bs: int,
    num_context: int,
    n: int,
    window: int | None,
    with_sinks: bool,
    chunk: int | None,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    sinks = sinks_of() if with_sinks else None
    check_prefill(backend, monkeypatch, bs, num_context, n, window, sinks, chunk)


@pytest.mark.parametrize(("window", "chunk"), [(None, 8), (5, None), (5, 4)])
def test_prefill_in_query_chunks(window: int | None, chunk: int | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long piece runs in slices of query rows, each over the keys its window and chunk reach."""
    monkeypatch.setattr(attention_module, "_PREFILL_CHUNK_SCORES", 200)  # a few rows per slice
    check_prefill("torch", monkeypatch, 4, 13, 21, window, sinks_of(), chunk)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_prefill_chunks_of_a_step(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's prefill pieces through one plan (one Triton launch on that path, the torch code
    with sinks and chunks): each piece as the reference computes it."""
    use_backend(backend, monkeypatch)
    lens, contexts, bs, chunk = [23, 14], [9, 0], 4, 8
    seqs = Paged(lens, bs, seed=6)
    sinks = sinks_of()
    news = [n - c for n, c in zip(lens, contexts)]
    q = torch.randn(sum(news), KVH * GROUP, D, generator=torch.Generator().manual_seed(8))
    k = torch.cat([seqs.k[i][c:] for i, c in enumerate(contexts)])
    v = torch.cat([seqs.v[i][c:] for i, c in enumerate(contexts)])
    plan = plan_prefill([(news[i], contexts[i], seqs.tables[i]) for i in range(2)], "cpu")
    assert (plan.triton is not None) == (backend == "triton")
    out = prefill_attention_chunks(q, k, v, seqs.kc, seqs.vc, plan, SCALE, sinks=sinks, chunk=chunk)
    start = 0
    for i, (c, n) in enumerate(zip(contexts, news)):
        expected = reference(q[start : start + n], seqs.k[i], seqs.v[i], c, sinks=sinks, chunk=chunk)
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)
        start += n


@pytest.mark.parametrize("backend", BACKENDS)
def test_the_layer_passes_sinks_and_chunk_to_every_kernel(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`PagedAttention` with sinks and a chunk over a step of one decode row and one prefill piece."""
    native = use_backend(backend, monkeypatch)
    sinks, chunk, bs = sinks_of(), 8, 4
    attn = PagedAttention(KVH * GROUP, KVH, D, SCALE, sinks=sinks, chunk=chunk)
    seqs = Paged([17, 21], bs, seed=9)
    q = torch.randn(13, KVH * GROUP, D, generator=torch.Generator().manual_seed(10))
    k = torch.cat((seqs.k[0][16:], seqs.k[1][9:]))
    v = torch.cat((seqs.v[0][16:], seqs.v[1][9:]))
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(13, dtype=torch.long), num_decodes=1,
        decode_plan=plan_decode([seqs.tables[0]], [17], bs, "cpu", native=native),
        prefill_plan=plan_prefill([(12, 9, seqs.tables[1])], "cpu"),
    )  # fmt: skip
    out = attn._attend(q, k, v, meta, seqs.kc, seqs.vc).view(13, KVH * GROUP, D)
    torch.testing.assert_close(
        out[:1], reference(q[:1], seqs.k[0], seqs.v[0], 16, sinks=sinks, chunk=chunk), rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(
        out[1:], reference(q[1:], seqs.k[1], seqs.v[1], 9, sinks=sinks, chunk=chunk), rtol=1e-5, atol=1e-5
    )


@pytest.mark.parametrize(
    ("sinks", "chunk", "match"),
    [
        (torch.zeros(5), None, r"sinks: shape \(5,\) must be \[6\]"),
        (None, 0, r"chunk: 0 must be a positive number of tokens"),
        (None, True, r"chunk: True must be"),
    ],
)
def test_bad_sinks_and_chunks_are_refused(sinks: torch.Tensor | None, chunk: object, match: str) -> None:
    seqs = Paged([5], 4)
    plan = plan_decode(seqs.tables, [5], 4, "cpu", native=False)
    q = torch.randn(1, KVH * GROUP, D)
    with pytest.raises(ValueError, match=match):
        decode_attention(q, seqs.kc, seqs.vc, plan, SCALE, sinks=sinks, chunk=chunk)  # type: ignore[arg-type]
