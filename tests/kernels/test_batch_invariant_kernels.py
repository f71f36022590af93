"""The pieces batch invariance rests on (kernels/batch_invariant.py), each checked for a row's
bits at several batch sizes (==, not a tolerance), on two threads so the kernels' thread splits
change with the batch: prefill rows through the native decode kernel (`plan_rows`) against the
same tokens decoded one at a time; dense GEMMs over fixed row tiles (`tiled_rows`); and the
per-row ops the all-decode path runs (native RMSNorm, SwiGLU, rotary + cache write, torch's
fp32 RMSNorm, the sampler's log_softmax). The end-to-end cases are tests/engine/test_batch_invariance.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch
import torch.nn.functional as F

from triollm.engine import envs
from triollm.engine.execution.layers.activation import gelu_tanh_and_mul
from triollm.engine.execution.layers.linear import onednn_linear, pack_weight, packable
from triollm.kernels import cpu_native
from triollm.kernels.attention import decode_attention, plan_decode
from triollm.kernels.batch_invariant import TILE_ROWS, plan_rows, tiled_rows, unsupported
from triollm.kernels.rotary import apply_rotary_signed

native = pytest.mark.skipif(not cpu_native.available(), reason="native CPU kernels not built")
BS = 16


@pytest.fixture(autouse=True)
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def _cache(num_blocks: int, kvh: int, hd: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    k = torch.randn(kvh, num_blocks, hd, BS, generator=g).to(dtype)
    v = torch.randn(kvh, num_blocks, BS, hd, generator=g).to(dtype)
    return k, v


@native
@pytest.mark.parametrize("window", [None, 20])
def test_prefill_rows_are_decode_rows(window: int | None) -> None:
    """A 50-token sequence's attention, as one prefill chunk, as 16-token chunks beside another
    sequence's decode row, and token by token as decodes: the same bits for every token."""
    h, kvh, hd, n = 6, 2, 64, 50
    k_cache, v_cache = _cache(12, kvh, hd, torch.bfloat16)  # a bf16 cache under fp32 queries
    blocks = [7, 2, 9, 4]  # the sequence's blocks, out of order
    q = torch.randn(n, h, hd, generator=torch.Generator().manual_seed(2))
    scale = hd**-0.5

    def attend(q_rows: torch.Tensor, plan) -> torch.Tensor:  # type: ignore[no-untyped-def]
        return decode_attention(q_rows, k_cache, v_cache, plan, scale, window=window)

    one_by_one = torch.cat([attend(q[i : i + 1], plan_decode([blocks], [i + 1], BS, "cpu")) for i in range(n)])
    whole = attend(q, plan_rows([], [], [(0, n, 0, blocks)], "cpu"))
    assert torch.equal(whole, one_by_one)
    other = torch.randn(1, h, hd)
    chunks = [(1 + c, min(16, n - c), c, blocks) for c in range(0, n, 16)]
    mixed = attend(torch.cat([other, q]), plan_rows([[3, 5]], [20], chunks, "cpu"))
    assert torch.equal(mixed[1:], one_by_one)
    assert torch.equal(mixed[:1], attend(other, plan_decode([[3, 5]], [20], BS, "cpu")))


def _rows_invariant(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, sizes: tuple[int, ...]) -> None:
    """Row 0's bits from fn over x's first m rows, for every m; and every row's, with the rows permuted."""
    first = fn(x[:1])
    for m in sizes:
        assert torch.equal(fn(x[:m])[:1], first), f"{m} rows"
    perm = torch.randperm(x.shape[0], generator=torch.Generator().manual_seed(3))
    assert torch.equal(fn(x[perm]), fn(x)[perm])


