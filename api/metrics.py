"""Prometheus metrics for `triollm serve`: GET /metrics.

vLLM v1's names and labels (`vllm:` prefix, `PREFIX`), so vLLM's Grafana dashboard and KEDA/HPA
rules read this server unchanged. Every series is labelled `model_name`: the engine's with the
first served model name (as vLLM does), the per-request ones with the served name the request
asked for (any other name is recorded under the first). The `triollm:` names of earlier
releases are gone: serving both would double every scrape.

    engine state, read at scrape time (fresh from the engine core, else the last step's stats),
    one series per engine core (label `engine`)
      vllm:num_requests_running          gauge    requests in the engine core's running set
      vllm:num_requests_waiting          gauge    requests queued in the engine core
      vllm:kv_cache_usage_perc           gauge    fraction of KV blocks in use, 0..1
      vllm:prefix_cache_hit_rate         gauge    prompt tokens found in the prefix cache / looked up
      vllm:num_preemptions_total         counter  preemptions since the engine started

    speculative decoding, the same way, only when an engine core reports it (a speculative
    config: its statistics' `spec` is set), as vLLM has them only then
      vllm:spec_decode_num_drafts_total           counter  drafts verified (one request, one step)
      vllm:spec_decode_num_draft_tokens_total     counter  draft tokens proposed
      vllm:spec_decode_num_accepted_tokens_total  counter  draft tokens accepted
      vllm:spec_decode_num_accepted_tokens_per_pos_total  counter  + label position (0, 1, ...):
                                         drafts whose token at that position was accepted

    per request, recorded by the routes through a `RequestTimer`
      vllm:prompt_tokens_total           counter
      vllm:generation_tokens_total       counter
      vllm:request_success_total         counter  + label finished_reason (stop, length, abort, ...)
      vllm:request_prompt_tokens         histogram  prompt tokens per finished request
      vllm:request_generation_tokens     histogram  generated tokens per finished request
      vllm:time_to_first_token_seconds   histogram
      vllm:inter_token_latency_seconds   histogram  one observation per output token but the first
      vllm:request_time_per_output_token_seconds  histogram  per request: decode time / (tokens - 1)
      vllm:request_decode_time_seconds   histogram  per request: first output token to last
      vllm:e2e_request_latency_seconds   histogram

`inter_token_latency_seconds` is vLLM v1's current name (it replaced the deprecated
`time_per_output_token_seconds`); vLLM's per-request TPOT is
`request_time_per_output_token_seconds`, kept here under the same name. The token-count
histograms use vLLM's 1-2-5 buckets up to the model's `max_model_len`.

Not served, because nothing here measures them (no made-up numbers): vLLM's queue, prefill and
inference times (the frontend does not see when the core schedules a request), the
`request_params_*` histograms, and `prefix_cache_queries` / `prefix_cache_hits` (the core
reports only their ratio, served as `vllm:prefix_cache_hit_rate`, which vLLM itself derives
from those two counters).

Each `Metrics` owns its `CollectorRegistry`, so several servers can live in one process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import anyio
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from triollm.engine.core_protocol import EngineCoreStats, SpecDecodingStats

__all__ = ["Metrics", "RequestTimer"]

log = logging.getLogger("triollm")

# vLLM's buckets, with finer low ends for ITL (a small model decodes a token in a few ms).
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
)
ITL_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
    5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
E2E_BUCKETS = (
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
    240.0, 480.0, 960.0, 1920.0, 7680.0,
)

_FRESH_STATS_TIMEOUT_S = 1.0

PREFIX = "vllm:"  # every series' name starts with it (vLLM's, for its dashboards and rules)
_DEFAULT_MAX_MODEL_LEN = 1 << 20  # token-count buckets' top without a model config


def _buckets_1_2_5(max_value: int) -> tuple[int, ...]:
    """vLLM's token-count buckets: 1, 2, 5, 10, 20, 50, ... up to `max_value` inclusive."""
    out: list[int] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            if mantissa * scale > max_value:
                return tuple(out)
            out.append(mantissa * scale)
        scale *= 10


class _Series:
    """The children of every per-request metric for one model name, bound once."""

    __slots__ = (
        "decode", "e2e", "generation_tokens", "itl", "metrics", "prompt_tokens", "request_generation",
        "request_prompt", "tpot", "ttft",
    )

    def __init__(self, m: Metrics, model: str) -> None:
        self.metrics = m
        self.prompt_tokens = m.prompt_tokens.labels(model)
        self.generation_tokens = m.generation_tokens.labels(model)
        self.ttft = m.ttft.labels(model)
        self.itl = m.itl.labels(model)
        self.tpot = m.tpot.labels(model)
        self.e2e = m.e2e.labels(model)
        self.decode = m.decode.labels(model)
        self.request_prompt = m.request_prompt_tokens.labels(model)
        self.request_generation = m.request_generation_tokens.labels(model)


