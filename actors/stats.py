"""The frontend's view of the engine's numbers: vLLM's `get_metrics()` list and its stats line.

Both combine the engine core's `EngineCoreStats` (a utility call's answer) with the frontend's
own counters (`AsyncLLM.statistics()`); neither keeps state beyond the last log line's mark.

Speculative decoding adds vLLM's `vllm:spec_decode_*` counters and its second log line
(`SpecDecodingLogging`), both only when the core reports speculation (`EngineCoreStats.spec`),
as vLLM has them only with a speculative config. The core's counters are cumulative; the log
line wants the interval since the previous line, so the mark keeps the previous counters and the
line reports the difference (`SpecDecodingStats.since`; vLLM sums per-step stats it reset at
each line instead: the same numbers, without a list that grows between lines).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from triollm.actors.core_client import CoreClient
from triollm.engine.core_protocol import EngineCoreStats, SpecDecodingStats
from triollm.engine.frontend import Frontend
from triollm.engine.metrics import Counter, Gauge, Metric, Vector

__all__ = ["FrontendStatistics", "StatsLog", "engine_metrics", "frontend_statistics"]

log = logging.getLogger("triollm")


@dataclass(frozen=True)
class FrontendStatistics:
    """`AsyncLLM.statistics()`: the request table's counts and what the frontend knows of the
    engine core (no round trip: see `get_engine_stats()` for the core's own)."""

    num_requests: int  # user requests whose consumer has not let go
    num_sequences: int  # unfinished core requests (an n > 1 request counts n), held included
    num_held: int  # added while paused, not sent yet
    queued_prompt_tokens: int  # prompt tokens of sequences with no output yet
    paused: bool
    num_prompt_tokens: int
    num_generation_tokens: int
    core_pids: tuple[int, ...]  # the engine-core child process, or each data-parallel rank's
    requests_per_rank: tuple[int, ...] | None  # data parallel: requests routed to each rank
    core_accepting: bool  # the core's input stream is open


def frontend_statistics(frontend: Frontend | None, client: CoreClient | None) -> FrontendStatistics:
    """The request table's counts (zeros before start) and what the transport tells of the core."""
    table = frontend.statistics() if frontend is not None else None
    pids = () if client is None else client.rank_pids or ((client.pid,) if client.pid is not None else ())
    return FrontendStatistics(
        num_requests=table.num_requests if table else 0,
        num_sequences=table.num_sequences if table else 0,
        num_held=table.num_held if table else 0,
        queued_prompt_tokens=table.queued_prompt_tokens if table else 0,
        paused=table.paused if table else False,
        num_prompt_tokens=table.num_prompt_tokens if table else 0,
        num_generation_tokens=table.num_generation_tokens if table else 0,
        core_pids=tuple(pids),
        requests_per_rank=None if client is None or client.assigned is None else tuple(client.assigned),
        core_accepting=client is not None and client.inputs.statistics().open_receive_streams > 0,
    )


def engine_metrics(stats: EngineCoreStats, frontend: FrontendStatistics) -> list[Metric]:
    """vLLM's `get_metrics()` shapes, under the server's `vllm:` names."""
    return [
        Gauge("vllm:num_requests_running", value=stats.num_running),
        Gauge("vllm:num_requests_waiting", value=stats.num_waiting),
        Gauge("vllm:kv_cache_usage_perc", value=stats.kv_cache_usage),
        Gauge("vllm:prefix_cache_hit_rate", value=stats.prefix_cache_hit_rate),
        Counter("vllm:num_preemptions", value=stats.num_preemptions),
        Counter("vllm:prompt_tokens", value=frontend.num_prompt_tokens),
        Counter("vllm:generation_tokens", value=frontend.num_generation_tokens),
        *_spec_decode_metrics(stats.spec),
    ]


def _spec_decode_metrics(spec: SpecDecodingStats | None) -> list[Metric]:
    """vLLM's `vllm:spec_decode_*` counters; none without speculation. The per-position counts
    are one `Vector` (its `values` by draft position), as vLLM's reader gives them."""
    if spec is None:
        return []
    return [
        Counter("vllm:spec_decode_num_drafts", value=spec.num_drafts),
        Counter("vllm:spec_decode_num_draft_tokens", value=spec.num_draft_tokens),
        Counter("vllm:spec_decode_num_accepted_tokens", value=spec.num_accepted_tokens),
        Vector("vllm:spec_decode_num_accepted_tokens_per_pos", values=list(spec.accepted_per_pos)),
    ]


@dataclass(frozen=True)
class _Mark:
    """The counters when the previous stats line was written: the next reports the difference."""

    time: float
    prompt_tokens: int = 0
    generation_tokens: int = 0
    spec: SpecDecodingStats | None = None


class StatsLog:
    """vLLM's periodic stats line: throughput since the previous line, requests, caches; and,
    with speculative decoding, vLLM's `SpecDecoding metrics` line for the same interval."""

    def __init__(self) -> None:
        self._mark = _Mark(time.monotonic())
        self._was_busy = True  # the first line is written

    def log(self, stats: EngineCoreStats, frontend: FrontendStatistics) -> None:
        """The line at INFO; at DEBUG when the engine was idle over this interval and the one
        before (no tokens, no requests), as vLLM keeps an idle server's log quiet."""
        now = time.monotonic()
        prev = self._mark
        elapsed = max(now - prev.time, 1e-9)
        prompt, gen = frontend.num_prompt_tokens, frontend.num_generation_tokens
        busy = prompt > prev.prompt_tokens or gen > prev.generation_tokens or stats.num_running + stats.num_waiting > 0
        level = logging.INFO if busy or self._was_busy else logging.DEBUG
        self._was_busy = busy
        self._mark = _Mark(now, prompt, gen, stats.spec)
        log.log(
            level,
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, "
            "Prefix cache hit rate: %.1f%%",
            (prompt - prev.prompt_tokens) / elapsed, (gen - prev.generation_tokens) / elapsed,
            stats.num_running, stats.num_waiting, 100 * stats.kv_cache_usage,
            100 * stats.prefix_cache_hit_rate,
        )
        if stats.spec is not None:
            # The first line's interval began at zero (prev.spec None).
            _log_spec_decoding(stats.spec.since(prev.spec), elapsed)


def _log_spec_decoding(interval: SpecDecodingStats, elapsed: float) -> None:
    """vLLM's `SpecDecodingLogging.log()` line over an interval's counts; nothing when no draft
    was verified in it (vLLM logs nothing then either)."""
    drafts = interval.num_drafts
    if drafts <= 0:
        return
    drafted, accepted = interval.num_draft_tokens, interval.num_accepted_tokens
    rate = interval.acceptance_rate
    log.info(
        "SpecDecoding metrics: Mean acceptance length: %.2f, Accepted throughput: %.2f tokens/s, "
        "Drafted throughput: %.2f tokens/s, Accepted: %d tokens, Drafted: %d tokens, "
        "Per-position acceptance rate: %s, Avg Draft acceptance rate: %.1f%%",
        interval.mean_acceptance_length,  # counts the target's own token, as vLLM's does
        accepted / elapsed,
        drafted / elapsed,
        accepted,
        drafted,
        ", ".join(f"{n / drafts:.3f}" for n in interval.accepted_per_pos),
        100 * rate if rate is not None else float("nan"),
    )
