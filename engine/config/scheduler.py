"""The scheduler: batch sizes, the token budget per step, chunked prefill and the order requests
are served in (engine/scheduling/)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from triollm.engine.config.checks import one_of, positive
from triollm.engine.loading.model_config import ModelConfig

__all__ = [
    "PREFILL_BUDGETS",
    "SCHEDULING_POLICIES",
    "SchedulerConfig",
    "check_scheduler",
    "resolve_scheduler",
]

SCHEDULING_POLICIES = ("fcfs", "priority")  # vLLM's --scheduling-policy
PREFILL_BUDGETS = ("auto", "off")  # --scheduler-prefill-budget (triollm's)


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    long_prefill_token_threshold: int = 0  # > 0: a prompt takes at most this many tokens per step
    policy: str = "fcfs"  # "fcfs": arrival order, `priority` must be 0; "priority": by priority
    # "auto": beside running decodes a step takes only the prompt tokens that keep it near a
    # decode-only step's measured time (engine/scheduling/scheduler.py); "off": the whole budget.
    prefill_budget: str = "auto"
    max_loras: int = 0  # the most distinct LoRA adapters among running requests (0: LoRA off)


class SchedulerArgs(Protocol):
    """The `EngineArgs` fields the scheduler reads."""

    @property
    def max_num_seqs(self) -> int: ...
    @property
    def max_num_batched_tokens(self) -> int | None: ...
    @property
    def enable_chunked_prefill(self) -> bool: ...
    @property
    def long_prefill_token_threshold(self) -> int: ...
    @property
    def scheduler_prefill_budget(self) -> str: ...
    @property
    def scheduling_policy(self) -> str: ...
    @property
    def enable_lora(self) -> bool: ...
    @property
    def max_loras(self) -> int: ...


def check_scheduler(args: SchedulerArgs) -> None:
    """What can be checked before the model is read (the token budget needs its length)."""
    positive("max_num_seqs", args.max_num_seqs)
    threshold = args.long_prefill_token_threshold
    if not isinstance(threshold, int) or threshold < 0:
        raise ValueError(
            f"long_prefill_token_threshold: must be a non-negative integer (0: no limit), "
            f"got {threshold!r}"
        )
    one_of("scheduler_prefill_budget", args.scheduler_prefill_budget, PREFILL_BUDGETS)
    if args.scheduling_policy not in SCHEDULING_POLICIES:
        raise ValueError(
            f"scheduling_policy: must be one of {', '.join(SCHEDULING_POLICIES)}, "
            f"got {args.scheduling_policy!r}"
        )


def resolve_scheduler(args: SchedulerArgs, model: ModelConfig) -> SchedulerConfig:
    """The token budget per step defaulted against the model's length (2048 with chunked
    prefill; without it, at least a whole prompt of max_model_len) and checked."""
    budget = args.max_num_batched_tokens
    if budget is None:
        budget = 2048 if args.enable_chunked_prefill else max(2048, model.max_model_len)
    positive("max_num_batched_tokens", budget)
    if not args.enable_chunked_prefill and budget < model.max_model_len:
        raise ValueError(
            f"max_num_batched_tokens: {budget} is smaller than max_model_len "
            f"({model.max_model_len}) with chunked prefill disabled; raise it or enable chunked "
            "prefill"
        )
    mm = model.multimodal
    if mm is not None and mm.bidirectional and budget < mm.tokens_per_image:
        raise ValueError(
            f"max_num_batched_tokens: {budget} is smaller than the {mm.tokens_per_image} positions of one image "
            f"of {mm.architecture}, which a prefill chunk takes whole; raise it to at least {mm.tokens_per_image}"
        )
    return SchedulerConfig(
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=budget,
        enable_chunked_prefill=args.enable_chunked_prefill,
        long_prefill_token_threshold=args.long_prefill_token_threshold,
        policy=args.scheduling_policy,
        prefill_budget=args.scheduler_prefill_budget,
        max_loras=args.max_loras if args.enable_lora else 0,
    )
