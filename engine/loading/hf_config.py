"""The numerics of a Hugging Face config.json (transformers 4.x or 5.x), parsed and checked once.

`parse_hf_config` turns the raw dict into a frozen `HfConfig` holding every field that changes what
the model computes, read the way transformers' `LlamaConfig` / `MistralConfig` / `Qwen2Config` and
their modeling files read it, with each architecture's own defaults (a Mistral config without
`num_key_value_heads` has 8, a Qwen2 one 32; a Mistral without `sliding_window` has a 4096-token
window). What the engine cannot compute exactly is a `ValueError` naming the field, raised at load:
an activation other than SiLU, an unsupported RoPE (rope_config.py), layer types other than full and
sliding attention, a `quantization_config` that quant_checkpoints.py cannot read (it reads GPTQ,
AWQ, compressed-tensors and FP8 checkpoints of decoder models). Fields that change nothing at
inference (`attention_dropout`, `initializer_range`, `pretraining_tp`, `use_cache`, `pad_token_id`)
are ignored, as are fields the architecture's modeling code does not read (`sliding_window` on
Llama, `attention_bias` / `mlp_bias` on Mistral and Qwen2).

Which modeling code runs the model is `model_impl` (vLLM's values): "auto" takes the native
class where `architectures[0]` has one, else the Transformers backend, whose config
transformers' own config class reads (transformers_config.py: only the sizes the engine needs,
and what the backend cannot page refused); "triollm" refuses architectures with no native
class; "transformers" reads every decoder the backend's way.

Encoder-only checkpoints (`BertModel`, served by the pooling runner) are read into the same
`HfConfig` (no RoPE, biases everywhere) plus an `EncoderSpec` with what only they have
(token-type vocabulary, LayerNorm epsilon, GELU flavour); relative position embeddings and
non-GELU activations are refused.

Where the two generations differ in spelling:

| what | transformers 4.x | transformers 5.x |
| --- | --- | --- |
| RoPE | `rope_theta`, `rope_scaling` | `rope_parameters` (see rope_config.py) |
| dtype | `torch_dtype` | `dtype` (wins when both are present) |
| Qwen2 windows | `use_sliding_window`, `sliding_window`, `max_window_layers` | the same, or `layer_types` |

Sliding windows: Mistral applies `sliding_window` to every layer; Qwen2 only when
`use_sliding_window` is true, to the layers `layer_types` marks `sliding_attention` (by default
those from `max_window_layers` on). triollm's attention has no window, so the parsed window is
only a limit: a window of w tokens changes nothing while no sequence is longer than w (position p
attends to positions > p - w). `ModelConfig.from_pretrained` clamps its default max_model_len to
the window and refuses an explicit longer one; implementing windowed attention in the kernels
was rejected for now (it also needs block eviction in the KV manager to pay off).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import KW_ONLY, dataclass
from typing import Any

import torch

from triollm.engine.loading.config_checks import check_head_counts
from triollm.engine.loading.config_checks import read_bool as _bool
from triollm.engine.loading.config_checks import read_eps as _eps
from triollm.engine.loading.config_checks import read_int as _int
from triollm.engine.loading.hf_deepseek import DEEPSEEK_ARCHITECTURES, MLASpec, parse_deepseek
from triollm.engine.loading.hf_families import Llama4Spec, MoESpec, family_fields
from triollm.engine.loading.hf_recurrent import (
    RECURRENT_ARCHITECTURES,
    RECURRENT_LAYER_TYPES,
    STATE_LAYER_TYPES,
    RecurrentSpec,
    parse_recurrent,
)
from triollm.engine.loading.quant_checkpoints import CheckpointQuant, parse_quantization_config
from triollm.engine.loading.rope_config import RopeConfig, parse_rope
from triollm.engine.loading.transformers_config import parse_transformers_config

__all__ = [
    "DECODER_CLASSIFIERS",
    "DTYPES",
    "ENCODER_ARCHITECTURES",
    "ROBERTA_ARCHITECTURES",
    "SUPPORTED_ARCHITECTURES",
    "EncoderSpec",
    "MODEL_IMPLS",
    "MODERNBERT_ARCHITECTURES",
    "ModernBertSpec",
    "HfConfig",
    "causal_architecture",
    "checkpoint_dtype",
    "parse_hf_config",
]


@dataclass(frozen=True)
class _Defaults:
    """One architecture's config-class defaults (transformers 4.x and 5.x agree on these)."""

    model_type: str
    max_position_embeddings: int
    num_kv_heads: int | None  # None: as many as query heads
    qkv_bias: bool | None  # None: `attention_bias` decides (q, k, v and o_proj)
    has_mlp_bias: bool  # whether `mlp_bias` is read at all
    sliding_window: int | None
    head_dim: int | None = None  # None: hidden_size // num_attention_heads
    tie_word_embeddings: bool = False
    rms_norm_eps: float = 1e-6
    hidden_act: str = "silu"
    attention_bias: bool = False  # `attention_bias` when config.json does not say


