"""config.json of the DeepSeek V2 / V3 family: multi-head latent attention (MLA) and routed experts.

Read as transformers 5.25's `DeepseekV2Config` / `DeepseekV3Config` and their modeling files read
it. What the engine computes from it (engine/execution/models/deepseek.py) is the absorbed form of
MLA, whose cache per token and layer is one vector: the normalised latent `c_kv`
(`kv_lora_rank` wide) and the rotated shared key `k_pe` (`qk_rope_head_dim`). So the parsed
`HfConfig` says one KV head of `head_dim = kv_lora_rank + qk_rope_head_dim` (576 for V2 and V3),
and the KV cache is allocated from it as for any other model; `MLASpec` holds the rest.

Honoured: `q_lora_rank` (None: a plain `q_proj`, V2-Lite), `kv_lora_rank`, `qk_nope_head_dim`,
`qk_rope_head_dim`, `v_head_dim` (may differ from `qk_nope_head_dim`), `attention_bias` (on
`q_a_proj`, `kv_a_proj_with_mqa` and `o_proj`, as transformers puts it), `mlp_bias` (V2's dense and
shared MLPs), `rope_interleave` (V3; V2 always interleaves), RoPE of any supported type over the
rotary dims with YaRN's `mscale_all_dim` folded into the softmax scale (transformers'
`yarn_apply_mscale`: qk_head_dim^-0.5 * mscale^2), and the experts: V2's softmax scores with
`topk_method` "greedy" or "group_limited_greedy" (each group scored by its best expert), V3's
sigmoid scores with `e_score_correction_bias` (hf_families.MoESpec, GLM-4.5's routing), `n_group`,
`topk_group`, `norm_topk_prob` (V3), `routed_scaling_factor`, `n_shared_experts`,
`first_k_dense_replace`. Multi-token-prediction layers (`num_nextn_predict_layers`) are skipped.

Refused, naming the field: what transformers 5.25 ignores but the checkpoint's own code honours
(`moe_layer_freq` other than 1, V2's `norm_topk_prob` true), a `scoring_func` or `topk_method`
other than the family's, `num_key_value_heads` other than `num_attention_heads` (transformers
cannot run it), activations other than SiLU (the experts' SwiGLU), a partial rotary factor, and
quantized checkpoints (`quantization_config`: the FP8 releases; not tested here).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triollm.engine.loading.config_checks import MISSING
from triollm.engine.loading.config_checks import read_bool as _bool
from triollm.engine.loading.config_checks import read_eps as _eps
from triollm.engine.loading.config_checks import read_int as _int
from triollm.engine.loading.hf_families import MoESpec
from triollm.engine.loading.rope_config import parse_rope

__all__ = ["DEEPSEEK_ARCHITECTURES", "MLASpec", "parse_deepseek"]

DEEPSEEK_ARCHITECTURES = {"DeepseekV2ForCausalLM": "deepseek_v2", "DeepseekV3ForCausalLM": "deepseek_v3"}
_V2_TOPK_METHODS = ("greedy", "group_limited_greedy")


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention's sizes (module note). The cache holds `kv_lora_rank +
    qk_rope_head_dim` per token and layer (`HfConfig.head_dim`)."""

    q_lora_rank: int | None  # None: q_proj straight from the hidden state
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool  # the rotary dims pair (0, 1), (2, 3), ... rather than (i, i + d/2)
    softmax_scale: float  # qk_head_dim^-0.5, times YaRN's mscale^2 where the rope says so


