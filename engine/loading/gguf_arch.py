"""What each GGUF `general.architecture` is in Hugging Face terms: one table per architecture.

llama.cpp's converter (convert_hf_to_gguf.py) writes every family with the same vocabulary of
metadata keys (`{arch}.embedding_length`, `{arch}.attention.head_count`, ...) and tensor names
(`blk.N.attn_q.weight`, ...); the families differ in a few keys, a few tensor names, and two
layout changes made while converting:

* Q/K rows permuted so each head's rotary pairs are interleaved (`LlamaModel.permute`), for the
  classes derived from its LlamaModel only (llama, Mistral, Mixtral, Granite): `permuted_qk`.
* Gemma's RMSNorm weights stored as `w + 1` (Gemma's norm computes with (1 + w)): `norm_plus_one`.

An `ArchSpec` lists those differences; `hf_config` reads the metadata into a config.json dict the
way llama.cpp's runtime reads it, including what llama.cpp fixes rather than reads: Gemma 2/3's
softmax scale (1/sqrt(head_dim), or 1/sqrt(hidden/heads) for the 27B models), their sliding-window
layer patterns (every 2nd / every 6th layer global), top-k renormalisation in the MoE families,
and Phi-3's window (llama.cpp runs Phi-3 without one). A key the importer cannot express is a
`ValueError` naming it. Rejected: one importer class per family (most of each would be the shared
part, copied).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGUFReader

__all__ = ["ARCHS", "ArchSpec", "GGUFMeta", "f32", "hf_config", "llama3_rope_factors", "llama3_rope_scaling"]

# `blk.N.<name>` -> HF `model.layers.N.<name>`, shared by every architecture (an ArchSpec's
# `tensors` overrides or extends it). `{e}` in an expert name is the expert index.
LAYER_TENSORS = {
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "attn_q.bias": "self_attn.q_proj.bias",
    "attn_k.bias": "self_attn.k_proj.bias",
    "attn_v.bias": "self_attn.v_proj.bias",
    "attn_output.bias": "self_attn.o_proj.bias",
    "attn_q_norm.weight": "self_attn.q_norm.weight",
    "attn_k_norm.weight": "self_attn.k_norm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "ffn_gate_inp.weight": "mlp.gate.weight",
    "ffn_gate_exps.weight": "mlp.experts.{e}.gate_proj.weight",
    "ffn_up_exps.weight": "mlp.experts.{e}.up_proj.weight",
    "ffn_down_exps.weight": "mlp.experts.{e}.down_proj.weight",
}
GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
# Tensors that carry configuration, read into config.json and not written as weights.
CONFIG_TENSORS = frozenset({"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"})

# `{arch}.<key>` -> HF field, shared by every architecture.
COMMON_KEYS = {
    "context_length": "max_position_embeddings",
    "embedding_length": "hidden_size",
    "feed_forward_length": "intermediate_size",
    "block_count": "num_hidden_layers",
    "attention.head_count": "num_attention_heads",
    "attention.head_count_kv": "num_key_value_heads",
    "attention.key_length": "head_dim",
    "rope.freq_base": "rope_theta",
    "attention.layer_norm_rms_epsilon": "rms_norm_eps",
}
_REQUIRED = ("embedding_length", "feed_forward_length", "block_count", "attention.head_count")

_SANDWICH_NORMS = {
    "ffn_norm.weight": "pre_feedforward_layernorm.weight",
    "post_attention_norm.weight": "post_attention_layernorm.weight",
    "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
}
_GEMMA_ACT = {"hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh"}
_EXPERT_KEYS = {"expert_used_count": "num_experts_per_tok"}


@dataclass(frozen=True)
class ArchSpec:
    """One GGUF architecture: its HF class and what differs from the shared tables."""

    architecture: str  # HF `architectures[0]`
    model_type: str
    permuted_qk: bool = False  # Q/K rows interleaved by the converter (LlamaModel.permute)
    norm_plus_one: bool = False  # norm weights stored as w + 1
    tensors: Mapping[str, str] = field(default_factory=dict)  # layer tensor names beyond LAYER_TENSORS
    keys: Mapping[str, str] = field(default_factory=dict)  # metadata keys beyond COMMON_KEYS
    fixed: Mapping[str, Any] = field(default_factory=dict)  # HF fields llama.cpp fixes, not reads
    swa_pattern: int = 0  # llama.cpp's default: every n-th layer global (0: no windows)
    # The model reorders q/k rows from rotary pairs to halves as it loads dense weights (Llama 4,
    # models/llama4.py): the kept blocks are written in that order, since blocks load as they are.
    paired_qk: bool = False


_GRANITE_KEYS = {
    "attention.scale": "attention_multiplier",
    "embedding_scale": "embedding_multiplier",
    "residual_scale": "residual_multiplier",
    "logit_scale": "logits_scaling",
}
_GRANITE_FIXED = {"mlp_bias": False, "embedding_multiplier": 1.0, "residual_multiplier": 1.0}

# DeepSeek V3's routed experts (GLM-4.5's too): sigmoid scores with a correction bias, groups,
# a scale and renormalisation, shared experts, leading dense layers.
_GROUPED_EXPERT_TENSORS = {
    "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
    "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
    "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
    "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
}
_GROUPED_EXPERT_KEYS = {
    "expert_count": "n_routed_experts",
    "expert_feed_forward_length": "moe_intermediate_size",
    "expert_shared_count": "n_shared_experts",
    "leading_dense_block_count": "first_k_dense_replace",
    "expert_weights_scale": "routed_scaling_factor",
    "expert_weights_norm": "norm_topk_prob",
    "expert_group_count": "n_group",
    "expert_group_used_count": "topk_group",
}

ARCHS: dict[str, ArchSpec] = {
    "llama": ArchSpec("LlamaForCausalLM", "llama", permuted_qk=True, fixed={"mlp_bias": False}),
    "qwen2": ArchSpec("Qwen2ForCausalLM", "qwen2", fixed={"use_sliding_window": False}),
    "qwen3": ArchSpec("Qwen3ForCausalLM", "qwen3", fixed={"use_sliding_window": False, "attention_bias": False}),
    "qwen3moe": ArchSpec(
        "Qwen3MoeForCausalLM",
        "qwen3_moe",
        keys={
            "expert_count": "num_experts",
            "expert_feed_forward_length": "moe_intermediate_size",
            **_EXPERT_KEYS,
        },
        fixed={"use_sliding_window": False, "attention_bias": False, "norm_topk_prob": True, "decoder_sparse_step": 1},
    ),
    # Qwen1.5-MoE / Qwen2-MoE: routed experts (top-k not renormalised) plus one shared expert
    # behind a sigmoid gate (`ffn_gate_inp_shexp`, one row).
    "qwen2moe": ArchSpec(
        "Qwen2MoeForCausalLM",
        "qwen2_moe",
        tensors={
            "ffn_gate_inp_shexp.weight": "mlp.shared_expert_gate.weight",
            "ffn_gate_shexp.weight": "mlp.shared_expert.gate_proj.weight",
            "ffn_up_shexp.weight": "mlp.shared_expert.up_proj.weight",
            "ffn_down_shexp.weight": "mlp.shared_expert.down_proj.weight",
        },
        keys={
            "expert_count": "num_experts",
            "expert_feed_forward_length": "moe_intermediate_size",
            "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
            **_EXPERT_KEYS,
        },
        fixed={"use_sliding_window": False, "norm_topk_prob": False, "decoder_sparse_step": 1},
    ),
    # gpt-oss: biased q/k/v/o and router, a learned sink per head, windows on even layers, experts
    # (MXFP4 in the released files) whose gate and up gguf_import interleaves back into
    # transformers' `gate_up_proj` [E, H, 2I]; YaRN without truncation, as its config says.
    "gpt-oss": ArchSpec(
        "GptOssForCausalLM",
        "gpt_oss",
        tensors={
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "attn_sinks.weight": "self_attn.sinks",
            "ffn_gate_inp.weight": "mlp.router.weight",
            "ffn_gate_inp.bias": "mlp.router.bias",
            **{f"ffn_{p}_exps.{kind}": f"mlp.experts.{p}_proj{suffix}"
               for p in ("gate", "up", "down") for kind, suffix in (("weight", ""), ("bias", "_bias"))},
        },
        keys={
            "expert_count": "num_local_experts",
            "expert_feed_forward_length": "intermediate_size",
            "attention.sliding_window": "sliding_window",
            **_EXPERT_KEYS,
        },
        fixed={"attention_bias": True, "swiglu_limit": 7.0, "sliding_window": 128},
        swa_pattern=2,
    ),
    # OLMoE: OLMo's full-width q/k norms, routed experts (top-k not renormalised, as llama.cpp)
    "olmoe": ArchSpec(
        "OlmoeForCausalLM",
        "olmoe",
        keys={"expert_count": "num_experts", **_EXPERT_KEYS},
        fixed={"norm_topk_prob": False, "clip_qkv": None, "attention_bias": False},
    ),
    "gemma": ArchSpec("GemmaForCausalLM", "gemma", norm_plus_one=True, fixed=_GEMMA_ACT),
    "gemma2": ArchSpec(
        "Gemma2ForCausalLM",
        "gemma2",
        norm_plus_one=True,
        tensors=_SANDWICH_NORMS,
        keys={
            "attn_logit_softcapping": "attn_logit_softcapping",
            "final_logit_softcapping": "final_logit_softcapping",
            "attention.sliding_window": "sliding_window",
        },
        fixed={**_GEMMA_ACT, "attn_logit_softcapping": 50.0, "final_logit_softcapping": 30.0, "sliding_window": 4096},
        swa_pattern=2,
    ),
    "gemma3": ArchSpec(
        "Gemma3ForCausalLM",
        "gemma3_text",
        norm_plus_one=True,
        tensors=_SANDWICH_NORMS,
        keys={
            "final_logit_softcapping": "final_logit_softcapping",
            "attention.sliding_window": "sliding_window",
            "rope.freq_base_swa": "rope_local_base_freq",
        },
        fixed={**_GEMMA_ACT, "attn_logit_softcapping": None, "final_logit_softcapping": None,
               "rope_local_base_freq": 10000.0},
        swa_pattern=6,
    ),
    "phi3": ArchSpec(
        "Phi3ForCausalLM",
        "phi3",
        tensors={"attn_qkv.weight": "self_attn.qkv_proj.weight", "ffn_up.weight": "mlp.gate_up_proj.weight"},
        keys={"rope.scaling.original_context_length": "original_max_position_embeddings"},
        fixed={"sliding_window": None},  # llama.cpp runs Phi-3 without its window
    ),
    "olmo2": ArchSpec(
        "Olmo2ForCausalLM",
        "olmo2",
        tensors={
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
        },
        fixed={"attention_bias": False},
    ),
    "granite": ArchSpec("GraniteForCausalLM", "granite", permuted_qk=True, keys=_GRANITE_KEYS, fixed=_GRANITE_FIXED),
    # Granite MoE (and GraniteMoeShared where the file has a shared MLP): Granite's multipliers, its
    # experts' gate and up joined back into `input_linear` by gguf_import, as transformers stores them.
    "granitemoe": ArchSpec(
        "GraniteMoeForCausalLM",
        "granitemoe",
        permuted_qk=True,
        tensors={
            "ffn_gate_inp.weight": "block_sparse_moe.router.layer.weight",
            "ffn_gate_exps.weight": "block_sparse_moe.gate_exps",
            "ffn_up_exps.weight": "block_sparse_moe.up_exps",
            "ffn_down_exps.weight": "block_sparse_moe.output_linear.weight",
            "ffn_gate_shexp.weight": "shared_mlp.gate",
            "ffn_up_shexp.weight": "shared_mlp.up",
            "ffn_down_shexp.weight": "shared_mlp.output_linear.weight",
        },
        keys={
            **_GRANITE_KEYS,
            "expert_count": "num_local_experts",
            "expert_shared_feed_forward_length": "shared_intermediate_size",
            **_EXPERT_KEYS,
        },
        fixed=_GRANITE_FIXED,
    ),
    # GLM-4.5 / 4.6 (Glm4Moe): partial rotary, optional q/k norms, leading dense layers, sigmoid-scored
    # experts with a correction bias and groups, shared experts; the converter's multi-token-prediction
    # layers (`nextn_predict_layers`, after the model's own) are left out.
    "glm4moe": ArchSpec(
        "Glm4MoeForCausalLM",
        "glm4_moe",
        tensors={
            "post_attention_norm.weight": "post_attention_layernorm.weight",
            **_GROUPED_EXPERT_TENSORS,
        },
        keys={
            **_GROUPED_EXPERT_KEYS,
            "nextn_predict_layers": "num_nextn_predict_layers",
            **_EXPERT_KEYS,
        },
        fixed={"n_group": 1, "topk_group": 1, "norm_topk_prob": True, "routed_scaling_factor": 1.0},
    ),
    # DeepSeek V2 / V3 (and their kin written as deepseek2: Kimi K2, GigaChat 3, ...): multi-head
    # latent attention, whose `kv_b_proj` the converter split into `attn_k_b` (transposed) and
    # `attn_v_b` for llama.cpp's absorbed form (older files keep `attn_kv_b`); q straight or through
    # a low-rank `q_a`/`q_b`; leading dense layers, routed experts scored by softmax (V2) or by
    # sigmoid with a correction bias and groups (V3, `expert_gating_func` 2), shared experts.
    "deepseek2": ArchSpec(
        "DeepseekV3ForCausalLM",
        "deepseek_v3",
        tensors={
            "attn_q.weight": "self_attn.q_proj.weight",
            "attn_q_a.weight": "self_attn.q_a_proj.weight",
            "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
            "attn_q_b.weight": "self_attn.q_b_proj.weight",
            "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
            "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
            "attn_kv_b.weight": "self_attn.kv_b_proj.weight",
            "attn_k_b.weight": "self_attn.k_b",
            "attn_v_b.weight": "self_attn.v_b",
            **_GROUPED_EXPERT_TENSORS,
        },
        keys={
            "attention.kv_lora_rank": "kv_lora_rank",
            "attention.q_lora_rank": "q_lora_rank",
            **_GROUPED_EXPERT_KEYS,
            **_EXPERT_KEYS,
        },
        fixed={"n_group": 1, "topk_group": 1, "norm_topk_prob": False, "routed_scaling_factor": 1.0,
               "n_shared_experts": 0, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0},
    ),
    # Llama 4 (text; Scout, Maverick): no Q/K permutation (transformers' rotary pairs are llama.cpp's),
    # experts on every `interleave_moe_layer_step`-th layer (gate and up joined back into
    # `gate_up_proj` [E, H, 2I], down transposed) beside a shared expert, dense MLPs of
    # `feed_forward_length` between; what llama.cpp fixes: 8192-token chunks on three of four layers,
    # the fourth global without rotary and with temperature tuning, q/k L2 norms but for 128 experts.
    "llama4": ArchSpec(
        "Llama4ForCausalLM",
        "llama4_text",
        paired_qk=True,
        tensors={
            "ffn_gate_inp.weight": "feed_forward.router.weight",
            "ffn_gate_exps.weight": "feed_forward.experts.gate_exps",
            "ffn_up_exps.weight": "feed_forward.experts.up_exps",
            "ffn_down_exps.weight": "feed_forward.experts.down_proj",
            "ffn_gate_shexp.weight": "feed_forward.shared_expert.gate_proj.weight",
            "ffn_up_shexp.weight": "feed_forward.shared_expert.up_proj.weight",
            "ffn_down_shexp.weight": "feed_forward.shared_expert.down_proj.weight",
            "ffn_gate.weight": "feed_forward.gate_proj.weight",
            "ffn_up.weight": "feed_forward.up_proj.weight",
            "ffn_down.weight": "feed_forward.down_proj.weight",
        },
        keys={
            "feed_forward_length": "intermediate_size_mlp",
            "expert_feed_forward_length": "intermediate_size",
            "expert_count": "num_local_experts",
            "interleave_moe_layer_step": "interleave_moe_layer_step",
            **_EXPERT_KEYS,
        },
        fixed={"interleave_moe_layer_step": 1, "attention_chunk_size": 8192, "attn_temperature_tuning": True,
               "floor_scale": 8192, "attn_scale": 0.1, "rope_theta": 500000.0},
        swa_pattern=4,
    ),
}
# A `llama` GGUF with experts is Mixtral: Mixtral's checkpoint names for the sparse block.
MIXTRAL = ArchSpec(
    "MixtralForCausalLM",
    "mixtral",
    permuted_qk=True,
    tensors={
        "ffn_gate_inp.weight": "block_sparse_moe.gate.weight",
        "ffn_gate_exps.weight": "block_sparse_moe.experts.{e}.w1.weight",
        "ffn_up_exps.weight": "block_sparse_moe.experts.{e}.w3.weight",
        "ffn_down_exps.weight": "block_sparse_moe.experts.{e}.w2.weight",
    },
    keys={"expert_count": "num_local_experts", **_EXPERT_KEYS},
    fixed={"sliding_window": None},
)


class GGUFMeta:
    """Typed access to a GGUF's key/value metadata."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._reader = reader
        self.path = path

    def get(self, key: str, default: Any = None) -> Any:
        field_ = self._reader.fields.get(key)
        return default if field_ is None else field_.contents()

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ValueError(f"gguf: {self.path} lacks the metadata key {key!r}")
        return value


