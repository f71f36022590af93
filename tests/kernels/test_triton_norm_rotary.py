"""The Triton RMSNorm and rotary + KV-write kernels against their torch references, run by
Triton's interpreter on CPU (tests/conftest.py sets TRITON_INTERPRET=1 before any import).

fp32 and fp16 only: the interpreter's bf16 is unreliable. Outputs are written into views of
larger buffers filled with a sentinel (guard bands), and the KV cache starts full of the
sentinel, so a stray write anywhere shows up as a changed sentinel.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton", reason="triton is not installed")

from triollm.kernels.attention import write_kv  # noqa: E402
from triollm.kernels.norm import rms_norm as torch_rms_norm  # noqa: E402
from triollm.kernels.rotary import apply_rotary, rotary_cos_sin  # noqa: E402
from triollm.kernels.triton.norm import fused_add_rms_norm, rms_norm  # noqa: E402
from triollm.kernels.triton.rotary import rotary_write_kv  # noqa: E402

SENTINEL = -1234.0  # exact in fp16 and far from any value the kernels produce
DTYPES = [torch.float32, torch.float16]
TOL = {torch.float32: {"atol": 1e-5, "rtol": 1e-5}, torch.float16: {"atol": 2e-3, "rtol": 2e-3}}
EPS = 1e-6


def guarded(shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(buffer, view): `view` has `shape`; it is the inside of a 2-D `buffer` `[rows + 2,
    shape[-1] + 2]` whose margin holds a sentinel (so its rows are not contiguous)."""
    rows = math.prod(shape[:-1])
    buffer = torch.full((rows + 2, shape[-1] + 2), SENTINEL, dtype=dtype)
    return buffer, buffer[1:-1, 1:-1].view(shape)


def assert_guard_intact(buffer: torch.Tensor) -> None:
    inner = torch.zeros_like(buffer, dtype=torch.bool)
    inner[1:-1, 1:-1] = True
    assert (buffer[~inner] == SENTINEL).all(), "a kernel wrote outside its output"


