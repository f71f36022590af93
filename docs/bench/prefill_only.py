"""Prefill alone through `LLM.generate`: 64 prompts of 200 random token ids, one output token each,
prefix caching off (the bundled model unless `MODEL` is set), twice after a warm-up; prompt tokens
per second. What a served start-up's first tokens are bounded by.

    .venv/bin/python docs/bench/prefill_only.py
"""

from __future__ import annotations

import os
import random
import time

from triollm import LLM, SamplingParams


def main() -> None:
    kwargs = {"model": os.environ["MODEL"]} if os.environ.get("MODEL") else {}
    llm = LLM(enable_prefix_caching=False, **kwargs)
    rng = random.Random(0)
    prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(200)]} for _ in range(64)]
    params = SamplingParams(max_tokens=1, temperature=0)
    llm.generate(prompts[:4], params, use_tqdm=False)
    for _ in range(2):
        start = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        took = time.perf_counter() - start
        print(f"prefill 64 x 200 tokens: {took:.2f} s, {64 * 200 / took:.0f} tok/s")


if __name__ == "__main__":
    main()
