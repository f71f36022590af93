"""One request's decode step at a long context, alone in its engine: an 8000-token random prompt
(prefix caching off), 20 steps in, then the median of its steps. The KV cache's dtypes are the first
argument, comma-separated (`auto`, `bfloat16`, `fp8`, `int8`, ...): one engine per dtype in this
process, each holding the same prompt, stepping in turn (10 steps each, `ROUNDS` rounds), so that
the machine's drift (this VM's memory bandwidth moves by 1.5x from minute to minute) falls on all of
them alike; the ratios to the first are printed. As the served engine does, the collector is frozen
after set-up (`gc.freeze()`). Compare builds by running it once per build, alternating
(PYTHONPATH pointing at the other checkout). `PAUSE=s` waits after printing READY and the pid, for a
profiler to attach (`perf record -p PID`).

    .venv/bin/python docs/bench/decode_step_long.py bfloat16,fp8,int8 [ROUNDS] [PROMPT]

PROMPT (default 8000) sets the prompt's length: 64 times a batch-1 step at short context.
"""

from __future__ import annotations

import gc
import os
import random
import statistics
import sys
import time

from triollm.engine.config import EngineArgs
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine

PROMPT, PER_ROUND = 8000, 10


def main() -> None:
    dtypes = sys.argv[1].split(",")
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 20
    prompt = int(sys.argv[3]) if len(sys.argv) > 3 else PROMPT
    steps = rounds * PER_ROUND
    engines = []
    for kv in dtypes:
        args = EngineArgs(kv_cache_dtype=kv, max_model_len=prompt + steps + 200, enable_prefix_caching=False, seed=0)
        engine = SyncEngine.from_engine_args(args)
        rng = random.Random(0)
        ids = [rng.randrange(100, 40000) for _ in range(prompt)]
        params = SamplingParams(max_tokens=steps + 60, ignore_eos=True, temperature=0)
        engine.add_request({"prompt_token_ids": ids}, params)
        produced = 0
        while produced < 2:  # the prompt's chunks, then a first decode
            for out in engine.step():
                produced = len(out.outputs[0].token_ids)
        for _ in range(20):
            engine.step()
        engines.append(engine)
    gc.collect()
    gc.freeze()
    print("READY", os.getpid(), flush=True)
    time.sleep(float(os.environ.get("PAUSE", "0")))
    times: dict[str, list[float]] = {kv: [] for kv in dtypes}
    for _ in range(rounds):
        for kv, engine in zip(dtypes, engines):
            for _ in range(PER_ROUND):
                start = time.perf_counter()
                engine.step()
                times[kv].append(time.perf_counter() - start)
    med = {kv: statistics.median(t) * 1000 for kv, t in times.items()}
    print(", ".join(f"{kv}: median step {m:.2f} ms ({m / med[dtypes[0]]:.3f}x)" for kv, m in med.items()))


if __name__ == "__main__":
    main()
