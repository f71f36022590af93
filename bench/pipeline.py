"""`triollm bench pipeline`: the actor pipeline alone, and `LLM`'s overhead on the real model.

Part 1 replays scripted tokens in the engine core (no forward pass: the core is `triollm.testing`'s
`FakeCore()`, scripted tokens at full speed, passed as `engine_core_factory`, which reaches the
engine-core child process too), so what is measured is everything around the model: scheduling, the
wire (ZMQ + msgspec in the multiprocess transport), the output actor (detokenizing, building
RequestOutputs), collectors and consumers. 256 concurrent DELTA streams, for each transport and
event-loop backend; a heartbeat task sleeping 1 ms records the longest event-loop stall.

Part 2 runs one workload on the real model twice: driving the engine directly (`SyncEngine`:
no event loop, no threads) and through `LLM.generate` (portal + AsyncLLM + transport), and
reports the overhead.
"""

from __future__ import annotations

import argparse
import random
import time
from typing import Any

import anyio

from triollm import EngineArgs, RequestOutputKind, SamplingParams


def add_pipeline_parser(kinds: Any) -> None:
    p = kinds.add_parser("pipeline", help="actor pipeline throughput (scripted engine) and LLM overhead")
    p.add_argument("--streams", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--tokens-per-stream", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--transports", default="inproc,multiprocess", help="(default: %(default)s)")
    p.add_argument("--backends", default="trio,asyncio", help="(default: %(default)s)")
    p.add_argument(
        "--overhead-requests",
        type=int,
        default=32,
        help="real-model requests for the LLM overhead run; 0 skips it (default: %(default)s)",
    )
    EngineArgs.add_cli_args(p, skip=("multiprocess",))
    p.set_defaults(func=run_pipeline)


async def _stream_all(args: EngineArgs, streams: int, tokens: int) -> dict[str, float]:
    from triollm import AsyncLLM
    from triollm.testing import FakeCore

    params = SamplingParams(max_tokens=tokens, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    received = 0
    stall = 0.0

    async def heartbeat() -> None:
        nonlocal stall
        while True:
            t = time.perf_counter()
            await anyio.sleep(0.001)
            stall = max(stall, time.perf_counter() - t - 0.001)

    async def consume(i: int) -> None:
        nonlocal received
        async for out in llm.generate({"prompt_token_ids": [10 + i % 100] * 16}, params, f"s{i}"):
            received += len(out.outputs[0].token_ids)

    async with AsyncLLM.from_engine_args(args, engine_core_factory=FakeCore().factory()) as llm:
        async with anyio.create_task_group() as beat:
            beat.start_soon(heartbeat)
            start = time.perf_counter()
            async with anyio.create_task_group() as tg:
                for i in range(streams):
                    tg.start_soon(consume, i)
            elapsed = time.perf_counter() - start
            beat.cancel_scope.cancel()
    assert received == streams * tokens, f"received {received} tokens, expected {streams * tokens}"
    return {"tokens_per_s": received / elapsed, "elapsed_s": elapsed, "max_stall_ms": stall * 1e3}


def _overhead(args: EngineArgs, n: int) -> tuple[float, float]:
    from triollm import LLM

    # Not public: the engine driven directly is the baseline LLM's overhead is measured against.
    from triollm.engine.sync_engine import SyncEngine

    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(10000) for _ in range(rng.randint(32, 128))]} for _ in range(n)]
    params = [SamplingParams(max_tokens=rng.randint(32, 128), ignore_eos=True, temperature=0.0) for _ in range(n)]
    engine = SyncEngine.from_engine_args(args)
    engine.generate(prompts[:2], params[:2])  # warm-up
    t = time.perf_counter()
    engine.generate(prompts, params)
    direct = time.perf_counter() - t
    del engine
    with LLM.from_engine_args(args) as llm:
        llm.generate(prompts[:2], params[:2], use_tqdm=False)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        through = time.perf_counter() - t
    return direct, through


def run_pipeline(ns: argparse.Namespace) -> int:
    base = EngineArgs.from_cli_args(ns)
    print(f"{ns.streams} streams x {ns.tokens_per_stream} tokens, scripted engine core")
    for transport in ns.transports.split(","):
        for backend in ns.backends.split(","):
            args = EngineArgs(
                **{**vars(base), "multiprocess": transport == "multiprocess",
                   "max_num_seqs": max(base.max_num_seqs, ns.streams)}
            )
            res = anyio.run(_stream_all, args, ns.streams, ns.tokens_per_stream, backend=backend)
            print(
                f"{transport:<13} {backend:<8} {res['tokens_per_s']:9.0f} streamed tokens/s  "
                f"max event-loop stall {res['max_stall_ms']:6.1f} ms  ({res['elapsed_s']:.2f} s)"
            )
    if ns.overhead_requests:
        direct, through = _overhead(base, ns.overhead_requests)
        print(
            f"real model, {ns.overhead_requests} requests: engine directly {direct:.2f} s, "
            f"LLM.generate {through:.2f} s, overhead {100 * (through / direct - 1):+.1f}%"
        )
    return 0
