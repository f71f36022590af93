"""Attention over a paged KV cache: the torch path (CPU, and the reference for GPU kernels).

Layout (a detail of this module; callers only hand over block ids and slot numbers): per layer,
K and V are `[num_kv_heads, num_blocks, block_size, head_dim]`. Head-major keeps one head's
blocks contiguous, so the decode gather is one `index_select` over whole blocks and the two
attention matmuls run batched with the GQA group folded into the query rows. On this CPU that
was ~3-4x faster than vLLM's `[num_blocks, block_size, kv_heads, head_dim]` layout with a permuted
matmul (see shared/KERNELS.md). A slot is `block_id * block_size + offset`.

Prefill uses `scaled_dot_product_attention`: with no earlier context (the usual case) directly
on the new K/V with `is_causal`; with earlier context (chunked prefill, prefix-cache hits) over
K/V gathered from the cache with an explicit offset-causal mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

__all__ = [
    "KVCache",
    "allocate_kv_cache",
    "paged_decode_attention",
    "prefill_attention",
    "write_kv",
]


@dataclass
class KVCache:
    k: list[torch.Tensor]  # per layer [kv_heads, num_blocks, block_size, head_dim]
    v: list[torch.Tensor]
    num_blocks: int
    block_size: int

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * num_kv_heads * block_size * head_dim * elem


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVCache:
    # Zeroed, not empty: masked-out slots are multiplied by a zero probability, and 0 * NaN
    # garbage would poison the output. Large zero allocations are lazily mapped by the OS.
    shape = (num_kv_heads, num_blocks, block_size, head_dim)
    k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
    return KVCache(k, v, num_blocks, block_size)


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v `[T, kv_heads, head_dim]` at the given slots `[T]` (int64)."""
    kvh, nb, bs, hd = k_cache.shape
    k_cache.view(kvh, nb * bs, hd).index_copy_(1, slot_mapping, k.transpose(0, 1))
    v_cache.view(kvh, nb * bs, hd).index_copy_(1, slot_mapping, v.transpose(0, 1))


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """One query token per sequence. q `[B, H, hd]`; block_tables `[B, M]` (padded with any
    valid block id); context_lens `[B]` counts the tokens to attend to, the query's own included
    (its K/V must already be written). Returns `[B, H, hd]`."""
    kvh, _, bs, hd = k_cache.shape
    b, h, _ = q.shape
    m = block_tables.shape[1]
    flat = block_tables.reshape(-1)
    k = k_cache.index_select(1, flat).view(kvh, b, m * bs, hd)
    v = v_cache.index_select(1, flat).view(kvh, b, m * bs, hd)
    qh = q.view(b, kvh, h // kvh, hd).transpose(0, 1)  # [kvh, B, group, hd]
    scores = torch.matmul(qh, k.transpose(-1, -2)).mul_(scale)  # [kvh, B, group, L]
    pad = torch.arange(m * bs, device=q.device)[None, :] >= context_lens[:, None]  # [B, L]
    scores.masked_fill_(pad[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [kvh, B, group, hd]
    return out.transpose(0, 1).reshape(b, h, hd)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_context: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of n new tokens of one sequence. q `[n, H, hd]`, k/v `[n, kvh, hd]` (the
    new tokens, already written to the cache); `num_context` earlier tokens of the sequence live
    in the cache blocks `block_ids`. Returns `[n, H, hd]`."""
    n = q.shape[0]
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
    if num_context == 0:
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
        out = _sdpa(qh, kh, vh, None, scale)
    else:
        kvh, _, bs, hd = k_cache.shape
        total = num_context + n
        kh = k_cache.index_select(1, block_ids).view(1, kvh, -1, hd)[:, :, :total]
        vh = v_cache.index_select(1, block_ids).view(1, kvh, -1, hd)[:, :, :total]
        rows = torch.arange(n, device=q.device)[:, None] + num_context
        mask = torch.arange(total, device=q.device)[None, :] <= rows  # [n, total], True = attend
        out = _sdpa(qh, kh, vh, mask, scale)
    return out.squeeze(0).transpose(0, 1)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:
        if _HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


def _has_enable_gqa() -> bool:
    q = torch.zeros(1, 2, 1, 2)
    try:
        F.scaled_dot_product_attention(q, q[:, :1], q[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


_HAS_GQA = _has_enable_gqa()
