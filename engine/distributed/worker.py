"""A tensor-parallel worker (ranks 1..N-1): `python -m triollm.engine.distributed.worker`.

Started by rank 0 (`group.TensorParallelGroup`), which sends everything over this process's
stdin: the setup, the KV cache size, then one message per step, or a `collective_rpc` (sleep,
wake-up and weight reload among them: `RankWorker`) whose result goes back over gloo. The worker runs each step's
forward pass on its shard and exits on STOP, on end of file (rank 0 is gone) or on a gloo error
(a peer died mid-step). One thread does all the torch work, as in the engine core.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from typing import IO, Any

import torch
import torch.distributed as dist

from triollm.engine import envs
from triollm.engine.distributed.collectives import Collectives
from triollm.engine.distributed.protocol import (
    CACHE,
    RPC,
    SETUP,
    STEP,
    RpcFailure,
    StepInputs,
    WorkerSetup,
    decode_step,
    joined_key,
    read_message,
    unpickled,
)
from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import calculate_kv_scales_on_first_prompt
from triollm.engine.execution.model_runner import ModelRunner
from triollm.engine.execution.models import CausalLM, load_model
from triollm.engine.execution.sleep_mode import check_level, check_tags, release_memory, run_rpc
from triollm.engine.loading.model_config import ModelConfig
from triollm.kernels import KVCache, allocate_kv_cache, cpu_native


class RankWorker:
    """This rank's model and runner: the worker `collective_rpc` names (a callable gets it as
    its first argument), with rank 0's sleep-mode methods (engine/execution/sleep_mode.py):
    `sleep(level)` drops the runner (the KV cache) and, at level 2, the model; `wake_up` reads
    this rank's shard again (of `model`, a new checkpoint's config from rank 0) and allocates
    the KV cache anew."""

    def __init__(self, setup: WorkerSetup, shard: TPShard, comm: Collectives, model: CausalLM, num_blocks: int) -> None:
        self.setup = setup
        self.rank = setup.rank
        self.shard, self.comm = shard, comm
        self.num_blocks = num_blocks
        self.model: CausalLM | None = model
        self.runner: ModelRunner | None = self._runner()
        self._asleep: set[str] = set()

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    def get_model(self) -> CausalLM | None:
        return self.model

    def apply_model(self, func: Callable[[CausalLM], Any]) -> Any:
        if self.model is None:
            raise ValueError("apply_model: no model is loaded (the weights are asleep)")
        return func(self.model)

    def bytes_per_block(self) -> int:
        mc = self.setup.model
        kv_heads = self.shard.kv_heads(mc.num_heads, mc.num_kv_heads)[1]
        return KVCache.bytes_per_block(mc.num_layers, kv_heads, mc.head_dim, self.setup.block_size, mc.cache_dtype)

    def sleep(self, level: int = 1) -> None:
        self._asleep.add("kv_cache")
        self.runner = None
        if check_level(level) == 2:
            self._asleep.add("weights")
            self.model = None
        release_memory(self.setup.device)

    def wake_up(self, tags: list[str] | None = None, model: ModelConfig | None = None) -> None:
        if model is not None:
            self.setup = replace(self.setup, model=model)
        wanted = check_tags(tags) & self._asleep
        if "weights" in wanted:
            self.model = load_model(self.setup.model, self.setup.device, self.shard, self.comm)
        self._asleep -= wanted
        if not self._asleep and self.runner is None:
            self.runner = self._runner()

    def step(self, inputs: StepInputs) -> None:
        if self.runner is None:
            raise RuntimeError("a step reached a sleeping tensor-parallel worker")
        self.runner.follow(inputs)

    def _runner(self) -> ModelRunner:
        assert self.model is not None
        mc, setup = self.setup.model, self.setup
        kv_heads = self.shard.kv_heads(mc.num_heads, mc.num_kv_heads)[1]
        kv = allocate_kv_cache(
            mc.num_layers, self.num_blocks, setup.block_size, kv_heads, mc.head_dim, mc.cache_dtype, setup.device
        )
        if mc.calculate_kv_scales:
            calculate_kv_scales_on_first_prompt(self.model)
        return ModelRunner(self.model, kv, setup.device)


def serve() -> None:
    stdin = sys.stdin.buffer
    kind, payload = read_message(stdin)
    if kind != SETUP:
        return  # rank 0 left before the setup
    setup: WorkerSetup = unpickled(payload)
    torch.set_num_threads(setup.num_threads)
    cpu_native.keep_freed_memory(setup.device)  # as rank 0's executor does
    envs.gloo_over_loopback()
    timeout = timedelta(seconds=setup.timeout_s)
    store = dist.TCPStore("127.0.0.1", setup.port, setup.size, is_master=False, timeout=timeout)
    store.set(joined_key(setup.rank), "1")  # rank 0 waits for this, watching that we live
    dist.init_process_group("gloo", store=store, rank=setup.rank, world_size=setup.size, timeout=timeout)
    try:
        worker = _start(stdin, setup)
        if worker is None:
            return
        while True:
            kind, payload = read_message(stdin)
            if kind == STEP:
                worker.step(decode_step(payload))
            elif kind == RPC:
                dist.gather_object(_rpc(worker, payload), None, dst=0)
            else:
                return
    finally:
        dist.destroy_process_group()


def _start(stdin: IO[bytes], setup: WorkerSetup) -> RankWorker | None:
    """Load this rank's shard, then wait for the KV cache size (None: rank 0 stopped first).
    The model loads before the size comes: rank 0 measures it after its own shard loaded."""
    shard = TPShard(setup.rank, setup.size)
    comm = Collectives(shard, setup.model.vocab_size)
    model = load_model(setup.model, setup.device, shard, comm)
    kind, payload = read_message(stdin)
    if kind != CACHE:
        return None
    return RankWorker(setup, shard, comm, model, unpickled(payload))


def _rpc(worker: RankWorker, payload: bytes) -> Any:
    """This rank's part of a `collective_rpc`: its result, or the failure for rank 0 to raise."""
    try:
        method, args, kwargs = unpickled(payload)
        return run_rpc(worker, method, args, kwargs)
    except Exception as exc:  # noqa: BLE001 - reported to rank 0, which raises it
        return RpcFailure(worker.rank, type(exc).__name__, str(exc))


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
