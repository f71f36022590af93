"""The rules a request's prompt must meet, each worded once.

The frontend (engine/frontend/input.py) checks them before a request reaches a core, so a
client gets the error at once; both cores (engine/core.py, engine/pooling_core.py) check them
again in `add_request`, because a core must never trust its input (a request may come from
another process, a test, or a frontend with other settings). Each rule raises `ValueError`
naming the field, the value and the limit; the same rule gives the same words wherever it
fails, so a client, a log line and a test see one message.
"""

from __future__ import annotations

from collections.abc import Container, Sequence

__all__ = [
    "check_kv_fit",
    "check_new_request_id",
    "check_prompt_len",
    "check_prompt_not_empty",
    "check_prompt_tokens",
    "check_vocab",
]


def check_new_request_id(request_id: str, running: Container[str]) -> None:
    if request_id in running:
        raise ValueError(f"request_id: {request_id!r} is already running")


def check_prompt_not_empty(num_tokens: int) -> None:
    if num_tokens == 0:
        raise ValueError("prompt: must not be empty (0 tokens)")


def check_prompt_len(num_tokens: int, max_model_len: int, *, generate: bool = True) -> None:
    """A generative model's prompt leaves room for one token to generate; a pooling model's may
    fill max_model_len (and may be cut to it: `truncate_prompt_tokens`)."""
    if generate and num_tokens > max_model_len - 1:
        raise ValueError(
            f"prompt: {num_tokens} tokens exceeds max_model_len ({max_model_len}) minus one "
            f"token to generate; at most {max_model_len - 1} prompt tokens are allowed"
        )
    if not generate and num_tokens > max_model_len:
        raise ValueError(
            f"prompt: {num_tokens} tokens exceed max_model_len ({max_model_len}); shorten it or "
            "set truncate_prompt_tokens (-1: truncate to max_model_len)"
        )


def check_vocab(token_ids: Sequence[int], vocab_size: int) -> None:
    """Every prompt token id in the model's vocabulary."""
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise ValueError(
            f"prompt_token_ids: token ids must be in [0, {vocab_size}) (vocab_size), "
            f"got {bad[:8]}"
        )


def check_prompt_tokens(
    token_ids: Sequence[int], max_model_len: int, vocab_size: int, *, generate: bool = True
) -> None:
    """The three prompt rules, cheapest first."""
    check_prompt_not_empty(len(token_ids))
    check_prompt_len(len(token_ids), max_model_len, generate=generate)
    check_vocab(token_ids, vocab_size)


def check_kv_fit(prompt_len: int, max_tokens: int, capacity: int) -> None:
    """A sequence that needs more KV slots than the cache has would preempt itself forever. The
    last sampled token is never fed back, so prompt + max_tokens - 1 slots suffice."""
    if prompt_len + max_tokens - 1 <= capacity:
        return
    if prompt_len > capacity:
        raise ValueError(
            f"prompt: {prompt_len} tokens do not fit in the KV cache ({capacity} tokens)"
        )
    raise ValueError(
        f"max_tokens: {max_tokens} tokens after a prompt of {prompt_len} need "
        f"{prompt_len + max_tokens - 1} KV cache slots, more than the KV cache's "
        f"{capacity} tokens; ask for at most {capacity - prompt_len + 1}"
    )
