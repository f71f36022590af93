"""`triollm bench serve`: an online load generator for any OpenAI-compatible server.

The workload is `triollm bench throughput`'s: `--num-prompts` requests, input and output
lengths uniform in `--input-len` / `--output-len` (MIN-MAX), seed 0, `ignore_eos: true`. Token-id
prompts are the same as bench throughput's random workload (ids below `--vocab-size`, sent
in the `prompt` token-id list form); text prompts (`--prompt-kind text`, the only kind chat
accepts) are random common words, about one token each.

Requests stream from /v1/completions (or /v1/chat/completions with `--endpoint chat`). Arrivals
are all at once (`--request-rate inf`) or Poisson at R requests/s; `--max-concurrency N` caps
the requests in flight (a request's clock starts when it gets a slot, as in vLLM's bench).

Per request: TTFT (the first chunk carrying a token), ITL (for each later chunk, the gap since
the previous one divided over its tokens, one value per token: the server may merge several
engine steps into one chunk), TPOT ((latency - TTFT) / (output tokens - 1)) and end-to-end
latency. Tokens per chunk come from `usage` on every chunk (`stream_options.continuous_usage_stats`,
vLLM's extension); without it each chunk with text counts as one token, and the output length
is the final usage chunk's `completion_tokens` (`include_usage`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import anyio

if TYPE_CHECKING:
    import httpx  # imported when a run starts: `triollm --help` must not need it

__all__ = [
    "BenchRequest",
    "RequestResult",
    "ServeBenchOptions",
    "StreamAccumulator",
    "add_serve_bench_parser",
    "make_workload",
    "percentile",
    "run_benchmark",
    "summarize",
]

WORDS = (
    "the of and to in is you that it he was for on are as with his they at be this have from or "
    "one had by word but not what all were we when your can said there use an each which she do "
    "how their if will up other about out many then them these so some her would make like him "
    "into time has look two more write go see number no way could people my than first water "
    "been call who oil its now find long down day did get come made may part over new sound take "
    "only little work know place year live me back give most very after thing our just name good "
    "sentence man think say great where help through much before line right too mean old any same "
    "tell boy follow came want show also around form three small set put end does another well "
    "large must big even such because turn here why ask went men read need land different home us "
    "move try kind hand picture again change off play spell air away animal house point page letter"
).split()


def _range(text: str) -> tuple[int, int]:
    """`N` or `MIN-MAX` (inclusive)."""
    try:
        lo, _, hi = text.partition("-")
        a, b = int(lo), int(hi or lo)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected N or MIN-MAX, got {text!r}") from exc
    if a < 1 or b < a:
        raise argparse.ArgumentTypeError(f"expected 1 <= MIN <= MAX, got {text!r}")
    return a, b


def add_serve_bench_parser(kinds: Any) -> None:
    """Register `bench serve` (a client: it takes no engine flags)."""
    p = kinds.add_parser("serve", help="online load against an OpenAI-compatible server (TTFT, ITL, throughput)")
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server (a trailing /v1 is fine) (default: %(default)s)"
    )
    p.add_argument(
        "--endpoint",
        choices=["completions", "chat"],
        default="completions",
        help="/v1/completions or /v1/chat/completions (default: %(default)s)",
    )
    p.add_argument("--model", default=None, help="the `model` field (default: the first of GET /v1/models)")
    p.add_argument(
        "--api-key",
        default=os.environ.get("TRIOLLM_API_KEY") or os.environ.get("OPENAI_API_KEY"),
        help="sent as a Bearer token (default: $TRIOLLM_API_KEY, else $OPENAI_API_KEY)",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="(default: %(default)s)")
    p.add_argument(
        "--input-len",
        type=_range,
        default=(32, 256),
        metavar="N|MIN-MAX",
        help="prompt tokens, uniform (default: 32-256)",
    )
    p.add_argument(
        "--output-len",
        type=_range,
        default=(32, 256),
        metavar="N|MIN-MAX",
        help="max_tokens, uniform, with ignore_eos (default: 32-256)",
    )
    p.add_argument(
        "--prompt-kind",
        choices=["ids", "text"],
        default=None,
        help="token-id lists or random words (default: ids for completions, text for chat)",
    )
    p.add_argument(
        "--vocab-size", type=int, default=10000, help="token ids are drawn below this (default: %(default)s)"
    )
    p.add_argument("--seed", type=int, default=0, help="workload and arrival seed (default: %(default)s)")
    p.add_argument(
        "--request-rate",
        type=float,
        default=math.inf,
        help="Poisson arrivals per second; inf sends all at once (default: %(default)s)",
    )
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    p.add_argument("--temperature", type=float, default=0.0, help="(default: %(default)s)")
    p.add_argument(
        "--continuous-usage",
        action=argparse.BooleanOptionalAction,
        default=True,
        help=(
            "ask for usage on every chunk (vLLM's stream_options.continuous_usage_stats) to count tokens per chunk "
            "(default: %(default)s)"
        ),
    )
    p.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="send one short request first and stop if it fails (default: %(default)s)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a request may wait for its next bytes (default: %(default)s)",
    )
    p.add_argument(
        "--backend",
        choices=["asyncio", "trio"],
        default="asyncio",
        help="the client's event loop (default: %(default)s)",
    )
    p.add_argument("--result-file", default=None, help="write the results as JSON here")
    p.set_defaults(func=run_serve_bench)


# ---------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens asked for (text: words, about one token each)
    output_len: int


def make_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], kind: str = "ids",
    vocab_size: int = 10000, seed: int = 0,
) -> list[BenchRequest]:
    """Token ids: the same prompts and lengths as `bench throughput`'s random workload."""
    rng = random.Random(seed)
    out = []
    for _ in range(num_prompts):
        n = rng.randint(*input_len)
        if kind == "ids":
            prompt: str | list[int] = [rng.randrange(vocab_size) for _ in range(n)]
        else:
            prompt = " ".join(rng.choice(WORDS) for _ in range(n))
        out.append(BenchRequest(prompt, n, rng.randint(*output_len)))
    return out