_ARCHITECTURES = {
    "LlamaForCausalLM": _Defaults("llama", 2048, None, None, True, None),
    "MistralForCausalLM": _Defaults("mistral", 4096 * 32, 8, False, False, 4096),
    "Qwen2ForCausalLM": _Defaults("qwen2", 32768, 32, True, False, 4096),
    "Qwen3ForCausalLM": _Defaults("qwen3", 32768, 32, None, False, None, head_dim=128),
    "Qwen3MoeForCausalLM": _Defaults("qwen3_moe", 32768, 4, None, False, None),
    "Qwen2MoeForCausalLM": _Defaults("qwen2_moe", 32768, 16, True, False, 4096),
    "Glm4MoeForCausalLM": _Defaults("glm4_moe", 131072, 8, None, False, None, rms_norm_eps=1e-5),
    "OlmoeForCausalLM": _Defaults("olmoe", 4096, None, None, False, None, rms_norm_eps=1e-5),
    "GraniteMoeForCausalLM": _Defaults("granitemoe", 4096, None, None, False, None),
    "GraniteMoeSharedForCausalLM": _Defaults("granitemoeshared", 4096, None, None, False, None),
    "MixtralForCausalLM": _Defaults("mixtral", 4096 * 32, 8, False, False, None, rms_norm_eps=1e-5),
    "GemmaForCausalLM": _Defaults("gemma", 8192, 16, None, False, None, 256, True, 1e-6, "gelu_pytorch_tanh"),
    "Gemma2ForCausalLM": _Defaults("gemma2", 8192, 4, None, False, 4096, 256, True, 1e-6, "gelu_pytorch_tanh"),
    "Gemma3ForCausalLM": _Defaults("gemma3_text", 131072, 4, None, False, 4096, 256, True, 1e-6, "gelu_pytorch_tanh"),
    "Phi3ForCausalLM": _Defaults("phi3", 4096, None, False, False, None, rms_norm_eps=1e-5),
    "PhimoeForCausalLM": _Defaults("phimoe", 4096 * 32, 8, None, False, None, rms_norm_eps=1e-5),
    "Llama4ForCausalLM": _Defaults("llama4_text", 4096 * 32, 8, None, False, None, 128, rms_norm_eps=1e-5),
    "Olmo2ForCausalLM": _Defaults("olmo2", 2048, None, None, False, None, rms_norm_eps=1e-5),
    "GraniteForCausalLM": _Defaults("granite", 2048, None, None, True, None),
    "GptOssForCausalLM": _Defaults("gpt_oss", 131072, 8, None, False, 128, 64, rms_norm_eps=1e-5, attention_bias=True),
    # LayerNorm and partial rotary (models/layernorm_decoder.py); eps and biases: hf_families.py.
    "GPTNeoXForCausalLM": _Defaults("gpt_neox", 2048, None, None, False, None, hidden_act="gelu", attention_bias=True),
    "PhiForCausalLM": _Defaults("phi", 2048, None, True, False, None, hidden_act="gelu_new"),
    "StableLmForCausalLM": _Defaults("stablelm", 4096, 32, False, False, None),
}
# Encoder-only (bidirectional) models: served by the pooling runner (embeddings, or a
# classifier's scores for the *ForSequenceClassification heads), never generate.
ENCODER_ARCHITECTURES = (
    "BertModel",
    "BertForSequenceClassification",
    "XLMRobertaModel",
    "XLMRobertaForSequenceClassification",
    "ModernBertModel",
    "ModernBertForSequenceClassification",
)
MODERNBERT_ARCHITECTURES = ("ModernBertModel", "ModernBertForSequenceClassification")
# The encoders whose position ids follow RoBERTa's (padding_idx + 1 onwards) and whose tensors
# sit under `roberta.` in their *For* checkpoints.
ROBERTA_ARCHITECTURES = ("XLMRobertaModel", "XLMRobertaForSequenceClassification")
# Decoder sequence classifiers (rerankers, reward models): served by the pooling runner as their
# family's causal trunk plus a `score` head (engine/execution/models/decoder_pooling.py).
DECODER_CLASSIFIERS = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
}
SUPPORTED_ARCHITECTURES = (
    *_ARCHITECTURES, *RECURRENT_ARCHITECTURES, *DEEPSEEK_ARCHITECTURES, *ENCODER_ARCHITECTURES, *DECODER_CLASSIFIERS
)
# transformers' activation names, by the function they compute.
_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_new": "gelu_tanh",
    "gelu": "gelu",
}
_LAYER_TYPES = ("full_attention", "sliding_attention")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class HfConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_proj_bias: bool
    mlp_bias: bool
    # The smallest window any layer uses; None: full attention everywhere.
    sliding_window: int | None
    checkpoint_dtype: torch.dtype | None  # `dtype` / `torch_dtype`, when given
    # Encoder-only models (BERT): what the decoder fields above do not say; None for decoders.
    encoder: EncoderSpec | None
    # What only some families have (engine/loading/hf_families.py); the defaults are Llama's.
    _: KW_ONLY
    hidden_act: str = "silu"  # the MLP's gate activation: "silu", "gelu_tanh" or "gelu"
    layer_types: tuple[str, ...] = ()  # "full_attention" / "sliding_attention" per layer; (): all full
    local_rope: RopeConfig | None = None  # the sliding layers' own RoPE (Gemma 3); None: `rope`
    rotary_dim: int | None = None  # partial rotary: dims of each head that rotate; None: head_dim
    # Norm of q and k: RMSNorm "head" (over each head) or "full" (OLMo 2); LayerNorm over each head,
    # "layernorm" (one weight and bias for every head: Phi) or "layernorm_head" (a weight per head: StableLM).
    qk_norm: str | None = None
    parallel_residual: bool = False  # x + attn(norm(x)) + mlp(norm'(x)) (GPT-NeoX, Phi, StableLM)
    norm_layout: str = "pre"  # "pre" (Llama), "sandwich" (Gemma 2/3: pre and post), "post" (OLMo 2)
    norm_offset: bool = False  # Gemma's RMSNorm scales by (1 + weight)
    embedding_multiplier: float = 1.0  # Gemma: sqrt(hidden_size); Granite: embedding_multiplier
    residual_multiplier: float = 1.0  # Granite
    attention_scale: float | None = None  # the softmax scale; None: head_dim ** -0.5
    attn_softcap: float | None = None  # Gemma 2: attention logit soft-capping
    final_softcap: float | None = None  # Gemma 2: final logit soft-capping
    logits_divisor: float = 1.0  # Granite: logits_scaling
    fused_checkpoint: bool = False  # Phi-3: qkv_proj and gate_up_proj stored fused
    moe: MoESpec | None = None
    lm_head_bias: bool = False  # Phi-MoE's `lm_head_bias`
    llama4: Llama4Spec | None = None  # Llama 4's chunked / NoPE layers and their norms (hf_families.py)
    # Layers with a per-request state instead of a KV cache (hf_recurrent.py: LFM2's short
    # convolutions); None: every layer attends.
    recurrent: RecurrentSpec | None = None
    # Multi-head latent attention (hf_deepseek.py: DeepSeek V2/V3); None: q/k/v heads as above.
    mla: MLASpec | None = None
    # config.json's `quantization_config` (quant_checkpoints.py); None: a float checkpoint.
    checkpoint_quant: CheckpointQuant | None = None
    # Whose modeling code runs: "triollm" (engine/execution/models/) or "transformers" (the
    # Transformers backend, transformers_backend.py; only the sizes above are read then).
    model_impl: str = "triollm"

    @property
    def kv_layers(self) -> tuple[int, ...]:
        """The layers that read and write the KV cache, in order (all but a hybrid's recurrent ones)."""
        if self.recurrent is None:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t not in RECURRENT_LAYER_TYPES)

    @property
    def state_layers(self) -> tuple[int, ...]:
        """The layers with a recurrent state, in order (a hybrid's recurrent ones; Falcon-H1: all)."""
        if self.recurrent is None:
            return ()
        return tuple(i for i, t in enumerate(self.layer_types) if t in STATE_LAYER_TYPES)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of `layer`, None for full attention."""
        if self.layer_types and self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None


@dataclass(frozen=True)
class EncoderSpec:
    """A BERT-style encoder's own numerics (absolute position and token-type embeddings, LayerNorm
    with biases, a GELU MLP). `HfConfig.rms_norm_eps` holds `layer_norm_eps` too."""

    type_vocab_size: int
    layer_norm_eps: float
    hidden_act: str  # "gelu" (exact, erf) or "gelu_new" / "gelu_pytorch_tanh" (tanh)
    pad_token_id: int
    # The first token's position id: 0 for BERT; pad_token_id + 1 for RoBERTa / XLM-R, whose pad
    # token sits at position pad_token_id (transformers' `create_position_ids_from_input_ids`).
    position_offset: int = 0
    modernbert: ModernBertSpec | None = None  # a ModernBERT's own numerics

    def max_tokens(self, max_position_embeddings: int) -> int:
        """The longest prompt the position table covers."""
        return max_position_embeddings - self.position_offset


@dataclass(frozen=True)
class ModernBertSpec:
    """What a ModernBERT computes beyond BERT's fields (execution/models/modernbert.py)."""

    layer_types: tuple[str, ...]  # "full_attention" or "sliding_attention" per layer
    local_window: int  # a sliding layer's query sees keys within this distance (local_attention // 2)
    global_rope_theta: float
    local_rope_theta: float
    norm_bias: bool
    attention_bias: bool
    mlp_bias: bool
    classifier_pooling: str  # "cls" or "mean"
    classifier_activation: str  # "gelu" or a tanh GELU
    classifier_bias: bool


