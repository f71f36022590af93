"""The kernel fixes for the GPU's first contact, under the interpreter (issue 28): the varlen
prefill (every chunk of a step in one launch) against the per-sequence torch reference, the
decode tile/warp knobs the check's sweep turns, and both K storages (`allocate_kv_cache`'s
head_dim-innermost one for the GPU, the contiguous transposed blocks for the CPU kernels).

Unused cache slots and outputs hold NaN, the block tables are shuffled, the lengths ragged.
"""

from __future__ import annotations

import pytest
import torch

from triollm.kernels.attention import (
    allocate_kv_cache,
    plan_prefill,
    prefill_attention,
    prefill_attention_chunks,
    write_kv,
)
from triollm.kernels.triton.attention import (
    paged_decode_attention,
    paged_prefill_attention,
    paged_prefill_attention_varlen,
)

TOL = {torch.float32: 1e-4, torch.float16: 2e-2}


class Cache:
    """A NaN-poisoned one-layer cache holding random K/V of sequences of `lens` tokens in
    shuffled blocks (block 0 left unused, so a padded table's entries read NaN)."""

    def __init__(
        self, lens: list[int], bs: int, kvh: int, hd: int, dtype: torch.dtype, head_dim_last: bool
    ) -> None:
        g = torch.Generator().manual_seed(sum(lens) + bs)
        need = [-(-n // bs) for n in lens]
        nb = 2 * sum(need) + 2
        kv = allocate_kv_cache(1, nb, bs, kvh, hd, dtype, "cpu", k_head_dim_last=head_dim_last)
        self.k, self.v = kv.k[0].fill_(float("nan")), kv.v[0].fill_(float("nan"))
        free = (torch.randperm(nb - 1, generator=g) + 1).tolist()
        self.tables = [[free.pop() for _ in range(m)] for m in need]
        self.keys = [torch.randn(n, kvh, hd, generator=g).to(dtype) for n in lens]
        self.values = [torch.randn(n, kvh, hd, generator=g).to(dtype) for n in lens]
        for table, k, v in zip(self.tables, self.keys, self.values):
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(len(k))])
            write_kv(self.k, self.v, k, v, slots)


def test_the_gpu_layout_is_the_same_tensor_shape_with_head_dim_innermost() -> None:
    gpu = allocate_kv_cache(1, 4, 16, 2, 32, torch.float16, "cpu", k_head_dim_last=True)
    cpu = allocate_kv_cache(1, 4, 16, 2, 32, torch.float16, "cpu", k_head_dim_last=False)
    assert gpu.k[0].shape == cpu.k[0].shape == (2, 4, 32, 16)
    assert gpu.k[0].stride(2) == 1 and cpu.k[0].stride(3) == 1
    assert cpu.k[0].is_contiguous() and gpu.k[0].transpose(2, 3).is_contiguous()