# ---------------------------------------------------------------------------- one stream


@dataclass
class RequestResult:
    success: bool = False
    prompt_len: int = 0
    output_len: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start: float = 0.0
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_len > 1:
            return (self.latency - self.ttft) / (self.output_len - 1)
        return None


class StreamAccumulator:
    """Turns the decoded SSE chunks of one stream, with their arrival times, into a result."""

    def __init__(self, start: float, prompt_len: int) -> None:
        self.result = RequestResult(start=start, prompt_len=prompt_len)
        self._last: float | None = None  # when the previous token-carrying chunk arrived
        self._counted = 0  # tokens counted chunk by chunk
        self._usage_seen = 0  # completion_tokens in the last per-chunk usage
        self._final_usage: int | None = None
        self.text: list[str] = []

    def feed(self, chunk: dict[str, Any], now: float) -> None:
        if "error" in chunk:
            err = chunk["error"]
            raise RuntimeError(err.get("message", str(err)) if isinstance(err, dict) else str(err))
        choices = chunk.get("choices") or []
        usage = chunk.get("usage") or None
        text = "".join(_choice_text(c) for c in choices)
        if usage:
            if usage.get("prompt_tokens") is not None:
                self.result.prompt_len = int(usage["prompt_tokens"])
            if usage.get("completion_tokens") is not None:
                self._final_usage = int(usage["completion_tokens"])
        if choices and usage and usage.get("completion_tokens") is not None:
            k = int(usage["completion_tokens"]) - self._usage_seen  # continuous usage
            self._usage_seen = int(usage["completion_tokens"])
        elif choices:
            k = 1 if text else 0
        else:
            k = 0  # a usage-only chunk
        if text:
            self.text.append(text)
        if k <= 0:
            return
        r = self.result
        if self._last is None:
            r.ttft = now - r.start
        else:
            gap = (now - self._last) / k
            r.itl.extend([gap] * k)
        self._last = now
        self._counted += k

    def finish(self, now: float) -> RequestResult:
        r = self.result
        r.latency = now - r.start
        r.output_len = self._final_usage if self._final_usage is not None else self._counted
        r.success = self._last is not None or r.output_len == 0
        if not r.success and not r.error:
            r.error = "the stream ended without a token"
        return r


def _choice_text(choice: dict[str, Any]) -> str:
    if "text" in choice:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return delta.get("content") or ""


