"""The native product of a few rows with weights read in place (kernels/csrc/small_matmul.cpp),
which decode's MoE experts and DeepSeek's absorbed per-head projections take, and decode's dense
linears over oneDNN's packed weight (`blocked_matvec`, `Linear.blocked`), against torch."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from triollm.engine.execution.layers.linear import (
    Linear,
    blocked_view,
    few_rows_matmul,
    onednn_linear,
    pack_weight,
    packable,
)
from triollm.kernels import cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")

DTYPES = [torch.float32, torch.bfloat16]


def _tol(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2  # a bf16 result is rounded once


@pytest.mark.parametrize("x_dtype", DTYPES, ids=["x-fp32", "x-bf16"])
@pytest.mark.parametrize("w_dtype", DTYPES, ids=["w-fp32", "w-bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(("batch", "k", "n"), [(1, 1024, 512), (16, 64, 256), (3, 100, 37), (2, 17, 5), (1, 40, 130)])
def test_both_layouts_match_torch(
    x_dtype: torch.dtype, w_dtype: torch.dtype, rows: int, batch: int, k: int, n: int
) -> None:
    """x @ w^T (a linear's [N, K]) and x @ w ([K, N]): any K (16-wide lanes and a tail), any N
    (4-row groups and single rows; 64-wide column chunks and a narrower last one)."""
    g = torch.Generator().manual_seed(rows * 1000 + k + n)
    x = torch.randn(batch, rows, k, generator=g).to(x_dtype)
    w_nk = torch.randn(batch, n, k, generator=g).to(w_dtype)
    w_kn = torch.randn(batch, k, n, generator=g).to(w_dtype)
    for w, kn, ref in (
        (w_nk, False, x.double() @ w_nk.double().transpose(1, 2)),
        (w_kn, True, x.double() @ w_kn.double()),
    ):
        out = few_rows_matmul(x, w, w_is_kn=kn)
        assert out is not None and out.dtype == x_dtype and out.shape == (batch, rows, n)
        scale = ref.abs().max().item()
        assert (out.double() - ref).abs().max().item() <= _tol(x_dtype) * scale


def test_weights_are_read_in_place_from_a_strided_view() -> None:
    """A view into a fused per-head weight (DeepSeek's kv_b_proj: W_UK rows then W_UV rows per
    head) and one expert of a stacked [E, N, K] tensor: the same numbers as the copies give."""
    g = torch.Generator().manual_seed(0)
    heads, nope, v, rank = 4, 24, 40, 64
    fused = torch.randn(heads, nope + v, rank, generator=g)
    q = torch.randn(heads, 1, nope, generator=g)
    lat = torch.randn(heads, 2, rank, generator=g)
    w_uk, w_uv = fused[:, :nope], fused[:, nope:]
    assert not w_uk.is_contiguous() and not w_uv.is_contiguous()
    got_k = few_rows_matmul(q, w_uk, w_is_kn=True)
    got_v = few_rows_matmul(lat, w_uv)
    assert got_k is not None and got_v is not None
    torch.testing.assert_close(got_k, torch.bmm(q, w_uk.contiguous()), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_v, torch.bmm(lat, w_uv.contiguous().transpose(1, 2)), rtol=1e-5, atol=1e-5)
    q_t = torch.randn(2, heads, nope, generator=g).transpose(0, 1)  # a strided x, as the model passes it
    got_t = few_rows_matmul(q_t, w_uk, w_is_kn=True)
    assert got_t is not None and not q_t.is_contiguous()
    torch.testing.assert_close(got_t, torch.bmm(q_t, w_uk.contiguous()), rtol=1e-5, atol=1e-5)
    experts = torch.randn(8, 32, 48, generator=g)
    x = torch.randn(1, 3, 48, generator=g)
    got = few_rows_matmul(x, experts[5][None])
    assert got is not None
    torch.testing.assert_close(got[0], x[0] @ experts[5].t(), rtol=1e-5, atol=1e-5)


def test_a_row_does_not_depend_on_the_others() -> None:
    """Each row's sums are its own: alone or beside three others, the same bits."""
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, 4, 300, generator=g)
    w = torch.randn(1, 70, 300, generator=g)
    together = few_rows_matmul(x, w)
    assert together is not None
    for i in range(4):
        alone = few_rows_matmul(x[:, i : i + 1], w)
        assert alone is not None and torch.equal(alone[0, 0], together[0, i])


def test_what_the_kernel_does_not_take_is_left_to_torch() -> None:
    """More than FEW_ROWS rows, a transposed (column-major) weight, fp16: None, and the caller
    runs torch's product."""
    x = torch.randn(1, cpu_native.FEW_ROWS + 1, 32)
    w = torch.randn(1, 16, 32)
    assert few_rows_matmul(x, w) is None
    assert few_rows_matmul(x[:, :1], w.transpose(1, 2).contiguous().transpose(1, 2)) is None
    assert few_rows_matmul(x[:, :1].half(), w.half()) is None