def weight(hidden: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return (1 + 0.1 * torch.randn(hidden, generator=g)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [48, 576])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_rms_norm(rows: int, hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    # x is a column slice of a wider tensor: its row stride is not `hidden`.
    x = (3 * torch.randn(rows, hidden + 5, generator=g)).to(dtype)[:, 2 : hidden + 2]
    w = weight(hidden, dtype, g)
    buffer, out = guarded((rows, hidden), dtype)
    result = rms_norm(x, w, EPS, out=out)
    assert result.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out, torch_rms_norm(x, w, EPS), **TOL[dtype])
    assert_guard_intact(buffer)
    # New output, leading dimensions kept.
    x3 = x.reshape(1, rows, hidden)
    torch.testing.assert_close(rms_norm(x3, w, EPS), torch_rms_norm(x3, w, EPS), **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("hidden", [48, 576])
@pytest.mark.parametrize("rows", [1, 3, 7])
def test_fused_add_rms_norm(rows: int, hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * hidden + 1)
    x = torch.randn(2, rows, hidden, generator=g).to(dtype)
    residual = (4 * torch.randn(2, rows, hidden, generator=g)).to(dtype)
    x_before, residual_before = x.clone(), residual.clone()
    w = weight(hidden, dtype, g)
    out_buffer, out = guarded((2, rows, hidden), dtype)
    res_buffer, res_out = guarded((2, rows, hidden), dtype)

    normed, summed = fused_add_rms_norm(x, residual, w, EPS, out=out, residual_out=res_out)
    expected_sum = (x.float() + residual.float()).to(dtype)
    assert torch.equal(summed, expected_sum)  # one rounding of an exact fp32 sum
    torch.testing.assert_close(normed, torch_rms_norm(expected_sum, w, EPS), **TOL[dtype])
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)
    assert_guard_intact(out_buffer)
    assert_guard_intact(res_buffer)

    # vLLM's in-place form.
    fused_add_rms_norm(x, residual, w, EPS, out=x, residual_out=residual)
    assert torch.equal(x, normed) and torch.equal(residual, summed)


def test_norm_rejects_bad_shapes() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rms_norm(x, torch.randn(3, 9), torch.ones(8), EPS)
    with pytest.raises(ValueError, match="out"):
        rms_norm(x, torch.ones(8), EPS, out=torch.empty(3, 9))
    with pytest.raises(ValueError, match="evenly spaced rows"):
        rms_norm(x.view(3, 2, 4), torch.ones(4), EPS, out=torch.empty(2, 3, 4).transpose(0, 1))


def sequences(block_size: int) -> tuple[list[int], list[int]]:
    """Positions and slots of a ragged batch: a chunk that crosses a block boundary, a single
    decode token, a chunk at a later position; each sequence has its own block table."""
    batch = [  # (first position, tokens, block table)
        (block_size - 2, 4, [5, 2]),
        (0, 1, [7]),
        (3 * block_size + 1, 2, [0, 1, 4, 3]),
    ]
    positions, slots = [], []
    for start, n, table in batch:
        for p in range(start, start + n):
            positions.append(p)
            slots.append(table[p // block_size] * block_size + p % block_size)
    return positions, slots


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [16, 24])
@pytest.mark.parametrize("heads,kv_heads", [(4, 2), (3, 3)], ids=["gqa", "mha"])
@pytest.mark.parametrize("block_size", [8, 16])
def test_rotary_write_kv(
    block_size: int, heads: int, kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    g = torch.Generator().manual_seed(block_size + heads + head_dim)
    cos, sin = rotary_cos_sin(head_dim, 64, 10000.0)
    position_list, slot_list = sequences(block_size)
    positions, slots = torch.tensor(position_list), torch.tensor(slot_list)
    t = len(position_list)
    # q, k, v are views of one fused projection output, as the model produces them.
    qkv = torch.randn(t, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    q, k, v = (
        part.view(t, -1, head_dim)
        for part in qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], 1)
    )
    qkv_before = qkv.clone()
    num_blocks = 8
    k_cache = torch.full((kv_heads, num_blocks, head_dim, block_size), SENTINEL, dtype=dtype)
    v_cache = torch.full((kv_heads, num_blocks, block_size, head_dim), SENTINEL, dtype=dtype)
    q_buffer, q_out = guarded((t, heads, head_dim), dtype)
    k_buffer, k_out = guarded((t, kv_heads, head_dim), dtype)

    rotary_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots, q_out=q_out, k_out=k_out)

    q_ref = apply_rotary(q.float(), cos[positions], sin[positions]).to(dtype)
    k_ref = apply_rotary(k.float(), cos[positions], sin[positions]).to(dtype)
    torch.testing.assert_close(q_out, q_ref, **TOL[dtype])
    torch.testing.assert_close(k_out, k_ref, **TOL[dtype])
    assert torch.equal(qkv, qkv_before)
    assert_guard_intact(q_buffer)
    assert_guard_intact(k_buffer)

    k_expected = torch.full_like(k_cache, SENTINEL)
    v_expected = torch.full_like(v_cache, SENTINEL)
    write_kv(k_expected, v_expected, k_ref, v, slots)
    # Exactly the intended slots changed...
    assert torch.equal(k_cache == SENTINEL, k_expected == SENTINEL)
    assert torch.equal(v_cache == SENTINEL, v_expected == SENTINEL)
    assert (v_cache != SENTINEL).sum() == t * kv_heads * head_dim
    # ...to the rotated k and the untouched v.
    torch.testing.assert_close(k_cache, k_expected, **TOL[dtype])
    assert torch.equal(v_cache, v_expected)

    # New outputs by default.
    q_new, k_new = rotary_write_kv(q, k, v, cos, sin, positions, k_cache, v_cache, slots)
    assert torch.equal(q_new, q_out) and torch.equal(k_new, k_out)


def test_rotary_rejects_bad_shapes() -> None:
    cos, sin = rotary_cos_sin(8, 16, 10000.0)
    q, k = torch.randn(2, 2, 8), torch.randn(2, 1, 8)
    k_cache, v_cache = torch.zeros(1, 4, 8, 4), torch.zeros(1, 4, 4, 8)
    positions, slots = torch.tensor([0, 1]), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="k_cache"):
        rotary_write_kv(q, k, k, cos, sin, positions, k_cache.transpose(2, 3), v_cache, slots)
    with pytest.raises(ValueError, match="head_dim 8"):
        rotary_write_kv(q, k, k, cos[:, :4], sin, positions, k_cache, v_cache, slots)
    with pytest.raises(ValueError, match="slot_mapping"):
        rotary_write_kv(q, k, k, cos, sin, positions, k_cache, v_cache, slots[:1])
