"""Where large inputs start taking the AMX bf16 tiles (kernels/quant.py `TILE_MIN_ROWS`): a step's
four quantized linears of SmolLM2-135M (qkv, o, gate_up, down) over 30 layers of distinct random
4-bit weights, called in forward order (each weight comes from memory, as in a step, not from the
cache a loop over one weight leaves it in), every input through the int8 kernel and then through
the tiles (`tile_linear`), for M rows; the best of 3 rounds after a warm-up, 2 threads. Needs a CPU
with AMX bf16 tiles.

    .venv/bin/python docs/bench/tile_rows.py [M ...]      # default: 8 16 24 32 64 128 256
"""

from __future__ import annotations

import sys
import time

import torch

from triollm.kernels.quant import PackedWeight, QuantWeight, packed_linear, tile_linear, tiles_available

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]
LAYERS = 30


def one_pass(f: object, weights: list[list[PackedWeight]], inputs: dict[int, torch.Tensor]) -> list[float]:
    """Seconds per shape of one pass over every layer's projections in order."""
    assert callable(f)
    spent = [0.0] * len(SHAPES)
    for layer in weights:
        for i, w in enumerate(layer):
            x = inputs[SHAPES[i][1]]
            start = time.perf_counter()
            f(x, w)
            spent[i] += time.perf_counter() - start
    return spent


def main() -> None:
    if not tiles_available():
        sys.exit("no AMX bf16 tiles here (or a kernel path is forced)")
    torch.set_num_threads(2)
    torch.manual_seed(0)
    rows = [int(a) for a in sys.argv[1:]] or [8, 16, 24, 32, 64, 128, 256]
    weights = [
        [PackedWeight.pack(QuantWeight.quantize(torch.randn(n, k) * 0.02, 4)) for n, k in SHAPES] for _ in range(LAYERS)
    ]
    print("rows  int8 ms (qkv o gate_up down = sum)  tiles ms (the same)  tiles / int8")
    for m in rows:
        inputs = {k: torch.randn(m, k) for _, k in SHAPES}
        best: dict[str, list[float]] = {}
        for rnd in range(4):
            for name, f in (("int8", packed_linear), ("tiles", tile_linear)):
                spent = one_pass(f, weights, inputs)
                if rnd:  # the first round warms up
                    best[name] = [min(a, b) for a, b in zip(best.get(name, spent), spent)]
        cells = {k: " ".join(f"{t * 1e3:.2f}" for t in v) + f" = {sum(v) * 1e3:.2f}" for k, v in best.items()}
        print(f"{m:4}  {cells['int8']}  {cells['tiles']}  {sum(best['tiles']) / sum(best['int8']):.2f}x")


if __name__ == "__main__":
    main()
