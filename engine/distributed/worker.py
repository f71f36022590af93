"""A tensor-parallel worker (ranks 1..N-1): `python -m triollm.engine.distributed.worker`.

Started by rank 0 (`group.TensorParallelGroup`), which sends everything over this process's
stdin: the setup, the KV cache size, then one message per step. The worker runs each step's
forward pass on its shard and exits on STOP, on end of file (rank 0 is gone) or on a gloo error
(a peer died mid-step). One thread does all the torch work, as in the engine core.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from triollm.engine import envs
from triollm.engine.distributed.collectives import Collectives
from triollm.engine.distributed.protocol import (
    CACHE,
    SETUP,
    STEP,
    WorkerSetup,
    decode_step,
    joined_key,
    read_message,
    unpickled,
)
from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import calculate_kv_scales_on_first_prompt
from triollm.engine.execution.model_runner import ModelRunner
from triollm.engine.execution.models import load_model
from triollm.kernels import allocate_kv_cache


def serve() -> None:
    stdin = sys.stdin.buffer
    kind, payload = read_message(stdin)
    if kind != SETUP:
        return  # rank 0 left before the setup
    setup: WorkerSetup = unpickled(payload)
    torch.set_num_threads(setup.num_threads)
    envs.gloo_over_loopback()
    timeout = timedelta(seconds=setup.timeout_s)
    store = dist.TCPStore("127.0.0.1", setup.port, setup.size, is_master=False, timeout=timeout)
    store.set(joined_key(setup.rank), "1")  # rank 0 waits for this, watching that we live
    dist.init_process_group("gloo", store=store, rank=setup.rank, world_size=setup.size, timeout=timeout)
    try:
        mc = setup.model
        shard = TPShard(setup.rank, setup.size)
        model = load_model(mc, setup.device, shard, Collectives(shard, mc.vocab_size))
        kind, payload = read_message(stdin)
        if kind != CACHE:
            return
        kv_heads = shard.kv_heads(mc.num_heads, mc.num_kv_heads)[1]
        kv = allocate_kv_cache(
            mc.num_layers, unpickled(payload), setup.block_size, kv_heads, mc.head_dim, mc.cache_dtype, setup.device
        )
        if mc.calculate_kv_scales:
            calculate_kv_scales_on_first_prompt(model)
        runner = ModelRunner(model, kv, setup.device)
        while (msg := read_message(stdin))[0] == STEP:
            runner.follow(decode_step(msg[1]))
    finally:
        dist.destroy_process_group()


def main() -> int:
    # Ctrl-C reaches the whole process group: rank 0 decides how the engine stops, and this
    # worker follows (STOP, end of file), rather than dying under a step rank 0 is finishing.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        serve()
    except Exception as exc:  # rank 0 reports the failure; one line here says which rank
        print(f"triollm tensor-parallel worker (pid {os.getpid()}) failed: {exc!r}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