async def _post_stream(
    client: httpx.AsyncClient, url: str, body: dict[str, Any], headers: dict[str, str], prompt_len: int
) -> RequestResult:
    start = time.perf_counter()
    acc = StreamAccumulator(start, prompt_len)
    end: float | None = None
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            if resp.status_code != 200:
                detail = (await resp.aread()).decode(errors="replace")[:500]
                acc.result.error = f"HTTP {resp.status_code}: {detail}"
                acc.result.latency = time.perf_counter() - start
                return acc.result
            # Read to the end of the body rather than break at [DONE]: leaving httpx's nested
            # async generators half-consumed makes trio warn when they are collected.
            async for line in resp.aiter_lines():
                if end is not None or not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    end = time.perf_counter()
                    continue
                acc.feed(json.loads(data), time.perf_counter())
    except Exception as exc:
        acc.result.error = f"{type(exc).__name__}: {exc}"
        acc.result.latency = time.perf_counter() - start
        return acc.result
    return acc.finish(time.perf_counter() if end is None else end)


# ---------------------------------------------------------------------------- the run


@dataclass
class ServeBenchOptions:
    base_url: str = "http://127.0.0.1:8000"
    endpoint: str = "completions"
    model: str | None = None
    api_key: str | None = None
    num_prompts: int = 64
    input_len: tuple[int, int] = (32, 256)
    output_len: tuple[int, int] = (32, 256)
    prompt_kind: str | None = None
    vocab_size: int = 10000
    seed: int = 0
    request_rate: float = math.inf
    max_concurrency: int | None = None
    temperature: float = 0.0
    continuous_usage: bool = True
    warmup: bool = True
    timeout: float = 600.0

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url


def _body(opts: ServeBenchOptions, model: str, req: BenchRequest, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": opts.temperature,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if opts.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    return body


async def _default_model(client: httpx.AsyncClient, root: str, headers: dict[str, str]) -> str:
    resp = await client.get(f"{root}/v1/models", headers=headers)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{root}/v1/models lists no model")
    return str(data[0]["id"])


async def run_benchmark(opts: ServeBenchOptions, client: httpx.AsyncClient | None = None) -> dict[str, Any]:
    """Run the workload against `opts.base_url`; return `summarize`'s dict plus the settings.
    `client` is for tests (e.g. an httpx.MockTransport); by default one is made here."""
    import httpx

    kind = opts.prompt_kind or ("text" if opts.endpoint == "chat" else "ids")
    if opts.endpoint == "chat" and kind != "text":
        raise ValueError("the chat endpoint takes text prompts: use --prompt-kind text")
    work = make_workload(opts.num_prompts, opts.input_len, opts.output_len, kind, opts.vocab_size, opts.seed)
    if client is None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=opts.max_concurrency or len(work) or 1)
        async with httpx.AsyncClient(timeout=httpx.Timeout(opts.timeout), limits=limits) as own:
            return await _run(opts, own, work, kind)
    return await _run(opts, client, work, kind)


async def _run(
    opts: ServeBenchOptions, client: httpx.AsyncClient, work: list[BenchRequest], kind: str
) -> dict[str, Any]:
    root = opts.root
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    model = opts.model or await _default_model(client, root, headers)
    url = f"{root}/v1/chat/completions" if opts.endpoint == "chat" else f"{root}/v1/completions"
    if opts.warmup and work:
        first = work[0]
        res = await _post_stream(
            client, url, _body(opts, model, first, min(first.output_len, 4)), headers, first.prompt_len
        )
        if not res.success:
            raise RuntimeError(f"the warm-up request failed: {res.error}")

    results: list[RequestResult | None] = [None] * len(work)
    limiter = anyio.CapacityLimiter(opts.max_concurrency) if opts.max_concurrency else None
    arrivals = random.Random(opts.seed)

    async def one(i: int) -> None:
        req = work[i]
        body = _body(opts, model, req, req.output_len)
        if limiter is None:
            results[i] = await _post_stream(client, url, body, headers, req.prompt_len)
        else:
            async with limiter:
                results[i] = await _post_stream(client, url, body, headers, req.prompt_len)

    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(work)):
            if i and math.isfinite(opts.request_rate) and opts.request_rate > 0:
                await anyio.sleep(arrivals.expovariate(opts.request_rate))
            tg.start_soon(one, i)
    duration = time.perf_counter() - start
    done = [r for r in results if r is not None]
    out = summarize(done, duration)
    out["expected_output_tokens"] = sum(r.output_len for r in work)
    out.update(
        base_url=root, endpoint=url, model=model, prompt_kind=kind, num_prompts=len(work),
        request_rate=opts.request_rate if math.isfinite(opts.request_rate) else "inf",
        max_concurrency=opts.max_concurrency, input_len=list(opts.input_len), output_len=list(opts.output_len),
        seed=opts.seed, continuous_usage=opts.continuous_usage,
    )
    return out