def parse_deepseek(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """`HfConfig`'s fields (but `architecture` and `checkpoint_dtype`) from a DeepSeek V2 / V3
    config.json (module note); a `ValueError` naming the field."""
    v3 = arch == "DeepseekV3ForCausalLM"
    if hf.get("quantization_config"):
        raise ValueError(f"quantization_config: quantized checkpoints of {arch} are not supported; use bf16 weights")
    act = hf.get("hidden_act") or "silu"
    if act not in ("silu", "swish"):
        raise ValueError(f"hidden_act: {act!r} is not supported for {arch}; supported: silu")
    hidden = _int(hf, "hidden_size", 7168 if v3 else 4096)
    num_heads = _int(hf, "num_attention_heads", 128 if v3 else 32)
    num_layers = _int(hf, "num_hidden_layers", 61 if v3 else 32)
    kv_heads = hf.get("num_key_value_heads")
    if kv_heads is not None and kv_heads != num_heads:
        raise ValueError(
            f"num_key_value_heads: {kv_heads!r}; multi-head latent attention expands the latent to every head, "
            f"allowed: {num_heads} (num_attention_heads) or null"
        )
    q_lora = hf.get("q_lora_rank", 1536)
    if q_lora is not None:
        q_lora = _int(hf, "q_lora_rank")
    nope, rope_dim = _int(hf, "qk_nope_head_dim", 128), _int(hf, "qk_rope_head_dim", 64)
    kv_lora, v_dim = _int(hf, "kv_lora_rank", 512), _int(hf, "v_head_dim", 128)
    if rope_dim % 2:
        raise ValueError(f"qk_rope_head_dim: RoPE needs an even number of dims, got {rope_dim}")
    max_pos = _int(hf, "max_position_embeddings", 4096 if v3 else 2048)
    rope = parse_rope(hf, max_pos)
    mla = MLASpec(
        q_lora_rank=q_lora,
        kv_lora_rank=kv_lora,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=v_dim,
        rope_interleave=_bool(hf, "rope_interleave", True) if v3 else True,
        softmax_scale=(nope + rope_dim) ** -0.5 * _mscale_squared(hf),
    )
    bias = _bool(hf, "attention_bias", False)
    return {
        "hidden_size": hidden,
        "intermediate_size": _int(hf, "intermediate_size", 18432 if v3 else 11008),
        "num_layers": num_layers,
        "num_heads": num_heads,
        "num_kv_heads": 1,  # the latent: one vector per token, shared by every head
        "head_dim": kv_lora + rope_dim,
        "vocab_size": _int(hf, "vocab_size", 129280 if v3 else 102400),
        "rms_norm_eps": _eps(hf, 1e-6),
        "rope": rope,
        "max_position_embeddings": max_pos,
        "tie_word_embeddings": _bool(hf, "tie_word_embeddings", False),
        "qkv_bias": bias,
        "o_proj_bias": bias,
        "mlp_bias": False if v3 else _bool(hf, "mlp_bias", False),
        "sliding_window": None,
        "encoder": None,
        "rotary_dim": rope_dim,
        "attention_scale": mla.softmax_scale,
        "moe": _v3_moe(hf, num_layers) if v3 else _v2_moe(hf, num_layers),
        "mla": mla,
    }


def _mscale_squared(hf: Mapping[str, Any]) -> float:
    """transformers' `yarn_apply_mscale`: with a RoPE type other than default and a
    `mscale_all_dim`, the softmax scale times (0.1 * mscale_all_dim * ln(factor) + 1)^2."""
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}  # parse_rope's precedence
    if not isinstance(params, Mapping) or (params.get("rope_type", params.get("type")) or "default") == "default":
        return 1.0
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError("partial_rotary_factor: not supported for multi-head latent attention (only 1.0)")
    all_dim = params.get("mscale_all_dim") or 0
    if not all_dim:
        return 1.0
    factor = params.get("factor")
    if isinstance(factor, bool) or not isinstance(factor, int | float) or not isinstance(all_dim, int | float):
        raise ValueError(f"rope_parameters.mscale_all_dim: needs a numeric factor, got {factor!r} and {all_dim!r}")
    mscale = 1.0 if factor <= 1 else 0.1 * all_dim * math.log(factor) + 1.0
    return mscale * mscale


def _common_moe(hf: Mapping[str, Any], arch: str) -> None:
    freq = hf.get("moe_layer_freq", 1)
    if freq != 1:
        raise ValueError(
            f"moe_layer_freq: {freq!r}; transformers puts experts in every layer from first_k_dense_replace on, "
            f"allowed: 1"
        )
    scoring = hf.get("scoring_func")
    expected = "sigmoid" if arch == "v3" else "softmax"
    if scoring is not None and scoring != expected:
        raise ValueError(f"scoring_func: {scoring!r}; DeepSeek {arch.upper()}'s router scores by {expected}")


