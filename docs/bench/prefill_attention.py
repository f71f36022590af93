"""Prefill attention alone, one layer at SmolLM2-135M's shapes (3 kv heads x 3 query heads,
head_dim 64, block 16), one prompt of L tokens with no earlier context, 2 threads: the native
kernel (`cpu_native.paged_prefill_attention`, each row the decode kernel's arithmetic) against
the torch path it replaces (SDPA over the K/V read back from the cache), through
`prefill_attention_chunks` with and without the plan's native tables. Best of 2 rounds, the two
alternating, for a bf16 and an fp8 cache.

    .venv/bin/python docs/bench/prefill_attention.py [L ...]    # default 200 2048 8192
"""

from __future__ import annotations

import sys
import time

import torch

from triollm.kernels import allocate_kv_cache, cpu_native, write_kv
from triollm.kernels.attention import PrefillPlan, plan_prefill, prefill_attention_chunks

KV_HEADS, GROUP, HEAD_DIM = 3, 3, 64


def main() -> None:
    lengths = [int(a) for a in sys.argv[1:]] or [200, 2048, 8192]
    assert cpu_native.available(), "the native kernels did not build"
    torch.set_num_threads(2)
    heads = KV_HEADS * GROUP
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for n in lengths:
            cache = allocate_kv_cache(1, n // 16 + 2, 16, KV_HEADS, HEAD_DIM, dtype, "cpu")
            kc, vc = cache.k[0], cache.v[0]
            k, v = torch.randn(n, KV_HEADS, HEAD_DIM), torch.randn(n, KV_HEADS, HEAD_DIM)
            q = torch.randn(n, heads, HEAD_DIM)
            write_kv(kc, vc, k, v, torch.arange(n))
            native = plan_prefill([(n, 0, list(range((n + 15) // 16)))], "cpu")
            if not cpu_native.prefill_attention_supported(q, kc):
                print(f"{dtype}: the native prefill does not run on this CPU (AVX-512 BF16)")
                return
            torch_path = PrefillPlan(native.chunks, native.max_tokens)
            best: dict[str, float] = {}
            reps = 5 if n < 8192 else 2
            for _ in range(2):
                for name, plan in (("native", native), ("sdpa", torch_path)):
                    prefill_attention_chunks(q, k, v, kc, vc, plan, HEAD_DIM**-0.5)
                    start = time.perf_counter()
                    for _ in range(reps):
                        prefill_attention_chunks(q, k, v, kc, vc, plan, HEAD_DIM**-0.5)
                    ms = (time.perf_counter() - start) / reps * 1000
                    best[name] = min(best.get(name, ms), ms)
            print(
                f"{str(dtype).removeprefix('torch.'):14s} {n:6d} tokens, one layer: native {best['native']:8.2f} ms, "
                f"SDPA {best['sdpa']:8.2f} ms ({best['native'] / best['sdpa']:.2f}x)",
                flush=True,
            )


if __name__ == "__main__":
    main()
