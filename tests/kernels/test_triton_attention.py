"""The Triton paged-attention kernels under the interpreter (`TRITON_INTERPRET=1`, set by
conftest.py), against dense attention and the torch references in `kernels/attention.py`.

Cache slots no sequence owns hold NaN, so a kernel that reads past a context, or outside its
blocks, poisons its output; outputs are views into larger buffers of a sentinel, so a write
outside them shows. The interpreter cannot run bf16 `tl.dot`: bf16 is only compiled (AOT_SPECS).
"""

from __future__ import annotations

import pytest
import torch

from triollm.kernels import attention as torch_attention
from triollm.kernels.attention import allocate_kv_cache, prefill_attention, write_kv
from triollm.kernels.triton.attention import (
    AOT_SPECS,
    choose_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
)

SENTINEL = 12345.0
GUARD = 16
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-2}


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, offset: int) -> torch.Tensor:
    """q [n, H, d] at positions offset..offset+n-1; k, v [L, kvh, d] for positions 0..L-1; fp32."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / q.shape[-1] ** 0.5
    n, length = q.shape[0], k.shape[0]
    allowed = torch.arange(length)[None, :] <= (torch.arange(n)[:, None] + offset)
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


class Sequences:
    """A one-layer paged cache poisoned with NaN, holding random K/V for sequences of the given
    lengths in shuffled, non-adjacent blocks."""

    def __init__(
        self,
        lens: list[int],
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        seed: int = 0,
        poison: float = float("nan"),
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        blocks_needed = [-(-n // block_size) for n in lens]
        num_blocks = 2 * sum(blocks_needed) + 1
        cache = allocate_kv_cache(1, num_blocks, block_size, kv_heads, head_dim, dtype, "cpu")
        self.k_cache, self.v_cache = cache.k[0].fill_(poison), cache.v[0].fill_(poison)
        free = torch.randperm(num_blocks, generator=g).tolist()
        self.tables = [[free.pop() for _ in range(m)] for m in blocks_needed]
        self.k = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lens]
        self.v = [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for n in lens]
        self.pad_block = free.pop()  # a valid id whose slots are all poison
        for table, k, v in zip(self.tables, self.k, self.v):
            slots = torch.tensor(
                [table[p // block_size] * block_size + p % block_size for p in range(len(k))]
            )
            write_kv(self.k_cache, self.v_cache, k, v, slots)

    def padded_tables(self) -> torch.Tensor:
        width = max(map(len, self.tables))
        rows = [t + [self.pad_block] * (width - len(t)) for t in self.tables]
        return torch.tensor(rows, dtype=torch.int32)


def guarded_output(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A sentinel-filled buffer `GUARD` elements wider on each side of every dimension, and the
    (non-contiguous) view of `shape` inside it. `GUARD` covers a whole padded GQA group, so even
    a kernel that stores its padding rows writes inside the buffer, where the check sees it."""
    buffer = torch.full(tuple(n + 2 * GUARD for n in shape), SENTINEL, dtype=dtype)
    return buffer, buffer[_inner(shape)]


def _inner(shape: torch.Size | tuple[int, ...]) -> tuple[slice, ...]:
    return tuple(slice(GUARD, GUARD + n) for n in shape)


def assert_guard_bands_intact(buffer: torch.Tensor, view: torch.Tensor) -> None:
    bands = buffer.clone()
    bands[_inner(view.shape)] = SENTINEL
    assert torch.equal(bands, torch.full_like(buffer, SENTINEL)), "a write outside the output"


def random_q(
    tokens: int, heads: int, head_dim: int, dtype: torch.dtype, seed: int = 1
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, heads, head_dim, generator=g).to(dtype)


