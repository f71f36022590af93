"""Decode attention alone over bf16, fp8 (e4m3) and int8 KV caches, at SmolLM2-135M's shapes (3 kv
heads x 3 query heads, head_dim 64, block 16), one row of `--context` tokens, 2 threads: the best
of 3 rounds (the dtypes alternating) of 60 passes (10 with 30 layers).

    .venv/bin/python docs/bench/kv_cache_decode.py --layers 1    # K/V resident in L3: the arithmetic
    .venv/bin/python docs/bench/kv_cache_decode.py --layers 30   # 30 layers cycled: K/V from memory

With one layer the 6.3 MB of bf16 K/V stay in the cache (the kernel's arithmetic); with 30 they
come from memory, as in a decode step (the figure includes Python's cost per call).
"""

from __future__ import annotations

import argparse
import time

import torch

from triollm.kernels import allocate_kv_cache, write_kv
from triollm.kernels.attention import decode_attention, plan_decode

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 16


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ns = ap.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(ns.threads)
    n, layers = ns.context, ns.layers
    blocks = -(-n // BLOCK)
    caches = {}
    for dt in (torch.bfloat16, torch.float8_e4m3fn, torch.int8):
        cache = allocate_kv_cache(layers, blocks, BLOCK, KV_HEADS, HEAD_DIM, dt, "cpu")
        for layer in range(layers):
            k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
            write_kv(cache.k[layer], cache.v[layer], k, v, torch.arange(n))
        caches[str(dt).removeprefix("torch.")] = cache
    plan = plan_decode([list(range(blocks))], [n], BLOCK, "cpu", native=True)
    q = torch.randn(1, KV_HEADS * GROUP, HEAD_DIM)
    passes = max(10, 60 // layers)
    best: dict[str, list[float]] = {}
    for _ in range(3):
        for name, cache in caches.items():
            for layer in range(layers):  # warm-up
                decode_attention(q, cache.k[layer], cache.v[layer], plan, HEAD_DIM**-0.5)
            start = time.perf_counter()
            for _ in range(passes):
                for layer in range(layers):
                    decode_attention(q, cache.k[layer], cache.v[layer], plan, HEAD_DIM**-0.5)
            best.setdefault(name, []).append((time.perf_counter() - start) / passes * 1e3)
    for name, runs in best.items():
        rounds = [round(r, 3) for r in runs]
        print(f"{name:14s} {layers} layer(s), {n} tokens: {min(runs):.3f} ms a pass (rounds {rounds})")


if __name__ == "__main__":
    main()
