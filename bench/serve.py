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

vLLM's spellings (`vllm bench serve`'s flags) work too, so a published vLLM line runs unchanged:
`--backend vllm|openai|openai-chat` (the API; `asyncio`/`trio` there, or `--event-loop`, pick the
client's loop), `--host/--port`, `--endpoint /v1/...`, `--header K=V`, `--dataset-name random` with
`--random-input-len/--random-output-len/--random-range-ratio/--random-prefix-len` (lengths drawn
as vLLM draws them), `--burstiness` (gamma arrivals), `--num-warmups`, sampling flags,
`--extra-body`, `--percentile-metrics/--metric-percentiles`, and `--save-result` /
`--save-detailed` / `--append-result` / `--result-dir` / `--result-filename` / `--label` /
`--metadata`, which write vLLM's result keys under vLLM's file name. Flags that only choose how
vLLM's client counts tokens (`--tokenizer`, `--tokenizer-mode`, `--trust-remote-code`,
`--disable-tqdm`, `--skip-tokenizer-init`) are accepted: here the server's usage counts them.
Other datasets are refused naming the flag.

`--server-pid PID` (a server on this machine) adds where the server spent CPU during the run, per
output token: its own process and its children. For `triollm serve` that is the time outside the
engine (HTTP, SSE encoding, detokenization, the output actor) against the engine core's.
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


def _endpoint(text: str) -> str:
    if text in ("completions", "chat") or text.startswith("/"):
        return text
    raise argparse.ArgumentTypeError(f"expected completions, chat or a path such as /v1/completions, got {text!r}")


def add_serve_bench_parser(kinds: Any) -> None:
    """Register `bench serve` (a client: it takes no engine flags)."""
    p = kinds.add_parser("serve", help="online load against an OpenAI-compatible server (TTFT, ITL, throughput)")
    p.add_argument(
        "--base-url", default="http://127.0.0.1:8000", help="the server (a trailing /v1 is fine) (default: %(default)s)"
    )
    p.add_argument(
        "--endpoint",
        type=_endpoint,
        default="completions",
        help="completions, chat, or a path as vLLM takes it (/v1/completions, /v1/chat/completions) "
        "(default: %(default)s)",
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
        "--vocab-size", type=int, default=None,
        help="token ids are drawn below this (default: the vocabulary of a local --tokenizer or --model "
        "folder, as vLLM's random dataset draws from the tokenizer; else 10000)",
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
        choices=[*API_BACKENDS, *EVENT_LOOPS],
        default=None,
        help="vLLM's: the API (vllm and openai: completions; openai-chat: chat); asyncio or trio: the "
        "client's event loop, as --event-loop (default: openai)",
    )
    p.add_argument("--event-loop", choices=EVENT_LOOPS, default=None, help="the client's event loop (default: asyncio)")
    p.add_argument("--result-file", default=None, help="write every result (per-request lists too) as JSON here")
    p.add_argument(
        "--server-pid",
        type=int,
        default=None,
        help="a server process on this machine: report its CPU time and its children's per output token "
        "(for triollm serve: the API process and the engine core)",
    )
    _add_vllm_flags(p)
    p.set_defaults(func=run_serve_bench)


API_BACKENDS = ("vllm", "openai", "openai-chat")
EVENT_LOOPS = ("asyncio", "trio")
# vLLM client flags that only choose how its client tokenizes or shows progress: the server's
# usage counts the tokens here.
_ACCEPTED = ("--tokenizer", "--tokenizer-mode")
_ACCEPTED_SWITCHES = ("--trust-remote-code", "--disable-tqdm", "--skip-tokenizer-init")


def _key_values(items: Sequence[str] | None, flag: str) -> dict[str, str]:
    out = {}
    for item in items or ():
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{flag}: expected KEY=VALUE, got {item!r}")
        out[key.strip()] = value.strip()
    return out


