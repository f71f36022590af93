"""`Request`: the engine core's mutable state for one request.

Built by the core from an `EngineCoreRequest` (the wire message, engine/request.py) when it is
added, and owned by the core and its scheduler until the request finishes: the token lists, the
KV blocks and their hashes, the scheduling status, and what sampling needs per request (the
`SamplingPlan`, the grammar matcher). None of it crosses a process
boundary, so it is a plain class, not a msgspec Struct, and sits above the wire vocabulary.
"""

from __future__ import annotations

import enum
from typing import Any

import torch

from triollm.engine.execution.sampling_plan import SamplingPlan
from triollm.engine.request import EngineCoreRequest, FinishReason

__all__ = ["Request", "RequestStatus"]


class RequestStatus(enum.IntEnum):
    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED


class Request:
    """The engine core's mutable state for one request."""

    def __init__(self, req: EngineCoreRequest, max_tokens: int) -> None:
        self.request_id = req.request_id
        self.prompt_token_ids = list(req.prompt_token_ids)
        self.num_prompt_tokens = len(self.prompt_token_ids)
        self.sampling_params = req.sampling_params
        self.eos_token_ids = req.eos_token_ids
        self.bad_words_token_ids = req.bad_words_token_ids
        # Token-id sets and tensors for the stop checks and the sampler, deduplicated once here.
        self.sampling_plan = SamplingPlan.prepare(req.sampling_params, req.eos_token_ids, req.bad_words_token_ids)
        self.priority = req.priority
        self.lora_request = req.lora_request  # the adapter it runs under (None: the base model)
        self.arrival_time = req.arrival_time
        self.waiting_since = 0.0  # when it was queued or preempted, by the scheduler's clock
        # RequestOutput.metrics' core stamps, by the scheduler's clock (monotonic): first queued,
        # first scheduled; sent with the request's first output (`times_sent`), then not again.
        self.queued_ts = 0.0
        self.scheduled_ts = 0.0
        self.times_sent = False
        self.preemptions_unsent = 0  # preemptions since its last output (RequestOutput.metrics)
        self.wave_held: float | None = None  # the start of the wave that held its decode (scheduler's `_wave`)
        self.max_tokens = max_tokens
        # all_token_ids = prompt + output; tokens [0, num_computed_tokens) have KV in the cache.
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 = not yet scheduled
        # KV blocks by position: block_ids[i] holds tokens [i * block_size, (i + 1) * block_size).
        # Under a sliding window on every layer the first num_released_blocks of them fell out of
        # it and went back to the block manager: their ids stay (positions still index the list)
        # but the request no longer references them and no kernel reads them again.
        self.block_ids: list[int] = []
        self.num_released_blocks = 0
        self.block_hashes: list[bytes] = []  # chained sha256 of the full blocks of all_token_ids
        # A hybrid model's recurrent-state slot (layers/recurrent.py), held with the blocks.
        self.state_slot: int | None = None
        # A vision-language prompt's images (engine/request.py `ImageFeature`); the spans
        # (first position, end, digest) key the blocks that hold them (block_manager.py); the
        # model runner keeps each image's features here from the first prefill chunk that
        # touches it until the chunk that finishes it.
        self.images = req.images
        self.image_spans = tuple((f.offset, f.offset + f.length, f.digest) for f in req.images)
        self.image_features: dict[int, torch.Tensor] = {}
        # An M-RoPE model's (prompt positions [3, P], delta), built by the model runner at the
        # request's first step (engine/execution/mrope.py); it outlives preemption.
        self.mrope: tuple[torch.Tensor, int] | None = None
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        # The request's grammar matcher (engine/structured_outputs.py), built by the core before
        # the request's first step when `structured_outputs` is set.
        self.grammar: Any = None
        # Prompt logprobs need logits at every prompt position: skip the prefix cache for them.
        self.skip_prefix_cache = req.sampling_params.prompt_logprobs is not None
        # Speculative decoding (engine/speculative/): the draft tokens this request asks to have
        # verified in the coming step (set by the speculator before each schedule; 0: a plain
        # decode), the most it may ask for after its last verification, the n-gram proposal, the method's per-request
        # state (an n-gram
        # index), and how many of its tokens have K/V in the draft model's cache.
        self.spec_wanted = 0
        self.spec_limit = 0  # the most drafts it proposes next (0: num_speculative_tokens)
        self.spec_proposal: list[int] = []
        self.spec_state: Any = None
        self.draft_computed = 0

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def held_block_ids(self) -> list[int]:
        """The blocks the request references: block_ids less those released by the window."""
        return self.block_ids[self.num_released_blocks :]

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)}, "
            f"released={self.num_released_blocks})"
        )


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}
