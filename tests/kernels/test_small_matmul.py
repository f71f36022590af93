"""The native product of a few rows with weights read in place (kernels/csrc/small_matmul.cpp),
which decode's MoE experts and DeepSeek's absorbed per-head projections take, against torch."""

from __future__ import annotations

import pytest
import torch

from triollm.engine.execution.layers.linear import few_rows_matmul
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