def _add_vllm_flags(p: argparse.ArgumentParser) -> None:
    """`vllm bench serve`'s spellings (see the module docstring)."""
    p.add_argument("--host", default=None, help="vLLM's: the server's host, with --port (default: 127.0.0.1)")
    p.add_argument("--port", type=int, default=None, help="vLLM's: the server's port (default: 8000)")
    p.add_argument("--header", nargs="+", default=None, metavar="KEY=VALUE", help="extra request headers")
    p.add_argument("--dataset-name", default="random", help="vLLM's; only random is generated here")
    p.add_argument("--random-input-len", type=int, default=None, help="vLLM's: mean prompt tokens (vLLM: 1024)")
    p.add_argument("--random-output-len", type=int, default=None, help="vLLM's: mean max_tokens (vLLM: 128)")
    p.add_argument(
        "--random-range-ratio", type=float, default=0.0, help="vLLM's: lengths uniform in mean x [1-r, 1+r]"
    )
    p.add_argument("--random-prefix-len", type=int, default=0, help="vLLM's: a prefix of N tokens shared by all")
    p.add_argument("--burstiness", type=float, default=1.0, help="vLLM's: gamma arrivals' shape (1: Poisson)")
    p.add_argument("--num-warmups", type=int, default=None, help="vLLM's: warm-up requests (default: --warmup's 1)")
    p.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos, so outputs are as long as asked (default: %(default)s; vLLM's: off)")
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--min-p", type=float, default=None)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--extra-body", type=json.loads, default=None, help="JSON merged into every request body")
    p.add_argument("--request-id-prefix", default=None, help="vLLM's: ids PREFIX0, PREFIX1, ... (X-Request-Id)")
    p.add_argument("--served-model-name", default=None, help="vLLM's: the `model` field (default: --model)")
    p.add_argument("--ready-check-timeout-sec", type=float, default=0.0,
                   help="vLLM's: wait up to this long for the server's /v1/models first")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el", help="(default: %(default)s)")
    p.add_argument("--metric-percentiles", default="99", help="comma-separated (default: %(default)s)")
    p.add_argument("--label", default=None, help="vLLM's: the result's label and file-name prefix")
    p.add_argument("--metadata", nargs="+", default=None, metavar="KEY=VALUE", help="vLLM's: added to the result")
    p.add_argument("--save-result", action="store_true", help="vLLM's: write the result JSON (vLLM's name)")
    p.add_argument("--append-result", action="store_true", help="vLLM's: append it to the file instead")
    p.add_argument("--save-detailed", action="store_true", help="vLLM's: keep the per-request lists in it")
    p.add_argument("--result-dir", default=None, help="vLLM's: the result file's folder")
    p.add_argument("--result-filename", default=None, help="vLLM's: the result file's name")
    for flag in _ACCEPTED:
        p.add_argument(flag, default=None, help="accepted (vLLM's client tokenizer; the server counts here)")
    for flag in _ACCEPTED_SWITCHES:
        p.add_argument(flag, action="store_true", help="accepted (vLLM's client option)")


# ---------------------------------------------------------------------------- the workload


@dataclass(frozen=True)
class BenchRequest:
    prompt: str | list[int]
    prompt_len: int  # tokens asked for (text: words, about one token each)
    output_len: int


def make_workload(
    num_prompts: int, input_len: tuple[int, int], output_len: tuple[int, int], kind: str = "ids",
    vocab_size: int = 10000, seed: int = 0, prefix_len: int = 0,
) -> list[BenchRequest]:
    """Token ids: the same prompts and lengths as `bench throughput`'s random workload; with
    `prefix_len`, every prompt starts with the same `prefix_len` tokens (vLLM's
    `--random-prefix-len`: a prefix-cache workload)."""
    rng = random.Random(seed)
    prefix = _random_prompt(random.Random(seed + 1), prefix_len, kind, vocab_size)
    out = []
    for _ in range(num_prompts):
        n = rng.randint(*input_len)
        prompt = _random_prompt(rng, n, kind, vocab_size)
        if isinstance(prefix, list) and isinstance(prompt, list):
            prompt = prefix + prompt
        elif prefix:
            prompt = f"{prefix} {prompt}"
        out.append(BenchRequest(prompt, prefix_len + n, rng.randint(*output_len)))
    return out