class RequestTimer:
    """One request's timings. Times are `time.perf_counter()` seconds (pass `now` to share a
    clock reading, or leave it out).

    on_tokens(n, now): `n` new output tokens arrived at `now` (summed over the choices of an n>1
      request). The first call with n > 0 records TTFT (from `request_started`); each later one
      records the gap since the previous call divided over its n tokens, n observations of
      gap / n: the collector may merge several engine steps into one output, and this keeps
      the histogram per token. Tokens that arrive together with the first one add no ITL.
    finished(finish_reason, prompt_tokens, completion_tokens, now): once per request (later calls
      are ignored): e2e latency, per-request decode time and TPOT, the token counters and
      histograms, and request_success_total{finished_reason}.
    """

    __slots__ = ("_series", "_model", "done", "first", "last", "start", "tokens")

    def __init__(self, series: _Series, model: str, start: float) -> None:
        self._series = series
        self._model = model
        self.start = start
        self.first: float | None = None
        self.last = start
        self.tokens = 0
        self.done = False

    def on_tokens(self, n: int, now: float | None = None) -> None:
        if n <= 0 or self.done:
            return
        if now is None:
            now = time.perf_counter()
        s = self._series
        if self.first is None:
            self.first = now
            s.ttft.observe(max(now - self.start, 0.0))
        else:
            gap = max(now - self.last, 0.0) / n
            for _ in range(n):
                s.itl.observe(gap)
        self.last = now
        self.tokens += n

    def finished(
        self, finish_reason: str | None, prompt_tokens: int, completion_tokens: int, now: float | None = None
    ) -> None:
        if self.done:
            return
        self.done = True
        if now is None:
            now = time.perf_counter()
        s = self._series
        s.e2e.observe(max(now - self.start, 0.0))
        if prompt_tokens > 0:
            s.prompt_tokens.inc(prompt_tokens)
        if completion_tokens > 0:
            s.generation_tokens.inc(completion_tokens)
        s.request_prompt.observe(max(prompt_tokens, 0))
        s.request_generation.observe(max(completion_tokens, 0))
        if self.first is not None:
            decode = max(self.last - self.first, 0.0)
            s.decode.observe(decode)
            if completion_tokens > 1:
                s.tpot.observe(decode / (completion_tokens - 1))
        s.metrics.request_success.labels(self._model, finish_reason or "abort").inc()


class _EngineCollector(Collector):
    """Gauges and counters (preemptions, speculative decoding) filled from the engine's
    `EngineCoreStats` at scrape time."""

    def __init__(self, metrics: Metrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Metric]:
        # One series per engine core (vLLM's `engine` label): each data parallel rank's own
        # statistics, or this server's one core (labelled with its rank under external load
        # balancing, "0" otherwise).
        m = self._metrics
        per_rank = getattr(m.state.llm, "rank_stats", None)
        config = getattr(m.state.llm, "config", None)
        own_rank = config.actor.data_parallel_rank if config is not None else 0
        engines: list[tuple[int, EngineCoreStats | None]] = (
            list(enumerate(per_rank)) if per_rank else [(own_rank, m.current_stats())]
        )
        names = ["model_name", "engine"]

        def family(
            kind: type[GaugeMetricFamily] | type[CounterMetricFamily],
            name: str,
            doc: str,
            value: Callable[[EngineCoreStats], float],
        ) -> Metric:
            fam = kind(name, doc, labels=names)
            for engine, st in engines:
                fam.add_metric([m.model_name, str(engine)], value(st) if st else 0)
            return fam

        yield family(
            GaugeMetricFamily,
            PREFIX + "num_requests_running",
            "Number of requests in the engine's running set.",
            lambda st: st.num_running,
        )
        yield family(
            GaugeMetricFamily,
            PREFIX + "num_requests_waiting",
            "Number of requests waiting in the engine's queue.",
            lambda st: st.num_waiting,
        )
        yield family(
            GaugeMetricFamily, PREFIX + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0 to 1).",
            lambda st: st.kv_cache_usage,
        )
        yield family(
            GaugeMetricFamily, PREFIX + "prefix_cache_hit_rate",
            "Fraction of looked-up prompt tokens found in the prefix cache since start.",
            lambda st: st.prefix_cache_hit_rate,
        )
        yield family(
            CounterMetricFamily, PREFIX + "num_preemptions", "Cumulative number of preemptions in the engine.",
            lambda st: st.num_preemptions,
        )
        # vLLM registers these only with a speculative config; here, only while some engine
        # reports speculation (all ranks share one config, so it is all of them or none).
        specs = [(engine, st.spec if st else None) for engine, st in engines]
        if all(sp is None for _, sp in specs):
            return

        def spec_counter(name: str, doc: str, value: Callable[[SpecDecodingStats], int]) -> Metric:
            return family(
                CounterMetricFamily, PREFIX + name, doc, lambda st: value(st.spec) if st.spec else 0
            )

        yield spec_counter(
            "spec_decode_num_drafts", "Number of spec decoding drafts.", lambda sp: sp.num_drafts
        )
        yield spec_counter(
            "spec_decode_num_draft_tokens", "Number of draft tokens.",
            lambda sp: sp.num_draft_tokens,
        )
        yield spec_counter(
            "spec_decode_num_accepted_tokens", "Number of accepted tokens.",
            lambda sp: sp.num_accepted_tokens,
        )
        per_pos = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos", "Accepted tokens per draft position.",
            labels=[*names, "position"],
        )
        num_pos = max((len(sp.accepted_per_pos) for _, sp in specs if sp), default=0)
        for engine, sp in specs:
            counts = sp.accepted_per_pos if sp else ()
            for pos in range(num_pos):
                n = counts[pos] if pos < len(counts) else 0
                per_pos.add_metric([m.model_name, str(engine), str(pos)], n)
        yield per_pos


