"""What crosses the boundary of the engine core: one request in, per-step outputs out.

`EngineCoreRequest` is a fully processed request (token ids, not text); `EngineCoreOutput` is what
one step produced for one request. Both are msgspec Structs so the actor layer can put them on
the wire unchanged. `Request` is the core's own mutable per-request state.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec
import torch

from triollm.engine.execution.sampling_plan import SamplingPlan
from triollm.engine.pooling_params import PoolingParams
from triollm.engine.sampling_params import SamplingParams

__all__ = [
    "EngineCoreOutput",
    "EngineCoreRequest",
    "FinishReason",
    "Logprobs",
    "Request",
    "RequestStatus",
]


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class EngineCoreRequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Every id that ends the request as EOS (tokenizer EOS plus generation_config's eos ids).
    eos_token_ids: list[int] = []
    # `SamplingParams.bad_words` tokenized by the input processor.
    bad_words_token_ids: list[list[int]] = []
    arrival_time: float = 0.0
    priority: int = 0
    # A request to a pooling model (engine/pooling_core.py): its sampling_params are unused.
    pooling_params: PoolingParams | None = None


class Logprobs(msgspec.Struct, array_like=True, gc=False):
    """Logprobs of several positions, one row per position.

    Row i: `token_ids[i][0]` is the chosen (sampled or prompt) token and `logprobs[i][0]` its
    logprob; the rest of the row is the top-k, most likely first. `ranks[i]` is the rank of the
    chosen token in the whole vocabulary (1 = most likely).
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    ranks: list[int]


class EngineCoreOutput(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    request_id: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    # The stop token id that ended the request (EOS gives None), or an error message.
    stop_reason: int | str | None = None
    new_logprobs: Logprobs | None = None
    # Rows for prompt positions 1..P-1 (position 0 has no logprob), possibly over several steps.
    new_prompt_logprobs: Logprobs | None = None
    num_cached_tokens: int = 0
    # A pooling model's result (finished, no tokens): little-endian float32 bytes
    # (engine/pooling_outputs.py `pack_pooled`).
    pooled: bytes | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


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
        self.sampling_plan = SamplingPlan.prepare(
            req.sampling_params, req.eos_token_ids, req.bad_words_token_ids
        )
        self.priority = req.priority
        self.arrival_time = req.arrival_time
        self.max_tokens = max_tokens
        # all_token_ids = prompt + output; tokens [0, num_computed_tokens) have KV in the cache.
        self.all_token_ids: list[int] = list(req.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.num_computed_tokens = 0
        self.num_cached_tokens = -1  # prefix-cache hit at first schedule; -1 = not yet scheduled
        self.block_ids: list[int] = []
        self.block_hashes: list[bytes] = []  # chained sha256 of the full blocks of all_token_ids
        self.status = RequestStatus.WAITING
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.generator: torch.Generator | None = None
        if req.sampling_params.seed is not None:
            self.generator = torch.Generator().manual_seed(req.sampling_params.seed)
        # The request's grammar matcher (engine/structured_outputs.py), built by the core before
        # the request's first step when `structured_outputs` is set.
        self.grammar: Any = None
        # Prompt logprobs need logits at every prompt position: skip the prefix cache for them.
        self.skip_prefix_cache = req.sampling_params.prompt_logprobs is not None

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self.status)

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.status.name}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, blocks={len(self.block_ids)})"
        )


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}