def check_decode(
    lens: list[int],
    block_size: int,
    kv_heads: int,
    group: int,
    dtype: torch.dtype = torch.float32,
    num_splits: int | None = None,
    head_dim: int = 16,
) -> None:
    seqs = Sequences(lens, block_size, kv_heads, head_dim, dtype)
    heads = kv_heads * group
    q = random_q(len(lens), heads, head_dim, dtype)
    buffer, out = guarded_output(tuple(q.shape), dtype)
    result = paged_decode_attention(
        q,
        seqs.k_cache,
        seqs.v_cache,
        seqs.padded_tables(),
        torch.tensor(lens, dtype=torch.int32),
        head_dim**-0.5,
        num_splits=num_splits,
        out=out,
    )
    assert result.data_ptr() == out.data_ptr()
    assert_guard_bands_intact(buffer, out)
    for b, n in enumerate(lens):
        expected = dense_attention(q[b : b + 1], seqs.k[b], seqs.v[b], n - 1)[0]
        torch.testing.assert_close(
            out[b].float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype]
        )


def check_prefill(
    num_context: int,
    num_tokens: int,
    block_size: int,
    kv_heads: int,
    group: int,
    dtype: torch.dtype = torch.float32,
    table_dtype: torch.dtype = torch.int32,
    head_dim: int = 16,
) -> None:
    total = num_context + num_tokens
    seqs = Sequences([total], block_size, kv_heads, head_dim, dtype)
    q = random_q(num_tokens, kv_heads * group, head_dim, dtype)
    buffer, out = guarded_output(tuple(q.shape), dtype)
    table = torch.tensor(seqs.tables[0] + [seqs.pad_block], dtype=table_dtype)  # one spare entry
    paged_prefill_attention(
        q, seqs.k_cache, seqs.v_cache, table, num_context, head_dim**-0.5, out=out
    )
    assert_guard_bands_intact(buffer, out)
    expected = dense_attention(q, seqs.k[0], seqs.v[0], num_context)
    torch.testing.assert_close(out.float(), expected, atol=TOLERANCE[dtype], rtol=TOLERANCE[dtype])


# Ragged lengths: one token, a partial block, exact block multiples, several KV tiles.
@pytest.mark.parametrize(
    ("block_size", "group", "lens"),
    [(8, 1, [1, 9, 16, 41]), (16, 3, [5, 16, 33]), (32, 4, [1, 32, 70]), (8, 4, [24, 3])],
    ids=["bs8-mha", "bs16-gqa3", "bs32-gqa4", "bs8-gqa4"],
)
def test_decode_matches_dense(block_size: int, group: int, lens: list[int]) -> None:
    check_decode(lens, block_size, kv_heads=2, group=group)


@pytest.mark.parametrize("num_splits", [2, 3])
def test_decode_split_kv_matches_dense(num_splits: int) -> None:
    # Length 1 leaves splits empty; 40 and 65 tokens give splits of uneven size.
    check_decode([1, 40, 65], 8, kv_heads=2, group=3, num_splits=num_splits)


def test_decode_fp16() -> None:
    check_decode([7, 50], 16, kv_heads=2, group=4, dtype=torch.float16, num_splits=2, head_dim=32)


