"""`triollm bench quality`: what a quantization scheme costs in accuracy, against the dense model.

Two figures for each scheme in `--schemes`, each next to the dense (`quantization="none"`)
model's, on the same model and dtype in one run:

* perplexity on a fixed text (`--text`, default tests/data/coriolanus.txt: the opening of
  Shakespeare's Coriolanus, public domain, ~4700 tokens of the bundled tokenizer), scored in
  windows of `--window` tokens through prompt logprobs;
* greedy agreement: 8 chat prompts x `--max-tokens` tokens, the share of generated tokens equal
  to the dense model's, position by position up to the first difference (after a difference the
  two continue from different texts, so later positions are not comparable), and the number of
  prompts whose whole output is identical.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from triollm.engine.config import QUANTIZATIONS, EngineArgs

__all__ = ["add_quality_parser"]

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis to a child.",
    "List three uses of a paperclip.",
    "What is 17 times 3?",
    "Give me a tip for learning a new language.",
    "Describe a cat in one sentence.",
    "Why is the sky blue?",
]
DEFAULT_TEXT = Path(__file__).resolve().parents[2] / "tests" / "data" / "coriolanus.txt"


def add_quality_parser(kinds: Any) -> None:
    p = kinds.add_parser("quality", help="perplexity and greedy agreement of quantized weights against the dense model")
    p.add_argument("--schemes", default="gguf", help=f"comma-separated quantization schemes to compare with the dense model, from {', '.join(QUANTIZATIONS)} (default: %(default)s)")
    p.add_argument("--text", default=str(DEFAULT_TEXT), help="the perplexity text (default: the bundled Coriolanus excerpt)")
    p.add_argument("--window", type=int, default=1024, help="tokens per perplexity window (default: %(default)s)")
    p.add_argument("--max-tokens", type=int, default=64, help="greedy tokens per chat prompt (default: %(default)s)")
    p.add_argument("--output-json", default=None, help="write the results here")
    EngineArgs.add_cli_args(p)
    p.set_defaults(func=run_quality)


def _measure(args: EngineArgs, text: str, window: int, max_tokens: int) -> dict[str, Any]:
    from triollm.engine.sampling_params import SamplingParams
    from triollm.engine.sync_engine import SyncEngine

    engine = SyncEngine.from_engine_args(args)
    tok = engine.tokenizer
    ids = tok.encode(text)
    nll, count = 0.0, 0
    start = time.perf_counter()
    for s in range(0, len(ids) - 1, window):
        chunk = ids[s : s + window]
        if len(chunk) < 2:
            break
        (out,) = engine.generate([{"prompt_token_ids": chunk}], SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0))
        assert out.prompt_logprobs is not None
        for row, token in zip(out.prompt_logprobs[1:], chunk[1:], strict=True):
            assert row is not None
            nll -= row[token].logprob
            count += 1
    prompts = [{"prompt_token_ids": tok.encode_chat([{"role": "user", "content": c}])} for c in CHAT_PROMPTS]
    outs = engine.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return {
        "perplexity": math.exp(nll / count),
        "scored_tokens": count,
        "greedy": [o.outputs[0].token_ids for o in outs],
        "seconds": time.perf_counter() - start,
    }


def _agreement(dense: list[list[int]], other: list[list[int]]) -> tuple[float, int]:
    same = total = identical = 0
    for a, b in zip(dense, other, strict=True):
        total += len(a)
        prefix = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += prefix
        identical += a == b
    return same / max(total, 1), identical


def run_quality(ns: argparse.Namespace) -> int:
    base = EngineArgs.from_cli_args(ns)
    text = Path(ns.text).read_text(encoding="utf-8")
    schemes = [s.strip() for s in ns.schemes.split(",") if s.strip()]
    results: dict[str, Any] = {}
    dense = _measure(_with(base, "none"), text, ns.window, ns.max_tokens)
    results["dense"] = {"perplexity": dense["perplexity"], "scored_tokens": dense["scored_tokens"]}
    print(f"{'dense':<8} perplexity {dense['perplexity']:.3f} over {dense['scored_tokens']} tokens")
    for scheme in schemes:
        res = _measure(_with(base, scheme), text, ns.window, ns.max_tokens)
        share, identical = _agreement(dense["greedy"], res["greedy"])
        ratio = res["perplexity"] / dense["perplexity"]
        results[scheme] = {"perplexity": res["perplexity"], "perplexity_ratio": ratio, "greedy_prefix_agreement": share, "identical_outputs": identical}
        print(
            f"{scheme:<8} perplexity {res['perplexity']:.3f} ({ratio:.4f}x dense); greedy: {share:.1%} of tokens before the "
            f"first difference, {identical}/{len(CHAT_PROMPTS)} outputs identical ({ns.max_tokens} tokens each)"
        )
    if ns.output_json:
        Path(ns.output_json).write_text(json.dumps(results, indent=2))
    return 0


def _with(args: EngineArgs, quantization: str) -> EngineArgs:
    import dataclasses

    return dataclasses.replace(args, quantization=quantization)