MODEL_IMPLS = ("auto", "triollm", "transformers")  # vLLM's --model-impl ("vllm" is ours: "triollm")


def parse_hf_config(hf: Mapping[str, Any], model_impl: str = "auto") -> HfConfig:
    """The numerics of config.json `hf` (module note); a `ValueError` naming the field if unsupported.

    `model_impl` (vLLM's): "triollm" refuses what has no native class; "transformers" reads the
    config for the Transformers backend (transformers_config.py); "auto" takes the native class
    where there is one, else the backend."""
    if model_impl not in MODEL_IMPLS:
        raise ValueError(f"model_impl: {model_impl!r} is not one of {', '.join(MODEL_IMPLS)}")
    arch = _architecture(hf, native_only=model_impl == "triollm")
    if model_impl == "transformers" or arch not in SUPPORTED_ARCHITECTURES:
        if arch in ENCODER_ARCHITECTURES or arch in DECODER_CLASSIFIERS:
            raise ValueError(f"model_impl: 'transformers' runs causal LMs; {arch} is pooled natively (use 'auto')")
        return _parse_transformers(arch, hf)
    if arch in MODERNBERT_ARCHITECTURES:
        return _parse_modernbert(arch, hf)
    if arch in ENCODER_ARCHITECTURES:
        return _parse_bert(arch, hf)
    if arch in RECURRENT_ARCHITECTURES:
        return HfConfig(architecture=arch, checkpoint_dtype=checkpoint_dtype(hf), **parse_recurrent(arch, hf))
    if arch in DEEPSEEK_ARCHITECTURES:
        return HfConfig(architecture=arch, checkpoint_dtype=checkpoint_dtype(hf), **parse_deepseek(arch, hf))
    family = causal_architecture(arch)
    d = _ARCHITECTURES[family]
    raw_quant = hf.get("quantization_config")
    quant = parse_quantization_config(raw_quant) if raw_quant and not _mxfp4_experts(family, raw_quant) else None
    act_field = "hidden_activation" if hf.get("hidden_activation") is not None else "hidden_act"
    act = hf.get(act_field) or d.hidden_act
    if act not in _ACTIVATIONS:
        raise ValueError(f"{act_field}: {act!r} is not supported; supported: {', '.join(_ACTIVATIONS)}")
    hidden = _int(hf, "hidden_size")
    num_heads = _int(hf, "num_attention_heads")
    num_layers = _int(hf, "num_hidden_layers")
    check_head_counts(hf, hidden, num_heads)
    num_kv_heads = _int(hf, "num_key_value_heads", d.num_kv_heads, null=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads: {num_kv_heads} does not divide num_attention_heads {num_heads}; allowed: a "
            f"divisor of {num_heads}"
        )
    head_dim = _int(hf, "head_dim", d.head_dim or hidden // num_heads, null=hidden // num_heads)
    if head_dim % 2:
        raise ValueError(f"head_dim: RoPE needs an even head_dim, got {head_dim}")
    max_pos = _int(hf, "max_position_embeddings", d.max_position_embeddings)
    attention_bias = _bool(hf, "attention_bias", d.attention_bias)
    window, layer_types = _sliding_window(family, hf, num_layers)
    extra = family_fields(family, hf, num_layers=num_layers, head_dim=head_dim, hidden=hidden, max_pos=max_pos)
    return HfConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=_int(hf, "intermediate_size"),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=_int(hf, "vocab_size"),
        # LayerNorm families read their eps and biases from fields of their own (hf_families.py).
        rms_norm_eps=extra.pop("rms_norm_eps", None) or _eps(hf, d.rms_norm_eps),
        rope=extra.pop("rope", None) or parse_rope(hf, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=_bool(hf, "tie_word_embeddings", d.tie_word_embeddings),
        qkv_bias=extra.pop("qkv_bias", attention_bias if d.qkv_bias is None else d.qkv_bias),
        o_proj_bias=extra.pop("o_proj_bias", attention_bias if d.qkv_bias is None else False),  # Llama biases o_proj
        mlp_bias=_bool(hf, "mlp_bias", False) if d.has_mlp_bias else False,
        sliding_window=window,
        checkpoint_dtype=checkpoint_dtype(hf),
        encoder=None,
        hidden_act=_ACTIVATIONS[act],
        layer_types=layer_types,
        checkpoint_quant=quant,
        **extra,
    )


def _mxfp4_experts(family: str, raw: Any) -> bool:
    """gpt-oss's released checkpoints: MXFP4 experts, every other weight in bf16. The experts are
    dequantized as they load (models/gpt_oss.py), so the model is a float checkpoint here."""
    return family == "GptOssForCausalLM" and isinstance(raw, Mapping) and raw.get("quant_method") == "mxfp4"


_GELUS = ("gelu", "gelu_new", "gelu_pytorch_tanh")


def _parse_bert(arch: str, hf: Mapping[str, Any]) -> HfConfig:
    """BERT and XLM-R encoders as transformers' `BertConfig` / `XLMRobertaConfig` read them (their
    defaults when a field is absent: XLM-R's pad_token_id is 1).
    Refused: relative position embeddings, activations other than GELU, quantised weights."""
    if hf.get("quantization_config"):
        raise ValueError(
            f"quantization_config: quantized checkpoints of {arch} are not supported; use unquantized weights"
        )
    position = hf.get("position_embedding_type", "absolute")
    if position != "absolute":
        raise ValueError(f"position_embedding_type: {position!r} is not supported; supported: absolute")
    act = hf.get("hidden_act", "gelu")
    if act not in _GELUS:
        raise ValueError(f"hidden_act: {act!r} is not supported for {arch}; supported: {', '.join(_GELUS)}")
    if hf.get("is_decoder") or hf.get("add_cross_attention"):
        raise ValueError("is_decoder: BERT as a decoder is not supported (encoder-only models are pooled)")
    hidden = _int(hf, "hidden_size", 768)
    num_heads = _int(hf, "num_attention_heads", 12)
    if hidden % num_heads:
        raise ValueError(f"num_attention_heads: {num_heads} does not divide hidden_size {hidden}")
    eps = hf.get("layer_norm_eps", 1e-12)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"layer_norm_eps: expected a positive number, got {eps!r}")
    max_pos = _int(hf, "max_position_embeddings", 512)
    roberta = arch in ROBERTA_ARCHITECTURES
    pad = _int(hf, "pad_token_id", 1 if roberta else 0, null=0, minimum=0)
    if roberta and pad + 2 > max_pos:
        raise ValueError(
            f"pad_token_id: {pad} leaves no position embeddings for tokens (XLM-R counts positions from "
            f"pad_token_id + 1; max_position_embeddings is {max_pos})"
        )
    return HfConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=_int(hf, "intermediate_size", 3072),
        num_layers=_int(hf, "num_hidden_layers", 12),
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        vocab_size=_int(hf, "vocab_size", 30522),
        rms_norm_eps=float(eps),
        rope=RopeConfig(max_position_embeddings=max_pos),  # unused: positions are learned
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
        qkv_bias=True,
        o_proj_bias=True,
        mlp_bias=True,
        sliding_window=None,
        checkpoint_dtype=checkpoint_dtype(hf),
        encoder=EncoderSpec(
            type_vocab_size=_int(hf, "type_vocab_size", 2),
            layer_norm_eps=float(eps),
            hidden_act=act,
            pad_token_id=pad,
            position_offset=pad + 1 if roberta else 0,
        ),
    )