def test_decode_matches_torch_reference() -> None:
    """Against `kernels/attention.py` on a zeroed cache, with q a strided view into a fused QKV
    projection's output and int32 tables padded with block 0."""
    bs, kvh, group, d = 8, 2, 3, 16
    lens = [3, 19, 8]
    seqs = Sequences(lens, bs, kvh, d, torch.float32, seed=3, poison=0.0)
    heads = kvh * group
    qkv = random_q(len(lens), heads + 2 * kvh, d, torch.float32, seed=4)
    q = qkv[:, :heads]
    width = max(map(len, seqs.tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in seqs.tables], dtype=torch.int32)
    context_lens = torch.tensor(lens, dtype=torch.int32)
    args = (q, seqs.k_cache, seqs.v_cache, tables, context_lens, 0.3)
    expected = torch_attention.paged_decode_attention(*args, native=False)
    torch.testing.assert_close(paged_decode_attention(*args), expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(
    ("num_context", "num_tokens", "block_size", "group"),
    [
        (0, 30, 8, 3),  # no context; 90 rows: two query tiles, a token's heads straddling them
        (137, 11, 16, 3),  # a prefix hit ending mid-block; three KV tiles
        (75, 30, 32, 4),  # 120 rows: two query tiles; 105 positions: two KV tiles
        (13, 1, 8, 3),  # one new token
        (0, 1, 16, 1),  # one token, nothing else
    ],
    ids=["fresh", "prefix-hit", "long", "one-token", "single"],
)
def test_prefill_matches_dense(
    num_context: int, num_tokens: int, block_size: int, group: int
) -> None:
    check_prefill(num_context, num_tokens, block_size, kv_heads=2, group=group)


def test_prefill_int64_table_fp16() -> None:
    check_prefill(
        100, 9, 8, kv_heads=1, group=4, dtype=torch.float16, table_dtype=torch.int64, head_dim=32
    )


def test_prefill_matches_torch_reference() -> None:
    bs, kvh, group, d = 16, 2, 2, 16
    num_context, n = 18, 7
    seqs = Sequences([num_context + n], bs, kvh, d, torch.float32, seed=5, poison=0.0)
    q = random_q(n, kvh * group, d, torch.float32, seed=6)
    block_ids = torch.tensor(seqs.tables[0])
    k_new, v_new = seqs.k[0][num_context:], seqs.v[0][num_context:]
    expected = prefill_attention(
        q, k_new, v_new, seqs.k_cache, seqs.v_cache, block_ids, num_context, 0.25
    )
    actual = paged_prefill_attention(q, seqs.k_cache, seqs.v_cache, block_ids, num_context, 0.25)
    torch.testing.assert_close(actual, expected, atol=1e-4, rtol=1e-4)


def test_default_splits_decode() -> None:
    # On CPU the default is one split (no parallelism to fill); the result is still right.
    check_decode([5, 30], 8, kv_heads=1, group=2)


@pytest.mark.parametrize(
    ("batch", "kv_heads", "max_tiles", "expected"),
    [
        (1, 8, 4, 1),  # short context: not worth splitting
        (64, 8, 512, 1),  # 512 programs already fill 132 SMs
        (1, 8, 512, 16),  # one long sequence: as many splits as allowed
        (4, 8, 512, 4),  # 32 programs: 132 / 32 -> 5, rounded down to a power of two
        (1, 8, 24, 2),  # limited by length: 24 tiles / 8 per split -> 3 -> 2
    ],
)
def test_choose_num_splits(batch: int, kv_heads: int, max_tiles: int, expected: int) -> None:
    assert choose_num_splits(batch, kv_heads, max_tiles, num_sms=132) == expected


def test_rejects_unsupported_shapes() -> None:
    seqs = Sequences([4], 8, 2, 16, torch.float32)
    table, lens = seqs.padded_tables(), torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="num_heads"):
        paged_decode_attention(
            random_q(1, 3, 16, torch.float32), seqs.k_cache, seqs.v_cache, table, lens, 1.0
        )
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(
            random_q(1, 2, 8, torch.float32), seqs.k_cache, seqs.v_cache, table, lens, 1.0
        )


def test_aot_specs_name_every_kernel_argument() -> None:
    assert AOT_SPECS
    names = [spec.name for spec in AOT_SPECS]
    assert len(set(names)) == len(names)
    for spec in AOT_SPECS:
        assert list(spec.signature) == list(spec.kernel.arg_names), spec.name
        constexpr_args = {arg for arg, kind in spec.signature.items() if kind == "constexpr"}
        assert constexpr_args == set(spec.constexprs), spec.name
    kernels = {
        spec.kernel.fn.__name__ if hasattr(spec.kernel, "fn") else spec.kernel.__name__
        for spec in AOT_SPECS
    }
    assert kernels == {"_paged_decode_kernel", "_split_kv_reduce_kernel", "_paged_prefill_kernel"}
