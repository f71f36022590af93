"""A closed loop without the server: `CONC` clients, each sending a 200-token random prompt for 128
sampled tokens (temperature 1, `ignore_eos`) and the next as soon as one ends, `N` prompts in
all, through `SyncEngine` with the serve defaults (`max_num_seqs` 64, `max_model_len` 1024):
what `vllm bench serve`'s random workload asks of the engine, with no HTTP in between. Prints
output tok/s, the steps taken and the mean step.

    .venv/bin/python docs/bench/closed_loop.py CONC N
"""

from __future__ import annotations

import random
import sys
import time

from triollm.engine.config import EngineArgs
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine


def main() -> None:
    conc, n = int(sys.argv[1]), int(sys.argv[2])
    engine = SyncEngine.from_engine_args(EngineArgs(max_model_len=1024, max_num_seqs=64, seed=0))
    rng = random.Random(1)
    pending = [[rng.randrange(100, 40000) for _ in range(200)] for _ in range(n)]
    params = SamplingParams(max_tokens=128, ignore_eos=True, temperature=1.0)
    active = tokens = steps = 0
    start = time.perf_counter()
    while pending or active:
        while pending and active < conc:
            engine.add_request({"prompt_token_ids": pending.pop()}, params)
            active += 1
        for out in engine.step():
            if out.finished:
                active -= 1
                tokens += len(out.outputs[0].token_ids)
        steps += 1
    took = time.perf_counter() - start
    print(f"conc {conc}: {tokens} tokens in {took:.1f} s = {tokens / took:.1f} tok/s, {steps} steps, "
          f"{took / steps * 1000:.1f} ms/step")


if __name__ == "__main__":
    main()