def _parse_modernbert(arch: str, hf: Mapping[str, Any]) -> HfConfig:
    """ModernBERT as transformers' `ModernBertConfig` reads it, 4.x (`global_rope_theta`,
    `local_rope_theta`, `global_attn_every_n_layers`) or 5.x (`layer_types`, `rope_parameters`
    by layer type); refused: quantized weights, RoPE scaling, activations other than GELU."""
    if hf.get("quantization_config"):
        raise ValueError(f"quantization_config: quantized checkpoints of {arch} are not supported")
    for field in ("hidden_activation", "classifier_activation"):
        if hf.get(field, "gelu") not in _GELUS:
            raise ValueError(f"{field}: {hf.get(field)!r} is not supported; supported: {', '.join(_GELUS)}")
    hidden, num_heads = _int(hf, "hidden_size", 768), _int(hf, "num_attention_heads", 12)
    num_layers = _int(hf, "num_hidden_layers", 22)
    if hidden % num_heads:
        raise ValueError(f"num_attention_heads: {num_heads} does not divide hidden_size {hidden}")
    every = _int(hf, "global_attn_every_n_layers", 3)
    types = hf.get("layer_types") or [
        "sliding_attention" if i % every else "full_attention" for i in range(num_layers)
    ]
    if len(types) != num_layers or any(t not in _LAYER_TYPES for t in types):
        raise ValueError(f"layer_types: expected {num_layers} of {', '.join(_LAYER_TYPES)}, got {types!r:.80}")
    thetas = {
        "full_attention": hf.get("global_rope_theta") or 160_000.0,
        "sliding_attention": hf.get("local_rope_theta") or 10_000.0,
    }
    rope = hf.get("rope_parameters") or {}
    for kind in thetas:
        params = rope.get(kind) or {}
        if params.get("rope_type", "default") != "default" or hf.get("rope_scaling"):
            raise ValueError(f"rope_parameters: only the default RoPE is supported for {arch}")
        thetas[kind] = params.get("rope_theta", thetas[kind])
    eps = hf.get("norm_eps", 1e-5)
    pooling = hf.get("classifier_pooling", "cls")
    if pooling not in ("cls", "mean"):
        raise ValueError(f"classifier_pooling: {pooling!r} is not one of cls, mean")
    max_pos = _int(hf, "max_position_embeddings", 8192)
    return HfConfig(
        architecture=arch,
        hidden_size=hidden,
        intermediate_size=_int(hf, "intermediate_size", 1152),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_heads,
        head_dim=hidden // num_heads,
        vocab_size=_int(hf, "vocab_size", 50368),
        rms_norm_eps=float(eps),
        rope=RopeConfig(max_position_embeddings=max_pos),  # unused: ModernBertSpec's thetas
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
        qkv_bias=_bool(hf, "attention_bias", False),
        o_proj_bias=_bool(hf, "attention_bias", False),
        mlp_bias=_bool(hf, "mlp_bias", False),
        sliding_window=None,  # the local layers' window is ModernBertSpec's: no limit on length
        checkpoint_dtype=checkpoint_dtype(hf),
        encoder=EncoderSpec(
            type_vocab_size=1,
            layer_norm_eps=float(eps),
            hidden_act=hf.get("hidden_activation", "gelu"),
            pad_token_id=_int(hf, "pad_token_id", 50283, null=0, minimum=0),
            modernbert=ModernBertSpec(
                layer_types=tuple(types),
                local_window=_int(hf, "local_attention", 128) // 2,
                global_rope_theta=float(thetas["full_attention"]),
                local_rope_theta=float(thetas["sliding_attention"]),
                norm_bias=_bool(hf, "norm_bias", False),
                attention_bias=_bool(hf, "attention_bias", False),
                mlp_bias=_bool(hf, "mlp_bias", False),
                classifier_pooling=pooling,
                classifier_activation=hf.get("classifier_activation", "gelu"),
                classifier_bias=_bool(hf, "classifier_bias", False),
            ),
        ),
    )


