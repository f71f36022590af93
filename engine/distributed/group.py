"""Rank 0 of a tensor-parallel engine: starts the workers, sends them each step, reaps them.

    engine-core process (rank 0)                 worker processes (ranks 1..N-1)
    scheduler -> ModelRunner.execute             python -m triollm.engine.distributed.worker
      send_step(StepInputs) --- stdin pipes --->  ModelRunner.follow(StepInputs)
      forward on shard 0   <=== gloo, 127.0.0.1 ===> forward on shard r
      sample (rank 0 only) <--- gather logits ---

Rank 0 lives in the engine core's compute thread; it listens on a free loopback port, starts
the N-1 workers (`subprocess`, stdin a pipe) and all ranks meet there (`init_process_group`,
gloo, `GLOO_SOCKET_IFNAME=lo`: no other address is touched). Rank 0 opens the rendezvous socket
itself, bound to 127.0.0.1, and hands it to its `TCPStore`: given only `tcp://127.0.0.1:PORT`,
the store's server listens on every address of the machine.

Failure: a worker that exits before it has joined fails start-up at once (rank 0 polls the workers
while it waits for their store keys); a worker that has exited is found before each step (`poll`);
one that dies during a step breaks its gloo connections, and the collective raises in rank 0 (at the
latest after the group's timeout). Either way the step raises and the engine core reports itself
dead. Workers end on STOP (`close`), or on end of file on stdin when rank 0's process is gone, or on
a gloo error when it dies mid-step: no worker outlives its engine.
"""

from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import cloudpickle
import torch.distributed as dist

from triollm.engine import envs
from triollm.engine.distributed.collectives import Collectives
from triollm.engine.distributed.protocol import (
    CACHE,
    RPC,
    SETUP,
    STEP,
    STOP,
    RpcFailure,
    StepInputs,
    WorkerSetup,
    encode_step,
    joined_key,
    pickled,
    write_message,
)
from triollm.engine.distributed.sharding import TPShard
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["TensorParallelGroup"]

log = logging.getLogger("triollm")

TIMEOUT_S = 60.0  # rendezvous, and any one collective (a peer that hangs, not one that dies)
STOP_GRACE_S = 5.0  # a stopped worker leaves in milliseconds; then it is killed
JOIN_POLL_S = 0.1  # while the workers join: how often rank 0 checks that none has exited
WORKER_COMMAND = [sys.executable, "-m", "triollm.engine.distributed.worker"]


class TensorParallelGroup:
    def __init__(self, size: int, num_threads: int, model: ModelConfig, device: str, block_size: int) -> None:
        """Start ranks 1..size-1 and join them as rank 0 (blocks until all have joined)."""
        if dist.is_initialized():
            raise RuntimeError("tensor_parallel_size: one tensor-parallel engine per process (a process group exists)")
        self.shard = TPShard(0, size)
        self.comm = Collectives(self.shard, model.vocab_size)
        self.workers: list[subprocess.Popen[bytes]] = []
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(size)
        port = int(self._listener.getsockname()[1])
        timeout = timedelta(seconds=TIMEOUT_S)
        envs.gloo_over_loopback()  # this rank's gloo; the workers inherit it
        env = {**os.environ, "OMP_NUM_THREADS": str(num_threads)}
        try:
            for rank in range(1, size):
                proc = subprocess.Popen(WORKER_COMMAND, stdin=subprocess.PIPE, env=env)
                self.workers.append(proc)
                setup = WorkerSetup(rank, size, port, num_threads, model, device, block_size, TIMEOUT_S)
                self._send(rank, SETUP, pickled(setup))
            store = dist.TCPStore(
                "127.0.0.1",
                port,
                size,
                is_master=True,
                timeout=timeout,
                master_listen_fd=self._listener.fileno(),
                wait_for_workers=False,  # _await_workers watches them while they come
            )
            self._listener.detach()  # the store owns (and closes) the socket now
            self._await_workers(store)
            dist.init_process_group("gloo", store=store, rank=0, world_size=size, timeout=timeout)
        except BaseException:
            self.close()
            raise

    def _await_workers(self, store: dist.TCPStore) -> None:
        """Until every worker has joined the store: one that exits first (a bad environment, an
        import error: its traceback is on stderr) fails start-up at once, not after TIMEOUT_S."""
        keys = [joined_key(rank) for rank in range(1, self.shard.size)]
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            try:
                store.wait(keys, timedelta(seconds=JOIN_POLL_S))
                return
            except RuntimeError:  # DistStoreError: not all there yet
                pass
            for rank, proc in enumerate(self.workers, start=1):
                if (code := proc.poll()) is not None:
                    raise RuntimeError(
                        f"tensor_parallel_size: worker rank {rank} (pid {proc.pid}) exited with "
                        f"code {code} before it joined the group"
                    )
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor_parallel_size: the workers did not join within {TIMEOUT_S:g} s")

    def send_cache(self, num_blocks: int) -> None:
        """The KV cache size rank 0 measured: every rank allocates as many blocks."""
        for rank in range(1, self.shard.size):
            self._send(rank, CACHE, pickled(num_blocks))

    def send_step(self, inputs: StepInputs) -> None:
        """Hand the step to every worker; raise if one has exited."""
        payload = encode_step(inputs)
        for rank in range(1, self.shard.size):
            self._send(rank, STEP, payload)

    def call(
        self,
        method: str | Callable[..., Any],
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        local: Callable[[], Any],
    ) -> list[Any]:
        """`collective_rpc` on every rank: the workers run `method` (a name of their worker's
        methods, or a callable given the worker), rank 0 runs `local`; the results by rank,
        gathered over gloo. A rank that raised is raised here (a ValueError stays one), after
        every rank has answered, so the group stays in step."""
        payload = cloudpickle.dumps((method, tuple(args), dict(kwargs)))
        for rank in range(1, self.shard.size):
            self._send(rank, RPC, payload)
        mine: Any
        failure: BaseException | None = None
        try:
            mine = local()
        except Exception as exc:  # raised below, once the workers' answers are in
            mine, failure = None, exc
        gathered: list[Any] = [None] * self.shard.size
        dist.gather_object(None, gathered, dst=0)  # rank 0's own result never needs pickling
        gathered[0] = mine
        if failure is not None:
            raise failure
        for result in gathered:
            if isinstance(result, RpcFailure):
                text = f"rank {result.rank}: {result.message}"
                raise ValueError(text) if result.kind == "ValueError" else RuntimeError(f"{result.kind}: {text}")
        return gathered

    def close(self) -> None:
        """Stop the workers (killed if they do not leave within STOP_GRACE_S) and leave the group."""
        for proc in self.workers:
            if proc.stdin is not None:
                try:
                    if proc.poll() is None:
                        write_message(proc.stdin, STOP)
                    proc.stdin.close()
                except OSError:  # already gone
                    pass
        for proc in self.workers:
            try:
                proc.wait(STOP_GRACE_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.workers = []
        if dist.is_initialized():
            dist.destroy_process_group()
        self._listener.close()  # unless the store took it

    def _send(self, rank: int, kind: int, payload: bytes) -> None:
        proc = self.workers[rank - 1]
        code = proc.poll()
        if code is None and proc.stdin is not None:
            try:
                write_message(proc.stdin, kind, payload)
                return
            except OSError:  # a broken pipe: it is exiting
                code = proc.wait(STOP_GRACE_S)
        raise RuntimeError(f"tensor_parallel_size: worker rank {rank} (pid {proc.pid}) exited with code {code}")

