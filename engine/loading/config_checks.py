"""Checks of config.json and generation_config.json that must fail at load, not at the first step.

A field the engine indexes with at every step is checked here once: an `eos_token_id` outside the
vocabulary used to be accepted and then killed the engine core at the first step that banned or
looked up the stop token (`IndexError: index 50279 is out of bounds`), taking every other request
with it. transformers' own config defaults do this for a small vocabulary (OLMo 2's config class
defaults `eos_token_id` to 50279 whatever `vocab_size` is), so a tiny or pruned checkpoint hits it.

Special token ids (`eos_token_id`, `bos_token_id`, `pad_token_id`, in config.json and in the
generation_config.json the engine reads) must lie in `[0, vocab_size)`; `eos_token_id` may be a
list; null means none. A negative `pad_token_id` is accepted as "no pad token" (older converted
Llama configs say -1; nothing in the engine pads with it). Head counts: `num_attention_heads`
must divide `hidden_size` where `head_dim` is not given (hf_config.py checks that the KV heads
divide the query heads). RoPE settings are checked by rope_config.py for native models and for
the Transformers backend alike.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["MISSING", "check_head_counts", "check_special_tokens", "read_bool", "read_eps", "read_int"]

_SPECIAL = ("eos_token_id", "bos_token_id", "pad_token_id")


def check_special_tokens(sources: Mapping[str, Mapping[str, Any]], vocab_size: int) -> None:
    """Every special token id of each source (file name -> its JSON) in the vocabulary."""
    for where, data in sources.items():
        for key in _SPECIAL:
            value = data.get(key)
            if value is None:
                continue
            ids = value if isinstance(value, list) and key == "eos_token_id" else [value]
            for tok in ids:
                if isinstance(tok, bool) or not isinstance(tok, int):
                    raise ValueError(
                        f"{key} ({where}): expected an integer token id"
                        f"{' or a list of them' if key == 'eos_token_id' else ''} or null, got {value!r}"
                    )
                if key == "pad_token_id" and tok < 0:
                    continue  # "no pad token" (module note)
                if not 0 <= tok < vocab_size:
                    raise ValueError(
                        f"{key} ({where}): {tok} is outside the vocabulary; allowed: 0 to {vocab_size - 1} "
                        f"(vocab_size {vocab_size}) or null"
                    )


def check_head_counts(hf: Mapping[str, Any], hidden: int, num_heads: int) -> None:
    """Without an explicit `head_dim`, the heads split `hidden_size` evenly."""
    if hf.get("head_dim") is None and hidden % num_heads:
        raise ValueError(
            f"num_attention_heads: {num_heads} does not divide hidden_size {hidden} (and config.json gives no "
            f"head_dim); allowed: a divisor of {hidden}"
        )


# Readers of one config.json field each: the value, or a ValueError naming the field.
MISSING: Any = object()


def read_int(
    hf: Mapping[str, Any],
    key: str,
    default: int | None = MISSING,
    *,
    null: int | None = None,
    minimum: int = 1,
) -> int:
    """hf[key] as an int >= minimum; `default` when absent (required if not given), `null` when null."""
    if key not in hf:
        if default is MISSING:
            raise ValueError(f"{key}: required in config.json")
        value = default
    else:
        value = hf[key]
    if value is None:
        value = null
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def read_bool(hf: Mapping[str, Any], key: str, default: bool) -> bool:
    value = hf.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    return value


def read_eps(hf: Mapping[str, Any], default: float = 1e-6) -> float:
    value = hf.get("rms_norm_eps")
    if value is None:
        return default
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not (math.isfinite(value) and value > 0)
    ):
        raise ValueError(f"rms_norm_eps: expected a positive number, got {value!r}")
    return float(value)