# ---------------------------------------------------------------------------- statistics


def percentile(values: Sequence[float], q: float) -> float:
    """numpy's default (linear interpolation between the closest ranks); 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _stats(prefix: str, values: Sequence[float]) -> dict[str, float]:
    ms = [v * 1e3 for v in values]
    return {
        f"mean_{prefix}_ms": sum(ms) / len(ms) if ms else 0.0,
        f"median_{prefix}_ms": percentile(ms, 50),
        f"p99_{prefix}_ms": percentile(ms, 99),
    }


def summarize(results: Sequence[RequestResult], duration: float) -> dict[str, Any]:
    """Aggregate successful requests (failures are counted and their errors kept). Latencies
    in ms; ITL pools every request's per-token values (so long requests weigh more)."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    out: dict[str, Any] = {
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
    }
    out.update(_stats("ttft", [r.ttft for r in ok]))
    out.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None]))
    out.update(_stats("itl", [x for r in ok for x in r.itl]))
    out.update(_stats("e2el", [r.latency for r in ok]))
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_len for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["e2els"] = [r.latency for r in results]
    out["errors"] = [r.error for r in results]
    return out


def print_report(res: dict[str, Any]) -> None:
    rows: list[tuple[str, Any]] = [
        ("Successful requests", res["completed"]),
        ("Failed requests", res["failed"]),
        ("Benchmark duration (s)", f"{res['duration_s']:.2f}"),
        ("Total input tokens", res["total_input_tokens"]),
        ("Total generated tokens", res["total_output_tokens"]),
        ("Request throughput (req/s)", f"{res['request_throughput']:.2f}"),
        ("Output token throughput (tok/s)", f"{res['output_throughput']:.2f}"),
        ("Total token throughput (tok/s)", f"{res['total_token_throughput']:.2f}"),
    ]
    print(f"{' Serving Benchmark Result ':=^50}")
    for name, value in rows:
        print(f"{name:<38}{value:>12}")
    for key, title in (("ttft", "Time to First Token"), ("tpot", "Time per Output Token (excl. 1st token)"),
                       ("itl", "Inter-token Latency"), ("e2el", "End-to-end Latency")):
        print(f"{title:-^50}")
        for stat in ("mean", "median", "p99"):
            print(f"{f'{stat.capitalize()} {key.upper()} (ms)':<38}{res[f'{stat}_{key}_ms']:>12.2f}")
    print("=" * 50)
    errors = [e for e in res["errors"] if e]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    elif res["total_output_tokens"] != res.get("expected_output_tokens", res["total_output_tokens"]):
        print(f"warning: {res['total_output_tokens']} tokens generated, {res['expected_output_tokens']} "
              "asked for (does the server honour ignore_eos?)", file=sys.stderr)


def run_serve_bench(ns: argparse.Namespace) -> int:
    try:
        import httpx
    except ImportError:
        print("triollm: error: bench serve needs httpx (pip install httpx)", file=sys.stderr)
        return 2
    opts = ServeBenchOptions(
        base_url=ns.base_url, endpoint=ns.endpoint, model=ns.model, api_key=ns.api_key,
        num_prompts=ns.num_prompts, input_len=ns.input_len, output_len=ns.output_len,
        prompt_kind=ns.prompt_kind, vocab_size=ns.vocab_size, seed=ns.seed,
        request_rate=ns.request_rate, max_concurrency=ns.max_concurrency, temperature=ns.temperature,
        continuous_usage=ns.continuous_usage, warmup=ns.warmup, timeout=ns.timeout,
    )
    rate = "inf" if not math.isfinite(opts.request_rate) else f"{opts.request_rate:g}/s"
    print(f"bench serve: {opts.num_prompts} prompts to {opts.root} ({opts.endpoint}), "
          f"request rate {rate}, max concurrency {opts.max_concurrency or 'unlimited'}")
    try:
        res = anyio.run(run_benchmark, opts, backend=ns.backend)
    except (httpx.HTTPError, RuntimeError) as exc:
        print(f"triollm: error: {exc}", file=sys.stderr)
        return 1
    print_report(res)
    if ns.result_file:
        with open(ns.result_file, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {ns.result_file}")
    return 0 if res["failed"] == 0 else 1
