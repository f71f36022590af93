"""`triollm bench moe`: the MoE block alone, its step time against the experts in the layer.

A stack of `--layers` `FusedMoE` blocks (engine/execution/layers/moe.py), each with its own
weights (so a layer's experts are not cache-hot from the one before), stands for a model step.
For each expert count in `--experts` and token count in `--tokens`, each step routes the tokens
through every layer with fresh random router logits (drawn before the clock starts) and the step
is timed; the table gives the median, the experts that actually ran per layer (on average), and
the ratio of the median to the first expert count's at the same token count. With top-k routing
the cost follows the experts used: at one token and top-2 two experts run per layer whether the
layer holds 8 or 64, so the ratio stays near 1; at more tokens more distinct experts are hit in
a larger layer, and the ratio follows the "experts run" column, not E.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

__all__ = ["add_moe_parsers", "bench_moe"]

DTYPES = ("float32", "bfloat16")


def add_moe_parsers(kinds: Any) -> None:
    p = kinds.add_parser("moe", help="MoE block step time against the number of experts (top-k routed, CPU or CUDA)")
    p.add_argument(
        "--experts",
        type=int,
        nargs="+",
        default=[8, 64],
        help="experts per layer, each measured (default: %(default)s)",
    )
    p.add_argument("--top-k", type=int, default=2, help="experts per token (default: %(default)s)")
    p.add_argument("--hidden", type=int, default=512, help="hidden size (default: %(default)s)")
    p.add_argument("--intermediate", type=int, default=256, help="expert intermediate size (default: %(default)s)")
    p.add_argument(
        "--tokens", type=int, nargs="+", default=[1, 16], help="tokens per step, each measured (default: %(default)s)"
    )
    p.add_argument("--layers", type=int, default=8, help="MoE blocks per step (default: %(default)s)")
    p.add_argument(
        "--iters", type=int, default=50, help="timed steps per point, after 3 warm-up steps (default: %(default)s)"
    )
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="(default: %(default)s)")
    p.add_argument("--device", default="cpu", help="torch device (default: %(default)s)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's, one per core)")
    p.add_argument(
        "--flush-mib",
        type=int,
        default=64,
        help=(
            "MiB written before each step to evict the caches, as a model whose weights exceed them sees; 0: off "
            "(default: %(default)s)"
        ),
    )
    p.add_argument("--json", default=None, metavar="F", help="write the results here")
    p.set_defaults(func=run_moe_bench)


def bench_moe(
    experts: list[int],
    tokens: list[int],
    *,
    top_k: int = 2,
    hidden: int = 512,
    intermediate: int = 256,
    layers: int = 8,
    iters: int = 50,
    dtype: str = "float32",
    device: str = "cpu",
    flush_mib: int = 64,
    warmup: int = 3,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One row per (tokens, experts): median and mean ms per step, experts run per layer, and the
    ratio of the median to the first expert count's at the same token count."""
    import torch

    # Not public: this times the layer alone, which no engine API exposes.
    from triollm.engine.execution.layers.moe import FusedMoE

    for field, value in (("layers", layers), ("iters", iters)):
        if value < 1:
            raise ValueError(f"{field} must be >= 1, got {value}")
    if flush_mib < 0:
        raise ValueError(f"flush_mib must be >= 0, got {flush_mib}")
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    if any(t < 1 for t in tokens):
        raise ValueError(f"tokens must all be >= 1, got {tokens}")
    torch_dtype = getattr(torch, dtype)
    dev = torch.device(device)
    gen = torch.Generator().manual_seed(seed)
    flush = torch.empty(flush_mib << 18, device=dev)  # float32: 4 bytes
    rows: list[dict[str, Any]] = []
    for num_experts in experts:
        blocks = [FusedMoE(num_experts, top_k, hidden, intermediate, renormalize=True) for _ in range(layers)]
        for block in blocks:
            block.w13.data.uniform_(-0.05, 0.05, generator=gen)
            block.w2.data.uniform_(-0.05, 0.05, generator=gen)
            block.to(device=dev, dtype=torch_dtype)
        for t in tokens:
            x = torch.randn(t, hidden, generator=gen).to(dev, torch_dtype)
            logits = torch.randn(warmup + iters, layers, t, num_experts, generator=gen).to(dev, torch_dtype)
            # distinct experts per layer-step, from the same top-k the block takes
            run = torch.topk(logits.float(), top_k, dim=-1).indices.flatten(2)
            used = sum(len(torch.unique(r)) for r in run[warmup:].flatten(0, 1)) / (iters * layers)
            times = []
            with torch.inference_mode():
                for i in range(warmup + iters):
                    flush.fill_(i)
                    _sync(dev)
                    start = time.perf_counter()
                    for layer, block in enumerate(blocks):
                        block(x, logits[i, layer])
                    _sync(dev)
                    if i >= warmup:
                        times.append((time.perf_counter() - start) * 1e3)
            rows.append(
                {
                    "tokens": t,
                    "experts": num_experts,
                    "top_k": top_k,
                    "experts_run_per_layer": used,
                    "median_ms": statistics.median(times),
                    "mean_ms": statistics.fmean(times),
                }
            )
        del blocks
    for row in rows:
        base = next(r for r in rows if r["tokens"] == row["tokens"])
        row["ratio"] = row["median_ms"] / base["median_ms"]
    return rows


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_moe_bench(ns: argparse.Namespace) -> int:
    import torch

    if ns.threads is not None:
        if ns.threads < 1:
            raise ValueError(f"--threads must be >= 1, got {ns.threads}")
        torch.set_num_threads(ns.threads)
    rows = bench_moe(
        ns.experts,
        ns.tokens,
        top_k=ns.top_k,
        hidden=ns.hidden,
        intermediate=ns.intermediate,
        layers=ns.layers,
        iters=ns.iters,
        dtype=ns.dtype,
        device=ns.device,
        flush_mib=ns.flush_mib,
    )
    first = ns.experts[0]
    print(
        f"MoE step: {ns.layers} layers, hidden {ns.hidden}, intermediate {ns.intermediate}, top-{ns.top_k}, {ns.dtype} "
        f"on {ns.device} ({torch.get_num_threads()} threads), {ns.iters} steps each"
    )
    print(f"{'tokens':>6} {'experts':>7} {'run/layer':>9} {'median ms':>10} {'mean ms':>8} {f'vs {first}':>8}")
    for r in rows:
        print(
            f"{r['tokens']:>6} {r['experts']:>7} {r['experts_run_per_layer']:>9.2f} {r['median_ms']:>10.3f} "
            f"{r['mean_ms']:>8.3f} {r['ratio']:>7.2f}x"
        )
    if ns.json:
        config = {
            k: getattr(ns, k)
            for k in (
                "experts",
                "tokens",
                "top_k",
                "hidden",
                "intermediate",
                "layers",
                "iters",
                "dtype",
                "device",
                "flush_mib",
            )
        } | {"threads": torch.get_num_threads()}
        Path(ns.json).write_text(json.dumps({"config": config, "rows": rows}, indent=2))
    return 0
