"""The quantized linear's compiled paths side by side on the bundled model's layer shapes: for each
code format (4-bit, 8-bit, IQ4) and row count, the best of three alternating rounds of 20 calls per
path this CPU runs (`cpu_native.supported_isas()`: AMX, AVX-512 VNNI, AVX2, plain loops), every
path's output checked equal to the first's before it is timed (the paths give the same bits). The
ratio is to the AVX-512 VNNI path where the CPU has it, else to the first. Where the CPU has AMX
bf16 tiles, the prompt rows' kernel (`tile_linear`: other numbers, so not checked equal) is timed
beside them as "tiles". Random weights and activations; 2 threads unless `THREADS` says otherwise.

    .venv/bin/python docs/bench/quant_paths.py [ROWS ...]      # default: 16 32 64 256 2048
"""

from __future__ import annotations

import os
import sys
import time

import torch

from triollm.kernels import cpu_native
from triollm.kernels.quant import IQ4, PackedWeight, QuantWeight, packed_linear, tile_linear, tiles_available

# SmolLM2-135M's linears (qkv, o, gate_up, down) and its tied 49,152-row head.
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536), (49152, 576)]


def weight(bits: int, n: int, k: int) -> PackedWeight:
    w = QuantWeight.quantize(torch.randn(n, k), 8 if bits == 8 else 4)
    return PackedWeight.pack(QuantWeight(w.q, w.d, w.m, IQ4) if bits == IQ4 else w)


def best_of(x: torch.Tensor, p: PackedWeight, isa: str, calls: int = 20) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        tile_linear(x, p) if isa == "tiles" else packed_linear(x, p, isa=isa)
    return (time.perf_counter() - start) / calls


def main() -> None:
    if not cpu_native.available():
        sys.exit("the native CPU kernels are not built here")
    torch.set_num_threads(int(os.environ.get("THREADS", "2")))
    rows = [int(a) for a in sys.argv[1:]] or [16, 32, 64, 256, 2048]
    isas = [i for i in cpu_native.supported_isas() if i != "scalar"] or ["scalar"]
    base = "avx512_vnni" if "avx512_vnni" in isas else isas[0]
    timed = isas + (["tiles"] if tiles_available() else [])
    print(f"paths: {', '.join(timed)}; ratio: time / {base}'s; best of 3 rounds x 20 calls, ms")
    torch.manual_seed(0)
    for bits in (4, 8, IQ4):
        for n, k in SHAPES:
            p = weight(bits, n, k)
            for m in rows:
                if n * m > 49152 * 256:
                    continue  # the head at prompt sizes: not a shape the engine runs
                x = torch.randn(m, k)
                first = packed_linear(x, p, isa=isas[0])
                for isa in isas[1:]:
                    assert torch.equal(packed_linear(x, p, isa=isa), first), (bits, n, k, m, isa)
                best = {isa: min(best_of(x, p, isa) for _ in range(3)) for isa in timed}
                cells = "  ".join(f"{isa} {best[isa] * 1e3:8.3f} ({best[isa] / best[base]:.2f}x)" for isa in timed)
                name = "iq4" if bits == IQ4 else f"{bits}-bit"
                print(f"{name:6} {n:6}x{k:<5} rows {m:5}  {cells}")


if __name__ == "__main__":
    main()