class _WithoutCreated:
    """The registry's metrics less the `*_created` timestamps prometheus_client adds to every
    counter and histogram (noise here; `disable_created_metrics()` would be process-wide)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterator[Metric]:
        for metric in self._registry.collect():
            metric.samples = [s for s in metric.samples if not s.name.endswith("_created")]
            yield metric


class Metrics:
    """The server's metrics. Built once per server: `Metrics(state)`; see the module doc."""

    def __init__(self, state: Any, *, fresh_stats: bool = True) -> None:
        self.state = state
        names = tuple(state.settings.served_model_names)
        self.model_name: str = names[0]
        self._names = frozenset(names)
        self.fresh_stats = fresh_stats
        self._fresh: Any = None  # EngineCoreStats fetched for the scrape in progress
        self.registry = CollectorRegistry()
        r = self.registry
        ml = ["model_name"]
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "Number of prefill tokens processed.", ml, registry=r)
        self.generation_tokens = Counter(
            PREFIX + "generation_tokens", "Number of generation tokens processed.", ml, registry=r
        )
        self.request_success = Counter(
            PREFIX + "request_success", "Count of finished requests, by finish reason.",
            ["model_name", "finished_reason"], registry=r,
        )
        self.ttft = Histogram(
            PREFIX + "time_to_first_token_seconds", "Histogram of time to first token in seconds.", ml,
            registry=r, buckets=TTFT_BUCKETS,
        )
        self.itl = Histogram(
            PREFIX + "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ml,
            registry=r, buckets=ITL_BUCKETS,
        )
        self.tpot = Histogram(
            PREFIX + "request_time_per_output_token_seconds",
            "Histogram of time per output token (decode time / (tokens - 1)) per request, in seconds.",
            ml, registry=r, buckets=ITL_BUCKETS,
        )
        self.e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds", "Histogram of end-to-end request latency in seconds.",
            ml, registry=r, buckets=E2E_BUCKETS,
        )
        self.decode = Histogram(
            PREFIX + "request_decode_time_seconds",
            "Histogram of time from a request's first output token to its last, in seconds.",
            ml, registry=r, buckets=E2E_BUCKETS,
        )
        config = getattr(state.llm, "config", None)
        max_len = config.model.max_model_len if config is not None else _DEFAULT_MAX_MODEL_LEN
        self.request_prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens", "Number of prefill tokens processed, per request.", ml,
            registry=r, buckets=_buckets_1_2_5(max_len),
        )
        self.request_generation_tokens = Histogram(
            PREFIX + "request_generation_tokens", "Number of generation tokens processed, per request.", ml,
            registry=r, buckets=_buckets_1_2_5(max_len),
        )
        r.register(_EngineCollector(self))
        # Every served name's series exist from the start (at zero), as vLLM's do.
        self._series: dict[str, _Series] = {name: _Series(self, name) for name in names}
        for name in names:
            for reason in ("stop", "length", "abort"):
                self.request_success.labels(name, reason)

    # ------------------------------------------------------------------ per request

    def request_started(self, model: str | None = None, now: float | None = None) -> RequestTimer:
        """A timer for one request, started now. `model` is the name the client asked for; names
        that are not served (and None) are recorded under the first served name."""
        name = model if model is not None and model in self._names else self.model_name
        series = self._series[name]  # made for every served name up front
        return RequestTimer(series, name, time.perf_counter() if now is None else now)

    # ------------------------------------------------------------------ scraping

    def current_stats(self) -> Any:
        if self._fresh is not None:
            return self._fresh
        return getattr(self.state.llm, "last_stats", None)

    async def refresh(self) -> None:
        """Fetch fresh statistics from the engine core (the last step's go stale once it idles)."""
        llm = self.state.llm
        get = getattr(llm, "get_engine_stats", None)
        if not self.fresh_stats or get is None or getattr(llm, "errored", False):
            return
        with anyio.move_on_after(_FRESH_STATS_TIMEOUT_S):
            try:
                self._fresh = await get()
            except Exception as exc:  # a dead or stopping engine: fall back to the last step's
                log.debug("metrics: engine statistics unavailable: %r", exc)

    def render(self) -> bytes:
        return generate_latest(_WithoutCreated(self.registry))  # type: ignore[arg-type]

    async def endpoint(self, request: Request) -> Response:
        """GET /metrics: the Prometheus text exposition format."""
        try:
            await self.refresh()
            body = self.render()
        finally:
            self._fresh = None
        return Response(body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    def route(self) -> Route:
        """`Route("/metrics")` bound to this instance, for the app's route list."""
        return Route("/metrics", self.endpoint, methods=["GET"], name="metrics")
