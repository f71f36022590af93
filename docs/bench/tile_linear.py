"""The quantized linear on the AMX bf16 tiles (`quant_linear_bf16`) at the bundled model's four
projection shapes (qkv 576 -> 960, o 576 -> 576, gate/up 576 -> 3,072 unfused, down 1,536 -> 576;
4-bit codes), M rows, 2 threads, best time over a few seconds per shape; ms and TF/s. Needs a CPU
with AMX bf16 tiles. Compare builds by running it from a second checkout on PYTHONPATH in turn.

    .venv/bin/python docs/bench/tile_linear.py [M]      # default 2048
"""

from __future__ import annotations

import sys
import time

import torch

from triollm.kernels.quant import PackedWeight, QuantWeight, tile_linear, tiles_available


def main() -> None:
    if not tiles_available():
        sys.exit("no AMX bf16 tiles on this CPU")
    m = int(sys.argv[1]) if len(sys.argv) > 1 else 2048
    torch.set_num_threads(2)
    torch.manual_seed(0)
    for n, k in [(960, 576), (576, 576), (3072, 576), (576, 1536)]:
        w = PackedWeight.pack(QuantWeight.quantize(torch.randn(n, k) * 0.02, 4))
        x = torch.randn(m, k)
        tile_linear(x, w)
        best, start = float("inf"), time.perf_counter()
        while time.perf_counter() - start < 3:
            t = time.perf_counter()
            tile_linear(x, w)
            best = min(best, time.perf_counter() - t)
        print(f"{n}x{k} at M={m}: {best * 1e3:.2f} ms, {2 * m * n * k / best / 1e12:.2f} TF/s")


if __name__ == "__main__":
    main()