def causal_architecture(arch: str) -> str:
    """The `*ForCausalLM` class of a decoder classifier's family (other architectures: as given)."""
    return DECODER_CLASSIFIERS.get(arch, arch)


def checkpoint_dtype(hf: Mapping[str, Any]) -> torch.dtype | None:
    """The weights' dtype from `dtype` (5.x) or `torch_dtype` (4.x); None when neither is set."""
    for key in ("dtype", "torch_dtype"):
        value = hf.get(key)
        if value is None:
            continue
        name = str(value).removeprefix("torch.")
        if name not in DTYPES:
            raise ValueError(f"{key}: {value!r} is not one of {', '.join(DTYPES)}")
        return DTYPES[name]
    return None


def _parse_transformers(arch: str, hf: Mapping[str, Any]) -> HfConfig:
    if hf.get("quantization_config"):
        raise ValueError(
            f"quantization_config: quantized checkpoints are not supported through the Transformers backend "
            f"({arch}); use unquantized weights"
        )
    fields = parse_transformers_config(hf, arch)
    return HfConfig(architecture=arch, checkpoint_dtype=checkpoint_dtype(hf), model_impl="transformers", **fields)


def _architecture(hf: Mapping[str, Any], *, native_only: bool) -> str:
    archs = hf.get("architectures")
    if archs:
        if not isinstance(archs, list):
            raise ValueError(f"architectures: expected a list, got {archs!r}")
        arch = archs[0]
    else:  # no architectures: transformers goes by model_type
        model_type = hf.get("model_type") or "llama"
        by_type = {d.model_type: a for a, d in _ARCHITECTURES.items()} | {
            t: a for a, t in (RECURRENT_ARCHITECTURES | DEEPSEEK_ARCHITECTURES).items()
        } | {
            "bert": "BertModel",
            "xlm-roberta": "XLMRobertaModel",
            "modernbert": "ModernBertModel",
        }
        if model_type not in by_type and not native_only:
            return _causal_lm_for(model_type)
        if model_type not in by_type:
            raise ValueError(
                f"model_type: {model_type!r} is not supported; supported: {', '.join(by_type)}"
            )
        arch = by_type[model_type]
    if native_only and arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(
            f"architectures: {arch!r} is not supported with model_impl 'triollm'; supported: "
            f"{', '.join(SUPPORTED_ARCHITECTURES)} (model_impl 'auto' or 'transformers' runs other decoders through "
            f"the Transformers backend)"
        )
    if not isinstance(arch, str):
        raise ValueError(f"architectures: expected a list of class names, got {archs!r}")
    return arch


