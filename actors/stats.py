"""The frontend's view of the engine's numbers: vLLM's `get_metrics()` list and its stats line.

Both combine the engine core's `StepStats` (a utility call's answer) with the frontend's own
counters (`AsyncLLM.statistics()`); neither keeps state beyond the last log line's mark.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from triollm.actors.core_client import CoreClient
from triollm.actors.messages import StepStats
from triollm.engine.frontend import Frontend
from triollm.engine.metrics import Counter, Gauge, Metric

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


def kv_cache_usage(stats: StepStats) -> float:
    return 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0


def engine_metrics(stats: StepStats, frontend: FrontendStatistics) -> list[Metric]:
    """vLLM's `get_metrics()` shapes, under the server's `vllm:` names."""
    return [
        Gauge("vllm:num_requests_running", value=stats.num_running),
        Gauge("vllm:num_requests_waiting", value=stats.num_waiting),
        Gauge("vllm:kv_cache_usage_perc", value=kv_cache_usage(stats)),
        Gauge("vllm:prefix_cache_hit_rate", value=stats.prefix_cache_hit_rate),
        Counter("vllm:num_preemptions", value=stats.num_preemptions),
        Counter("vllm:prompt_tokens", value=frontend.num_prompt_tokens),
        Counter("vllm:generation_tokens", value=frontend.num_generation_tokens),
    ]


class StatsLog:
    """vLLM's periodic stats line: throughput since the previous line, requests, caches."""

    def __init__(self) -> None:
        self._mark = (time.monotonic(), 0, 0)  # (time, prompt tokens, generation tokens)

    def log(self, stats: StepStats, frontend: FrontendStatistics) -> None:
        now = time.monotonic()
        then, prompt0, gen0 = self._mark
        elapsed = max(now - then, 1e-9)
        prompt, gen = frontend.num_prompt_tokens, frontend.num_generation_tokens
        self._mark = (now, prompt, gen)
        log.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            (prompt - prompt0) / elapsed, (gen - gen0) / elapsed, stats.num_running,
            stats.num_waiting, 100 * kv_cache_usage(stats), 100 * stats.prefix_cache_hit_rate,
        )
