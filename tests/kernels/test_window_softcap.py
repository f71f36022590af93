"""Sliding-window attention and attention-logit soft-capping in every kernel path (the torch
path, the native CPU kernel, the Triton kernels under the interpreter), against dense fp32
attention over the unpaged K/V.

The K/V a windowed call must not read are NaN: the blocks wholly before each row's window
(every path skips them), and for the Triton kernels, which mask their loads per position, every
position before the window. Block 0 stays zero: the torch path pads its gathers with it.
"""

from __future__ import annotations

import pytest
import torch

from triollm.kernels import attention as attention_module
from triollm.kernels import cpu_native
from triollm.kernels.attention import (
    allocate_kv_cache,
    decode_attention,
    paged_decode_attention,
    plan_decode,
    prefill_attention,
    write_kv,
)

SCALE = 0.7  # scores of a few units, so a soft-cap of 1.5 changes them a lot
CAP = 1.5
NATIVE_OK = pytest.mark.skipif(not cpu_native.available(), reason="no native kernels")
BACKENDS = ["torch", pytest.param("native", marks=NATIVE_OK), "triton"]


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: int,
    window: int | None,
    softcap: float | None,
) -> torch.Tensor:
    """Dense fp32 attention: q [n, H, d] at positions offset.., k/v [L, kvh, d] at 0..L-1."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    i = torch.arange(q.shape[0])[:, None] + offset
    j = torch.arange(k.shape[0])[None, :]
    allowed = j <= i
    if window is not None:
        allowed &= j > i - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


def assert_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    seqs: Paged,
    lens: list[int],
    window: int | None,
    softcap: float | None,
    tol: float,
) -> None:
    """Each decode row (the query at position n - 1) against the dense reference."""
    for row, n in enumerate(lens):
        expected = reference(q[row : row + 1], seqs.k[row], seqs.v[row], n - 1, window, softcap)
        torch.testing.assert_close(out[row : row + 1], expected, rtol=tol, atol=tol)


class Paged:
    """Random K/V of sequences of the given lengths in shuffled blocks of a one-layer cache;
    `k`, `v` hold them as the cache stores them (rounded to its dtype), in fp32."""

    def __init__(
        self,
        lens: list[int],
        bs: int,
        kvh: int,
        d: int,
        dtype: torch.dtype,
        seed: int = 0,
    ) -> None:
        g = torch.Generator().manual_seed(seed)
        need = [-(-n // bs) for n in lens]
        num_blocks = sum(need) + 2
        cache = allocate_kv_cache(1, num_blocks, bs, kvh, d, dtype, "cpu")
        self.kc, self.vc, self.bs = cache.k[0], cache.v[0], bs
        free = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()  # block 0 stays zero
        self.tables = [[free.pop() for _ in range(m)] for m in need]
        self.k = [torch.randn(n, kvh, d, generator=g).to(dtype).float() for n in lens]
        self.v = [torch.randn(n, kvh, d, generator=g).to(dtype).float() for n in lens]
        for row in range(len(lens)):
            self._write(row, range(lens[row]), self.k[row], self.v[row])

    def _write(self, row: int, positions: range, k: torch.Tensor, v: torch.Tensor) -> None:
        table, bs = self.tables[row], self.bs
        slots = torch.tensor([table[p // bs] * bs + p % bs for p in positions], dtype=torch.long)
        write_kv(self.kc, self.vc, k, v, slots)

    def poison(self, row: int, upto: int, whole_blocks: bool) -> None:
        """NaN at the row's positions before `upto` (those of its whole blocks before it)."""
        if whole_blocks:
            upto = upto // self.bs * self.bs
        if upto > 0:
            nan = torch.full((upto, *self.k[row].shape[1:]), float("nan"))
            self._write(row, range(upto), nan, nan)

    def table(self) -> torch.Tensor:
        width = max(map(len, self.tables))
        return torch.tensor([t + [0] * (width - len(t)) for t in self.tables], dtype=torch.int32)


def use_backend(backend: str, monkeypatch: pytest.MonkeyPatch) -> bool | None:
    """Select the backend; returns the `native` argument of the decode functions."""
    if backend == "triton":
        pytest.importorskip("triton", reason="triton is not installed")
        monkeypatch.setenv("TRIOLLM_KERNELS", "triton")  # the interpreter (conftest.py)
        return False
    monkeypatch.setenv("TRIOLLM_KERNELS", "torch")
    return backend == "native"


