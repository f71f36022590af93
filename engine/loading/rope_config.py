"""RoPE settings of a Hugging Face checkpoint, read from either generation of config.json.

transformers 4.x wrote `rope_theta` at the top level and scaling, if any, in `rope_scaling`
(`{"type": "linear", "factor": 2.0}`, later `"rope_type"`); transformers 5.x writes one
`rope_parameters` dict holding both (`{"rope_theta": 1e6, "rope_type": "default"}`). Reading only
one of them is the silent defect this module exists to prevent: a 5.x directory read the 4.x way
falls back to theta 10000 and produces other tokens without any error. `parse_rope` merges them
with transformers 5's precedence (the version the parity tests pin):

* the dict is `rope_scaling` if that is set, else `rope_parameters`;
* `rope_theta` inside the dict wins over a top-level `rope_theta`, which wins over 10000;
* `rope_type` wins over the legacy `type`; absent means "default";
* a top-level `original_max_position_embeddings` wins over the dict's (transformers' Phi-3
  rule), and llama3 / yarn default it to `max_position_embeddings`.

Supported types: default, linear, dynamic, yarn, llama3, longrope (Phi-3), each computed as
transformers computes it (`kernels/rotary.py`); a per-layer-type dict where the architecture has
one (Gemma 3) and a partial rotary factor where the architecture honours it (its caller says so).
Anything else (proportional, ...) is a `ValueError` naming the field, never approximated. Dynamic NTK is honoured
only where it is exactly the default RoPE: transformers recomputes its frequencies from the
longest position in each forward call and keeps the K already cached at the old ones, a history
a paged cache with prefix sharing, chunked prefill and recompute preemption cannot reproduce. So
`check_max_model_len` refuses a dynamic model whose max_model_len exceeds max_position_embeddings.

LongRoPE has the same kind of history: transformers rotates a whole sequence with the short factors
while it is at most original_max_position_embeddings long and with the long factors once it is
longer (Phi-3's `generate` drops its cache and re-encodes the prompt at that point). One set of
factors per engine, chosen from max_model_len as vLLM chooses it: the long factors for every
position when max_model_len exceeds the original length, else the short ones. So every token a
sequence longer than the original length computes is transformers' (a 32k prompt on a 128k Phi-3,
from its first output token), and so is every token under a max_model_len within the original
length; what differs is a short sequence under a long max_model_len (long factors where
transformers uses the short ones, as in vLLM). Rejected: short rows below the original length and
long rows from there on, which agreed with transformers on short sequences but rotated every long
prompt in a way neither transformers nor the model's training ever did.

YaRN differs between generations: transformers 4.x replaced `factor` by
max_position_embeddings / original_max_position_embeddings whenever the latter was given; 5.x uses
the explicit `factor` (and warns). triollm follows 5.x.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch

from triollm.kernels.rotary import (
    default_inv_freq,
    linear_inv_freq,
    llama3_inv_freq,
    ntk_inv_freq,
    rotary_tables,
    yarn_inv_freq,
)

__all__ = ["ROPE_TYPES", "RopeConfig", "RopeType", "parse_rope", "partial_rotary_factor"]

RopeType = Literal["default", "linear", "dynamic", "yarn", "llama3", "longrope"]
ROPE_TYPES: tuple[str, ...] = get_args(RopeType)
DEFAULT_THETA = 10000.0


@dataclass(frozen=True)
class RopeConfig:
    """One checkpoint's rotary embedding. Fields a type does not use keep their defaults."""

    rope_type: RopeType = "default"
    theta: float = DEFAULT_THETA
    factor: float = 1.0  # linear, dynamic, yarn, llama3
    max_position_embeddings: int = 2048  # dynamic: the length up to which it is the default RoPE
    original_max_position_embeddings: int | None = None  # yarn, llama3
    low_freq_factor: float = 1.0  # llama3
    high_freq_factor: float = 4.0  # llama3
    beta_fast: float = 32.0  # yarn
    beta_slow: float = 1.0  # yarn
    truncate: bool = True  # yarn
    attention_factor: float = 1.0  # yarn, longrope: cos and sin are multiplied by it
    # longrope: the attention factor when max_model_len exceeds the original length (Phi-MoE's
    # `long_mscale`); None: `attention_factor` at every length.
    long_attention_factor: float | None = None
    short_factor: tuple[float, ...] = ()  # longrope: per-frequency divisors, max_model_len <= the original length
    long_factor: tuple[float, ...] = ()  # longrope: the same, max_model_len beyond it

    def tables(self, dim: int, max_model_len: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[max_model_len, dim]` fp32 (attention factor folded in). LongRoPE: the long
        factors' rows if max_model_len exceeds original_max_position_embeddings, else the short
        factors' (module note)."""
        if self.rope_type != "longrope":
            return rotary_tables(self.inv_freq(dim), max_model_len, self.attention_factor)
        factor = self.attention_factor
        assert self.original_max_position_embeddings is not None
        if self.long_attention_factor is not None and max_model_len > self.original_max_position_embeddings:
            factor = self.long_attention_factor
        return rotary_tables(self.longrope_inv_freq(dim, max_model_len), max_model_len, factor)

    def longrope_inv_freq(self, dim: int, max_model_len: int) -> torch.Tensor:
        """LongRoPE's inverse frequencies for an engine of `max_model_len` (module note)."""
        assert self.original_max_position_embeddings is not None
        factors = self.long_factor if max_model_len > self.original_max_position_embeddings else self.short_factor
        return self._longrope_inv_freq(dim, factors)

    def _longrope_inv_freq(self, dim: int, factors: tuple[float, ...]) -> torch.Tensor:
        if len(factors) != dim // 2:
            raise ValueError(
                f"rope_parameters: longrope factors have {len(factors)} entries, expected {dim // 2} (rotary_dim / 2)"
            )
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / (torch.tensor(factors, dtype=torch.float32) * self.theta**exponents)

    def inv_freq(self, head_dim: int) -> torch.Tensor:
        """The fp32 inverse frequencies, `[head_dim // 2]`, as transformers computes them."""
        match self.rope_type:
            case "default" | "longrope":  # longrope: `longrope_inv_freq`, which depends on max_model_len
                return default_inv_freq(head_dim, self.theta)
            case "linear":
                return linear_inv_freq(head_dim, self.theta, self.factor)
            case "dynamic":
                # transformers' initial frequencies: those of a max_position_embeddings-long sequence.
                m = self.max_position_embeddings
                return ntk_inv_freq(head_dim, self.theta, self.factor, m, m)
            case "llama3":
                assert self.original_max_position_embeddings is not None
                return llama3_inv_freq(
                    head_dim,
                    self.theta,
                    self.factor,
                    self.low_freq_factor,
                    self.high_freq_factor,
                    self.original_max_position_embeddings,
                )
            case "yarn":
                assert self.original_max_position_embeddings is not None
                return yarn_inv_freq(
                    head_dim,
                    self.theta,
                    self.factor,
                    self.original_max_position_embeddings,
                    self.beta_fast,
                    self.beta_slow,
                    self.truncate,
                )

    def check_max_model_len(self, max_model_len: int) -> None:
        """Refuse lengths at which this RoPE cannot be served exactly (see the module note)."""
        if self.rope_type == "dynamic" and max_model_len > self.max_position_embeddings:
            raise ValueError(
                f"rope_parameters: rope_type 'dynamic' changes its frequencies past max_position_embeddings "
                f"({self.max_position_embeddings}) depending on each batch's longest sequence, which a paged "
                f"KV cache cannot reproduce; max_model_len {max_model_len} would go there. "
                f"Use max_model_len <= {self.max_position_embeddings}"
            )


def parse_rope(
    hf: Mapping[str, Any],
    max_position_embeddings: int,
    *,
    layer_type: str | None = None,
    allow_partial: bool = False,
) -> RopeConfig:
    """The RoPE settings of a config.json dict of either transformers generation (module note).
    `layer_type`: the entry of a per-layer-type dict (Gemma 3's `rope_parameters`) to read;
    `allow_partial`: the caller honours `partial_rotary_factor` (see `partial_rotary_factor`)."""
    field, params = _rope_dict(hf)
    if layer_type is not None and isinstance(params.get(layer_type), Mapping):
        field, params = f"{field}.{layer_type}", params[layer_type]
    if any(isinstance(v, Mapping) for v in params.values()):
        raise ValueError(
            f"{field}: per-layer-type RoPE parameters are not supported for this architecture"
        )
    rope_type = params.get("rope_type", params.get("type")) or "default"
    if rope_type not in ROPE_TYPES:
        raise ValueError(
            f"{field}.rope_type: {rope_type!r} is not supported; supported: {', '.join(ROPE_TYPES)}"
        )
    theta = _theta(field, hf, params)
    if theta <= 0:
        raise ValueError(f"{field}.rope_theta: must be positive, got {theta}")
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    if partial is not None and partial != 1.0 and not allow_partial:
        raise ValueError(
            f"partial_rotary_factor: partial rotary embeddings are not supported (got {partial}; only 1.0)"
        )
    base = RopeConfig(theta=theta, max_position_embeddings=max_position_embeddings)
    match rope_type:
        case "default":
            return base
        case "linear" | "dynamic":
            return replace(base, rope_type=rope_type, factor=_factor(field, params))
        case "llama3":
            return replace(
                base,
                rope_type="llama3",
                factor=_factor(field, params),
                low_freq_factor=_required(field, params, "low_freq_factor", "llama3"),
                high_freq_factor=_required(field, params, "high_freq_factor", "llama3"),
                original_max_position_embeddings=_original_len(
                    field, hf, params, max_position_embeddings
                ),
            )
        case "longrope":
            return _longrope(field, hf, params, base)
    return _yarn(field, hf, params, base)


def partial_rotary_factor(hf: Mapping[str, Any]) -> float:
    """`partial_rotary_factor` (in the RoPE dict in 5.x, at the top level in 4.x), 1.0 if absent."""
    field, params = _rope_dict(hf)
    value = params.get("partial_rotary_factor", hf.get("partial_rotary_factor"))
    factor = _number(field, "partial_rotary_factor", value, 1.0)
    if not 0 < factor <= 1:
        raise ValueError(f"partial_rotary_factor: expected a number in (0, 1], got {value!r}")
    return factor


def _longrope(field: str, hf: Mapping[str, Any], params: Mapping[str, Any], base: RopeConfig) -> RopeConfig:
    original = _original_len(field, hf, params, base.max_position_embeddings)
    factors = {}
    for key in ("short_factor", "long_factor"):
        value = params.get(key)
        if not isinstance(value, list) or not all(
            isinstance(v, int | float) and not isinstance(v, bool) and v > 0 for v in value
        ):
            raise ValueError(
                f"{field}.{key}: required for rope_type 'longrope', a list of positive numbers; got {value!r}"
            )
        factors[key] = tuple(float(v) for v in value)
    factor = params.get("factor")
    factor = base.max_position_embeddings / original if factor is None else _number(field, "factor", factor, 1.0)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return replace(
        base,
        rope_type="longrope",
        factor=factor,
        original_max_position_embeddings=original,
        attention_factor=_number(field, "attention_factor", attention_factor, 1.0),
        short_factor=factors["short_factor"],
        long_factor=factors["long_factor"],
    )


def _rope_dict(hf: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    for field in ("rope_scaling", "rope_parameters"):
        value = hf.get(field)
        if value:
            if not isinstance(value, Mapping):
                raise ValueError(f"{field}: expected a JSON object, got {value!r}")
            return field, value
    return "rope_parameters", {}


def _yarn(
    field: str, hf: Mapping[str, Any], params: Mapping[str, Any], base: RopeConfig
) -> RopeConfig:
    if "factor" not in params:
        raise ValueError(f"{field}.factor: required for rope_type 'yarn'")
    original = _original_len(field, hf, params, base.max_position_embeddings)
    factor = params["factor"]
    if factor is None:  # transformers 5 then derives it from the two lengths
        factor = base.max_position_embeddings / original
    factor = _number(field, "factor", factor, 1.0)
    attention_factor = params.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = _yarn_mscale(factor)
    truncate = params.get("truncate", True)
    if not isinstance(truncate, bool):
        raise ValueError(f"{field}.truncate: expected true or false, got {truncate!r}")
    return replace(
        base,
        rope_type="yarn",
        factor=factor,
        original_max_position_embeddings=original,
        # transformers treats 0 / null as unset here (`or 32`, `or 1`).
        beta_fast=_number(field, "beta_fast", params.get("beta_fast") or 32, 32.0),
        beta_slow=_number(field, "beta_slow", params.get("beta_slow") or 1, 1.0),
        truncate=truncate,
        attention_factor=_number(field, "attention_factor", attention_factor, 1.0),
    )


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _theta(field: str, hf: Mapping[str, Any], params: Mapping[str, Any]) -> float:
    if "rope_theta" in params:
        where, value = f"{field}.rope_theta", params["rope_theta"]
    elif "rope_theta" in hf:
        where, value = "rope_theta", hf["rope_theta"]
    else:
        return DEFAULT_THETA
    if value is None:  # transformers keeps the null and fails; never fall back to 10000 silently
        raise ValueError(f"{where}: expected a number, got null")
    return _number(field, "rope_theta", value, DEFAULT_THETA)


def _number(field: str, key: str, value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{field}.{key}: expected a number, got {value!r}")
    return float(value)


def _required(field: str, params: Mapping[str, Any], key: str, rope_type: str) -> float:
    if params.get(key) is None:
        raise ValueError(f"{field}.{key}: required for rope_type {rope_type!r}")
    return _number(field, key, params[key], 0.0)


def _factor(field: str, params: Mapping[str, Any]) -> float:
    rope_type = params.get("rope_type", params.get("type"))
    factor = _required(field, params, "factor", str(rope_type))
    if factor <= 0:
        raise ValueError(f"{field}.factor: must be positive, got {factor}")
    return factor


def _original_len(
    field: str, hf: Mapping[str, Any], params: Mapping[str, Any], max_position_embeddings: int
) -> int:
    value = hf.get(
        "original_max_position_embeddings", params.get("original_max_position_embeddings")
    )
    if value is None:
        return max_position_embeddings
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(
            f"{field}.original_max_position_embeddings: expected a positive integer, got {value!r}"
        )
    return value