def has_table(meta: GGUFMeta) -> bool:
    """Whether the file's architecture has a table here (else gguf_import hands it to transformers)."""
    return str(meta.require("general.architecture")) in ARCHS


def arch_spec(meta: GGUFMeta) -> tuple[str, ArchSpec]:
    """(the GGUF architecture name, its table); a ValueError naming the supported ones."""
    arch = str(meta.require("general.architecture"))
    if arch == "llama" and int(meta.get("llama.expert_count", 0) or 0) > 0:
        return arch, MIXTRAL
    if arch not in ARCHS:
        raise ValueError(
            f"gguf: general.architecture {arch!r} of {meta.path} is not supported; supported: {', '.join(ARCHS)}"
        )
    return arch, ARCHS[arch]


def f32(value: float) -> float:
    """A float32 metadata value as its shortest decimal (9.999999747378752e-06 -> 1e-05)."""
    return float(str(np.float32(value)))


def hf_config(
    meta: GGUFMeta,
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
) -> tuple[dict[str, Any], ArchSpec]:
    """config.json for the GGUF: `shapes` are the tensors' numpy shapes by GGUF name, `read`
    dequantizes one (for the tensors that carry configuration: rope factors)."""
    arch, spec = arch_spec(meta)
    for key in _REQUIRED:
        meta.require(f"{arch}.{key}")
    if "token_embd.weight" not in shapes:
        raise ValueError(f"gguf: {meta.path} has no token_embd.weight tensor")
    config: dict[str, Any] = {
        "architectures": [spec.architecture],
        "model_type": spec.model_type,
        "hidden_act": "silu",
        "rope_theta": 10000.0,  # llama.cpp's default
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 2048,
        **spec.fixed,
    }
    for key, name in {**COMMON_KEYS, **spec.keys}.items():
        value = meta.get(f"{arch}.{key}")
        if value is not None:
            config[name] = f32(value) if isinstance(value, float) else int(value)
    if spec.model_type == "glm4_moe":  # the MTP layers are not run: the model's own layers only
        config["num_hidden_layers"] -= config.get("num_nextn_predict_layers", 0)
        config["num_nextn_predict_layers"] = 0
        config["norm_topk_prob"] = bool(config["norm_topk_prob"])
        config["use_qk_norm"] = "blk.0.attn_q_norm.weight" in shapes
    if spec.model_type == "deepseek_v3":
        _latent_attention(meta, arch, config, shapes)
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    config.setdefault("num_key_value_heads", heads)
    head_dim = config.setdefault("head_dim", hidden // heads)
    num_layers = config["num_hidden_layers"]
    config |= {
        "vocab_size": shapes["token_embd.weight"][0],
        "tie_word_embeddings": "output.weight" not in shapes,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "torch_dtype": "float32",
    }
    if spec.model_type == "qwen2_moe":
        config["qkv_bias"] = "blk.0.attn_q.bias" in shapes
    elif spec.model_type not in ("qwen2", "gemma2", "gemma3_text", "phi3"):
        config.setdefault("attention_bias", "blk.0.attn_q.bias" in shapes)
    if meta.get("tokenizer.ggml.padding_token_id") is not None:
        config["pad_token_id"] = meta.get("tokenizer.ggml.padding_token_id")
    _rotary(meta, arch, spec, config, shapes, read)
    _family(meta, arch, spec, config, shapes, num_layers, head_dim)
    return config, spec


def _latent_attention(meta: GGUFMeta, arch: str, config: dict[str, Any], shapes: Mapping[str, tuple[int, ...]]) -> None:
    """DeepSeek's config in transformers' terms. The converter writes the sizes of llama.cpp's
    absorbed form (one KV head of `kv_lora_rank + qk_rope_head_dim`, `key_length_mla` and
    `value_length_mla` per head; files from before that form have the per-head sizes in
    `key_length`/`value_length`), and the router's scoring as `expert_gating_func` (1 or absent:
    softmax, V2; 2: sigmoid with the correction bias, V3)."""
    rope = int(meta.require(f"{arch}.rope.dimension_count"))
    key_mla = meta.get(f"{arch}.attention.key_length_mla")
    value_mla = meta.get(f"{arch}.attention.value_length_mla")
    if key_mla is None:
        key_mla = meta.require(f"{arch}.attention.key_length")
        value_mla = meta.require(f"{arch}.attention.value_length")
    meta.require(f"{arch}.attention.kv_lora_rank")
    config |= {
        "qk_rope_head_dim": rope,
        "qk_nope_head_dim": int(key_mla) - rope,
        "v_head_dim": int(value_mla),
        "head_dim": rope,  # transformers' DeepseekV3Config: the rotary dims
        "num_key_value_heads": config["num_attention_heads"],  # the latent expands to every head
        "norm_topk_prob": bool(config["norm_topk_prob"]),
    }
    if "blk.0.attn_q_a.weight" not in shapes:
        config["q_lora_rank"] = None  # V2-Lite: q straight from the hidden state
    else:
        meta.require(f"{arch}.attention.q_lora_rank")
    gating = int(meta.get(f"{arch}.expert_gating_func", 1) or 1)
    if gating == 2:
        config["topk_method"] = "noaux_tc"
    elif gating == 1:
        config["architectures"], config["model_type"] = ["DeepseekV2ForCausalLM"], "deepseek_v2"
        config["topk_method"] = "greedy" if config["n_group"] == 1 else "group_limited_greedy"
    else:
        raise ValueError(
            f"gguf: {arch}.expert_gating_func {gating} is not supported; supported: 1 (softmax), 2 (sigmoid)"
        )


def _rotary(
    meta: GGUFMeta,
    arch: str,
    spec: ArchSpec,
    config: dict[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    read: Callable[[str], np.ndarray],
) -> None:
    head_dim = config["head_dim"]
    rope_dims = int(meta.get(f"{arch}.rope.dimension_count", head_dim))
    if rope_dims != head_dim:
        if spec.architecture not in ("Phi3ForCausalLM", "Glm4MoeForCausalLM"):
            raise ValueError(
                f"gguf: {arch}.rope.dimension_count {rope_dims} differs from the head size {head_dim}: partial rotary "
                f"embeddings are supported for phi3 and glm4moe only"
            )
        config["partial_rotary_factor"] = rope_dims / head_dim
    if "rope_factors_long.weight" in shapes:
        config["rope_scaling"] = {
            "rope_type": "longrope",
            "long_factor": [f32(x) for x in read("rope_factors_long.weight").tolist()],
            "short_factor": [f32(x) for x in read("rope_factors_short.weight").tolist()],
        }
        return
    if "rope_freqs.weight" in shapes:
        llama3 = llama3_rope_scaling(read("rope_freqs.weight").astype(np.float64), rope_dims, config["rope_theta"])
        if llama3 is not None:
            config["rope_scaling"] = llama3
        return
    kind = meta.get(f"{arch}.rope.scaling.type")
    factor = meta.get(f"{arch}.rope.scaling.factor")
    if kind in (None, "none") or factor in (None, 0.0, 1.0):
        return
    if kind == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": f32(factor)}
    elif kind == "yarn":
        scaling: dict[str, Any] = {"rope_type": "yarn", "factor": f32(factor)}
        orig = meta.get(f"{arch}.rope.scaling.original_context_length")
        if orig is not None:
            scaling["original_max_position_embeddings"] = int(orig)
        for key, name in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow"),
                          ("yarn_attn_factor", "attention_factor")):
            value = meta.get(f"{arch}.rope.scaling.{key}")
            if value is not None:
                scaling[name] = f32(value)
        log_mul = meta.get(f"{arch}.rope.scaling.yarn_log_multiplier")
        if log_mul is not None and spec.model_type == "deepseek_v3":
            # DeepSeek's converter writes 0.1 * mscale_all_dim; its configs have mscale equal to it
            # (1.0 for V3, 0.707 for V2): the rotation unscaled, the softmax scaled by mscale^2.
            mscale = float(str(np.float32(log_mul) / np.float32(0.1)))
            scaling |= {"mscale": mscale, "mscale_all_dim": mscale}
        config["rope_scaling"] = scaling
    else:
        raise ValueError(f"gguf: {arch}.rope.scaling.type {kind!r} is not supported; supported: linear, yarn")


def _family(
    meta: GGUFMeta,
    arch: str,
    spec: ArchSpec,
    config: dict[str, Any],
    shapes: Mapping[str, tuple[int, ...]],
    num_layers: int,
    head_dim: int,
) -> None:
    """What llama.cpp's runtime computes for the family rather than reads (module note)."""
    if spec.model_type in ("gemma2", "gemma3_text"):
        big = num_layers == {"gemma2": 46, "gemma3": 62}[arch]  # llama.cpp's LLM_TYPE_27B
        config["query_pre_attn_scalar"] = config["hidden_size"] // config["num_attention_heads"] if big else head_dim
        config["layer_types"] = _layer_types(meta, arch, spec, config, num_layers)
        if config["layer_types"] is None:
            del config["layer_types"]
            config["sliding_window"] = None
    if spec.model_type == "gpt_oss":
        config["layer_types"] = _layer_types(meta, arch, spec, config, num_layers)
        if config.get("rope_scaling", {}).get("rope_type") == "yarn":
            config["rope_scaling"]["truncate"] = False
    if spec.model_type == "granitemoe" and "blk.0.ffn_gate_shexp.weight" in shapes:
        config["architectures"], config["model_type"] = ["GraniteMoeSharedForCausalLM"], "granitemoeshared"
    if spec.model_type in ("granite", "granitemoe"):
        config.setdefault("attention_multiplier", 1.0 / math.sqrt(head_dim))
        if "logits_scaling" not in config:
            raise ValueError(f"gguf: {meta.path} lacks the metadata key '{arch}.logit_scale'")
    if spec.model_type == "llama4_text":
        _llama4_layers(meta, arch, spec, config, num_layers)
    if spec.model_type in ("qwen3_moe", "qwen2_moe"):
        dense = [i for i in range(num_layers) if f"blk.{i}.ffn_gate_inp.weight" not in shapes]
        config["mlp_only_layers"] = dense
    if spec.model_type == "mixtral":
        config["intermediate_size"] = shapes["blk.0.ffn_gate_exps.weight"][1]


def _llama4_layers(meta: GGUFMeta, arch: str, spec: ArchSpec, config: dict[str, Any], num_layers: int) -> None:
    """Llama 4's layers as llama.cpp's runtime sets them (`llama_model_llama4`): a file whose
    `attention.sliding_window` is 0 (the converter's mark of a config with only full-attention
    layers) has rotary everywhere, no chunks and no temperature; any other has 8192-token chunks
    on the rotary layers and every 4th layer (or the file's `sliding_window_pattern`) global,
    without rotary. q/k norms unless the model has 128 experts (Maverick)."""
    config["use_qk_norm"] = config["num_local_experts"] != 128
    config.pop("sliding_window", None)
    if meta.get(f"{arch}.attention.sliding_window") == 0:
        config |= {"no_rope_layers": [1] * num_layers, "attention_chunk_size": None, "attn_temperature_tuning": False}
        return
    config["layer_types"] = [
        "chunked_attention" if t == "sliding_attention" else t
        for t in _layer_types(meta, arch, spec, {**config, "sliding_window": config["attention_chunk_size"]},
                              num_layers) or []
    ]
    config["no_rope_layers"] = [int(t == "chunked_attention") for t in config["layer_types"]]


def _layer_types(
    meta: GGUFMeta, arch: str, spec: ArchSpec, config: dict[str, Any], num_layers: int
) -> list[str] | None:
    """Gemma's per-layer windows as llama.cpp sets them (`load_swa_pattern`): a per-layer array or a
    period in `{arch}.attention.sliding_window_pattern`, else the family's period; None: no windows."""
    window = config.get("sliding_window")
    if spec.model_type == "gemma3_text" and not window:
        return None
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern", spec.swa_pattern)
    if isinstance(pattern, list):
        if len(pattern) < num_layers:
            raise ValueError(
                f"gguf: {arch}.attention.sliding_window_pattern has {len(pattern)} entries, not {num_layers}"
            )
        swa = [bool(x) for x in pattern[:num_layers]]
    else:
        n = int(pattern)
        swa = [n == 0 or i % n < n - 1 for i in range(num_layers)]
    return ["sliding_attention" if s else "full_attention" for s in swa]


def llama3_rope_factors(
    head_dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float = 1.0,
    high_freq_factor: float = 4.0,
    original_max_position_embeddings: int = 8192,
) -> np.ndarray:
    """The per-frequency divisors llama.cpp stores as `rope_freqs.weight` for Llama 3.1-style rope."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    low_wavelen = original_max_position_embeddings / low_freq_factor
    high_wavelen = original_max_position_embeddings / high_freq_factor
    with np.errstate(divide="ignore", invalid="ignore"):  # low == high (Llama 4): no medium band
        smooth = (original_max_position_embeddings / wavelen - low_freq_factor) / (
            high_freq_factor - low_freq_factor
        )
        medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < high_wavelen, 1.0, np.where(wavelen > low_wavelen, factor, medium))


def llama3_rope_scaling(factors: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """Recover HF's `llama3` rope_scaling from a `rope_freqs.weight` tensor (standard Llama 3 knobs)."""
    factor = float(factors.max())
    if factor == 1.0 and float(factors.min()) == 1.0:
        return None
    for low, high in _LLAMA3_BANDS:
        expected = llama3_rope_factors(head_dim, theta, factor, low, high)
        if expected.shape == factors.shape and np.allclose(expected, factors, rtol=1e-4):
            return {
                "rope_type": "llama3",
                "factor": factor,
                "low_freq_factor": low,
                "high_freq_factor": high,
                "original_max_position_embeddings": 8192,
            }
    raise ValueError(
        "gguf: rope_freqs.weight does not match Llama 3 rope scaling (low/high frequency factors "
        f"{', '.join(f'{lo:g}/{hi:g}' for lo, hi in _LLAMA3_BANDS)} over 8192 positions); not supported"
    )


# llama3 rope's (low_freq_factor, high_freq_factor) in the released configs: Llama 3.1-3.3, Llama 4.
_LLAMA3_BANDS = ((1.0, 4.0), (1.0, 1.0))
