"""Batch-1 decode ms/token through the engine alone (SyncEngine) with tensor parallelism.

    .venv/bin/python docs/bench/tp_decode.py --model DIR -tp 2 --num-threads 2

`--num-threads` is the total, split between the ranks (1 each above). `triollm bench latency`
does the same on a real checkpoint; this one draws its prompt ids below the model's vocabulary,
so it runs on the random SmolLM2-shaped models of tests/tinymodel.py too:

    .venv/bin/python -c "import sys; sys.path.insert(0, 'tests'); from pathlib import Path; \\
      from tinymodel import make_tiny_model; make_tiny_model(Path('/tmp/smol8'), hidden_size=512, \\
      num_layers=30, num_heads=8, num_kv_heads=4, intermediate_size=1536, max_position_embeddings=2048)"
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from triollm.engine.config import EngineArgs
from triollm.engine.sampling_params import SamplingParams
from triollm.engine.sync_engine import SyncEngine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("-tp", "--tensor-parallel-size", type=int, default=1)
    ap.add_argument("--num-threads", type=int, default=1)
    ap.add_argument("--input-len", type=int, default=32)
    ap.add_argument("--output-len", type=int, default=64)
    ns = ap.parse_args()
    torch.set_num_threads(ns.num_threads)
    engine = SyncEngine.from_engine_args(
        EngineArgs(
            model=ns.model, tensor_parallel_size=ns.tensor_parallel_size, num_threads=ns.num_threads, max_model_len=512
        )
    )
    try:
        rng = random.Random(0)
        prompt = {"prompt_token_ids": [rng.randrange(engine.config.model.vocab_size) for _ in range(ns.input_len)]}
        engine.generate([prompt], SamplingParams(max_tokens=4, ignore_eos=True, temperature=0.0))  # warm-up
        engine.add_request(prompt, SamplingParams(max_tokens=ns.output_len, ignore_eos=True, temperature=0.0))
        times = []
        t = time.perf_counter()
        while engine.has_unfinished_requests():
            engine.step()
            now = time.perf_counter()
            times.append(now - t)
            t = now
        per_token = statistics.median(times[1:])
        print(f"tp {ns.tensor_parallel_size}, {ns.num_threads} thread(s) in all: TTFT {times[0] * 1e3:.1f} ms, "
              f"decode median {per_token * 1e3:.1f} ms/token")
    finally:
        engine.core.close()


if __name__ == "__main__":
    main()
