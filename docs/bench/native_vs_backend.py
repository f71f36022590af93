"""Batch-1 decode, a native class against the Transformers backend on the same checkpoint, in one
process: two engines (`model_impl` auto and transformers) each holding one request of a P-token
random prompt (prefix caching off), stepping in turn, 10 steps each, ROUNDS rounds, so that this
VM's drift in memory bandwidth falls on both alike; the median step of each and their ratio.

    .venv/bin/python docs/bench/native_vs_backend.py MODEL_DIR bfloat16|float32 P [ROUNDS]
"""

from __future__ import annotations

import gc
import random
import statistics
import sys
import time

from triollm.engine.config import EngineArgs
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine


def main() -> None:
    model, dtype, prompt = sys.argv[1], sys.argv[2], int(sys.argv[3])
    rounds = int(sys.argv[4]) if len(sys.argv) > 4 else 10
    engines = {}
    for impl in ("auto", "transformers"):
        args = EngineArgs(
            model=model, dtype=dtype, model_impl=impl, max_model_len=prompt + rounds * 10 + 200,
            enable_prefix_caching=False, seed=0, num_threads=2,
        )  # fmt: skip
        engine = SyncEngine.from_engine_args(args)
        rng = random.Random(0)
        ids = [rng.randrange(100, 40000) for _ in range(prompt)]
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=rounds * 10 + 100, ignore_eos=True))
        produced = 0
        while produced < 2:  # the prompt's chunks, then a first decode
            for out in engine.step():
                produced = len(out.outputs[0].token_ids)
        for _ in range(10):
            engine.step()
        engines[impl] = engine
    gc.collect()
    gc.freeze()
    times: dict[str, list[float]] = {impl: [] for impl in engines}
    for _ in range(rounds):
        for impl, engine in engines.items():
            for _ in range(10):
                start = time.perf_counter()
                engine.step()
                times[impl].append(time.perf_counter() - start)
    native, backend = (statistics.median(times[k]) * 1000 for k in ("auto", "transformers"))
    print(f"{dtype} P={prompt}: native {native:.2f} ms, backend {backend:.2f} ms a step: {backend / native:.2f}x")


if __name__ == "__main__":
    main()
