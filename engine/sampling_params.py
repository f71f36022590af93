"""Sampling parameters with vLLM's field names, defaults and validation rules.

Design: `SamplingParams` stays a msgspec Struct so it crosses process boundaries unchanged.
`__post_init__` validates and normalises in place; msgspec runs it on construction *and* on
decode, so an invalid payload fails as `msgspec.ValidationError` (a `ValueError` subclass).
Normalisation is idempotent (decode(encode(p)) == p): `top_k=-1` -> 0, a `stop` string ->
`[stop]`, `stop`/`stop_token_ids` None -> [], `logit_bias` keys -> int and values clamped to
[-100, 100], greedy (`temperature < 1e-5`) resets top_p/top_k/min_p to their no-op values.
Checks that need the vocabulary size live in `verify_token_ids`, called by the input processor.

Fields are plain attributes, so they can be changed after construction (`sp.n = 0`); the input
processor calls `validate()` again at submission, so such a value fails that one request with a
`ValueError` instead of reaching the engine core. Every integer must fit the wire (msgpack:
[-2**63, 2**64)) and every string must be encodable as UTF-8 (no lone surrogates).
"""

from __future__ import annotations

import copy
import enum
import math
from typing import Any, ClassVar

import msgspec

__all__ = [
    "SAMPLING_EPS",
    "BeamSearchParams",
    "RequestOutputKind",
    "SamplingParams",
    "SamplingType",
    "StructuredOutputsParams",
    "GuidedDecodingParams",
    "check_utf8",
    "check_wire_int",
    "check_wire_value",
]

# Temperatures below this are greedy sampling.
SAMPLING_EPS = 1e-5
_LOGIT_BIAS_LIMIT = 100.0
# What msgpack (the wire to the engine-core process) carries: 64-bit signed or unsigned ints.
_WIRE_INT_MIN = -(2**63)
_WIRE_INT_MAX = 2**64
# generation_config.json names that differ from ours.
_DEFAULT_ALIASES = {"max_new_tokens": "max_tokens"}


class RequestOutputKind(enum.IntEnum):
    CUMULATIVE = 0  # every output carries everything generated so far
    DELTA = 1  # every output carries only what is new since the last one
    FINAL_ONLY = 2  # one output when the request finishes


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


class StructuredOutputsParams(msgspec.Struct, kw_only=True, omit_defaults=True):
    """vLLM's structured-output constraint: exactly one of `json` (a JSON schema, as a dict or
    its text), `regex`, `choice`, `grammar` (Lark or GBNF/EBNF) or `json_object=True` (any JSON
    object). The grammar itself is checked by the input processor
    (engine/structured_outputs.py), which needs the grammar engine; this checks the shape."""

    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    whitespace_pattern: str | None = None
    # triollm's: the grammar applies from the output token after these token ids (a reasoning
    # model's end-of-thinking marker, e.g. Qwen3's `</think>`); until they appear the output is
    # free. The server sets it from its --reasoning-parser; None: from the first token.
    start_after_token_ids: list[int] | None = None

    KINDS: ClassVar[tuple[str, ...]] = ("json", "regex", "choice", "grammar", "json_object")

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        kinds = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(kinds) != 1:
            what = "none is" if not kinds else f"{len(kinds)} are ({', '.join(kinds)})"
            raise ValueError(
                f"structured_outputs: set exactly one of {', '.join(self.KINDS)}; {what} set"
            )
        if self.json is not None and not isinstance(self.json, str | dict):
            raise ValueError(
                f"structured_outputs.json: must be a JSON schema (an object or its text), got {self.json!r:.80}"
            )
        if isinstance(self.json, dict):
            check_wire_value("structured_outputs.json", self.json)
        for name in ("regex", "grammar", "whitespace_pattern"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"structured_outputs.{name}: must be a string, got {value!r:.80}")
            if value is not None:
                check_utf8(f"structured_outputs.{name}", value)
        ids = self.start_after_token_ids
        if ids is not None and (
            not isinstance(ids, list)
            or not 1 <= len(ids) <= 64
            or not all(isinstance(i, int) and 0 <= i < 2**31 for i in ids)
        ):
            raise ValueError(
                f"structured_outputs.start_after_token_ids: must be a list of 1 to 64 token ids, got {ids!r:.80}"
            )
        if self.choice is not None:
            if not isinstance(self.choice, list) or not self.choice or not all(
                isinstance(c, str) and c for c in self.choice
            ):
                raise ValueError(
                    f"structured_outputs.choice: must be a non-empty list of non-empty strings, got {self.choice!r:.80}"
                )
            for c in self.choice:
                check_utf8("structured_outputs.choice", c)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))


# The name vLLM used before 0.11 (`SamplingParams(guided_decoding=GuidedDecodingParams(...))`).
GuidedDecodingParams = StructuredOutputsParams


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's beam search parameters (the search itself: engine/beam_search.py)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")


