"""The frontend's view of the engine's numbers: vLLM's `get_metrics()` list and its stats line.

Both combine the engine core's `StepStats` (a utility call's answer) with the frontend's own
counters (`AsyncLLM.statistics()`); neither keeps state beyond the last log line's mark.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from triollm.actors.messages import StepStats
from triollm.engine.metrics import Counter, Gauge, Metric

if TYPE_CHECKING:
    from triollm.actors.async_llm import FrontendStatistics

__all__ = ["StatsLog", "engine_metrics"]

log = logging.getLogger("triollm")


def kv_cache_usage(stats: StepStats) -> float:
    return 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0


def engine_metrics(stats: StepStats, frontend: FrontendStatistics) -> list[Metric]:
    """vLLM's `get_metrics()` shapes, under the server's `triollm:` names."""
    return [
        Gauge("triollm:num_requests_running", value=stats.num_running),
        Gauge("triollm:num_requests_waiting", value=stats.num_waiting),
        Gauge("triollm:kv_cache_usage_perc", value=kv_cache_usage(stats)),
        Gauge("triollm:prefix_cache_hit_rate", value=stats.prefix_cache_hit_rate),
        Counter("triollm:num_preemptions", value=stats.num_preemptions),
        Counter("triollm:prompt_tokens", value=frontend.num_prompt_tokens),
        Counter("triollm:generation_tokens", value=frontend.num_generation_tokens),
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