def _random_prompt(rng: random.Random, n: int, kind: str, vocab_size: int) -> str | list[int]:
    if kind == "ids":
        return [rng.randrange(vocab_size) for _ in range(n)]
    return " ".join(rng.choice(WORDS) for _ in range(n))


def vllm_random_lengths(mean: int, range_ratio: float, floor: int = 0) -> tuple[int, int]:
    """vLLM's random dataset's range: uniform in [floor(mean (1-r)), ceil(mean (1+r))], r in
    [0, 1) (output lengths at least 1: `floor=1`)."""
    if not 0.0 <= range_ratio < 1.0:
        raise ValueError(f"--random-range-ratio: {range_ratio} is not in [0, 1)")
    low = max(math.floor(mean * (1 - range_ratio)), floor)
    high = max(math.ceil(mean * (1 + range_ratio)), floor)
    if high < 1:
        raise ValueError(f"the random lengths around {mean} hold no token")
    return max(low, 1), high


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
    generated_text: str = ""

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
        r.generated_text = "".join(self.text)
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
    # vLLM's (`_add_vllm_flags`)
    headers: dict[str, str] = field(default_factory=dict)
    prefix_len: int = 0
    burstiness: float = 1.0
    num_warmups: int | None = None  # None: `warmup` says (one)
    ignore_eos: bool = True
    sampling: dict[str, Any] = field(default_factory=dict)  # top_p, top_k, min_p, logprobs
    extra_body: dict[str, Any] = field(default_factory=dict)
    request_id_prefix: str | None = None
    ready_check_timeout: float = 0.0
    percentiles: tuple[float, ...] = (99.0,)
    server_pid: int | None = None  # --server-pid: the CPU time of that process and its children

    @property
    def root(self) -> str:
        url = self.base_url.rstrip("/")
        return url[: -len("/v1")] if url.endswith("/v1") else url

    @property
    def chat(self) -> bool:
        """`endpoint` is "chat", "completions" or a path (vLLM's `--endpoint /v1/...`)."""
        return self.endpoint == "chat" or self.endpoint.rstrip("/").endswith("chat/completions")

    @property
    def url(self) -> str:
        if self.endpoint.startswith("/"):
            return self.root + self.endpoint
        return f"{self.root}/v1/chat/completions" if self.chat else f"{self.root}/v1/completions"


