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

Beside decodes the same lag sized the chunks wrong both ways (issue 40, measured on a 0.5B
model on 2 Zen 4 cores): by the slope a prompt token at 8k of context cost 2.6 ms against 9.3 ms
measured, and in a shared Xeon's run the intercept read 1.0-1.5 s against 0.5-0.6 s measured
decode-only steps. So the prompt budget beside decodes reads what a prompt token costs off the
latest chunk (`prompt_token_seconds`: that step less its other rows, per prompt token) and the
decode-only step off the latest one measured where that is lower than the line
(`decode_seconds`).

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
        # The latest step that carried a prompt chunk: (tokens, seconds), for `tokens_within`,
        # and how many of its tokens were prompt tokens, for `prompt_token_seconds`.
        self.latest_prefill: tuple[int, float] | None = None
        self.latest_prompt_tokens = 0
        # The latest step that carried none: (tokens, seconds), for `decode_seconds`.
        self.latest_decode: tuple[int, float] | None = None
        # Weighted means of x (tokens), y (seconds), x*x and x*y.
        self._x = self._y = self._xx = self._xy = 0.0

    def observe(self, tokens: int, seconds: float, *, prefill: bool = False, prompt_tokens: int | None = None) -> None:
        """One step of `tokens` tokens took `seconds` (`prefill`: some of them were a prompt
        chunk's, `prompt_tokens` of them, all where not given); steps of no tokens or no time are
        ignored."""
        if tokens <= 0 or not seconds > 0:
            return
        if prefill:
            self.latest_prefill = (tokens, seconds)
            self.latest_prompt_tokens = tokens if prompt_tokens is None else max(1, min(tokens, prompt_tokens))
        else:
            self.latest_decode = (tokens, seconds)
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
        """The fitted line; before there is one, the line through the latest decode-only step
        and the latest step that carried a prompt chunk where both were seen (the prompt step
        the larger and the longer), else a line through the origin at the prompt step's pace (no
        fixed cost per step: beside decodes, the smaller prompt budget); None before a prompt
        step. Steps that all carry a few tokens (a stream beside prompt chunks of a few tokens
        each) never spread enough for a fit, and through the origin a decode-only step would
        read as a few tokens' cost."""
        if self.fit is not None:
            return self.fit
        if self.latest_prefill is None:
            return None
        tokens, took = self.latest_prefill
        if self.latest_decode is not None:
            rows, decode = self.latest_decode
            if tokens > rows and took > decode:
                slope = (took - decode) / (tokens - rows)
                return StepCostFit(max(0.0, decode - slope * rows), slope)
        return StepCostFit(0.0, took / tokens)

    def decode_seconds(self, rows: int, fit: StepCostFit) -> float:
        """A decode-only step of `rows` rows: the line's figure, or less where the latest
        decode-only step measured, moved along the line's slope to `rows`, says so. While a long
        prompt is cut into chunks beside decodes, the line takes up the chunks' growing cost per
        token partly in its intercept (a decode-only step read 0.59 s against 0.50 s in the
        simulated run of tests/engine/test_scheduler.py, 1.0-1.5 s against 0.5-0.6 s measured on
        a shared Xeon, docs/reliability.md), and a ratio of that figure let the steps beside a
        stream grow with the prompt. A measured step that is stale errs the safe way: the machine
        or the rows' contexts grew since, the budget is smaller than it could be."""
        line = fit.seconds(rows)
        if self.latest_decode is None:
            return line
        tokens, took = self.latest_decode
        return max(0.0, min(line, took + fit.seconds_per_token * (rows - tokens)))

    def prompt_token_seconds(self, fit: StepCostFit) -> float:
        """What one more prompt token adds to a step, at the context the latest prompt chunk
        reached: that step's time less what its other tokens cost (and the fixed cost of a step:
        `decode_seconds`), per prompt token; never less than the line's slope, which is all there is
        before a prompt step. The line does not follow the context (the module docstring): at 8k
        tokens of context a prompt token cost a 0.5B model six times what it did at the start
        (docs/reliability.md), and a chunk sized by the slope made the steps beside a stream grow
        as the prompt went on."""
        if self.latest_prefill is None:
            return fit.seconds_per_token
        tokens, took = self.latest_prefill
        prompt = self.latest_prompt_tokens
        return max(fit.seconds_per_token, (took - self.decode_seconds(tokens - prompt, fit)) / prompt)

    def tokens_within(self, seconds: float) -> int | None:
        """The tokens a step carrying a prompt chunk may take to be predicted to last `seconds`:
        at the pace of the latest such step (the module docstring); None before there was one."""
        if self.latest_prefill is None:
            return None
        tokens, took = self.latest_prefill
        return int(seconds * tokens / took)
