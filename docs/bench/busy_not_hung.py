"""Issue 40, "busy is not hung": the measurements in docs/reliability.md ("Long prompts: busy is
not hung"), on a random Llama-shaped checkpoint of realistic size.

    python docs/bench/busy_not_hung.py checkpoint OUT_DIR --tokenizer-from DIR
        a random LlamaForCausalLM (hidden 1,536, 16 layers, intermediate 4,096, 12 heads / 4 KV
        heads, vocabulary 49,152: ~0.48B parameters, bf16) written by transformers'
        save_pretrained, with the tokenizer files of DIR (the bundled SmolLM2's import)
    python docs/bench/busy_not_hung.py steps MODEL_DIR [--prompt 8000] [--chunk 512]
        one long prompt's prefill chunks through an EngineCore: each step's time, its cost per
        token, and what the step-cost line (engine/scheduling/step_cost.py) predicted for it
    python docs/bench/busy_not_hung.py mixed MODEL_DIR [--prompt 4000]
        the second client run's schedule in an EngineCore with default settings: one request
        decoding, then a long prompt beside it; each step's tokens per request, time, the
        step-cost line (a, b in ms per token) and the pace the time bound reads
    python docs/bench/busy_not_hung.py client URL MODEL [--prompt 8000] [--stream-tokens 200]
            [--stream-first] [--seed 0]
        against `triollm serve MODEL`: one short request first, then the long prompt (random token
        ids from `--seed`: use a new seed for each run against one server, or the prefix cache
        serves the prompt)
        and a second client streaming a short prompt (ignore_eos), /health polled every 0.5 s;
        prints the long request's time, the stream's time to first token and inter-token
        latencies (all, and while the long request was in flight) and /health's statuses and
        latencies. `--stream-first`: the stream starts first and the long prompt 5 s later
        (its chunks then run beside the stream's decodes); otherwise the long prompt starts
        first and the stream 1 s later.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Any


def checkpoint(out: Path, tokenizer_from: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(  # type: ignore[call-arg]  # rope_theta: transformers 5 takes it in **kwargs
        vocab_size=49152, hidden_size=1536, intermediate_size=4096, num_hidden_layers=16,
        num_attention_heads=12, num_key_value_heads=4, head_dim=128, max_position_embeddings=16384,
        rope_theta=100000.0, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )  # fmt: skip
    model = LlamaForCausalLM(config).to(torch.bfloat16)  # type: ignore[arg-type]
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters")
    model.save_pretrained(out)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, out / name)


def steps(model: str, prompt_len: int, chunk: int) -> None:
    from triollm.engine.config import EngineArgs
    from triollm.engine.core import EngineCore
    from triollm.engine.request import EngineCoreRequest
    from triollm.engine.sampling_params import SamplingParams

    args = EngineArgs(
        model=model, max_num_batched_tokens=chunk, scheduler_prefill_budget="off", enable_prefix_caching=False
    )
    core = EngineCore(args.create_engine_config())
    sched = core.scheduler
    record = sched.record_step

    def report(output: Any, seconds: float) -> None:
        fit = sched.step_cost.fit
        predicted = f"{fit.seconds(output.num_tokens):.3f}" if fit else "-"
        context = [s.num_computed_tokens for s in output.scheduled]
        print(
            f"tokens={output.num_tokens:5d} context={context} s={seconds:.3f} "
            f"ms/token={1e3 * seconds / output.num_tokens:.2f} line predicted={predicted} line={fit}",
            flush=True,
        )
        record(output, seconds)

    sched.record_step = report  # type: ignore[method-assign]
    vocab = core.config.model.vocab_size
    for rid, n, max_tokens in (("warm", 300, 3), ("long", prompt_len, 2)):  # steps of other sizes first
        ids = [7 + (i * 31) % (vocab - 7) for i in range(n)]
        core.add_request(EngineCoreRequest(rid, ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True)))
        t0 = time.perf_counter()
        while core.has_unfinished_requests():
            core.step()
        print(f"{rid}: {time.perf_counter() - t0:.1f} s")


def mixed(model: str, prompt_len: int) -> None:
    from triollm.engine.config import EngineArgs
    from triollm.engine.core import EngineCore
    from triollm.engine.request import EngineCoreRequest
    from triollm.engine.sampling_params import SamplingParams

    core = EngineCore(EngineArgs(model=model).create_engine_config())
    sched = core.scheduler
    record = sched.record_step

    def report(output: Any, seconds: float) -> None:
        fit, pace = sched.step_cost.fit, sched.step_cost.latest_prefill
        line = fit and (round(fit.seconds_per_step, 3), round(fit.seconds_per_token * 1e3, 3))
        tokens = {s.request.request_id: (s.num_new_tokens, s.num_computed_tokens) for s in output.scheduled}
        print(f"s={seconds:.3f} (tokens, context)={tokens} line={line} pace={pace}", flush=True)
        record(output, seconds)

    sched.record_step = report  # type: ignore[method-assign]
    greedy = SamplingParams(max_tokens=10**4, ignore_eos=True)
    core.add_request(EngineCoreRequest("stream", [9 + i for i in range(8)], greedy))
    for _ in range(10):
        core.step()
    ids = [7 + (i * 37) % (core.config.model.vocab_size - 7) for i in range(prompt_len)]
    core.add_request(EngineCoreRequest("long", ids, SamplingParams(max_tokens=2, ignore_eos=True)))
    t0 = time.perf_counter()
    while "long" in core.requests:
        core.step()
    print(f"long: {time.perf_counter() - t0:.1f} s")


def _pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(p / 100 * (len(xs) - 1))))]


async def _client(
    url: str, model: str, prompt_len: int, stream_tokens: int, stream_first: bool, seed: int, max_id: int
) -> dict[str, Any]:
    import anyio
    import httpx

    rng = random.Random(seed)
    long_prompt = [rng.randrange(100, max_id) for _ in range(prompt_len)]
    health: list[tuple[float, int | str, float]] = []
    res: dict[str, Any] = {}
    times: list[float] = []

    async def poll_health(client: httpx.AsyncClient, t0: float, done: anyio.Event) -> None:
        while not done.is_set():
            s = time.perf_counter()
            try:
                status: int | str = (await client.get(f"{url}/health", timeout=30)).status_code
            except Exception as exc:  # noqa: BLE001 - recorded, not raised
                status = repr(exc)
            health.append((s - t0, status, time.perf_counter() - s))
            await anyio.sleep(0.5)

    async def long_request(client: httpx.AsyncClient, t0: float) -> None:
        if stream_first:
            await anyio.sleep(5.0)
        s = time.perf_counter()
        body = {"model": model, "prompt": long_prompt, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
        r = await client.post(f"{url}/v1/completions", json=body, timeout=3600)
        res["long_status"] = r.status_code
        res["long_error"] = r.text[:300] if r.status_code != 200 else None
        res["long_s"] = time.perf_counter() - s
        res["long_end_s"] = time.perf_counter() - t0

    async def stream(client: httpx.AsyncClient, t0: float) -> None:
        if not stream_first:
            await anyio.sleep(1.0)
        s = time.perf_counter()
        body = {
            "model": model, "prompt": "Tell me a story about a robot.", "max_tokens": stream_tokens,
            "ignore_eos": True, "stream": True, "temperature": 0,
        }  # fmt: skip
        async with client.stream("POST", f"{url}/v1/completions", json=body, timeout=3600) as r:
            res["stream_status"] = r.status_code
            async for line in r.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    choices = json.loads(line[6:]).get("choices")
                    if choices and choices[0].get("text") is not None:
                        times.append(time.perf_counter() - t0)
        res["stream_ttft_s"] = times[0] - (s - t0) if times else None
        res["stream_s"] = time.perf_counter() - s

    async with httpx.AsyncClient() as client:
        warm = {"model": model, "prompt": "warm up", "max_tokens": 2}
        (await client.post(f"{url}/v1/completions", json=warm, timeout=600)).raise_for_status()
        t0 = time.perf_counter()
        done = anyio.Event()
        async with anyio.create_task_group() as tg:
            tg.start_soon(poll_health, client, t0, done)
            async with anyio.create_task_group() as work:
                work.start_soon(long_request, client, t0)
                work.start_soon(stream, client, t0)
            done.set()
    itl = [b - a for a, b in zip(times, times[1:])]
    during = [b - a for a, b in zip(times, times[1:]) if b <= res.get("long_end_s", 0)]
    statuses: dict[str, int] = {}
    for _, status, _ in health:
        statuses[str(status)] = statuses.get(str(status), 0) + 1
    latencies = [h[2] for h in health]
    res.update(
        stream_tokens=len(times),
        itl_median_s=statistics.median(itl) if itl else None,
        itl_p99_s=_pct(itl, 99) if itl else None,
        itl_max_s=max(itl) if itl else None,
        itl_during_long_n=len(during),
        itl_during_long_median_s=statistics.median(during) if during else None,
        itl_during_long_p99_s=_pct(during, 99) if during else None,
        health_statuses=statuses,
        health_median_s=statistics.median(latencies),
        health_p99_s=_pct(latencies, 99),
        health_max_s=max(latencies),
    )
    return res


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("checkpoint")
    p.add_argument("out", type=Path)
    p.add_argument("--tokenizer-from", type=Path, required=True)
    p = sub.add_parser("steps")
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=8000)
    p.add_argument("--chunk", type=int, default=512)
    p = sub.add_parser("mixed")
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=4000)
    p = sub.add_parser("client")
    p.add_argument("url")
    p.add_argument("model")
    p.add_argument("--prompt", type=int, default=8000)
    p.add_argument("--stream-tokens", type=int, default=200)
    p.add_argument("--stream-first", action="store_true")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-token-id", type=int, default=40000, help="the prompt's ids are below it")
    args = parser.parse_args(argv)
    if args.cmd == "checkpoint":
        checkpoint(args.out, args.tokenizer_from)
    elif args.cmd == "steps":
        steps(args.model, args.prompt, args.chunk)
    elif args.cmd == "mixed":
        mixed(args.model, args.prompt)
    else:
        import anyio

        result = anyio.run(
            _client, args.url, args.model, args.prompt, args.stream_tokens, args.stream_first, args.seed,
            args.max_token_id,
        )  # fmt: skip
        print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(sys.argv[1:])
