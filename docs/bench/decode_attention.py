"""Decode attention alone, 30 layers of one step at SmolLM2-135M's shapes (9 query heads, 3 KV
heads, head_dim 64, block 16): the torch path against the native kernel. Best of 15.

    .venv/bin/python docs/bench/decode_attention.py [THREADS]
"""

from __future__ import annotations

import random
import sys
import time

import torch

from triollm.kernels.attention import DecodeWorkspace, decode_attention, plan_decode

KV_HEADS, HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 16
LAYERS = 30


def step_ms(q, kc, vc, tables, lens, native: bool) -> float:  # type: ignore[no-untyped-def]
    workspace = DecodeWorkspace()

    def step() -> None:
        plan = plan_decode(tables, lens, BLOCK, "cpu", workspace, native=native)
        for _ in range(LAYERS):
            decode_attention(q, kc, vc, plan, HEAD_DIM**-0.5)

    for _ in range(3):
        step()
    times = []
    for _ in range(15):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return min(times) * 1000


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
    random.seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for batch, lo, hi in ((1, 100, 100), (64, 40, 170), (64, 150, 170)):
            num_blocks = batch * 12 + 4
            kc = torch.randn(KV_HEADS, num_blocks, HEAD_DIM, BLOCK).to(dtype)  # K blocks transposed
            vc = torch.randn(KV_HEADS, num_blocks, BLOCK, HEAD_DIM).to(dtype)
            lens = sorted((random.randint(lo, hi) for _ in range(batch)), reverse=True)
            free = list(range(num_blocks))
            random.shuffle(free)
            tables = []
            for n in lens:
                need = -(-n // BLOCK)
                tables.append(free[:need])
                free = free[need:]
            q = torch.randn(batch, HEADS, HEAD_DIM).to(dtype)
            torch_ms = step_ms(q, kc, vc, tables, lens, native=False)
            native_ms = step_ms(q, kc, vc, tables, lens, native=True)
            print(
                f"{dtype} batch {batch} context {lo}-{hi}: torch {torch_ms:.2f} ms, native {native_ms:.2f} ms per step"
            )


if __name__ == "__main__":
    main()
