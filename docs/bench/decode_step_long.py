"""One request's decode step at a long context, alone in the engine: an 8000-token random prompt
(prefix caching off), 20 steps in, then the median of `STEPS` steps. The KV cache's dtype is the
first argument (`auto`, `bfloat16`, `fp8`, `int8`, ...); run it for each in turn, alternating
builds when comparing two (PYTHONPATH pointing at the other checkout). `PAUSE=s` waits after
printing READY and the pid, for a profiler to attach (`perf record -p PID`).

    .venv/bin/python docs/bench/decode_step_long.py fp8 [STEPS]
"""

from __future__ import annotations

import os
import random
import sys
import time

from triollm.engine.config import EngineArgs
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine


def main() -> None:
    kv = sys.argv[1]
    steps = int(sys.argv[2]) if len(sys.argv) > 2 else 200
    args = EngineArgs(kv_cache_dtype=kv, max_model_len=8448, enable_prefix_caching=False, seed=0)
    engine = SyncEngine.from_engine_args(args)
    rng = random.Random(0)
    ids = [rng.randrange(100, 40000) for _ in range(8000)]
    engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=steps + 60, ignore_eos=True, temperature=0))
    produced = 0
    while produced < 2:  # the prompt's chunks, then a first decode
        for out in engine.step():
            produced = len(out.outputs[0].token_ids)
    for _ in range(20):
        engine.step()
    print("READY", os.getpid(), flush=True)
    time.sleep(float(os.environ.get("PAUSE", "0")))
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    times.sort()
    print(f"{kv}: median step {times[len(times) // 2] * 1000:.2f} ms, p10 {times[len(times) // 10] * 1000:.2f}")


if __name__ == "__main__":
    main()