def _body(opts: ServeBenchOptions, model: str, req: BenchRequest, max_tokens: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        **opts.sampling,
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.continuous_usage:
        body["stream_options"]["continuous_usage_stats"] = True
    if opts.chat:
        body["messages"] = [{"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    body.update(opts.extra_body)
    return body


async def _default_model(
    client: httpx.AsyncClient, root: str, headers: dict[str, str], ready_timeout: float = 0.0
) -> str:
    """The first model of /v1/models; with `ready_timeout` (vLLM's --ready-check-timeout-sec),
    retried while the server is not up yet."""
    import httpx

    deadline = time.monotonic() + ready_timeout
    while True:
        try:
            resp = await client.get(f"{root}/v1/models", headers=headers)
            if resp.status_code < 500 or time.monotonic() >= deadline:
                break
        except httpx.TransportError:
            if time.monotonic() >= deadline:
                raise
        await anyio.sleep(0.5)
    resp.raise_for_status()
    data = resp.json().get("data") or []
    if not data:
        raise RuntimeError(f"{root}/v1/models lists no model")
    return str(data[0]["id"])


def server_cpu(pid: int) -> tuple[float, dict[int, float]]:
    """CPU seconds (user + system) of process `pid` and of each of its descendants now; a
    ValueError naming --server-pid when there is no such process."""
    import psutil

    try:
        proc = psutil.Process(pid)
        own = sum(proc.cpu_times()[:2])
        kids = proc.children(recursive=True)
    except psutil.Error as exc:
        raise ValueError(f"--server-pid: no process {pid} to read ({exc})") from None
    times: dict[int, float] = {}
    for kid in kids:
        try:
            times[kid.pid] = sum(kid.cpu_times()[:2])
        except psutil.Error:  # it exited meanwhile
            continue
    return own, times


def server_cpu_report(
    pid: int, before: tuple[float, dict[int, float]], after: tuple[float, dict[int, float]], tokens: int
) -> dict[str, Any]:
    """Where the server spent CPU during the run, per output token: its own process (for triollm
    serve: HTTP, SSE encoding, detokenization, the output actor) and its children (the engine
    core). A child that exited during the run is not counted; one started during it counts whole."""
    api = after[0] - before[0]
    engine = sum(t - before[1].get(k, 0.0) for k, t in after[1].items())
    per = 1e3 / tokens if tokens else 0.0
    return {
        "server_pid": pid,
        "server_cpu_s": api,
        "server_children_cpu_s": engine,
        "server_cpu_ms_per_token": api * per,
        "server_children_cpu_ms_per_token": engine * per,
    }


async def run_benchmark(opts: ServeBenchOptions, client: httpx.AsyncClient | None = None) -> dict[str, Any]:
    """Run the workload against `opts.base_url`; return `summarize`'s dict plus the settings.
    `client` is for tests (e.g. an httpx.MockTransport); by default one is made here."""
    import httpx

    kind = opts.prompt_kind or ("text" if opts.chat else "ids")
    if opts.chat and kind != "text":
        raise ValueError("the chat endpoint takes text prompts: use --prompt-kind text")
    if not opts.burstiness > 0:
        raise ValueError(f"--burstiness: {opts.burstiness} is not a positive number")
    work = make_workload(
        opts.num_prompts, opts.input_len, opts.output_len, kind, opts.vocab_size, opts.seed, opts.prefix_len
    )
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
    headers.update(opts.headers)
    model = opts.model or await _default_model(client, root, headers, opts.ready_check_timeout)
    url = opts.url
    warmups = opts.num_warmups if opts.num_warmups is not None else int(opts.warmup)
    for _ in range(warmups if work else 0):
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
        own = headers
        if opts.request_id_prefix is not None:
            own = {**headers, "X-Request-Id": f"{opts.request_id_prefix}{i}"}
        if limiter is None:
            results[i] = await _post_stream(client, url, body, own, req.prompt_len)
        else:
            async with limiter:
                results[i] = await _post_stream(client, url, body, own, req.prompt_len)

    before = server_cpu(opts.server_pid) if opts.server_pid is not None else None
    start = time.perf_counter()
    async with anyio.create_task_group() as tg:
        for i in range(len(work)):
            if i and math.isfinite(opts.request_rate) and opts.request_rate > 0:
                # vLLM's arrivals: gamma gaps of mean 1/rate (burstiness 1: Poisson).
                theta = 1.0 / (opts.request_rate * opts.burstiness)
                await anyio.sleep(arrivals.gammavariate(opts.burstiness, theta))
            tg.start_soon(one, i)
    duration = time.perf_counter() - start
    done = [r for r in results if r is not None]
    out = summarize(done, duration, opts.percentiles, start)
    out["expected_output_tokens"] = sum(r.output_len for r in work)
    if before is not None and opts.server_pid is not None:
        out.update(server_cpu_report(opts.server_pid, before, server_cpu(opts.server_pid), out["total_output_tokens"]))
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


def _stats(prefix: str, values: Sequence[float], percentiles: Sequence[float] = (99.0,)) -> dict[str, float]:
    """vLLM's keys: mean_, median_, std_ (population, as numpy's) and pNN_ (per `percentiles`:
    p99, p99.9) of `prefix`, in ms."""
    ms = [v * 1e3 for v in values]
    mean = sum(ms) / len(ms) if ms else 0.0
    out = {
        f"mean_{prefix}_ms": mean,
        f"median_{prefix}_ms": percentile(ms, 50),
        f"std_{prefix}_ms": math.sqrt(sum((x - mean) ** 2 for x in ms) / len(ms)) if ms else 0.0,
    }
    for q in percentiles:
        out[f"p{_pct_word(q)}_{prefix}_ms"] = percentile(ms, q)
    return out


def _pct_word(q: float) -> str:
    return str(int(q)) if int(q) == q else str(q)


def _peaks(ok: Sequence[RequestResult]) -> tuple[float, int]:
    """vLLM's `max_output_tokens_per_s` and `max_concurrent_requests`: the most tokens that
    arrived within one whole second (counted from the first request's start), and the most
    requests in flight during some part of such a second."""
    t0 = min((r.start for r in ok), default=0.0)
    tokens: dict[int, int] = {}
    active: dict[int, int] = {}
    for r in ok:
        t = r.start + r.ttft
        times = [t]
        for gap in r.itl:
            t += gap
            times.append(t)
        for when in times[: max(r.output_len, 1)]:
            second = int(when - t0)
            tokens[second] = tokens.get(second, 0) + 1
        for second in range(int(r.start - t0), int(r.start + r.latency - t0) + 1):
            active[second] = active.get(second, 0) + 1
    return float(max(tokens.values(), default=0)), max(active.values(), default=0)


def summarize(
    results: Sequence[RequestResult], duration: float, percentiles: Sequence[float] = (99.0,),
    t0: float | None = None,
) -> dict[str, Any]:
    """Aggregate successful requests (failures are counted and their errors kept) under vLLM's
    result keys (plus `duration_s`, the same as `duration`). Latencies in ms; ITL pools every
    request's per-token values (so long requests weigh more). `t0`: the run's start, for the
    per-second peaks and `start_times`."""
    ok = [r for r in results if r.success]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_len for r in ok)
    t0 = min((r.start for r in results), default=0.0) if t0 is None else t0
    peak_tokens, peak_requests = _peaks(ok)
    out: dict[str, Any] = {
        "duration": duration,
        "duration_s": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": input_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "request_goodput": None,
        "output_throughput": output_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
    }
    out.update(_stats("ttft", [r.ttft for r in ok], percentiles))
    out.update(_stats("tpot", [t for r in ok if (t := r.tpot) is not None], percentiles))
    out.update(_stats("itl", [x for r in ok for x in r.itl], percentiles))
    out.update(_stats("e2el", [r.latency for r in ok], percentiles))
    out["input_lens"] = [r.prompt_len for r in results]
    out["output_lens"] = [r.output_len for r in results]
    out["ttfts"] = [r.ttft for r in results]
    out["itls"] = [r.itl for r in results]
    out["latencies"] = [r.latency for r in results]
    out["e2els"] = out["latencies"]
    out["start_times"] = [r.start - t0 for r in results]
    out["generated_texts"] = [r.generated_text for r in results]
    out["errors"] = [r.error for r in results]
    return out


# Per-request lists: in a vLLM result file only with --save-detailed.
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts", "errors")
METRICS = {
    "ttft": ("TTFT", "Time to First Token"),
    "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
    "itl": ("ITL", "Inter-token Latency"),
    "e2el": ("E2EL", "End-to-end Latency"),
}


def print_report(
    res: dict[str, Any], metrics: Sequence[str] = tuple(METRICS), percentiles: Sequence[float] = (99.0,)
) -> None:
    """vLLM's report, line for line ("{:<40} {:<10}")."""

    def row(name: str, value: Any, fmt: str = "") -> None:
        print(f"{name:<40} {value:<10{fmt}}")

    print(f"{' Serving Benchmark Result ':=^50}")
    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res.get("max_concurrency") is not None:
        row("Maximum request concurrency:", res["max_concurrency"])
    if res.get("request_rate", "inf") != "inf":
        row("Request rate configured (RPS):", float(res["request_rate"]), ".2f")
    row("Benchmark duration (s):", res["duration"], ".2f")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", res["max_concurrent_requests"], ".2f")
    row("Total token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for key in metrics:
        name, title = METRICS[key]
        print(f"{title:-^50}")
        row(f"Mean {name} (ms):", res[f"mean_{key}_ms"], ".2f")
        row(f"Median {name} (ms):", res[f"median_{key}_ms"], ".2f")
        for q in percentiles:
            row(f"P{_pct_word(q)} {name} (ms):", res[f"p{_pct_word(q)}_{key}_ms"], ".2f")
    if "server_cpu_s" in res:
        print(f"{'Server CPU':-^50}")
        row("Server process CPU (s):", res["server_cpu_s"], ".2f")
        row("Its children's CPU (s):", res["server_children_cpu_s"], ".2f")
        row("Server process CPU per token (ms):", res["server_cpu_ms_per_token"], ".3f")
        row("Children's CPU per token (ms):", res["server_children_cpu_ms_per_token"], ".3f")
    print("=" * 50)
    errors = [e for e in res["errors"] if e]
    if errors:
        print(f"first error: {errors[0]}", file=sys.stderr)
    elif res["total_output_tokens"] != res.get("expected_output_tokens", res["total_output_tokens"]):
        print(f"warning: {res['total_output_tokens']} tokens generated, {res['expected_output_tokens']} "
              "asked for (does the server honour ignore_eos?)", file=sys.stderr)


def local_vocab_size(*paths: str | None) -> int | None:
    """The vocabulary size of the first local model or tokenizer folder among `paths`
    (config.json's `vocab_size`, else tokenizer.json's vocabulary); None when none is local."""
    for path in paths:
        if not path or not os.path.isdir(path):
            continue
        config = os.path.join(path, "config.json")
        if os.path.isfile(config):
            with open(config) as f:
                size = json.load(f).get("vocab_size")
            if isinstance(size, int) and size > 0:
                return size
        tokenizer = os.path.join(path, "tokenizer.json")
        if os.path.isfile(tokenizer):
            from tokenizers import Tokenizer

            return int(Tokenizer.from_file(tokenizer).get_vocab_size())
    return None


def options_from_args(ns: argparse.Namespace) -> tuple[ServeBenchOptions, str]:
    """The options the flags (ours and vLLM's) say, and the event loop; a ValueError naming
    the flag for what cannot be honoured."""
    backend = ns.backend or "openai"
    loop = ns.event_loop or (backend if backend in EVENT_LOOPS else "asyncio")
    if ns.dataset_name != "random":
        raise ValueError(f"--dataset-name: {ns.dataset_name!r} is not generated here (random only)")
    endpoint = ns.endpoint
    if backend == "openai-chat" and not endpoint.startswith("/"):
        endpoint = "chat"
    base_url = ns.base_url
    if ns.host is not None or ns.port is not None:
        base_url = f"http://{ns.host or '127.0.0.1'}:{ns.port or 8000}"
    input_len, output_len = ns.input_len, ns.output_len
    if ns.random_input_len is not None:
        input_len = vllm_random_lengths(ns.random_input_len, ns.random_range_ratio)
    if ns.random_output_len is not None:
        output_len = vllm_random_lengths(ns.random_output_len, ns.random_range_ratio, floor=1)
    if ns.random_prefix_len < 0:
        raise ValueError(f"--random-prefix-len: {ns.random_prefix_len} is negative")
    sampling = {
        name: value
        for name in ("top_p", "top_k", "min_p", "logprobs")
        if (value := getattr(ns, name)) is not None
    }
    if ns.extra_body is not None and not isinstance(ns.extra_body, dict):
        raise ValueError("--extra-body: expected a JSON object")
    metrics = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
    unknown = [m for m in metrics if m not in METRICS]
    if unknown:
        raise ValueError(f"--percentile-metrics: {', '.join(unknown)} not among {', '.join(METRICS)}")
    try:
        percentiles = tuple(float(q) for q in ns.metric_percentiles.split(","))
    except ValueError:
        percentiles = (-1.0,)
    if not all(0 < q <= 100 for q in percentiles):
        raise ValueError(f"--metric-percentiles: {ns.metric_percentiles!r} is not a list of numbers in (0, 100]")
    opts = ServeBenchOptions(
        base_url=base_url, endpoint=endpoint, model=ns.served_model_name or ns.model, api_key=ns.api_key,
        num_prompts=ns.num_prompts, input_len=input_len, output_len=output_len,
        prompt_kind=ns.prompt_kind, seed=ns.seed,
        vocab_size=ns.vocab_size or local_vocab_size(ns.tokenizer, ns.model) or 10000,
        request_rate=ns.request_rate, max_concurrency=ns.max_concurrency, temperature=ns.temperature,
        continuous_usage=ns.continuous_usage, warmup=ns.warmup, timeout=ns.timeout,
        headers=_key_values(ns.header, "--header"), prefix_len=ns.random_prefix_len,
        burstiness=ns.burstiness, num_warmups=ns.num_warmups, ignore_eos=ns.ignore_eos, sampling=sampling,
        extra_body=ns.extra_body or {}, request_id_prefix=ns.request_id_prefix,
        ready_check_timeout=ns.ready_check_timeout_sec, percentiles=percentiles, server_pid=ns.server_pid,
    )
    return opts, loop


def vllm_result(ns: argparse.Namespace, res: dict[str, Any], date: str) -> dict[str, Any]:
    """The JSON `vllm bench serve --save-result` writes: its header keys, --metadata, the
    traffic, then the results (the per-request lists only with --save-detailed)."""
    backend = ns.backend if ns.backend in API_BACKENDS else "openai"
    head: dict[str, Any] = {
        "date": date, "endpoint_type": backend, "backend": backend, "label": ns.label,
        "model_id": res["model"], "tokenizer_id": ns.tokenizer or res["model"], "num_prompts": ns.num_prompts,
    }
    head.update(_key_values(ns.metadata, "--metadata"))
    head.update(request_rate=res["request_rate"], burstiness=ns.burstiness, max_concurrency=ns.max_concurrency)
    body = {k: v for k, v in res.items() if ns.save_detailed or k not in (*DETAILED_KEYS, "e2els", "latencies")}
    return {**head, **body}


def vllm_result_path(ns: argparse.Namespace, model_id: str, date: str) -> str:
    """vLLM's file name: LABEL-RATEqps[-concurrencyN]-MODEL-DATE.json, or --result-filename;
    under --result-dir."""
    concurrency = f"-concurrency{ns.max_concurrency}" if ns.max_concurrency is not None else ""
    label = ns.label or (ns.backend if ns.backend in API_BACKENDS else "openai")
    name = ns.result_filename or f"{label}-{ns.request_rate}qps{concurrency}-{model_id.split('/')[-1]}-{date}.json"
    if ns.result_dir:
        os.makedirs(ns.result_dir, exist_ok=True)
        name = os.path.join(ns.result_dir, name)
    return name


def run_serve_bench(ns: argparse.Namespace) -> int:
    try:
        import httpx
    except ImportError:
        print("triollm: error: bench serve needs httpx (pip install httpx)", file=sys.stderr)
        return 2
    try:
        opts, loop = options_from_args(ns)
    except ValueError as exc:
        print(f"triollm: error: {exc}", file=sys.stderr)
        return 2
    rate = "inf" if not math.isfinite(opts.request_rate) else f"{opts.request_rate:g}/s"
    print(f"bench serve: {opts.num_prompts} prompts to {opts.url}, "
          f"request rate {rate}, max concurrency {opts.max_concurrency or 'unlimited'}")
    date = time.strftime("%Y%m%d-%H%M%S")
    try:
        res = anyio.run(run_benchmark, opts, backend=loop)
    except (httpx.HTTPError, RuntimeError, ValueError) as exc:
        print(f"triollm: error: {exc}", file=sys.stderr)
        return 1
    metrics = [m.strip() for m in ns.percentile_metrics.split(",") if m.strip()]
    print_report(res, metrics, opts.percentiles)
    if ns.result_file:
        with open(ns.result_file, "w") as f:
            json.dump(res, f, indent=2)
        print(f"results written to {ns.result_file}")
    if ns.save_result or ns.append_result:
        path = vllm_result_path(ns, res["model"], date)
        with open(path, "a+" if ns.append_result else "w", encoding="utf-8") as f:
            if ns.append_result and f.tell() != 0:
                f.write("\n")
            json.dump(vllm_result(ns, res, date), f)
        print(f"results written to {path}")
    return 0 if res["failed"] == 0 else 1
