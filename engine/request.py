"""What crosses the boundary of the engine core: one request in, per-step outputs out.

`EngineCoreRequest` is a fully processed request (token ids, not text); `EngineCoreOutput` is what
one step produced for one request. Both are msgspec Structs so the actor layer can put them on
the wire unchanged. The core's own mutable per-request state (`Request`: the token lists, KV
blocks, the grammar matcher) is no wire type: it lives with the scheduler
(engine/scheduling/request_state.py), above this module.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import msgspec

from triollm.engine.pooling_params import PoolingParams
from triollm.engine.sampling_params import SamplingParams
from triollm.lora.request import LoRARequest

__all__ = [
    "EngineCoreOutput",
    "EngineCoreRequest",
    "FinishReason",
    "ImageFeature",
    "Logprobs",
    "RunnerOutput",
]


class FinishReason(enum.IntEnum):
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3

    def __str__(self) -> str:
        return self.name.lower()


class ImageFeature(msgspec.Struct, array_like=True, gc=False):
    """One image of a request (engine/processing/image_inputs.py): the prompt positions its
    features fill and its processed pixels, which the model runner's vision encoder turns into
    those features."""

    offset: int  # the first prompt position it fills
    length: int  # how many positions
    digest: bytes  # sha256 of shape and pixels: keys the encoder's work and the prefix cache
    pixels: bytes  # float32, C order
    shape: list[int]  # [channels, height, width]; Qwen2-VL: [patches, channels * patch volume]
    # Whether its positions attend to each other both ways (Gemma 3): prefill never cuts it.
    bidirectional: bool = False
    # Qwen2-VL: the patch grid (temporal, height, width) the tower and the M-RoPE positions read.
    grid: list[int] = []


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
    # The adapter this request runs under (None: the base model); the frontend checked its config.
    lora_request: LoRARequest | None = None
    # A pooling request's segment per prompt token (a BERT text pair: 0s, then 1s); None: all 0.
    token_type_ids: list[int] | None = None
    # The prompt's images (a vision-language model): placeholders already expanded in the ids.
    images: list[ImageFeature] = []


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
    # RequestOutput.metrics' stamps (the scheduler's monotonic clock), on a request's first
    # output only: when it was queued and first scheduled (0.0 on the others).
    queued_ts: float = 0.0
    scheduled_ts: float = 0.0
    # Times it was preempted since its previous output (RequestOutput.metrics.num_preemptions).
    num_preemptions: int = 0

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RunnerOutput:
    """What one forward pass returns to the scheduler (`Scheduler.update_from_output`)."""

    # Per sampling request id: the sampled token, and its logprobs row (or None).
    sampled: dict[str, int]
    logprobs: dict[str, Logprobs]
    prompt_logprobs: dict[str, Logprobs]
    # Per request that fed drafts (speculative decoding): the tokens it emits, the accepted
    # drafts and then the target's own token (its first is also `sampled`; `logprobs` has a row
    # per token).
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