@pytest.mark.parametrize("k, n", [(576, 1536), (2048, 1024)])
def test_tiled_gemm_gives_a_row_the_same_bits(k: int, n: int) -> None:
    g = torch.Generator().manual_seed(4)
    w = torch.randn(n, k, generator=g) / k**0.5
    bias = torch.randn(n, generator=g)
    x = torch.randn(3 * TILE_ROWS + 5, k, generator=g)
    sizes = (1, 2, TILE_ROWS - 1, TILE_ROWS, TILE_ROWS + 1, x.shape[0])
    _rows_invariant(lambda t: tiled_rows(lambda a: F.linear(a, w, bias), t), x, sizes)
    if packable(w):
        packed = pack_weight(w)
        _rows_invariant(lambda t: tiled_rows(lambda a: onednn_linear(a, packed, bias), t), x, sizes)
    y = tiled_rows(lambda a: F.linear(a, w, bias), x[:5])
    assert y.shape == (5, n)
    torch.testing.assert_close(y, F.linear(x[:5], w, bias), rtol=1e-5, atol=1e-5)


@native
def test_per_row_ops_do_not_depend_on_the_batch() -> None:
    g = torch.Generator().manual_seed(5)
    sizes = (1, 3, 17, 64, 200)
    x = torch.randn(200, 576, generator=g)
    w = torch.randn(576, generator=g)
    _rows_invariant(lambda t: cpu_native.rms_norm(t, w, 1e-5), x, sizes)
    _rows_invariant(lambda t: F.rms_norm(t, (576,), w, 1e-5), x, sizes)
    _rows_invariant(lambda t: cpu_native.silu_and_mul(t), torch.randn(200, 2 * 1536, generator=g), sizes)
    _rows_invariant(lambda t: t.log_softmax(-1), torch.randn(200, 49152, generator=g) * 4, sizes)
    # Torch's elementwise ops (a partial rotary, Gemma's GeGLU), whose vector loops end in a
    # scalar tail that moves with the tensor's size and the thread split.
    _rows_invariant(gelu_tanh_and_mul, torch.randn(200, 2 * 1000, generator=g), sizes)
    # Each row: 12 heads of 24 rotary dims, then its cos and signed sin (they travel with the row).
    _rows_invariant(
        lambda t: apply_rotary_signed(t[:, :12], t[:, 12:13], t[:, 13:]), torch.randn(200, 14, 24, generator=g), sizes
    )
    # Rotary + cache write: each token's rotated Q, at any batch size.
    h, kvh, hd = 9, 3, 64
    qkv = torch.randn(200, (h + 2 * kvh) * hd, generator=g)
    cos, sin = torch.randn(200, hd, generator=g), torch.randn(200, hd, generator=g)
    k_cache, v_cache = _cache(16, kvh, hd, torch.bfloat16)

    def rotate(t: torch.Tensor) -> torch.Tensor:
        m = t.shape[0]
        slots = torch.arange(m, dtype=torch.long)
        return cpu_native.rotary_write_kv(t.contiguous(), cos[:m], sin[:m], k_cache, v_cache, slots, h, kvh)

    first = rotate(qkv[:1])
    for m in sizes:
        assert torch.equal(rotate(qkv[:m])[:1], first)


def test_the_switch_and_where_it_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    for value, on in (("1", True), ("0", False), ("", False)):
        monkeypatch.setenv(envs.BATCH_INVARIANT_ENV, value)
        assert envs.batch_invariant() is on
    monkeypatch.delenv(envs.BATCH_INVARIANT_ENV)
    assert envs.batch_invariant() is False
    monkeypatch.setenv(envs.BATCH_INVARIANT_ENV, "true")
    with pytest.raises(ValueError, match="VLLM_BATCH_INVARIANT: 'true' is not 0 or 1"):
        envs.batch_invariant()
    assert unsupported("meta") is not None and "meta" in str(unsupported("meta"))
    monkeypatch.setattr(cpu_native, "available", lambda: False)  # no compiler, or TRIOLLM_CPU_KERNELS=0
    assert "native CPU kernels are not available" in str(unsupported("cpu"))
