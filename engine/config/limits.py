"""What one request may ask of the server, and how much may wait for the scheduler."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from triollm.engine.config.checks import positive

__all__ = ["DEFAULT_IMAGES_PER_PROMPT", "LimitsConfig", "resolve_limits"]

DEFAULT_IMAGES_PER_PROMPT = 8


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
    # Images in one prompt of a vision-language model (`limit_mm_per_prompt={"image": N}`).
    max_images_per_prompt: int = DEFAULT_IMAGES_PER_PROMPT
    # The folder whose files a chat `image_url` may name as file:// URLs (None: none).
    allowed_local_media_path: str | None = None


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
    @property
    def limit_mm_per_prompt(self) -> dict[str, Any] | None: ...
    @property
    def allowed_local_media_path(self) -> str: ...


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
        max_images_per_prompt=_image_limit(args.limit_mm_per_prompt),
        allowed_local_media_path=args.allowed_local_media_path or None,
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


def _image_limit(limits: dict[str, Any] | None) -> int:
    """vLLM's `limit_mm_per_prompt` ({"image": N}); images are the one modality served."""
    if limits is None:
        return DEFAULT_IMAGES_PER_PROMPT
    if not isinstance(limits, dict):
        raise ValueError(f'limit_mm_per_prompt: expected a JSON object such as {{"image": 4}}, got {limits!r}')
    unknown = sorted(set(limits) - {"image"})
    if unknown:
        raise ValueError(f"limit_mm_per_prompt: unsupported modalities {unknown}; allowed: image")
    value = limits.get("image", DEFAULT_IMAGES_PER_PROMPT)
    if isinstance(value, dict):  # vLLM's newer form: {"image": {"count": N, ...}}
        value = value.get("count", DEFAULT_IMAGES_PER_PROMPT)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"limit_mm_per_prompt.image: expected an integer >= 0, got {value!r}")
    return value
