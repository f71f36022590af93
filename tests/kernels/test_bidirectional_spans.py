"""Bidirectional spans in prefill attention (Gemma 3's images: the positions of one image attend
to each other both ways), against dense fp32 attention under transformers' rule: for full
layers OR(causal, same image); for sliding layers AND(window, OR(causal, same image)).

The spans arrive as `prefill_attention(bidirectional=...)` and as a prefill plan's
`bidirectional` (which also takes a chunk off the Triton path), with and without cached context
(a prefix hit may end inside an image: the chunk then holds the rest of it), and with the query
rows cut into pieces.
"""

from __future__ import annotations

import pytest
import torch
from test_window_softcap import SCALE, Paged, reference

from triollm.kernels import attention as attention_module
from triollm.kernels.attention import plan_prefill, prefill_attention, prefill_attention_chunks
from triollm.kernels.masking import same_span


def span_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    offset: int,
    window: int | None,
    spans: list[tuple[int, int]],
    softcap: float | None = None,
) -> torch.Tensor:
    """Dense fp32 attention: q [n, H, d] at positions offset.., k/v [L, kvh, d] at 0..L-1;
    transformers' image groups (token_type_ids runs) built position by position."""
    q, k, v = q.float(), k.float(), v.float()
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) * SCALE
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    image = [-1] * k.shape[0]
    for g, (first, end) in enumerate(spans):
        image[first:end] = [g] * (end - first)
    allowed = torch.zeros(q.shape[0], k.shape[0], dtype=torch.bool)
    for r in range(q.shape[0]):
        i = r + offset
        for j in range(k.shape[0]):
            ok = j <= i or (image[i] >= 0 and image[i] == image[j])
            if window is not None:
                ok = ok and j > i - window
            allowed[r, j] = ok
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hnl,lhd->nhd", scores.softmax(-1), v)


# (context, new tokens, spans, window): an image mid-chunk; two images, one at the chunk's start;
# a chunk after a prefix hit that ends inside an image; a window shorter than an image; soft-cap.
CASES = [
    (0, 12, [(3, 8)], None),
    (5, 14, [(5, 9), (11, 16)], None),
    (6, 9, [(4, 10)], None),
    (0, 12, [(2, 9)], 3),
    (9, 10, [(7, 12), (14, 17)], 4),
]


@pytest.mark.parametrize(("num_context", "n", "spans", "window"), CASES)
@pytest.mark.parametrize("softcap", [None, 1.5])
def test_prefill_with_bidirectional_spans(
    num_context: int, n: int, spans: list[tuple[int, int]], window: int | None, softcap: float | None
) -> None:
    kvh, group, d, bs = 2, 2, 16, 4
    total = num_context + n
    seqs = Paged([total], bs, kvh, d, torch.float32, seed=4)
    q = torch.randn(n, kvh * group, d, generator=torch.Generator().manual_seed(5))
    k_new, v_new = seqs.k[0][num_context:], seqs.v[0][num_context:]
    block_ids = torch.tensor(seqs.tables[0], dtype=torch.long)
    out = prefill_attention(
        q, k_new, v_new, seqs.kc, seqs.vc, block_ids, num_context, SCALE,
        window=window, softcap=softcap, bidirectional=spans,
    )  # fmt: skip
    expected = span_reference(q, seqs.k[0], seqs.v[0], num_context, window, spans, softcap)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    causal = reference(q, seqs.k[0], seqs.v[0], num_context, window, softcap)
    assert not torch.allclose(out, causal, atol=1e-3)  # the spans change the result


def test_plan_spans_per_chunk_and_query_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    """Two sequences in one plan, spans on the second only; query rows in pieces of 3."""
    monkeypatch.setattr(attention_module, "_PREFILL_CHUNK_SCORES", 200)
    kvh, group, d, bs = 2, 2, 16, 4
    seqs = Paged([7, 15], bs, kvh, d, torch.float32, seed=6)
    contexts, lens, spans = [0, 3], [7, 12], [[], [(4, 9), (10, 13)]]
    q = torch.randn(sum(lens), kvh * group, d, generator=torch.Generator().manual_seed(7))
    k = torch.cat([seqs.k[i][c:] for i, c in enumerate(contexts)])
    v = torch.cat([seqs.v[i][c:] for i, c in enumerate(contexts)])
    plan = plan_prefill([(n, c, t) for n, c, t in zip(lens, contexts, seqs.tables)], "cpu")
    plan.bidirectional = spans
    out = prefill_attention_chunks(q, k, v, seqs.kc, seqs.vc, plan, SCALE)
    for i, (start, n) in enumerate([(0, 7), (7, 12)]):
        expected = span_reference(q[start : start + n], seqs.k[i], seqs.v[i], contexts[i], None, spans[i])
        torch.testing.assert_close(out[start : start + n], expected, rtol=1e-5, atol=1e-5)


def test_same_span_and_bad_spans() -> None:
    q = torch.arange(6)[:, None]
    k = torch.arange(6)[None, :]
    mask = same_span(q, k, [(1, 3), (4, 6)])
    assert mask.nonzero().tolist() == [[1, 1], [1, 2], [2, 1], [2, 2], [4, 4], [4, 5], [5, 4], [5, 5]]
    seqs = Paged([4], 4, 1, 16, torch.float32)
    x = torch.zeros(4, 1, 16)
    for bad in ([(3, 3)], [(2, 4), (1, 3)]):
        with pytest.raises(ValueError, match="bidirectional: span"):
            prefill_attention(x, x, x, seqs.kc, seqs.vc, torch.tensor(seqs.tables[0]), 0, SCALE, bidirectional=bad)


def test_spans_take_the_torch_path_under_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Triton kernels selected (the interpreter on CPU), a plan with spans runs every
    chunk on the torch path (the kernels have no spans) and matches the reference."""
    pytest.importorskip("triton", reason="triton is not installed")
    monkeypatch.setenv("TRIOLLM_KERNELS", "triton")
    kvh, group, d, bs = 2, 2, 16, 4
    seqs = Paged([10], bs, kvh, d, torch.float32, seed=8)
    q = torch.randn(6, kvh * group, d, generator=torch.Generator().manual_seed(9))
    plan = plan_prefill([(6, 4, seqs.tables[0])], "cpu")
    assert plan.triton is not None  # planned for the Triton kernels
    plan.bidirectional = [[(3, 8)]]
    out = prefill_attention_chunks(q, seqs.k[0][4:], seqs.v[0][4:], seqs.kc, seqs.vc, plan, SCALE)
    expected = span_reference(q, seqs.k[0], seqs.v[0], 4, None, [(3, 8)])
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