def _causal_lm_for(model_type: str) -> str:
    """transformers' causal-LM class for a `model_type` (a config.json without `architectures`)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ValueError(
            f"model_type: {model_type!r} has no causal language model in the installed transformers; "
            f"supported natively: {', '.join(d.model_type for d in _ARCHITECTURES.values())}"
        )
    return str(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type])


# Where each family's windows apply: every layer, or the layers `layer_types` marks (with that
# family's default pattern when config.json has no layer_types).
_EVERY_LAYER = ("MistralForCausalLM", "MixtralForCausalLM", "Phi3ForCausalLM", "PhimoeForCausalLM")
_QWEN = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Qwen2MoeForCausalLM")
# gpt-oss has no `sliding_window_pattern`; its default layer_types alternate as Gemma 2's.
_GEMMA_PATTERN = {"Gemma2ForCausalLM": 2, "Gemma3ForCausalLM": 6, "GptOssForCausalLM": 2}


def _sliding_window(arch: str, hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, tuple[str, ...]]:
    """(the window, each layer's type); (None, ()) where no layer has a window."""
    d = _ARCHITECTURES[arch]
    if arch in _EVERY_LAYER:  # these ignore layer_types
        window = _window(hf, d.sliding_window)
        return window, () if window is None else ("sliding_attention",) * num_layers
    if arch in _GEMMA_PATTERN:
        window = _window(hf, d.sliding_window)
        layer_types = hf.get("layer_types")
        if layer_types is None:
            pattern = _int(hf, "sliding_window_pattern", _GEMMA_PATTERN[arch])
            layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(num_layers)]
    elif arch in _QWEN:
        window = _window(hf, d.sliding_window) if _bool(hf, "use_sliding_window", False) else None
        layer_types = hf.get("layer_types")
        if layer_types is None:
            first = _int(hf, "max_window_layers", 28, minimum=0)
            layer_types = [
                "sliding_attention" if window is not None and i >= first else "full_attention"
                for i in range(num_layers)
            ]
    else:
        return None, ()  # Llama, Gemma, OLMo 2 and Granite have no window
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types: expected a list of {num_layers} entries (one per layer), got {layer_types!r}"
        )
    unknown = sorted({t for t in layer_types if t not in _LAYER_TYPES})
    if unknown:
        raise ValueError(
            f"layer_types: {', '.join(map(repr, unknown))} not supported; supported: {', '.join(_LAYER_TYPES)}"
        )
    if "sliding_attention" not in layer_types:
        return None, ()
    if window is None:
        raise ValueError(
            "layer_types: layers are marked sliding_attention but there is no window "
            "(use_sliding_window is false or sliding_window is null)"
        )
    return window, tuple(layer_types)


def _window(hf: Mapping[str, Any], default: int | None) -> int | None:
    if "sliding_window" not in hf:
        return default
    value = hf["sliding_window"]
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"sliding_window: expected a positive integer or null, got {value!r}")
    return value
