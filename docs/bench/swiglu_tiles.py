"""A fused gate/up projection and SwiGLU on the AMX bf16 tiles against the unfused pair: the
bundled model's shape (576 inputs, 2 x 1,536 outputs, 4-bit codes) at M rows, best of 10, ms.
Needs a CPU with AMX bf16 tiles.

    .venv/bin/python docs/bench/swiglu_tiles.py [M ...]      # default 2048
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable

import torch

from triollm.kernels import cpu_native
from triollm.kernels.quant import PackedWeight, QuantWeight, packed_swiglu, tile_linear, tiles_available


def best_ms(fn: Callable[[], object]) -> float:
    fn()
    best = float("inf")
    for _ in range(10):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best * 1e3


def main() -> None:
    if not tiles_available():
        sys.exit("no AMX bf16 tiles on this CPU")
    torch.manual_seed(0)
    w = PackedWeight.pack(QuantWeight.quantize(torch.randn(3072, 576) * 0.05, 4))
    for m in [int(a) for a in sys.argv[1:]] or [2048]:
        x = torch.randn(m, 576)
        unfused = best_ms(functools.partial(lambda t: cpu_native.silu_and_mul(tile_linear(t, w)), x))
        fused = best_ms(functools.partial(packed_swiglu, x, w))
        print(f"M={m}: fused {fused:.2f} ms, unfused {unfused:.2f} ms, {fused / unfused:.2f}x")


if __name__ == "__main__":
    main()
