"""A step's four quantized linears of SmolLM2-135M (qkv, o, gate_up, down) times its 30 layers,
with D decode rows and P prompt rows: every row through the int8 kernel, against the prompt rows
through the AMX bf16 tiles (`tile_linear`) and the decode rows through the int8 kernel (what a
split step runs, kernels/quant.py `RowSplit`). Where the tiles gain is where `TILE_MIN_ROWS` is
set. Random 4-bit weights and activations, 2 threads; needs a CPU with AMX bf16 tiles.

    .venv/bin/python docs/bench/prompt_tiles_split.py
"""

from __future__ import annotations

import sys
import time

import torch

from triollm.kernels.quant import PackedWeight, QuantWeight, packed_linear, prompt_tiles_available, tile_linear

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def per_call(f: object, reps: int = 30) -> float:
    assert callable(f)
    f()
    start = time.perf_counter()
    for _ in range(reps):
        f()
    return (time.perf_counter() - start) / reps


def main() -> None:
    if not prompt_tiles_available():
        sys.exit("no AMX bf16 tiles here (or a kernel path is forced)")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    weights = [PackedWeight.pack(QuantWeight.quantize(torch.randn(n, k), 4)) for n, k in SHAPES]
    for d in (0, 16, 64):
        for p in (16, 32, 64, 128, 256, 512):
            int8 = split = 0.0
            for w in weights:
                x = torch.randn(d + p, w.shape[1])
                int8 += per_call(lambda x=x, w=w: packed_linear(x, w))
                split += per_call(lambda x=x, w=w, d=d: (tile_linear(x[d:], w), packed_linear(x[:d], w) if d else None))
            print(
                f"decode rows {d:3}, prompt rows {p:4}: int8 {int8 * LAYERS * 1e3:6.1f} ms a step, "
                f"split {split * LAYERS * 1e3:6.1f} ms ({split / int8:.2f}x)"
            )


if __name__ == "__main__":
    main()
