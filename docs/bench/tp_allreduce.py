"""The cost of one gloo all-reduce of a batch-1 hidden state between two processes on loopback
(what tensor parallelism pays 2 * num_layers + 1 times per decode step, plus one logits gather).

    .venv/bin/python docs/bench/tp_allreduce.py [--hidden 576] [--ranks 2] [--iters 2000]

Each rank runs one torch thread, as `-tp 2 --num-threads 2` gives them on two cores.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank: int, size: int, port: int, hidden: int, iters: int, fd: int | None) -> None:
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    torch.set_num_threads(1)
    timeout = timedelta(seconds=60)
    if fd is not None:  # rank 0: serve the store on the loopback socket opened by main()
        store = dist.TCPStore("127.0.0.1", port, size, is_master=True, timeout=timeout, master_listen_fd=fd)
    else:
        store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=size, timeout=timeout)
    x = torch.randn(1, hidden)
    for _ in range(200):
        dist.all_reduce(x)
    samples = []
    for _ in range(5):
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        samples.append((time.perf_counter() - t) / iters)
    if rank == 0:
        print(
            f"gloo all-reduce of [1, {hidden}] fp32 over {size} ranks on loopback: "
            f"median {statistics.median(samples) * 1e6:.1f} us (runs: {', '.join(f'{s * 1e6:.1f}' for s in samples)})"
        )
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=576)  # SmolLM2-135M
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--iters", type=int, default=2000)
    ns = ap.parse_args()
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(ns.ranks)
    port = listener.getsockname()[1]
    ctx = mp.get_context("spawn")  # rank 0 is this process (it owns the loopback listener)
    procs = [
        ctx.Process(target=rank_main, args=(r, ns.ranks, port, ns.hidden, ns.iters, None)) for r in range(1, ns.ranks)
    ]
    for p in procs:
        p.start()
    rank_main(0, ns.ranks, port, ns.hidden, ns.iters, listener.detach())
    for p in procs:
        p.join()


if __name__ == "__main__":
    main()
