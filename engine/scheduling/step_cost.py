"""The step-cost model: how long an engine step of n tokens takes, fitted online to measured steps.

Why. On a slow CPU a step that carries a prefill chunk next to the running decodes takes several
times a decode-only step, and every running request's inter-token latency takes that stall
(issue 25). The scheduler therefore limits the prompt tokens a step carries beside decodes to
what keeps the step close to a decode-only one (`Scheduler._prefill_budget`); this module says
what a step of n tokens costs.

The model: `seconds(tokens) = a + b * tokens`, a least-squares line through the steps seen
(the engine core times each forward pass and reports it: `Scheduler.record_step`), weighted
exponentially (`ALPHA`: a step's weight halves after ~14 later steps), so it follows the machine
(other load) but not the noise of one step. It is kept as weighted means of x,
y, x*x and x*y, so an observation is O(1) and nothing is stored per step. The line is refitted
only while the recent steps differ in size by at least `MIN_SPREAD` tokens (standard deviation):
steady decode-only steps are all alike, and a line through them would be noise. Meanwhile the
last good line is kept. A line with no positive slope is no line (more tokens never cost less).

The line does not follow the context, though. A prompt chunk's cost per token grows with the
tokens already in the cache (each new token attends over all of them), and a long prompt is cut
into chunks of one size: all alike, so the line is refitted only while older steps of other
sizes keep the spread up, and then it moves at the weighting's pace (it remembers ~20 steps):
its prediction for the next chunk trails the measured cost more the longer the prompt, and its
slope takes up the growth, which may pull its intercept down (to zero in the run measured in
docs/reliability.md, "Long prompts: busy is not hung"). Beside decodes that errs on the safe
side: right after a long prompt a decode-only step may look cheap to the line, and prompts
beside decodes get `MIN_PREFILL_CHUNK` until decode steps restore the intercept. So the time bound
on a step (`Scheduler._prefill_budget`, `MAX_PREFILL_STEP_S`) is not read off the line but off
the pace of the latest step that carried a prompt chunk (`tokens_within`): its tokens per second,
measured at the context the next chunk starts from, one chunk back. Sizing the next step by that
pace, n' = seconds * n / took, converges to the bound whatever the fixed cost per step: for a
step of n tokens taking a + m * n, the next step's distance to the bound is the last one's times
a / (a + m * n), from below without crossing it, from above without undershooting it; and the
chunks shrink as the context grows (m grows). Rejected for
it: a second regressor for the attention work (sum of chunk * context) in the line, which needs
steps that vary in both to be told apart, and chunks of one size do not.

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
        # The latest step that carried a prompt chunk: (tokens, seconds), for `tokens_within`.
        self.latest_prefill: tuple[int, float] | None = None
        # Weighted means of x (tokens), y (seconds), x*x and x*y.
        self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float, *, prefill: bool = False) -> None:
        """One step of `tokens` tokens took `seconds` (`prefill`: some of them were a prompt
        chunk's); steps of no tokens or no time are ignored."""
        if tokens <= 0 or not seconds > 0:
            return
        if prefill:
            self.latest_prefill = (tokens, seconds)
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

    def line(self) -> StepCostFit | None:
        """The fitted line; before there is one, a line through the origin at the pace of the
        latest step that carried a prompt chunk (no fixed cost per step: beside decodes, the
        smaller prompt budget); None before either."""
        if self.fit is not None:
            return self.fit
        if self.latest_prefill is None:
            return None
        tokens, took = self.latest_prefill
        return StepCostFit(0.0, took / tokens)

    def tokens_within(self, seconds: float) -> int | None:
        """The tokens a step carrying a prompt chunk may take to be predicted to last `seconds`:
        at the pace of the latest such step (the module docstring); None before there was one."""
        if self.latest_prefill is None:
            return None
        tokens, took = self.latest_prefill
        return int(seconds * tokens / took)
