"""Where a batch-64 decode step's time goes: `SyncEngine` on the peers' workload (64 prompts,
128 greedy tokens each), 20 steps in, then the median of 20 steps and a torch.profiler table
over 10 more. Needs the peers' model and workload (../shared/peers/setup.sh).

    .venv/bin/python docs/bench/profile_step.py [THREADS]
"""

from __future__ import annotations

import json
import os
import sys
import time

from torch.profiler import ProfilerActivity, profile

from triollm.engine.config import EngineArgs
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine

PEERS = os.environ.get("PEERS", os.path.expanduser("~/.cache/triollm-peers"))


def main() -> None:
    threads = int(sys.argv[1]) if len(sys.argv) > 1 else 2
    prompts = json.load(open(f"{PEERS}/workload/prompts.json"))["token_ids"][:64]
    args = EngineArgs(
        model=f"{PEERS}/models/smollm2-135m-instruct-fp32",
        dtype="bfloat16",
        max_model_len=1024,
        max_num_seqs=64,
        seed=0,
        num_threads=threads,
    )
    engine = SyncEngine.from_engine_args(args)  # built and stepped in this one thread
    for ids in prompts:
        engine.add_request({"prompt_token_ids": ids}, SamplingParams(max_tokens=128, ignore_eos=True, temperature=0))
    for _ in range(20):
        engine.step()
    times = []
    for _ in range(20):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    median = sorted(times)[len(times) // 2]
    print(f"threads {threads}: decode step at batch 64 {median * 1000:.1f} ms ({64 / median:.0f} tok/s)")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            engine.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()
