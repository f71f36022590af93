"""Native decode attention alone at the shapes without an instance of their own: one row of 512 and
of 8,192 tokens over a bf16 cache, 2 threads, microseconds a call: 16 heads over one 288- or
576-wide KV head (DeepSeek's latent, small and released), 8 over 4 of 256 (Gemma 2 2B), 32 of 96
and of 80 (Phi-3, Phi-2). Compare builds by running it once per build (PYTHONPATH at the other).

    .venv/bin/python docs/bench/decode_attention_shapes.py
"""

from __future__ import annotations

import time

import torch

from triollm.kernels import allocate_kv_cache, write_kv
from triollm.kernels.attention import decode_attention, plan_decode

SHAPES = [(16, 1, 288), (8, 4, 256), (32, 32, 96), (32, 32, 80), (16, 1, 576)]  # heads, kv heads, head_dim
BLOCK = 16


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for heads, kv_heads, d in SHAPES:
        for n in (512, 8192):
            blocks = -(-n // BLOCK)
            cache = allocate_kv_cache(1, blocks, BLOCK, kv_heads, d, torch.bfloat16, "cpu")
            k = torch.randn(n, kv_heads, d)
            write_kv(cache.k[0], cache.v[0], k, k, torch.arange(n))
            plan = plan_decode([list(range(blocks))], [n], BLOCK, "cpu", native=True)
            q = torch.randn(1, heads, d)
            for _ in range(5):
                decode_attention(q, cache.k[0], cache.v[0], plan, d**-0.5)
            calls = 40 if n > 1000 else 200
            start = time.perf_counter()
            for _ in range(calls):
                decode_attention(q, cache.k[0], cache.v[0], plan, d**-0.5)
            us = (time.perf_counter() - start) / calls * 1e6
            print(f"{heads} heads over {kv_heads} x {d}, {n} tokens: {us:.0f} us", flush=True)


if __name__ == "__main__":
    main()