def _blocked(w: torch.Tensor, kp: int) -> torch.Tensor:
    """w `[n, k]` in oneDNN's packed layout as the kernel reads it (kernels/csrc/small_matmul.cpp):
    blocks of 64 rows, k-major, k padded to kp and n to a multiple of 64 with zeros; bf16 in
    pairs along k."""
    n, k = w.shape
    nb = -(-n // 64)
    padded = torch.zeros(nb * 64, kp, dtype=w.dtype)
    padded[:n, :k] = w
    blocks = padded.view(nb, 64, kp)
    if w.dtype == torch.float32:
        return blocks.transpose(1, 2).contiguous().view(-1)  # [nb, kp, 64]
    return blocks.view(nb, 64, kp // 2, 2).permute(0, 2, 1, 3).contiguous().view(-1)  # [nb, kp/2, 64, 2]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("n", "k", "kp"), [(1536, 1024, 1024), (100, 1000, 1024), (1, 64, 0), (7, 33, 0), (130, 7, 32), (64, 17, 18)]
)
def test_blocked_layout_matches_torch(dtype: torch.dtype, rows: int, n: int, k: int, kp: int) -> None:
    """x @ W^T + b with W in the packed layout: any n (a narrower last block), a k padded to kp,
    an odd k in bf16 (its last pair half padding), the plain rows of a one-row weight (kp = 0);
    in x's dtype or, asked, in fp32 before rounding."""
    g = torch.Generator().manual_seed(rows * 100 + n + k)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    data = w.reshape(-1).clone() if kp == 0 else _blocked(w, kp)
    ref = x.double() @ w.double().t() + bias.double()
    for b, want in ((None, ref - bias.double()), (bias, ref)):
        out = cpu_native.blocked_matvec(x, data, n, kp, b)
        assert out.dtype == dtype and out.shape == (rows, n)
        assert (out.double() - want).abs().max().item() <= _tol(dtype) * want.abs().max().item()
        wide = cpu_native.blocked_matvec(x, data, n, kp, b, fp32_out=True)
        assert wide.dtype == torch.float32
        assert torch.equal(out, wide.to(dtype))  # rounded once, as torch rounds
        assert (wide.double() - want).abs().max().item() <= 1e-5 * want.abs().max().item()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_blocked_row_does_not_depend_on_the_others(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 300, generator=g).to(dtype)
    w = torch.randn(200, 300, generator=g).to(dtype)
    data = _blocked(w, 320)
    together = cpu_native.blocked_matvec(x, data, 200, 320, None)
    for i in range(4):
        assert torch.equal(cpu_native.blocked_matvec(x[i : i + 1], data, 200, 320, None)[0], together[i])


def test_blocked_sizes_that_disagree_are_refused() -> None:
    w = _blocked(torch.randn(70, 32), 32)
    with pytest.raises(RuntimeError, match="blocks of kp x 64"):
        cpu_native.blocked_matvec(torch.randn(1, 32), w, 70, 16, None)
    with pytest.raises(RuntimeError, match="1 to 4 rows"):
        cpu_native.blocked_matvec(torch.randn(5, 32), w, 70, 32, None)
    with pytest.raises(RuntimeError, match="both fp32 or both bf16"):
        cpu_native.blocked_matvec(torch.randn(1, 32).bfloat16(), w, 70, 32, None)


def _avx512() -> bool:
    return "avx512f" in cpu_native._cpu_flags()


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize(("n", "k"), [(1, 1024), (8, 1024), (100, 1000), (1536, 576), (300, 7)])
def test_a_packed_linear_reads_onednn_s_buffer_in_place(dtype: torch.dtype, n: int, k: int) -> None:
    """A packed Linear runs 1-4 rows through the kernel over oneDNN's own buffer (no copy) and
    more rows through oneDNN; both give F.linear's numbers. On AVX-512 oneDNN's fp32 layout is the
    one the kernel reads, so there it must be found."""
    g = torch.Generator().manual_seed(n + k)
    w = torch.randn(n, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    if not packable(w):
        pytest.skip(f"oneDNN does not run {dtype} here")
    layer = Linear(k, [(0, n)], bias=True)
    with torch.no_grad():
        layer.weight.data = w.clone()
        layer.bias.data = bias.clone()
    layer.pack()
    assert layer.packed
    if dtype == torch.float32 and _avx512():
        assert layer.blocked is not None
    for rows in (0, 1, 2, 3, 4, 5, 9):
        x = torch.randn(rows, k, generator=g).to(dtype)
        out = layer(x)
        ref = F.linear(x.double(), w.double(), bias.double())
        terms = F.linear(x.double().abs(), w.double().abs(), bias.double().abs())  # sums of |terms|
        assert out.dtype == dtype
        assert out.shape == (rows, n)
        if rows == 0:
            continue  # no rows: oneDNN's call, as before
        assert (out.double() - ref).abs().max().item() <= _tol(dtype) * terms.max().item()
        if layer.blocked is not None and rows <= cpu_native.FEW_ROWS:
            assert torch.equal(out, cpu_native.blocked_matvec(x, layer.blocked.data, n, layer.blocked.kp, layer.bias))
        else:
            assert torch.equal(out, onednn_linear(x, layer.weight, layer.bias))


def test_a_layout_that_does_not_compute_the_weight_is_refused() -> None:
    """The load-time check is a product against the dense weight: a buffer that holds other
    numbers (here another weight's) is not taken, and the layer keeps oneDNN's call."""
    g = torch.Generator().manual_seed(3)
    w = torch.randn(200, 256, generator=g)
    if not packable(w):
        pytest.skip("oneDNN does not run fp32 here")
    packed = pack_weight(w)
    assert blocked_view(packed, w.flip(0)) is None
    assert blocked_view(packed, w * 1.01) is None
    if _avx512():
        assert blocked_view(packed, w) is not None
