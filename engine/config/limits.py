"""What one request may ask of the server, and how much may wait for the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from triollm.engine.config.checks import positive

__all__ = ["LimitsConfig", "resolve_limits"]


@dataclass(frozen=True)
class LimitsConfig:
    """What one request may ask of the server, and how much may wait for the scheduler. A request
    over a limit fails alone with a `ValueError` naming the field and the setting (HTTP 400); over
    a queue limit, with `EngineBusyError` (HTTP 429)."""

    max_num_queued_reqs: int | None  # requests admitted but not yet finished, beyond max_num_seqs
    max_num_queued_tokens: int | None  # prompt tokens of the requests waiting for the scheduler
    # What one request may hold in the engine: sequences x (prompt + token-list entries).
    max_request_tokens: int
    max_stop_strings: int  # `stop` entries per request
    max_stop_string_len: int  # characters per `stop` entry
    max_token_list_len: int  # entries of stop_token_ids, allowed_token_ids, bad_words, logit_bias
    max_prompts_per_request: int  # prompts in one /v1/completions request
    max_n: int  # `n` (and `best_of`)


class LimitsArgs(Protocol):
    """The `EngineArgs` fields the limits read (the same names as `LimitsConfig`'s)."""

    @property
    def max_num_queued_reqs(self) -> int | None: ...
    @property
    def max_num_queued_tokens(self) -> int | None: ...
    @property
    def max_request_tokens(self) -> int: ...
    @property
    def max_stop_strings(self) -> int: ...
    @property
    def max_stop_string_len(self) -> int: ...
    @property
    def max_token_list_len(self) -> int: ...
    @property
    def max_prompts_per_request(self) -> int: ...
    @property
    def max_n(self) -> int: ...


def resolve_limits(args: LimitsArgs) -> LimitsConfig:
    """Every limit a positive integer (the queue limits may be None: no limit)."""
    limits = LimitsConfig(
        max_num_queued_reqs=args.max_num_queued_reqs,
        max_num_queued_tokens=args.max_num_queued_tokens,
        max_request_tokens=args.max_request_tokens,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_len=args.max_stop_string_len,
        max_token_list_len=args.max_token_list_len,
        max_prompts_per_request=args.max_prompts_per_request,
        max_n=args.max_n,
    )
    for name in ("max_num_queued_reqs", "max_num_queued_tokens"):
        if getattr(limits, name) is not None:
            positive(name, getattr(limits, name))
    for name in (
        "max_stop_strings", "max_stop_string_len", "max_token_list_len",
        "max_prompts_per_request", "max_n", "max_request_tokens",
    ):  # fmt: skip
        positive(name, getattr(limits, name))
    return limits
