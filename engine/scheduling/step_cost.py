"""The step-cost model: how long an engine step of n tokens takes, fitted online to measured steps.

Why. On a slow CPU a step that carries a prefill chunk next to the running decodes takes several
times a decode-only step, and every running request's inter-token latency takes that stall
(issue 25). The scheduler therefore limits the prompt tokens a step carries beside decodes to
what keeps the step close to a decode-only one (`Scheduler._prefill_budget`); this module says
what a step of n tokens costs.

The model: `seconds(tokens) = a + b * tokens`, a least-squares line through the steps seen
(the engine core times each forward pass and reports it: `Scheduler.record_step`), weighted
exponentially (`ALPHA`: a step's weight halves after ~14 later steps), so it follows the machine
(other load, longer contexts) but not the noise of one step. It is kept as weighted means of x,
y, x*x and x*y, so an observation is O(1) and nothing is stored per step. The line is refitted
only while the recent steps differ in size by at least `MIN_SPREAD` tokens (standard deviation):
steady decode-only steps are all alike, and a line through them would be noise. Meanwhile the
last good line is kept. A line with no positive slope is no line (more tokens never cost less).

Rejected: a table of measured times per token count (sparse, and stale for sizes not seen
lately); separate slopes for prompt and decode tokens (one slope, set by the steps that carry a
prompt, is the cost that matters here); a calibration run at start-up (the cost moves with the
load and the context length).
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ALPHA", "MIN_SPREAD", "StepCost", "StepCostFit"]

ALPHA = 0.05  # weight of the newest step in the running means
MIN_SPREAD = 8.0  # tokens: the least standard deviation of recent step sizes to refit the line


@dataclass(frozen=True)
class StepCostFit:
    """`seconds(tokens) = seconds_per_step + seconds_per_token * tokens`."""

    seconds_per_step: float  # a >= 0: what a step costs whatever it carries
    seconds_per_token: float  # b > 0

    def seconds(self, tokens: int) -> float:
        return self.seconds_per_step + self.seconds_per_token * tokens


class StepCost:
    """Steps observed as (tokens, seconds); `fit` is the current line, or None before a first one."""

    def __init__(self, alpha: float = ALPHA, min_spread: float = MIN_SPREAD) -> None:
        if not 0 < alpha <= 1:
            raise ValueError(f"alpha: must be in (0, 1], got {alpha!r}")
        self.alpha = alpha
        self.min_spread = min_spread
        self.fit: StepCostFit | None = None
        self.num_steps = 0
        # Weighted means of x (tokens), y (seconds), x*x and x*y.
        self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float) -> None:
        """One step of `tokens` tokens took `seconds`; steps of no tokens or no time are ignored."""
        if tokens <= 0 or not seconds > 0:
            return
        x, y = float(tokens), float(seconds)
        w = 1.0 if self.num_steps == 0 else self.alpha
        self.num_steps += 1
        self._x += w * (x - self._x)
        self._y += w * (y - self._y)
        self._xx += w * (x * x - self._xx)
        self._xy += w * (x * y - self._xy)
        var = self._xx - self._x * self._x
        if var < self.min_spread * self.min_spread:
            return
        b = (self._xy - self._x * self._y) / var
        if b > 0:
            self.fit = StepCostFit(max(0.0, self._y - b * self._x), b)
