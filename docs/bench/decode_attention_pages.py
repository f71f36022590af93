"""The native decode attention of a 64-row step at SmolLM2-135M's shapes (9 query heads, 3 KV heads,
head_dim 64, bf16 cache, block 16), each row's blocks in order or scattered over the cache (as a
long-running server's block manager leaves them), the cache in 4 KB pages or advised for
transparent huge pages (`allocate_kv_cache` does that on the CPU). Per layer: the mean of 30
calls after 3, and the K/V bytes read per second.

    .venv/bin/python docs/bench/decode_attention_pages.py [CONTEXT]     # default 275 tokens
"""

from __future__ import annotations

import sys
import time

import torch

from triollm.kernels import cpu_native
from triollm.kernels.attention import allocate_kv_cache

ROWS, HEADS, KV_HEADS, HEAD_DIM, BLOCK = 64, 9, 3, 64, 16


def per_layer(k: torch.Tensor, v: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, q: torch.Tensor) -> float:
    for _ in range(3):
        cpu_native.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
    start = time.perf_counter()
    for _ in range(30):
        cpu_native.paged_decode_attention(q, k, v, tables, lens, HEAD_DIM**-0.5)
    return (time.perf_counter() - start) / 30


def main() -> None:
    if not cpu_native.available():
        sys.exit("the native CPU kernels are not built here")
    context = int(sys.argv[1]) if len(sys.argv) > 1 else 275
    per_row = -(-context // BLOCK)
    blocks = ROWS * per_row + 8
    torch.manual_seed(0)
    q = torch.randn(ROWS, HEADS, HEAD_DIM)
    lens = torch.full((ROWS,), context, dtype=torch.int32)
    huge = allocate_kv_cache(1, blocks, BLOCK, KV_HEADS, HEAD_DIM, torch.bfloat16, "cpu")
    plain_k = torch.zeros(KV_HEADS, blocks, HEAD_DIM, BLOCK, dtype=torch.bfloat16)
    plain_v = torch.zeros(KV_HEADS, blocks, BLOCK, HEAD_DIM, dtype=torch.bfloat16)
    for t in (huge.k[0], huge.v[0], plain_k, plain_v):
        t.copy_(torch.randn(t.shape))
    read = ROWS * context * KV_HEADS * HEAD_DIM * 2 * 2
    for order in ("in order", "scattered"):
        ids = torch.arange(blocks) if order == "in order" else torch.randperm(blocks)
        tables = ids[: ROWS * per_row].view(ROWS, per_row).to(torch.int32)
        for pages, (k, v) in (("4 KB pages", (plain_k, plain_v)), ("huge pages", (huge.k[0], huge.v[0]))):
            s = per_layer(k, v, tables, lens, q)
            print(f"context {context}, blocks {order:9}, {pages}: {s * 1e3:.3f} ms a layer, {read / s / 1e9:.1f} GB/s")


if __name__ == "__main__":
    main()
