"""The cost of batch invariance (`VLLM_BATCH_INVARIANT=1`): the switch off and on, interleaved in
one process, on one engine core (docs/benchmarks.md, "Batch invariance").

`triollm bench latency` run twice (once with the variable set) compares two processes started
minutes apart; on a shared 2-core VM the others' load moved its wall times by up to 10x between
them. Here one `EngineCore` is built with the switch off, and each repeat runs the prompt with
the switch off, then on, flipping what `ModelRunner` sets at start (its `batch_invariant`, a
dense head's row tiles, each dense `Linear.tile_rows`). What is timed is this process's CPU time
(`time.process_time`) on one thread, which others' load moves far less than wall time: the
prefill step (the whole prompt in one step) and the mean decode step after it. The minimum of
`--repeat` runs is printed for each, and the ratios.

    PYTHONPATH=<parent of the triollm package> python docs/bench/batch_invariance_ab.py \\
        --input-len 2048 --output-len 9 --repeat 3 [--quantization none] [--tile-rows 32]
"""

from __future__ import annotations

import argparse
import random
import time

from triollm.engine.config import EngineArgs
from triollm.engine.core import EngineCore
from triollm.engine.execution.layers.linear import Linear
from triollm.engine.execution.model_runner import ModelRunner
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams
from triollm.kernels import batch_invariant


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input-len", type=int, default=2048)
    p.add_argument("--output-len", type=int, default=9)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--quantization", default="gguf", help="gguf (the default model's blocks) or none (dense fp32)")
    p.add_argument("--tile-rows", type=int, default=batch_invariant.TILE_ROWS, help="dense GEMM tile under the switch")
    a = p.parse_args()
    args = EngineArgs(
        model=None, quantization=a.quantization, max_model_len=max(a.input_len + a.output_len + 16, 512),
        enable_prefix_caching=False, num_threads=1, max_num_batched_tokens=max(a.input_len, 2048), seed=0,
    )  # fmt: skip
    core = EngineCore(args.create_engine_config())
    runner = core.runner
    assert isinstance(runner, ModelRunner)
    linears = [m for m in runner.model.modules() if isinstance(m, Linear)]
    dense_head = any(m is runner.model.lm_head for m in linears) or a.quantization == "none"
    batch_invariant.tiled_rows.__defaults__ = (a.tile_rows,)  # the runner's head tiles
    rng = random.Random(0)
    prompt = [rng.randrange(100, 20000) for _ in range(a.input_len)]
    params = SamplingParams(max_tokens=a.output_len, temperature=0.0, ignore_eos=True)

    def run() -> tuple[float, float]:
        core.add_request(EngineCoreRequest(f"r{rng.random()}", prompt, params))
        t0 = time.process_time()
        core.step()  # the whole prompt, and the first token
        t1 = time.process_time()
        while core.has_unfinished_requests():
            core.step()
        return t1 - t0, (time.process_time() - t1) / max(a.output_len - 1, 1)

    runs: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(a.repeat):
        for on in (False, True):
            runner.batch_invariant = on
            runner._tile_logits = on and dense_head
            for m in linears:
                m.tile_rows = a.tile_rows if on else 0
            runs[on].append(run())
    best = {on: (min(r[0] for r in rs), min(r[1] for r in rs)) for on, rs in runs.items()}
    for on in (False, True):
        print(
            f"quantization={a.quantization} prompt={a.input_len} switch={'on' if on else 'off'}: prefill "
            f"{best[on][0]:.3f} s, decode {best[on][1] * 1e3:.1f} ms/token (CPU time, min of {a.repeat})"
        )
    print(f"on/off: prefill {best[True][0] / best[False][0]:.3f}x, decode {best[True][1] / best[False][1]:.3f}x")


if __name__ == "__main__":
    main()
