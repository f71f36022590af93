"""`triollm bench throughput | latency`: the offline yardsticks.

throughput: the community offline workload (as nano-vllm and mini-sglang use it): random
token-id prompts, input and output lengths uniform in [min, max], `ignore_eos`, seed 0; and a
text-prompt workload. `--compare-hf` runs Hugging Face transformers' batched `generate` on the
same prompts, model and dtype in the same process, one after the other, and prints the ratio.

latency: bench/latency.py.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from typing import Any

import torch

from triollm import EngineArgs

TEXT_TOPICS = [
    "a lighthouse keeper", "the history of bread", "how rainbows form", "a robot learning to paint",
    "the rules of chess", "why the sky is blue", "a journey to Mars", "the life of a honeybee",
]


def add_workload_args(p: argparse.ArgumentParser) -> None:
    """The random workload's size (`random_workload`): prompts and their length ranges."""
    p.add_argument("--num-prompts", type=int, default=64, help="(default: %(default)s)")
    p.add_argument("--min-input-len", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--max-input-len", type=int, default=256, help="(default: %(default)s)")
    p.add_argument("--min-output-len", type=int, default=32, help="(default: %(default)s)")
    p.add_argument("--max-output-len", type=int, default=256, help="(default: %(default)s)")


def add_throughput_parsers(kinds: Any) -> None:
    tp = kinds.add_parser("throughput", help="offline throughput on random token prompts and text prompts")
    add_workload_args(tp)
    tp.add_argument("--workload", choices=["random", "text", "both"], default="both", help="(default: %(default)s)")
    tp.add_argument("--compare-hf", action="store_true", help="also run transformers' batched generate")
    tp.add_argument(
        "--structured",
        action="store_true",
        help=(
            "also run the text prompts held to a JSON schema, against the same prompts unconstrained with the same "
            "token counts (the grammar's overhead)"
        ),
    )
    tp.add_argument("--output-json", default=None, help="write the results here")
    EngineArgs.add_cli_args(tp)
    tp.set_defaults(func=run_throughput)


def random_workload(ns: argparse.Namespace, vocab: int) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    top = min(vocab, 10000)
    return [
        (
            [rng.randrange(top) for _ in range(rng.randint(ns.min_input_len, ns.max_input_len))],
            rng.randint(ns.min_output_len, ns.max_output_len),
        )
        for _ in range(ns.num_prompts)
    ]


def text_workload(ns: argparse.Namespace, tokenizer: Any) -> list[tuple[list[int], int]]:
    rng = random.Random(0)
    out = []
    for i in range(ns.num_prompts):
        msg = [{"role": "user", "content": f"Write a short story about {TEXT_TOPICS[i % len(TEXT_TOPICS)]}."}]
        out.append((tokenizer.encode_chat(msg), rng.randint(ns.min_output_len, ns.max_output_len)))
    return out


def _run_triollm(engine: Any, work: list[tuple[list[int], int]]) -> dict[str, float]:
    from triollm import SamplingParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    params = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0, detokenize=True) for _, n in work]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    gen = sum(len(o.outputs[0].token_ids) for o in outs)
    assert gen == sum(n for _, n in work), "ignore_eos run produced the wrong token count"
    return _summary(elapsed, len(work), sum(len(ids) for ids, _ in work), gen)


# What the structured run asks for: a small record, as a JSON schema (the tests hold a shorter
# one, without the list, so that 64 tokens always finish it).
PERSON_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Berlin", "Rome"]},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}


def _run_structured(engine: Any, work: list[tuple[list[int], int]]) -> dict[str, Any]:
    """The prompts held to PERSON_SCHEMA (the grammar ends them), then the same prompts
    unconstrained with `ignore_eos` and each one's token count from the first run: the same
    work, so the ratio is the grammar's cost (matcher, bitmask, masking)."""
    from triollm import SamplingParams, StructuredOutputsParams

    prompts = [{"prompt_token_ids": ids} for ids, _ in work]
    so = StructuredOutputsParams(json=PERSON_SCHEMA)
    room = max(n for _, n in work)  # every document gets the longest request's room
    params = [SamplingParams(max_tokens=room, temperature=0.0, structured_outputs=so) for _ in work]
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    constrained = time.perf_counter() - start
    counts = [len(o.outputs[0].token_ids) for o in outs]
    valid = 0
    for o in outs:
        try:
            json.loads(o.outputs[0].text)
            valid += 1
        except ValueError:
            pass
    free = [SamplingParams(max_tokens=n, ignore_eos=True, temperature=0.0) for n in counts]
    start = time.perf_counter()
    engine.generate(prompts, free)
    unconstrained = time.perf_counter() - start
    gen, prompt_tokens = sum(counts), sum(len(ids) for ids, _ in work)
    res = {
        "structured/json": _summary(constrained, len(work), prompt_tokens, gen),
        "structured/free": _summary(unconstrained, len(work), prompt_tokens, gen),
    }
    _print("triollm json schema", res["structured/json"])
    _print("triollm same, free", res["structured/free"])
    ratio = unconstrained / constrained
    print(
        f"{'ratio structured':<24} {ratio:.2f}x output tokens/s (schema / free); {valid}/{len(outs)} outputs parse as "
        f"JSON"
    )
    return {**res, "ratio/structured": ratio, "structured/valid": valid}


