"""Metric values read from a running engine: `LLM.get_metrics()` / `AsyncLLM.get_metrics()`.

The shapes of vLLM's `vllm.v1.metrics.reader` (a name, labels, a value), with the server's
`vllm:` names (`api/metrics.py`), so a script that prints or filters them works unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["Counter", "Gauge", "Metric", "Vector"]


@dataclass(frozen=True)
class Metric:
    name: str
    labels: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Counter(Metric):
    """A monotonically increasing count since the engine started."""

    value: int = 0


@dataclass(frozen=True)
class Gauge(Metric):
    """A value at the time of reading."""

    value: float = 0.0


@dataclass(frozen=True)
class Vector(Metric):
    """Counts by position since the engine started (vLLM's: speculative decoding's accepted
    tokens per draft position)."""

    values: list[int] = field(default_factory=list)
