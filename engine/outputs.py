"""User-facing outputs with vLLM's names and fields."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = [
    "CompletionOutput",
    "Logprob",
    "PromptLogprobs",
    "RequestOutput",
    "RequestStateStats",
    "SampleLogprobs",
]


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One dict per position: token id -> Logprob (the chosen token plus the top-k).
SampleLogprobs = list[dict[int, Logprob]]
PromptLogprobs = list[dict[int, Logprob] | None]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: SampleLogprobs | None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestStateStats:
    """`RequestOutput.metrics`: a request's timings, with vLLM's field names and clocks.

    `arrival_time` is wall-clock (`time.time()`, taken by the frontend when the request
    arrived); the four `*_ts` are `time.monotonic()` stamps taken by the engine core where the
    event happened (a child process's monotonic clock is the parent's: the system's), so compare
    them with each other, not with `arrival_time`. `queued_ts`: the scheduler queued the
    request; `scheduled_ts`: it was first scheduled (a preemption does not move it);
    `first_token_ts` / `last_token_ts`: the steps that produced its first and latest tokens.
    `first_token_latency`: seconds from arrival to the first token (wall-clock, measured by the
    frontend when that token arrived). A stamp not reached yet is 0.0. `num_preemptions`: times
    the scheduler preempted it (its KV blocks freed, recomputed later). One object per request,
    updated in place as outputs arrive (as vLLM's is).
    """

    num_generation_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = 0.0
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    first_token_ts: float = 0.0
    last_token_ts: float = 0.0
    first_token_latency: float = 0.0
    is_corrupted: bool = False


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    prompt_logprobs: PromptLogprobs | None
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int | None = None
    metrics: RequestStateStats | None = field(default=None)