def check_decode(
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    lens: list[int],
    bs: int,
    window: int | None,
    softcap: float | None,
    *,
    kvh: int = 2,
    group: int = 4,
    d: int = 16,
    cache_dtype: torch.dtype = torch.float32,
    tol: float = 1e-5,
) -> None:
    native = use_backend(backend, monkeypatch)
    seqs = Paged(lens, bs, kvh, d, cache_dtype)
    if window is not None:
        for row, n in enumerate(lens):
            seqs.poison(row, n - window, whole_blocks=backend != "triton")
    q = torch.randn(len(lens), kvh * group, d, generator=torch.Generator().manual_seed(1))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = paged_decode_attention(
        q,
        seqs.kc,
        seqs.vc,
        seqs.table(),
        lens_t,
        SCALE,
        native=native,
        window=window,
        softcap=softcap,
    )
    assert_decode(out, q, seqs, lens, window, softcap, tol)


# (block size, window, lengths): windows below a block, a multiple of it, across blocks;
# lengths below, at and past the window, not multiples of the block size.
DECODE_CASES = [
    (4, 3, [1, 2, 3, 4, 7, 13]),
    (4, 8, [5, 8, 9, 16, 22]),
    (8, 6, [1, 6, 7, 11, 30]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("softcap", [None, CAP], ids=["window", "window+softcap"])
@pytest.mark.parametrize(("bs", "window", "lens"), DECODE_CASES, ids=["w<block", "w=2blocks", "w-across"])
def test_decode_window(
    backend: str,
    softcap: float | None,
    bs: int,
    window: int,
    lens: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_decode(backend, monkeypatch, lens, bs, window, softcap)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_softcap(backend: str, monkeypatch: pytest.MonkeyPatch) -> None:
    check_decode(backend, monkeypatch, [1, 5, 12, 19], 4, None, CAP)


@NATIVE_OK
@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "fp32-over-bf16"])
@pytest.mark.parametrize(("window", "softcap"), [(20, None), (16, None), (7, CAP), (None, CAP)])
@pytest.mark.parametrize(("group", "d"), [(4, 64), (2, 256), (16, 96)])
def test_native_decode_block16_instances(
    window: int | None,
    softcap: float | None,
    cache_dtype: torch.dtype,
    group: int,
    d: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Block size 16, head dim 64: the GQA-group instances (window) and the block-16 capped
    instance, also over a bf16 cache under fp32 queries (on a CPU with AVX-512 BF16 the group
    instances take `vdpbf16ps` there, the query and probabilities rounded to bf16: bf16's
    tolerance). Head dims 256 (Gemma 2's) and 96 under 16 query heads: the many-heads kernel,
    with the bf16 dot products over a bf16 cache too, fp32 arithmetic where capped."""
    lens = [1, 15, 16, 17, 40, 50]
    bf16_dot = cache_dtype == torch.bfloat16 and softcap is None and cpu_native.decode_attention_dot() == "bf16"
    check_decode(
        "native",
        monkeypatch,
        lens,
        16,
        window,
        softcap,
        group=group,
        d=d,
        cache_dtype=cache_dtype,
        # the query's bf16 rounding, summed over head_dim: a wider head moves a score more
        tol=(2e-2 if d == 64 else 4e-2) if bf16_dot else 1e-5,
    )


@pytest.mark.parametrize("num_splits", [2, 3])
def test_triton_decode_split_kv_window(num_splits: int) -> None:
    """Split-KV over a window spanning several tiles: the splits share the window's tiles."""
    pytest.importorskip("triton", reason="triton is not installed")
    from triollm.kernels.triton.attention import paged_decode_attention as triton_decode

    lens, bs, window = [3, 40, 75], 8, 41
    seqs = Paged(lens, bs, 1, 16, torch.float32, seed=2)
    for row, n in enumerate(lens):
        seqs.poison(row, n - window, whole_blocks=False)
    q = torch.randn(len(lens), 3, 16, generator=torch.Generator().manual_seed(3))
    lens_t = torch.tensor(lens, dtype=torch.int32)
    out = triton_decode(
        q,
        seqs.kc,
        seqs.vc,
        seqs.table(),
        lens_t,
        SCALE,
        window=window,
        softcap=CAP,
        num_splits=num_splits,
    )
    assert_decode(out, q, seqs, lens, window, CAP, 1e-5)


def test_window_longer_than_every_row_is_no_window(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The torch path reuses the plan's own groups: the same result as without a window."""
    monkeypatch.setenv("TRIOLLM_KERNELS", "torch")
    seqs = Paged([3, 9, 14], 4, 2, 16, torch.float32)
    q = torch.randn(3, 4, 16)
    plan = plan_decode(seqs.tables, [3, 9, 14], 4, "cpu", native=False)
    plain = decode_attention(q, seqs.kc, seqs.vc, plan, SCALE)
    assert plan.window_groups(14) is plan.groups
    assert torch.equal(decode_attention(q, seqs.kc, seqs.vc, plan, SCALE, window=14), plain)
    assert plan.window_groups(5) is plan.window_groups(5)  # built once per window


def check_prefill(
    backend: str,
    monkeypatch: pytest.MonkeyPatch,
    num_context: int,
    n: int,
    bs: int,
    window: int | None,
    softcap: float | None,
) -> None:
    use_backend(backend, monkeypatch)
    kvh, group, d = 2, 3, 16
    total = num_context + n
    seqs = Paged([total], bs, kvh, d, torch.float32, seed=4)
    if window is not None:  # before the first new token's window
        seqs.poison(0, num_context - window + 1, whole_blocks=backend != "triton")
    q = torch.randn(n, kvh * group, d, generator=torch.Generator().manual_seed(5))
    k_new, v_new = seqs.k[0][num_context:], seqs.v[0][num_context:]
    block_ids = torch.tensor(seqs.tables[0], dtype=torch.long)
    out = prefill_attention(
        q,
        k_new,
        v_new,
        seqs.kc,
        seqs.vc,
        block_ids,
        num_context,
        SCALE,
        window=window,
        softcap=softcap,
    )
    expected = reference(q, seqs.k[0], seqs.v[0], num_context, window, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)


# (block size, context, new tokens, window): no context; a window shorter than the chunk and
# than the context; a window of two blocks; a window below a block.
PREFILL_CASES = [(4, 0, 11, 4), (4, 13, 6, 5), (4, 9, 7, 8), (8, 20, 5, 3)]


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("softcap", [None, CAP], ids=["window", "window+softcap"])
@pytest.mark.parametrize(
    ("bs", "num_context", "n", "window"),
    PREFILL_CASES,
    ids=["fresh", "chunk", "w=2blocks", "w<block"],
)
def test_prefill_window(
    backend: str,
    softcap: float | None,
    bs: int,
    num_context: int,
    n: int,
    window: int,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    check_prefill(backend, monkeypatch, num_context, n, bs, window, softcap)


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("num_context", [0, 9])
def test_prefill_softcap(backend: str, num_context: int, monkeypatch: pytest.MonkeyPatch) -> None:
    check_prefill(backend, monkeypatch, num_context, 7, 4, None, CAP)


@pytest.mark.parametrize(("window", "softcap"), [(5, None), (5, CAP), (None, CAP)])
def test_prefill_in_query_chunks(window: int | None, softcap: float | None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long chunk runs in pieces of query rows, each over the keys its window reaches."""
    monkeypatch.setattr(attention_module, "_PREFILL_CHUNK_SCORES", 200)  # 200 // (6 * 10) = 3 rows
    check_prefill("torch", monkeypatch, 13, 10, 4, window, softcap)


@pytest.mark.parametrize("window", [0, -3, True, 2.5])
def test_a_bad_window_is_refused(window: object) -> None:
    q = torch.zeros(1, 2, 16)
    seqs = Paged([4], 4, 1, 16, torch.float32)
    plan = plan_decode(seqs.tables, [4], 4, "cpu", native=False)
    with pytest.raises(ValueError, match="window: .* positive number of tokens"):
        decode_attention(q, seqs.kc, seqs.vc, plan, SCALE, window=window)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="window"):
        prefill_attention(
            q,
            q[:, :1],
            q[:, :1],
            seqs.kc,
            seqs.vc,
            torch.tensor([1]),
            0,
            SCALE,
            window=window,
        )  # type: ignore[arg-type]


@pytest.mark.parametrize("softcap", [0.0, -1.0, float("inf"), float("nan")])
def test_a_bad_softcap_is_refused(softcap: float) -> None:
    q = torch.zeros(1, 2, 16)
    seqs = Paged([4], 4, 1, 16, torch.float32)
    plan = plan_decode(seqs.tables, [4], 4, "cpu", native=False)
    with pytest.raises(ValueError, match="softcap: .* finite number > 0"):
        decode_attention(q, seqs.kc, seqs.vc, plan, SCALE, softcap=softcap)
    with pytest.raises(ValueError, match="softcap"):
        prefill_attention(
            q,
            q[:, :1],
            q[:, :1],
            seqs.kc,
            seqs.vc,
            torch.tensor([1]),
            0,
            SCALE,
            softcap=softcap,
        )