@pytest.mark.parametrize("head_dim_last", [True, False], ids=["gpu-layout", "cpu-layout"])
@pytest.mark.parametrize(
    ("dtype", "tile_n", "num_warps"),
    [(torch.float32, None, 4), (torch.float32, 64, 2), (torch.float16, 32, 8)],
    ids=["fp32-default", "fp32-tile64", "fp16-tile32"],
)
def test_decode_tiles_and_layouts_match_the_reference(
    head_dim_last: bool, dtype: torch.dtype, tile_n: int | None, num_warps: int
) -> None:
    lens, bs, kvh, group, hd = [1, 23, 70, 16], 8, 2, 3, 32
    cache = Cache(lens, bs, kvh, hd, dtype, head_dim_last)
    width = max(map(len, cache.tables))
    tables = torch.tensor([t + [0] * (width - len(t)) for t in cache.tables], dtype=torch.int32)
    q = torch.randn(len(lens), kvh * group, hd, generator=torch.Generator().manual_seed(1)).to(dtype)
    out = torch.full_like(q, float("nan"))
    paged_decode_attention(
        q, cache.k, cache.v, tables, torch.tensor(lens, dtype=torch.int32), hd**-0.5,
        tile_n=tile_n, num_warps=num_warps, out=out,
    )  # fmt: skip
    for b, n in enumerate(lens):
        expected = prefill_attention(  # the last token of a prefill is this decode
            q[b : b + 1], cache.keys[b][-1:], cache.values[b][-1:], cache.k, cache.v,
            torch.tensor(cache.tables[b]), n - 1, hd**-0.5,
        )  # fmt: skip
        torch.testing.assert_close(out[b : b + 1].float(), expected.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_rejects_bad_tuning_knobs() -> None:
    cache = Cache([4], 16, 1, 16, torch.float32, True)
    args = (torch.zeros(1, 1, 16), cache.k, cache.v, torch.tensor([cache.tables[0]], dtype=torch.int32))
    lens = torch.tensor([4], dtype=torch.int32)
    with pytest.raises(ValueError, match="tile_n: 8 must be a power of two >= 16"):
        paged_decode_attention(*args, lens, 1.0, tile_n=8)
    with pytest.raises(ValueError, match="tile_n: 48"):
        paged_decode_attention(*args, lens, 1.0, tile_n=48)
    with pytest.raises(ValueError, match="num_warps: 3"):
        paged_decode_attention(*args, lens, 1.0, num_warps=3)


# Chunks: a fresh prompt, a prefix hit ending mid-block, one token after a long context, a
# prompt longer than one query tile; in the order a step lays them out.
CHUNKS = [(0, 21), (37, 9), (60, 1), (0, 48)]  # (earlier tokens, new tokens)


@pytest.mark.parametrize(
    ("dtype", "head_dim_last", "extra"),
    [
        (torch.float32, True, {}),
        (torch.float16, True, {}),
        (torch.float32, False, {}),
        (torch.float32, True, {"window": 13, "softcap": 5.0}),
    ],
    ids=["fp32", "fp16", "cpu-layout", "window-softcap"],
)
def test_varlen_prefill_is_the_per_sequence_prefill(
    dtype: torch.dtype, head_dim_last: bool, extra: dict[str, float]
) -> None:
    bs, kvh, group, hd = 8, 2, 3, 16
    cache = Cache([c + n for c, n in CHUNKS], bs, kvh, hd, dtype, head_dim_last)
    rows = sum(n for _, n in CHUNKS)
    q = torch.randn(rows, kvh * group, hd, generator=torch.Generator().manual_seed(2)).to(dtype)
    width = max(map(len, cache.tables)) + 1  # one spare column of padding (block 0: NaN)
    tables = torch.tensor([t + [0] * (width - len(t)) for t in cache.tables], dtype=torch.int32)
    starts = torch.tensor([0] + [sum(n for _, n in CHUNKS[: i + 1]) for i in range(len(CHUNKS))], dtype=torch.int32)
    contexts = torch.tensor([c for c, _ in CHUNKS], dtype=torch.int32)
    buffer = torch.full((rows + 4, kvh * group, hd), float("nan"), dtype=dtype)
    out = buffer[2 : 2 + rows]
    paged_prefill_attention_varlen(
        q, cache.k, cache.v, tables, starts, contexts, max(n for _, n in CHUNKS), hd**-0.5, out=out, **extra
    )  # type: ignore[arg-type]
    assert buffer[:2].isnan().all() and buffer[-2:].isnan().all()
    for i, (c, n) in enumerate(CHUNKS):
        s = int(starts[i])
        expected = paged_prefill_attention(
            q[s : s + n], cache.k, cache.v, torch.tensor(cache.tables[i]), c, hd**-0.5, **extra  # type: ignore[arg-type]
        )
        torch.testing.assert_close(out[s : s + n], expected, atol=TOL[dtype], rtol=TOL[dtype])
        if not extra:  # and the torch reference, for the plain case
            ref = prefill_attention(
                q[s : s + n], cache.keys[i][c:], cache.values[i][c:], cache.k, cache.v,
                torch.tensor(cache.tables[i]), c, hd**-0.5,
            )  # fmt: skip
            torch.testing.assert_close(out[s : s + n].float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.parametrize("kernels", ["triton", "torch"])
def test_a_prefill_plan_runs_every_chunk(kernels: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """`plan_prefill` + `prefill_attention_chunks`, the dispatch a step uses: one varlen launch on
    the Triton path, a call per chunk on the torch path, the same result."""
    monkeypatch.setenv("TRIOLLM_KERNELS", kernels)
    bs, kvh, group, hd = 16, 1, 4, 16
    cache = Cache([c + n for c, n in CHUNKS], bs, kvh, hd, torch.float32, kernels == "triton")
    rows = sum(n for _, n in CHUNKS)
    q = torch.randn(rows, kvh * group, hd, generator=torch.Generator().manual_seed(3))
    k = torch.cat([key[c:] for key, (c, _) in zip(cache.keys, CHUNKS)])
    v = torch.cat([val[c:] for val, (c, _) in zip(cache.values, CHUNKS)])
    plan = plan_prefill([(n, c, t) for (c, n), t in zip(CHUNKS, cache.tables)], "cpu")
    assert (plan.triton is not None) == (kernels == "triton")
    assert plan.max_tokens == 48 and [r[:3] for r in plan.chunks] == [(0, 21, 0), (21, 9, 37), (30, 1, 60), (31, 48, 0)]
    out = prefill_attention_chunks(q, k, v, cache.k, cache.v, plan, hd**-0.5)
    s = 0
    for i, (c, n) in enumerate(CHUNKS):
        expected = prefill_attention(
            q[s : s + n], k[s : s + n], v[s : s + n], cache.k, cache.v, torch.tensor(cache.tables[i]), c, hd**-0.5
        )
        torch.testing.assert_close(out[s : s + n], expected, atol=1e-4, rtol=1e-4)
        s += n


def test_varlen_rejects_mismatched_plans() -> None:
    cache = Cache([4], 16, 1, 16, torch.float32, True)
    q = torch.zeros(4, 1, 16)
    tables = torch.tensor([cache.tables[0]], dtype=torch.int32)
    with pytest.raises(ValueError, match="block_tables"):
        paged_prefill_attention_varlen(
            q,
            cache.k,
            cache.v,
            tables,
            torch.tensor([0, 4], dtype=torch.int32),
            torch.zeros(2, dtype=torch.int32),
            4,
            1.0,
        )
    with pytest.raises(ValueError, match="max_tokens: 0"):
        paged_prefill_attention_varlen(
            q,
            cache.k,
            cache.v,
            tables,
            torch.tensor([0, 4], dtype=torch.int32),
            torch.zeros(1, dtype=torch.int32),
            0,
            1.0,
        )