def _run_hf(path: str, work: list[tuple[list[int], int]], pad_id: int) -> dict[str, float]:
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    _hf_generate(model, work[:4], pad_id, 8)  # warm-up, as triollm gets one
    start = time.perf_counter()
    longest = _hf_generate(model, work, pad_id)
    elapsed = time.perf_counter() - start
    # Useful tokens are what each request asked for; the batch pads every row to the longest.
    res = _summary(elapsed, len(work), sum(len(p) for p, _ in work), sum(n for _, n in work))
    res["padded_output_tokens_per_s"] = len(work) * longest / elapsed
    return res


def _hf_generate(model: Any, work: list[tuple[list[int], int]], pad_id: int, limit: int | None = None) -> int:
    """One batched greedy generate, prompts left-padded with an attention mask; every row runs
    to the longest requested length (min_new_tokens: EOS never ends it early). Returns it."""
    width = max(len(ids) for ids, _ in work)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in work])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in work])
    longest = max(n for _, n in work) if limit is None else limit
    with torch.inference_mode():
        model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest,
            do_sample=False, pad_token_id=pad_id,
        )
    return longest


def _summary(elapsed: float, n: int, prompt_tokens: int, gen_tokens: int) -> dict[str, float]:
    return {
        "elapsed_s": elapsed,
        "requests_per_s": n / elapsed,
        "output_tokens_per_s": gen_tokens / elapsed,
        "total_tokens_per_s": (prompt_tokens + gen_tokens) / elapsed,
        "prompt_tokens": prompt_tokens,
        "output_tokens": gen_tokens,
    }


def _print(name: str, res: dict[str, float]) -> None:
    print(
        f"{name:<24} {res['requests_per_s']:7.2f} req/s  {res['output_tokens_per_s']:8.1f} output tok/s  "
        f"{res['total_tokens_per_s']:8.1f} total tok/s  ({res['elapsed_s']:.1f} s)"
    )


def run_throughput(ns: argparse.Namespace) -> int:
    # Not LLM: the engine alone, no portal or actors (bench pipeline measures what LLM adds).
    from triollm.engine.sync_engine import SyncEngine

    args = EngineArgs.from_cli_args(ns)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    engine = SyncEngine.from_engine_args(args)
    print(f"model {engine.config.model.path} dtype {engine.config.model.dtype} threads {torch.get_num_threads()}")
    results: dict[str, Any] = {}
    loads = {"random": random_workload(ns, engine.config.model.vocab_size)}
    if ns.workload in ("text", "both"):
        loads["text"] = text_workload(ns, engine.tokenizer)
    if ns.workload == "text":
        del loads["random"]
    _run_triollm(engine, loads[next(iter(loads))][:4])  # warm-up
    for name, work in loads.items():
        results[f"triollm/{name}"] = res = _run_triollm(engine, work)
        _print(f"triollm {name}", res)
    if ns.structured:
        results.update(_run_structured(engine, text_workload(ns, engine.tokenizer)))
    if ns.compare_hf:
        del engine
        pad = 0
        for name, work in loads.items():
            results[f"hf/{name}"] = res = _run_hf(str(args.create_engine_config().model.path), work, pad)
            _print(f"transformers {name}", res)
            print(f"{'':<24} {res['padded_output_tokens_per_s']:8.1f} padded output tok/s (every row to the longest)")
            ratio = results[f"triollm/{name}"]["output_tokens_per_s"] / res["output_tokens_per_s"]
            results[f"ratio/{name}"] = ratio
            print(f"{'ratio ' + name:<24} {ratio:.2f}x output tokens/s (triollm / transformers)")
    if ns.output_json:
        with open(ns.output_json, "w") as f:
            json.dump(results, f, indent=2)
    return 0
