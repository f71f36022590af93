"""What only some decoder families have in config.json, read as their transformers classes read it.

`family_fields` returns the `HfConfig` fields (hf_config.py) beyond Llama's for one architecture;
each value is what the family's modeling file computes with, and a field that would change the
numbers in a way triollm does not compute is a `ValueError` naming it.

What differs from Llama, by family:
- Qwen3, Qwen3-MoE: RMSNorm of q and k over each head, before RoPE; Qwen3-MoE: routed experts.
- Mixtral: routed experts (top-k renormalised).
- Gemma: GeLU-tanh, RMSNorm scales by (1 + w), embeddings times sqrt(hidden).
- Gemma 2: Gemma's, plus pre and post norms around attention and MLP, softmax scale from
  `query_pre_attn_scalar`, attention and final logit soft-capping, sliding windows on alternate
  layers.
- Gemma 3 (text): Gemma 2's without soft-capping by default, q/k norms, local layers with their
  own RoPE (`rope_local_base_freq` / `rope_parameters.sliding_attention`).
- Phi-3 / Phi-4: q/k/v and gate/up stored fused; partial rotary; LongRoPE.
- OLMo 2: norms after attention and MLP (none before), RMSNorm of the whole q and k projections.
- Granite: embedding, residual, attention and logit multipliers.
- gpt-oss: routed experts with biases and a clamped SwiGLU (`swiglu_alpha`, `swiglu_limit`), a
  router with a bias, attention sinks (models/gpt_oss.py); windows on alternate layers.
- Phi-MoE: LayerNorms and attention with biases, a window on every layer, sparsemixer top-2
  routing (`router_jitter_noise` sets its threshold), `lm_head_bias`, LongRoPE with its own
  short/long mscale and always the short factors (models/phimoe.py).
- Llama 4 (text): chunked local attention and RoPE on the layers `no_rope_layers` marks, NoPE
  layers with attention temperature tuning, weightless q/k L2 norms on the RoPE layers, MoE
  layers (`moe_layers` / `interleave_moe_layer_step`) with sigmoid-scaled expert inputs and a
  shared expert, dense layers of `intermediate_size_mlp` (`Llama4Spec`, models/llama4.py).
- GPT-NeoX, Phi (1, 1.5, 2), StableLM: LayerNorm (`layer_norm_eps`), partial rotary by default
  (NeoX 4.x: `rotary_pct`, `rotary_emb_base`), parallel residuals (`use_parallel_residual`; Phi
  always), their biases (NeoX `attention_bias`, Phi everywhere, StableLM `use_qkv_bias`), q/k
  LayerNorms (`qk_layernorm`: Phi one for every head, StableLM one per head); models/layernorm_decoder.py.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from triollm.engine.loading.rope_config import RopeConfig, parse_rope, partial_rotary_factor

__all__ = ["Llama4Spec", "MoESpec", "family_fields"]


@dataclass(frozen=True)
class MoESpec:
    """Routed experts replacing the MLP in the layers `sparse_layers` marks."""

    num_experts: int
    top_k: int
    intermediate_size: int  # each expert's
    renormalize: bool  # divide the top-k weights by their sum (Mixtral always; Qwen3-MoE: norm_topk_prob)
    sparse_layers: tuple[bool, ...]
    swiglu: tuple[float, float] | None = None  # gpt-oss: (alpha, limit) of its clamped SwiGLU
    # A shared expert every token runs beside the routed ones (Qwen2-MoE: scaled by a sigmoid
    # gate per token; Granite MoE Shared: added as is); 0: none.
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    # DeepSeek-V3-style routing (GLM-4.5): sigmoid scores, a per-expert correction bias added for
    # the choice only, the top `topk_groups` of `groups` expert groups (each scored by its best
    # two), then top-k within them; the chosen scores (renormalised when `renormalize`) times
    # `routed_scaling`. "softmax": the plain top-k of a softmax. "sparsemixer" (Phi-MoE) and
    # "sigmoid_input" (Llama 4: the top-k logits' sigmoids scale the experts' inputs) are run by
    # their families' own blocks (models/phimoe.py, models/llama4.py).
    scoring: str = "softmax"
    groups: int = 1
    topk_groups: int = 1
    routed_scaling: float = 1.0
    # Phi-MoE's sparsemixer ("sparsemixer" scoring): its mask threshold, `router_jitter_noise`.
    jitter_eps: float = 0.0


@dataclass(frozen=True)
class Llama4Spec:
    """What Llama 4's text layers do beyond Llama's (models/llama4.py), per layer where it varies."""

    rope_layers: tuple[bool, ...]  # `no_rope_layers`: 1 rotates q and k, 0 is a NoPE layer
    chunks: tuple[int | None, ...]  # `attention_chunk_size` on 'chunked_attention' layers, else None
    qk_norm: bool  # `use_qk_norm`: weightless RMS (L2) norm of q and k on the RoPE layers
    temperature: tuple[float, float] | None  # (floor_scale, attn_scale) on NoPE layers; None: off
    dense_intermediate_size: int  # `intermediate_size_mlp`: the MLP of the layers without experts


def family_fields(
    arch: str, hf: Mapping[str, Any], *, num_layers: int, head_dim: int, hidden: int, max_pos: int
) -> dict[str, Any]:
    out: dict[str, Any] = {}
    match arch:
        case "Qwen3ForCausalLM":
            out["qk_norm"] = "head"
        case "Qwen3MoeForCausalLM":
            out["qk_norm"] = "head"
            out["moe"] = _qwen3_moe(hf, num_layers)
        case "MixtralForCausalLM":
            out["moe"] = _mixtral(hf, num_layers)
        case "GptOssForCausalLM":
            out["moe"] = MoESpec(
                num_experts=_int(hf, "num_local_experts", 128),
                top_k=_int(hf, "num_experts_per_tok", 4),
                intermediate_size=_int(hf, "intermediate_size", 2880),
                renormalize=True,  # a softmax over the top-k logits
                sparse_layers=(True,) * num_layers,
                swiglu=(_positive(hf, "swiglu_alpha", 1.702), _positive(hf, "swiglu_limit", 7.0)),
            )
        case "PhimoeForCausalLM":
            out |= _phimoe(hf, num_layers, max_pos)
        case "Llama4ForCausalLM":
            out |= _llama4(hf, num_layers, max_pos)
        case "GemmaForCausalLM":
            out |= _gemma(hidden)
        case "Gemma2ForCausalLM":
            out |= _gemma(hidden) | _gemma2(hf, head_dim, softcaps=(50.0, 30.0))
        case "Gemma3ForCausalLM":
            if hf.get("use_bidirectional_attention"):
                raise ValueError(
                    "use_bidirectional_attention: bidirectional Gemma 3 (an embedding model) is not supported"
                )
            out |= _gemma(hidden) | _gemma2(hf, head_dim, softcaps=(None, None))
            out["qk_norm"] = "head"
            out["rope"] = parse_rope(_gemma3_global(hf), max_pos, layer_type="full_attention")
            out["local_rope"] = parse_rope(_gemma3_local(hf), max_pos, layer_type="sliding_attention")
        case "Phi3ForCausalLM":
            out["fused_checkpoint"] = True
            out |= _partial_rope(hf, head_dim, max_pos)
        case "GPTNeoXForCausalLM":
            if hf.get("quantization_config"):
                raise ValueError(
                    "quantization_config: quantized GPTNeoXForCausalLM checkpoints are not supported (their q|k|v "
                    "rows interleave per head); use unquantized weights"
                )
            out |= _layer_norm_family(hf, head_dim, max_pos, _neox_rope(hf), rotary=0.25)
            out["parallel_residual"] = _flag(hf, "use_parallel_residual", True)
        case "PhiForCausalLM":
            if _flag(hf, "tie_word_embeddings", False):
                raise ValueError(
                    "tie_word_embeddings: PhiForCausalLM's lm_head has a bias; a tied head is not supported"
                )
            out |= _layer_norm_family(hf, head_dim, max_pos, hf, rotary=0.5)
            out["parallel_residual"] = True
            out["qkv_bias"] = out["o_proj_bias"] = True
            out["qk_norm"] = "layernorm" if _flag(hf, "qk_layernorm", False) else None
        case "StableLmForCausalLM":
            act = hf.get("hidden_act") or "silu"
            if act not in ("silu", "swish", "gelu_pytorch_tanh", "gelu_new"):
                raise ValueError(
                    f"hidden_act: {act!r} is not supported for StableLmForCausalLM's gated MLP; supported: silu, "
                    "swish, gelu_pytorch_tanh, gelu_new"
                )
            out |= _layer_norm_family(hf, head_dim, max_pos, hf, rotary=0.25)
            out["parallel_residual"] = _flag(hf, "use_parallel_residual", False)
            out["qkv_bias"], out["o_proj_bias"] = _flag(hf, "use_qkv_bias", False), False
            out["qk_norm"] = "layernorm_head" if _flag(hf, "qk_layernorm", False) else None
        case "Olmo2ForCausalLM":
            out["norm_layout"], out["qk_norm"] = "post", "full"
        case "GraniteForCausalLM" | "GraniteMoeForCausalLM" | "GraniteMoeSharedForCausalLM":
            out["embedding_multiplier"] = _positive(hf, "embedding_multiplier", 1.0)
            out["residual_multiplier"] = _positive(hf, "residual_multiplier", 1.0)
            out["attention_scale"] = _positive(hf, "attention_multiplier", 1.0)
            out["logits_divisor"] = _positive(hf, "logits_scaling", 1.0)
            if arch != "GraniteForCausalLM":
                out["moe"] = _granite_moe(hf, num_layers, shared=arch == "GraniteMoeSharedForCausalLM")
        case "Qwen2MoeForCausalLM":
            out["moe"] = _qwen3_moe(hf, num_layers, default_experts=60, default_k=4, shared=True)
            out["qkv_bias"] = _flag(hf, "qkv_bias", True)
        case "Glm4MoeForCausalLM":
            out |= _partial_rope(hf, head_dim, max_pos)
            out["qk_norm"] = "head" if _flag(hf, "use_qk_norm", False) else None
            out["qkv_bias"], out["o_proj_bias"] = _flag(hf, "attention_bias", False), False
            out["moe"] = _glm4_moe(hf, num_layers)
        case "OlmoeForCausalLM":
            if hf.get("clip_qkv") is not None:
                raise ValueError("clip_qkv: clipping q, k and v is not supported for OlmoeForCausalLM")
            out["qk_norm"] = "full"
            out["moe"] = MoESpec(
                num_experts=_int(hf, "num_experts", 64),
                top_k=_int(hf, "num_experts_per_tok", 8),
                intermediate_size=_int(hf, "intermediate_size", 2048),
                renormalize=_flag(hf, "norm_topk_prob", False),
                sparse_layers=(True,) * num_layers,
            )
    return out


def _partial_rope(hf: Mapping[str, Any], head_dim: int, max_pos: int) -> dict[str, Any]:
    """`rope`, and `rotary_dim` where `partial_rotary_factor` rotates only part of each head
    (`int(head_dim * factor)` dims, as transformers counts them)."""
    out: dict[str, Any] = {"rope": parse_rope(hf, max_pos, allow_partial=True)}
    factor = partial_rotary_factor(hf)
    if factor != 1.0:
        rotary = int(head_dim * factor)
        if rotary % 2 or rotary == 0:
            raise ValueError(
                f"partial_rotary_factor: {factor} gives {rotary} rotary dims of {head_dim}; RoPE needs an even number"
            )
        out["rotary_dim"] = rotary
    return out


def _layer_norm_family(
    hf: Mapping[str, Any], head_dim: int, max_pos: int, rope_hf: Mapping[str, Any], *, rotary: float
) -> dict[str, Any]:
    """GPT-NeoX, Phi and StableLM: `layer_norm_eps`, and a partial rotary whose factor defaults to
    `rotary` (the config classes' default) when config.json does not give one."""
    eps = _positive(hf, "layer_norm_eps", 1e-5)
    params = rope_hf.get("rope_parameters") or rope_hf.get("rope_scaling") or {}
    if "partial_rotary_factor" not in rope_hf and not (
        isinstance(params, Mapping) and "partial_rotary_factor" in params
    ):
        rope_hf = {**rope_hf, "partial_rotary_factor": rotary}
    return {"rms_norm_eps": eps, **_partial_rope(rope_hf, head_dim, max_pos)}


def _neox_rope(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """GPT-NeoX's 4.x spelling: `rotary_pct` and `rotary_emb_base` (5.x: `rope_parameters`)."""
    out = dict(hf)
    if "rotary_pct" in hf and "partial_rotary_factor" not in hf:
        out["partial_rotary_factor"] = hf["rotary_pct"]
    if "rotary_emb_base" in hf and "rope_theta" not in hf:
        out["rope_theta"] = hf["rotary_emb_base"]
    return out


def _gemma(hidden: int) -> dict[str, Any]:
    return {"norm_offset": True, "embedding_multiplier": hidden**0.5}


def _gemma2(hf: Mapping[str, Any], head_dim: int, softcaps: tuple[float | None, float | None]) -> dict[str, Any]:
    scalar = _positive(hf, "query_pre_attn_scalar", 256.0)
    return {
        "norm_layout": "sandwich",
        "attention_scale": scalar**-0.5,
        "attn_softcap": _optional_positive(hf, "attn_logit_softcapping", softcaps[0]),
        "final_softcap": _optional_positive(hf, "final_logit_softcapping", softcaps[1]),
    }


def _gemma3_global(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """4.x spelling: `rope_theta` (default 1e6) and `rope_scaling` for the global layers."""
    if isinstance(hf.get("rope_parameters"), Mapping) and "full_attention" in hf["rope_parameters"]:
        return hf
    return {**hf, "rope_theta": hf.get("rope_theta", 1_000_000.0)}


def _gemma3_local(hf: Mapping[str, Any]) -> Mapping[str, Any]:
    """4.x spelling: `rope_local_base_freq` (default 10000), no scaling, for the sliding layers."""
    if isinstance(hf.get("rope_parameters"), Mapping) and "sliding_attention" in hf["rope_parameters"]:
        return hf
    return {"rope_theta": hf.get("rope_local_base_freq", 10_000.0)}


def _qwen3_moe(
    hf: Mapping[str, Any], num_layers: int, *, default_experts: int = 128, default_k: int = 8, shared: bool = False
) -> MoESpec:
    """Qwen3-MoE, and Qwen2-MoE (`shared`: its shared expert with a sigmoid gate)."""
    if hf.get("shared_expert_intermediate_size") and not shared:
        raise ValueError("shared_expert_intermediate_size: shared experts are not supported for Qwen3MoeForCausalLM")
    step = _int(hf, "decoder_sparse_step", 1)
    only_mlp = hf.get("mlp_only_layers") or []
    if not isinstance(only_mlp, list) or not all(isinstance(i, int) for i in only_mlp):
        raise ValueError(f"mlp_only_layers: expected a list of layer indices, got {only_mlp!r}")
    num_experts = (
        _int(hf, "num_local_experts", None) if "num_local_experts" in hf else _int(hf, "num_experts", default_experts)
    )
    sparse = tuple(i not in only_mlp and num_experts > 0 and (i + 1) % step == 0 for i in range(num_layers))
    return MoESpec(
        num_experts=num_experts,
        top_k=_int(hf, "num_experts_per_tok", default_k),
        intermediate_size=_int(hf, "moe_intermediate_size", 768 if not shared else 1408),
        renormalize=_flag(hf, "norm_topk_prob", False),
        sparse_layers=sparse,
        shared_intermediate_size=_int(hf, "shared_expert_intermediate_size", 5632) if shared else 0,
        shared_gate=shared,
    )


def _glm4_moe(hf: Mapping[str, Any], num_layers: int) -> MoESpec:
    experts = _int(hf, "n_routed_experts", 128)
    groups, topk_groups = _int(hf, "n_group", 1), _int(hf, "topk_group", 1)
    if experts % groups or topk_groups > groups:
        raise ValueError(
            f"n_group: {groups} groups (topk_group {topk_groups}) must divide n_routed_experts {experts} and "
            f"topk_group must not exceed n_group"
        )
    if experts // groups < 2:
        raise ValueError(f"n_group: each of the {groups} groups needs at least 2 of the {experts} experts")
    first_dense = _int(hf, "first_k_dense_replace", 1) if hf.get("first_k_dense_replace") != 0 else 0
    return MoESpec(
        num_experts=experts,
        top_k=_int(hf, "num_experts_per_tok", 8),
        intermediate_size=_int(hf, "moe_intermediate_size", 1408),
        renormalize=_flag(hf, "norm_topk_prob", True),
        sparse_layers=tuple(i >= first_dense for i in range(num_layers)),
        shared_intermediate_size=_int(hf, "moe_intermediate_size", 1408) * _int(hf, "n_shared_experts", 1)
        if hf.get("n_shared_experts") != 0
        else 0,
        scoring="sigmoid",
        groups=groups,
        topk_groups=topk_groups,
        routed_scaling=_positive(hf, "routed_scaling_factor", 1.0),
    )


def _phimoe(hf: Mapping[str, Any], num_layers: int, max_pos: int) -> dict[str, Any]:
    """Phi-MoE as `PhimoeConfig` / modeling_phimoe read it (module note). Its LongRoPE: transformers
    always computes the short factors' frequencies (`rope_init_fn(config)` without a length) and
    scales cos and sin by `short_mscale`, or by `long_mscale` once the forward call's longest
    position passes `original_max_position_embeddings`; here the short factors always, and the
    mscale chosen once per engine from max_model_len (rope_config.py's rule for Phi-3)."""
    if (hf.get("hidden_act") or "silu") not in ("silu", "swish"):
        raise ValueError(
            f"hidden_act: {hf.get('hidden_act')!r} is not supported for PhimoeForCausalLM's experts; supported: silu"
        )
    if _int(hf, "num_experts_per_tok", 2) != 2:
        raise ValueError(
            f"num_experts_per_tok: PhimoeForCausalLM's sparsemixer routes every token to exactly 2 experts, got "
            f"{hf.get('num_experts_per_tok')!r}"
        )
    jitter = hf.get("router_jitter_noise", 0.01)
    if isinstance(jitter, bool) or not isinstance(jitter, int | float) or not (math.isfinite(jitter) and jitter >= 0):
        raise ValueError(f"router_jitter_noise: expected a number >= 0, got {jitter!r}")
    head_bias = _flag(hf, "lm_head_bias", False)
    if head_bias and _flag(hf, "tie_word_embeddings", False):
        raise ValueError("lm_head_bias: a biased lm_head tied to the embeddings is not supported")
    experts = _int(hf, "num_local_experts", 16)
    if experts < 2:
        raise ValueError(f"num_local_experts: the sparsemixer picks 2 experts, got {experts}")
    return {
        "rope": _phimoe_rope(hf, max_pos),
        "lm_head_bias": head_bias,
        "moe": MoESpec(
            num_experts=experts,
            top_k=2,
            intermediate_size=_int(hf, "intermediate_size", 6400),
            renormalize=False,
            sparse_layers=(True,) * num_layers,
            scoring="sparsemixer",
            jitter_eps=float(jitter),
        ),
    }


def _phimoe_rope(hf: Mapping[str, Any], max_pos: int) -> RopeConfig:
    rope = parse_rope(_default_theta(hf, 1_000_000.0), max_pos)
    if rope.rope_type != "longrope":
        return rope
    params = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    mscales = []
    for key in ("short_mscale", "long_mscale"):
        value = params.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
            raise ValueError(
                f"rope_parameters.{key}: required for Phi-MoE's longrope, a positive number; got {value!r}"
            )
        mscales.append(float(value))
    return replace(rope, long_factor=rope.short_factor, attention_factor=mscales[0], long_attention_factor=mscales[1])


def _default_theta(hf: Mapping[str, Any], theta: float) -> Mapping[str, Any]:
    """The config class's `default_theta` where config.json gives none (the dict's still wins)."""
    return hf if "rope_theta" in hf else {**hf, "rope_theta": theta}


_LLAMA4_LAYER_TYPES = ("full_attention", "chunked_attention")


def _llama4(hf: Mapping[str, Any], num_layers: int, max_pos: int) -> dict[str, Any]:
    """Llama 4's text decoder as `Llama4TextConfig.__post_init__` fills it in (module note)."""
    if hf.get("quantization_config"):
        raise ValueError(
            "quantization_config: quantized Llama4ForCausalLM checkpoints are not supported (its q and k rows are "
            "reordered at load); use unquantized weights"
        )
    if (hf.get("hidden_act") or "silu") not in ("silu", "swish"):
        raise ValueError(
            f"hidden_act: {hf.get('hidden_act')!r} is not supported for Llama4ForCausalLM; supported: silu"
        )
    rope_layers = hf.get("no_rope_layers") or [
        int((i + 1) % _int(hf, "no_rope_layer_interval", 4) != 0) for i in range(num_layers)
    ]
    if not isinstance(rope_layers, list) or len(rope_layers) < num_layers or any(v not in (0, 1) for v in rope_layers):
        raise ValueError(f"no_rope_layers: expected at least {num_layers} entries of 0 or 1, got {rope_layers!r:.80}")
    chunk = hf.get("attention_chunk_size", 8192)
    if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 1):
        raise ValueError(f"attention_chunk_size: expected an integer >= 1 or null, got {chunk!r}")
    types = hf.get("layer_types") or [
        "chunked_attention" if rope and chunk is not None else "full_attention" for rope in rope_layers[:num_layers]
    ]
    if not isinstance(types, list) or len(types) != num_layers or any(t not in _LLAMA4_LAYER_TYPES for t in types):
        raise ValueError(
            f"layer_types: expected {num_layers} of {', '.join(_LLAMA4_LAYER_TYPES)}, got {types!r:.80}"
        )
    if chunk is None and "chunked_attention" in types:
        raise ValueError("attention_chunk_size: None for 'chunked_attention' layers; allowed: an integer >= 1")
    step = _int(hf, "interleave_moe_layer_step", 1)
    moe_layers = hf.get("moe_layers")
    if moe_layers is None:
        moe_layers = list(range(step - 1, num_layers, step))
    if not isinstance(moe_layers, list) or any(
        isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < num_layers for i in moe_layers
    ):
        raise ValueError(f"moe_layers: expected a list of layer indices in [0, {num_layers}), got {moe_layers!r:.80}")
    experts = _int(hf, "num_local_experts", 16)
    top_k = _int(hf, "num_experts_per_tok", 1)
    if top_k > experts:
        raise ValueError(f"num_experts_per_tok: {top_k} exceeds num_local_experts {experts}")
    tuning = hf.get("attn_temperature_tuning", True)
    if not isinstance(tuning, int | None):  # bool, or the int 4.x wrote (read as truthy)
        raise ValueError(f"attn_temperature_tuning: expected true or false, got {tuning!r}")
    temperature = None
    if tuning:  # null is off, as transformers reads it
        temperature = (_positive(hf, "floor_scale", 8192.0), _finite(hf, "attn_scale", 0.1))
    return {
        "rope": parse_rope(_default_theta(hf, 500_000.0), max_pos),
        "moe": MoESpec(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=_int(hf, "intermediate_size", 8192),
            renormalize=False,
            sparse_layers=tuple(i in moe_layers for i in range(num_layers)),
            shared_intermediate_size=_int(hf, "intermediate_size", 8192),
            scoring="sigmoid_input",
        ),
        "llama4": Llama4Spec(
            rope_layers=tuple(bool(v) for v in rope_layers[:num_layers]),
            chunks=tuple(chunk if t == "chunked_attention" else None for t in types),
            qk_norm=_flag(hf, "use_qk_norm", True),
            temperature=temperature,
            dense_intermediate_size=_int(hf, "intermediate_size_mlp", 16384),
        ),
    }


def _finite(hf: Mapping[str, Any], key: str, default: float) -> float:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a number, got {value!r}")
    return float(value)


def _granite_moe(hf: Mapping[str, Any], num_layers: int, *, shared: bool) -> MoESpec:
    """Granite MoE: top-k of the router's logits, softmaxed (the same weights as a softmax over
    all renormalised); Granite MoE Shared adds a shared MLP to every layer."""
    return MoESpec(
        num_experts=_int(hf, "num_local_experts", 8),
        top_k=_int(hf, "num_experts_per_tok", 2),
        intermediate_size=_int(hf, "intermediate_size", 1024),
        renormalize=True,
        sparse_layers=(True,) * num_layers,
        shared_intermediate_size=_int(hf, "shared_intermediate_size", 1024) if shared else 0,
    )


def _mixtral(hf: Mapping[str, Any], num_layers: int) -> MoESpec:
    num_experts = _int(hf, "num_local_experts", 8) if "num_local_experts" in hf else _int(hf, "num_experts", 8)
    return MoESpec(
        num_experts=num_experts,
        top_k=_int(hf, "num_experts_per_tok", 2),
        intermediate_size=_int(hf, "intermediate_size", 14336),
        renormalize=True,
        sparse_layers=(True,) * num_layers,
    )


def _int(hf: Mapping[str, Any], key: str, default: int | None) -> int:
    value = hf.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{key}: expected an integer >= 1, got {value!r}")
    return value


def _flag(hf: Mapping[str, Any], key: str, default: bool) -> bool:
    value = hf.get(key, default)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise ValueError(f"{key}: expected true or false, got {value!r}")
    return value


def _positive(hf: Mapping[str, Any], key: str, default: float) -> float:
    value = hf.get(key, default)
    if value is None:
        value = default
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{key}: expected a positive number, got {value!r}")
    return float(value)


def _optional_positive(hf: Mapping[str, Any], key: str, default: float | None) -> float | None:
    if key in hf and hf[key] is None:
        return None
    if key not in hf and default is None:
        return None
    return _positive(hf, key, default or 0.0)