def _groups(hf: Mapping[str, Any], experts: int, default: tuple[Any, Any]) -> tuple[int, int]:
    """`n_group` and `topk_group` (transformers fails on a null one: refused here)."""
    groups = _int(hf, "n_group", default[0])
    topk_groups = _int(hf, "topk_group", default[1])
    if experts % groups or topk_groups > groups:
        raise ValueError(
            f"n_group: {groups} groups (topk_group {topk_groups}) must divide n_routed_experts {experts}, and "
            f"topk_group must not exceed n_group"
        )
    return groups, topk_groups


def _v2_moe(hf: Mapping[str, Any], num_layers: int) -> MoESpec:
    """V2: softmax scores, top-k (greedy) or top-k within the best `topk_group` groups, each scored
    by its best expert (group_limited_greedy); the chosen probabilities times the routed scaling,
    never renormalised (transformers' `DeepseekV2TopkRouter`)."""
    _common_moe(hf, "v2")
    method = hf.get("topk_method") or "greedy"
    if method not in _V2_TOPK_METHODS:
        raise ValueError(f"topk_method: {method!r} is not supported for DeepSeek V2; supported: greedy, "
                         f"group_limited_greedy")  # fmt: skip
    if _bool(hf, "norm_topk_prob", False):
        raise ValueError(
            "norm_topk_prob: true; transformers' DeepSeek V2 router never renormalises (the checkpoint's own code "
            "would), allowed: false"
        )
    experts = _int(hf, "n_routed_experts", 64)
    # greedy is the group-limited choice with one group (the mask keeps every expert).
    groups, topk_groups = _groups(hf, experts, (MISSING, MISSING)) if method == "group_limited_greedy" else (1, 1)
    return _spec(hf, num_layers, experts, groups, topk_groups, scoring="softmax", renormalize=False, v3=False)


def _v3_moe(hf: Mapping[str, Any], num_layers: int) -> MoESpec:
    """V3: GLM-4.5's routing (layers/moe.py `route_grouped`)."""
    _common_moe(hf, "v3")
    method = hf.get("topk_method")
    if method not in (None, "noaux_tc"):
        raise ValueError(f"topk_method: {method!r}; DeepSeek V3 routes by noaux_tc (a correction bias)")
    experts = _int(hf, "n_routed_experts", 256)
    groups, topk_groups = _groups(hf, experts, (8, 4))
    if experts // groups < 2:
        raise ValueError(f"n_group: each of the {groups} groups needs at least 2 of the {experts} experts")
    renormalize = _bool(hf, "norm_topk_prob", True)
    return _spec(hf, num_layers, experts, groups, topk_groups, scoring="sigmoid", renormalize=renormalize, v3=True)


def _spec(
    hf: Mapping[str, Any],
    num_layers: int,
    experts: int,
    groups: int,
    topk_groups: int,
    *,
    scoring: str,
    renormalize: bool,
    v3: bool,
) -> MoESpec:
    top_k = _int(hf, "num_experts_per_tok", 8 if v3 else None)
    if top_k > experts // groups * topk_groups:
        raise ValueError(
            f"num_experts_per_tok: {top_k} exceeds the {experts // groups * topk_groups} experts of the "
            f"{topk_groups} groups a token may use"
        )
    first_dense = _int(hf, "first_k_dense_replace", 3 if v3 else 0, minimum=0)
    inter = _int(hf, "moe_intermediate_size", 2048 if v3 else 1407)
    shared = _int(hf, "n_shared_experts", 1 if v3 else 2, minimum=0)
    scaling = hf.get("routed_scaling_factor", 2.5 if v3 else 1.0)
    if (
        isinstance(scaling, bool)
        or not isinstance(scaling, int | float)
        or not (math.isfinite(scaling) and scaling > 0)
    ):
        raise ValueError(f"routed_scaling_factor: expected a positive number, got {scaling!r}")
    return MoESpec(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=inter,
        renormalize=renormalize,
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        shared_intermediate_size=inter * shared,
        scoring=scoring,
        groups=groups,
        topk_groups=topk_groups,
        routed_scaling=float(scaling),
    )