class SamplingParams(msgspec.Struct, kw_only=True, omit_defaults=True, dict=True):
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    # A grammar every output must follow (engine/structured_outputs.py).
    structured_outputs: StructuredOutputsParams | None = None
    guided_decoding: StructuredOutputsParams | None = None  # vLLM's older name: moved to the above

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (raising `ValueError` naming it) and normalise in place; idempotent.
        Runs at construction and decode, and again at submission (fields may have been changed)."""
        self._verify_penalties()
        self._verify_sampling()
        self._verify_lengths()
        self._verify_logprobs()
        self._normalize_stop()
        self._normalize_token_lists()
        self._verify_structured_outputs()
        if self.temperature < SAMPLING_EPS:  # greedy: the truncation knobs are moot
            self.top_p, self.top_k, self.min_p = 1.0, 0, 0.0

    # ----------------------------------------------------------------- validation

    def _verify_penalties(self) -> None:
        for name in ("presence_penalty", "frequency_penalty"):
            value = _number(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            setattr(self, name, value)
        self.repetition_penalty = _number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty < math.inf:
            raise ValueError(
                f"repetition_penalty must be a finite number > 0, got {self.repetition_penalty}"
            )

    def _verify_sampling(self) -> None:
        self.temperature = _number("temperature", self.temperature)
        if not 0.0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
        self.top_p = _number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if _integer("top_k", self.top_k) < -1:
            raise ValueError(f"top_k must be -1 or >= 0 (0 and -1 disable it), got {self.top_k}")
        self.top_k = max(self.top_k, 0)
        self.min_p = _number("min_p", self.min_p)
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.seed is not None:
            _integer("seed", self.seed)
            # n > 1 children get seeds seed + i: those must fit too.
            if self.seed + max(_integer("n", self.n), 1) - 1 >= _WIRE_INT_MAX:
                raise ValueError(f"seed must be below 2**64 - n, got {self.seed}")

    def _verify_lengths(self) -> None:
        if _integer("n", self.n) < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens is not None and _integer("max_tokens", self.max_tokens) < 1:
            raise ValueError(f"max_tokens must be None or >= 1, got {self.max_tokens}")
        if _integer("min_tokens", self.min_tokens) < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )

    def _verify_logprobs(self) -> None:
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and _integer(name, value) < -1:
                raise ValueError(f"{name} must be None, -1 (whole vocabulary) or >= 0, got {value}")

    def _normalize_stop(self) -> None:
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        for s in stop:
            check_utf8("stop", s)
        if stop and not self.detokenize:
            raise ValueError("stop strings need detokenize=True")
        self.stop = stop
        if self.bad_words is not None and not (
            isinstance(self.bad_words, list) and all(isinstance(w, str) for w in self.bad_words)
        ):
            raise ValueError(f"bad_words must be a list of strings, got {self.bad_words!r}")
        for word in self.bad_words or ():
            check_utf8("bad_words", word)

    def _normalize_token_lists(self) -> None:
        self.stop_token_ids = _int_list("stop_token_ids", self.stop_token_ids or [])
        if self.allowed_token_ids is not None:
            self.allowed_token_ids = _int_list("allowed_token_ids", self.allowed_token_ids)
            if not self.allowed_token_ids:
                raise ValueError("allowed_token_ids must be None or a non-empty list of token ids")
        if self.logit_bias is not None:
            self.logit_bias = _normalize_logit_bias(self.logit_bias)

    def _verify_structured_outputs(self) -> None:
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise ValueError("guided_decoding: set structured_outputs or guided_decoding (its old name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        so = self.structured_outputs
        if so is None:
            return
        if isinstance(so, dict):  # set after construction from a plain dict
            so = self.structured_outputs = StructuredOutputsParams(**so)
        if not isinstance(so, StructuredOutputsParams):
            raise ValueError(f"structured_outputs: must be a StructuredOutputsParams, got {type(so).__name__}")
        so.validate()

    def verify_token_ids(self, vocab_size: int) -> None:
        """Raise ValueError unless every token id in the params lies in [0, vocab_size)."""
        fields: dict[str, list[int]] = {
            "stop_token_ids": list(self.stop_token_ids or []),
            "allowed_token_ids": self.allowed_token_ids or [],
            "logit_bias": list(self.logit_bias or {}),
        }
        for name, ids in fields.items():
            bad = [t for t in ids if not 0 <= t < vocab_size]
            if bad:
                raise ValueError(f"{name} token ids must be in [0, {vocab_size}), got {bad[:8]}")

    # ----------------------------------------------------------------- properties

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    # ----------------------------------------------------------------- constructors

    def clone(self) -> SamplingParams:
        """A deep copy (lists and dicts are not shared)."""
        return copy.deepcopy(self)

    @classmethod
    def from_optional(cls, **kwargs: Any) -> SamplingParams:
        """Like vLLM's: arguments passed as None take the field's default.

        `max_tokens` is the exception: None there means "no limit" and is kept; leave the
        argument out to get the default (16).
        """
        args = {k: v for k, v in kwargs.items() if v is not None or k == "max_tokens"}
        return cls(**args)

    @classmethod
    def with_defaults(cls, defaults: dict[str, Any], **overrides: Any) -> SamplingParams:
        """Params where fields absent from `overrides` take the model's `defaults`.

        `defaults` is typically generation_config.json: unknown keys and None values are
        ignored, and `max_new_tokens` maps to `max_tokens`. `overrides` are taken literally
        (an explicit None is a value, e.g. `max_tokens=None` means no limit).
        """
        fields = set(cls.__struct_fields__)
        merged: dict[str, Any] = {}
        for key, value in defaults.items():
            name = _DEFAULT_ALIASES.get(key, key)
            if name in fields and value is not None:
                merged[name] = value
        merged.update(overrides)
        return cls(**merged)


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    return float(value)


def _integer(name: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an int, got {value!r}")
    return check_wire_int(name, value)


def check_wire_int(name: str, value: int) -> int:
    """`value` unless the wire (msgpack, 64-bit integers) cannot carry it: then `ValueError`."""
    if not _WIRE_INT_MIN <= value < _WIRE_INT_MAX:
        raise ValueError(f"{name} must be in [-2**63, 2**64) (a 64-bit integer), got {value}")
    return value


# How deep a JSON value the wire takes (msgspec's own limit is far deeper; no schema needs this).
_WIRE_MAX_DEPTH = 64


def check_wire_value(name: str, value: Any) -> None:
    """`ValueError` naming `name` (and the path inside it) unless `value` is JSON-like data the
    wire (msgpack) carries: dicts with string keys, lists, strings without lone surrogates,
    64-bit integers, floats, bools and None, nested at most 64 deep. A JSON schema with
    `"maximum": 2**64 + 5` is refused here, at validation, rather than failing the encode."""
    stack: list[tuple[str, Any, int]] = [(name, value, 0)]
    while stack:
        path, v, depth = stack.pop()
        if depth > _WIRE_MAX_DEPTH:
            raise ValueError(f"{name}: nested more than {_WIRE_MAX_DEPTH} levels deep (at {path[:200]})")
        if v is None or isinstance(v, bool | float):
            continue
        if isinstance(v, int):
            if not _WIRE_INT_MIN <= v < _WIRE_INT_MAX:
                raise ValueError(f"{path[:200]}: integers must be in [-2**63, 2**64) (64-bit), got {v:.3e}")
        elif isinstance(v, str):
            check_utf8(path[:200], v)
        elif isinstance(v, dict):
            for k, item in v.items():
                if not isinstance(k, str):
                    raise ValueError(f"{path[:200]}: object keys must be strings, got {k!r:.40}")
                check_utf8(f"{path[:200]} (a key)", k)
                stack.append((f"{path[:200]}.{k[:40]}", item, depth + 1))
        elif isinstance(v, list | tuple):
            stack.extend((f"{path[:200]}[{i}]", item, depth + 1) for i, item in enumerate(v))
        else:
            raise ValueError(f"{path[:200]}: must be JSON data, got a {type(v).__name__}")


def check_utf8(name: str, value: str) -> str:
    """`value` unless it cannot be encoded as UTF-8 (a lone surrogate): then `ValueError`."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise ValueError(
            f"{name} must be valid Unicode text (no lone surrogates): {exc.reason} at {exc.start}"
        ) from None
    return value


def _int_list(name: str, values: Any) -> list[int]:
    if not isinstance(values, list | tuple):
        raise ValueError(f"{name} must be a list of token ids, got {values!r}")
    return [_integer(name, v) for v in values]


def _normalize_logit_bias(bias: Any) -> dict[int, float]:
    if not isinstance(bias, dict):
        raise ValueError(f"logit_bias must be a dict of token id -> bias, got {bias!r}")
    out: dict[int, float] = {}
    for key, value in bias.items():
        token = _token_key(key)
        number = _number("logit_bias", value)
        if math.isnan(number):
            raise ValueError(f"logit_bias values must be in [-100, 100], got {number}")
        out[token] = min(max(number, -_LOGIT_BIAS_LIMIT), _LOGIT_BIAS_LIMIT)
    return out


def _token_key(key: Any) -> int:
    """A logit_bias key: an int, or a string holding one (JSON object keys are strings)."""
    if isinstance(key, int) and not isinstance(key, bool):
        return key
    if isinstance(key, str):
        try:
            return int(key)
        except ValueError:
            pass
    raise ValueError(f"logit_bias keys must be token ids (ints), got {key!r}")
