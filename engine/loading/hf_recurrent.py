"""config.json of hybrid decoders: attention layers beside layers that carry a recurrent state.

LFM2 (`Lfm2ForCausalLM`) interleaves Qwen3-style attention layers with gated short
convolutions: `in_proj` to B, C and x, a causal depthwise convolution of B*x over the last
`conv_L_cache` positions, times C, `out_proj`. What a convolution layer remembers of a sequence
is its last `conv_L_cache - 1` inputs: a fixed-size state per request, not a KV cache that grows
(engine/execution/layers/recurrent.py keeps it).

`RecurrentSpec` is what `HfConfig.recurrent` holds for such a model; `layer_types` names each
layer "full_attention" or "conv". Read as transformers' `Lfm2Config` reads config.json: the MLP
width is `block_ff_dim` (or `intermediate_size`) adjusted by `block_auto_adjust_ff_dim`, the
attention layers are `layer_types` or else `full_attn_idxs` (default: every layer), RoPE's base
defaults to 1,000,000, the embedding is tied unless `tie_embedding` / `tie_word_embeddings`
says otherwise.

Falcon-H1 (`FalconH1ForCausalLM`) runs attention and a Mamba-2 mixer side by side in every layer
(layer type "hybrid": a KV cache layer and a state both), each with its muP multipliers
(`FalconH1Multipliers`; `_parse_falcon_h1`). Qwen3-Next (`Qwen3NextForCausalLM`) interleaves
gated attention with gated DeltaNet layers ("linear_attention": a convolution state and a
key x value matrix per value head; `_parse_qwen3_next`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from triollm.engine.loading.config_checks import check_head_counts
from triollm.engine.loading.config_checks import read_bool as _bool
from triollm.engine.loading.config_checks import read_eps as _eps
from triollm.engine.loading.config_checks import read_int as _int
from triollm.engine.loading.hf_families import MoESpec
from triollm.engine.loading.rope_config import parse_rope, partial_rotary_factor

__all__ = [
    "RECURRENT_ARCHITECTURES",
    "RECURRENT_LAYER_TYPES",
    "STATE_LAYER_TYPES",
    "FalconH1Multipliers",
    "RecurrentSpec",
    "parse_recurrent",
]

RECURRENT_LAYER_TYPES = ("conv", "mamba", "linear_attention")  # layers with a state and no KV cache
# Layers that keep a state: the recurrent ones, and Falcon-H1's "hybrid" layers (attention and a
# Mamba-2 mixer in one layer: a KV cache layer too).
STATE_LAYER_TYPES = (*RECURRENT_LAYER_TYPES, "hybrid")
RECURRENT_ARCHITECTURES = {  # architecture -> model_type
    "Lfm2ForCausalLM": "lfm2",
    "BambaForCausalLM": "bamba",
    "GraniteMoeHybridForCausalLM": "granitemoehybrid",
    "FalconH1ForCausalLM": "falcon_h1",
    "Qwen3NextForCausalLM": "qwen3_next",
}
# A Mamba-2 hybrid's layer types as config.json spells them (Granite 4.0-H: "mamba", "attention").
_MAMBA_TYPES = {
    "mamba": "mamba",
    "linear_attention": "mamba",
    "attention": "full_attention",
    "full_attention": "full_attention",
}
_LFM2_LAYER_TYPES = ("full_attention", "conv")


@dataclass(frozen=True)
class FalconH1Multipliers:
    """Falcon-H1's muP multipliers outside the mixer (transformers' `FalconH1DecoderLayer`): the
    attention's input and output, its keys (before RoPE), the mixer's output, the MLP's gate
    (before the activation) and output, and the logits."""

    attention_in: float = 1.0
    attention_out: float = 1.0
    key: float = 1.0
    ssm_out: float = 1.0
    mlp_gate: float = 1.0
    mlp_down: float = 1.0
    lm_head: float = 1.0


@dataclass(frozen=True)
class RecurrentSpec:
    """The per-request state of a hybrid model's recurrent layers: LFM2's short convolutions
    (`kind` "short_conv"), Mamba-2 mixers ("mamba2": Bamba, Granite 4.0-H, Falcon-H1) or gated
    DeltaNets ("gated_deltanet": Qwen3-Next)."""

    kind: str
    conv_kernel: int  # a convolution reads this many positions (its state: the last kernel - 1 inputs)
    conv_bias: bool
    # Mamba-2 only: heads x head_dim = the mixer's inner width; B and C per group of heads.
    mamba_heads: int = 0
    mamba_head_dim: int = 0
    mamba_groups: int = 1
    mamba_state: int = 0
    mamba_chunk: int = 256  # the scan's chunk in prefill (a reduction order, not a result)
    mamba_proj_bias: bool = False  # in_proj's bias
    mamba_out_bias: bool = False  # out_proj's (Bamba: mamba_proj_bias; Falcon-H1: projectors_bias)
    time_step_limit: tuple[float, float] = (0.0, math.inf)
    # The output's gated RMSNorm over each group's channels: "after_gate" (Bamba: norm(y * silu(z))),
    # "before_gate" (norm(y) * silu(z)) or "none" (y * silu(z), no norm and no weight).
    mamba_norm: str = "after_gate"
    # Falcon-H1's muP: the mixer's input times `ssm_in_multiplier`, and in_proj's output times
    # `ssm_multipliers` (one each for z, x, B, C and dt).
    ssm_in_multiplier: float = 1.0
    ssm_multipliers: tuple[float, float, float, float, float] = (1.0, 1.0, 1.0, 1.0, 1.0)
    falcon: FalconH1Multipliers | None = None  # Falcon-H1's multipliers outside the mixer
    # Gated DeltaNet only: q and k per key head, v per value head (a group of them per key head).
    delta_key_heads: int = 0
    delta_value_heads: int = 0
    delta_key_dim: int = 0
    delta_value_dim: int = 0
    delta_chunk: int = 64  # the chunked delta rule's chunk in prefill (transformers' too; an order only)

    @property
    def mamba_inner(self) -> int:
        return self.mamba_heads * self.mamba_head_dim

    @property
    def conv_channels(self) -> int:
        """Channels the convolution runs over: Mamba-2's x|B|C, a DeltaNet's q|k|v (LFM2's: the
        hidden size)."""
        if self.kind == "gated_deltanet":
            return 2 * self.delta_key_heads * self.delta_key_dim + self.delta_value_heads * self.delta_value_dim
        return self.mamba_inner + 2 * self.mamba_groups * self.mamba_state

    def state_shapes(self, hidden: int) -> list[tuple[int, ...]]:
        """One recurrent layer's states for one request: the convolution's last kernel - 1
        inputs, and a Mamba-2 mixer's SSM state `[heads, head_dim, state]` or a DeltaNet's
        `[value heads, key dim, value dim]`."""
        if self.kind == "short_conv":
            return [(hidden, self.conv_kernel - 1)]
        conv = (self.conv_channels, self.conv_kernel - 1)
        if self.kind == "gated_deltanet":
            return [conv, (self.delta_value_heads, self.delta_key_dim, self.delta_value_dim)]
        return [conv, (self.mamba_heads, self.mamba_head_dim, self.mamba_state)]


def parse_recurrent(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """`HfConfig`'s fields (but `architecture` and `checkpoint_dtype`, which hf_config.py adds) from
    the config.json of a hybrid architecture (module note); a `ValueError` naming the field."""
    if arch in ("BambaForCausalLM", "GraniteMoeHybridForCausalLM"):
        return _parse_mamba_hybrid(arch, hf)
    if arch == "FalconH1ForCausalLM":
        return _parse_falcon_h1(arch, hf)
    if arch == "Qwen3NextForCausalLM":
        return _parse_qwen3_next(arch, hf)
    return _parse_lfm2(arch, hf)


def _parse_lfm2(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    if hf.get("quantization_config"):
        raise ValueError(f"quantization_config: quantized checkpoints of {arch} are not supported")
    hidden = _int(hf, "hidden_size", 2560)
    num_heads = _int(hf, "num_attention_heads", 32)
    num_layers = _int(hf, "num_hidden_layers", 32)
    check_head_counts({"head_dim": None}, hidden, num_heads)
    num_kv_heads = _int(hf, "num_key_value_heads", 8, null=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(
            f"num_key_value_heads: {num_kv_heads} does not divide num_attention_heads {num_heads}; allowed: a "
            f"divisor of {num_heads}"
        )
    head_dim = hidden // num_heads
    if head_dim % 2:
        raise ValueError(f"num_attention_heads: RoPE needs an even head dimension, got {head_dim}")
    layer_types = hf.get("layer_types")
    if layer_types is None:
        full = hf.get("full_attn_idxs")
        full = list(range(num_layers)) if full is None else full
        if not isinstance(full, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in full):
            raise ValueError(f"full_attn_idxs: expected a list of layer indices below {num_layers}, got {full!r:.80}")
        layer_types = ["full_attention" if i in full else "conv" for i in range(num_layers)]
    if not isinstance(layer_types, list) or len(layer_types) != num_layers:
        raise ValueError(
            f"layer_types: expected a list of {num_layers} entries (one per layer), got {layer_types!r:.80}"
        )
    unknown = sorted({str(t) for t in layer_types if t not in _LFM2_LAYER_TYPES})
    if unknown:
        raise ValueError(f"layer_types: {', '.join(unknown)} not supported for {arch}; supported: full_attention, conv")
    if "full_attention" not in layer_types:
        raise ValueError(f"layer_types: {arch} needs at least one full_attention layer")
    kernel = _int(hf, "conv_L_cache", 3, minimum=2)
    ff = _int(hf, "block_ff_dim", None) if "block_ff_dim" in hf else _int(hf, "intermediate_size", 12288)
    if _bool(hf, "block_auto_adjust_ff_dim", True):  # transformers' Lfm2MLP
        ff = int(2 * ff / 3)
        multiplier = hf.get("block_ffn_dim_multiplier", 1.0)
        if multiplier is not None:
            if isinstance(multiplier, bool) or not isinstance(multiplier, int | float) or multiplier <= 0:
                raise ValueError(f"block_ffn_dim_multiplier: expected a positive number, got {multiplier!r}")
            multiple = _int(hf, "block_multiple_of", 256)
            ff = multiple * ((int(multiplier * ff) + multiple - 1) // multiple)
    eps = hf.get("norm_eps", 1e-5)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ValueError(f"norm_eps: expected a positive number, got {eps!r}")
    max_pos = _int(hf, "max_position_embeddings", 128_000)
    rope_hf = hf if ("rope_theta" in hf or hf.get("rope_parameters")) else {**hf, "rope_theta": 1_000_000.0}
    tie = hf.get("tie_embedding", hf.get("tie_word_embeddings", True))
    if not isinstance(tie, bool):
        raise ValueError(f"tie_word_embeddings: expected true or false, got {tie!r}")
    return dict(
        hidden_size=hidden,
        intermediate_size=ff,
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=_int(hf, "vocab_size", 65536),
        rms_norm_eps=float(eps),
        rope=parse_rope(rope_hf, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=tie,
        qkv_bias=False,
        o_proj_bias=False,
        mlp_bias=False,
        sliding_window=None,
        encoder=None,
        layer_types=tuple(layer_types),
        qk_norm="head",
        recurrent=RecurrentSpec("short_conv", conv_kernel=kernel, conv_bias=_bool(hf, "conv_bias", False)),
    )


def _parse_mamba_hybrid(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """Bamba as transformers' `BambaConfig` reads it: Llama attention (partial rotary, 0.5 as
    transformers fixes it) on `attn_layer_indices`, Mamba-2 mixers on the other layers, a gated MLP
    on every layer. Granite 4.0-H (`GraniteMoeHybridConfig`): the layers by `layer_types`, RoPE
    only with `position_embedding_type` "rope" (else none), Granite's multipliers, and the MLP of
    every layer routed experts (`num_local_experts`, top-k softmax) plus a shared MLP
    (`shared_intermediate_size`)."""
    granite = arch == "GraniteMoeHybridForCausalLM"
    if hf.get("quantization_config"):
        raise ValueError(f"quantization_config: quantized checkpoints of {arch} are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {hf.get('hidden_act')!r} is not supported for {arch}; supported: silu")
    hidden = _int(hf, "hidden_size", 4096)
    num_heads = _int(hf, "num_attention_heads", 32)
    num_layers = _int(hf, "num_hidden_layers", 32)
    check_head_counts({"head_dim": None}, hidden, num_heads)
    num_kv_heads = _int(hf, "num_key_value_heads", num_heads if granite else 8, null=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads: {num_kv_heads} does not divide num_attention_heads {num_heads}")
    head_dim = hidden // num_heads
    if granite:
        raw_types = hf.get("layer_types") or ["mamba"] * num_layers
        if (
            not isinstance(raw_types, list)
            or len(raw_types) != num_layers
            or any(t not in _MAMBA_TYPES for t in raw_types)
        ):
            raise ValueError(f"layer_types: expected {num_layers} of {', '.join(_MAMBA_TYPES)}, got {raw_types!r:.80}")
        layer_types = tuple(_MAMBA_TYPES[t] for t in raw_types)
    else:
        attn = hf.get("attn_layer_indices") or []
        if not isinstance(attn, list) or not all(isinstance(i, int) and 0 <= i < num_layers for i in attn):
            raise ValueError(
                f"attn_layer_indices: expected a list of layer indices below {num_layers}, got {attn!r:.80}"
            )
        layer_types = tuple("full_attention" if i in attn else "mamba" for i in range(num_layers))
    if "full_attention" not in layer_types:
        field = "layer_types" if granite else "attn_layer_indices"
        raise ValueError(f"{field}: {arch} without attention layers is not supported (at least one)")
    heads, head, groups = _mamba_heads(hf, _int(hf, "mamba_expand", 2) * hidden, "mamba_expand x hidden_size")
    low, high = _time_step_limit(hf)
    max_pos = _int(hf, "max_position_embeddings", 2048 if granite else 262144)
    rope = parse_rope(hf, max_pos, allow_partial=not granite)
    extra: dict[str, Any] = {}
    if granite:
        rotary = head_dim if hf.get("position_embedding_type") == "rope" else 0  # 0: no rotary (NoPE)
        extra = {
            "embedding_multiplier": _number(hf, "embedding_multiplier"),
            "residual_multiplier": _number(hf, "residual_multiplier"),
            "attention_scale": _number(hf, "attention_multiplier"),
            "logits_divisor": _number(hf, "logits_scaling"),
        }
        experts = _int(hf, "num_local_experts", 8, minimum=0)
        shared = _int(hf, "shared_intermediate_size", 1024)
        if experts:
            top_k = _int(hf, "num_experts_per_tok", 2)
            if top_k > experts:
                raise ValueError(f"num_experts_per_tok: {top_k} is more than num_local_experts {experts}")
            extra["moe"] = MoESpec(experts, top_k, _int(hf, "intermediate_size", 11008), True, (True,) * num_layers)
    else:
        params = hf.get("rope_parameters") or {}
        partial = params.get("partial_rotary_factor", 0.5) if isinstance(params, Mapping) else 0.5
        rotary = int(head_dim * partial)
        if rotary <= 0 or rotary % 2 or rotary > head_dim:
            raise ValueError(f"rope_parameters.partial_rotary_factor: {partial} gives {rotary} rotary dimensions")
    return dict(
        hidden_size=hidden,
        intermediate_size=shared if granite else _int(hf, "intermediate_size", 14336),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=_int(hf, "vocab_size", 32000 if granite else 128000),
        rms_norm_eps=_eps(hf, 1e-6 if granite else 1e-5),
        rope=rope,
        max_position_embeddings=max_pos,
        tie_word_embeddings=_bool(hf, "tie_word_embeddings", False),
        qkv_bias=_bool(hf, "attention_bias", False),
        o_proj_bias=_bool(hf, "attention_bias", False),
        mlp_bias=False if granite else _bool(hf, "mlp_bias", False),
        sliding_window=None,
        encoder=None,
        layer_types=layer_types,
        rotary_dim=None if rotary == head_dim else rotary,
        recurrent=_mamba2(hf, heads, head, groups, (low, high), out_bias="mamba_proj_bias"),
        **extra,
    )


def _mamba2(
    hf: Mapping[str, Any],
    heads: int,
    head: int,
    groups: int,
    time_step_limit: tuple[float, float],
    *,
    out_bias: str,
    **more: Any,
) -> RecurrentSpec:
    """A Mamba-2 mixer's spec as Bamba's and Falcon-H1's configs name its fields (`out_bias`: the
    field that gives out_proj a bias: Bamba's `mamba_proj_bias`, Falcon-H1's `projectors_bias`)."""
    return RecurrentSpec(
        "mamba2",
        conv_kernel=_int(hf, "mamba_d_conv", 4, minimum=2),
        conv_bias=_bool(hf, "mamba_conv_bias", True),
        mamba_heads=heads,
        mamba_head_dim=head,
        mamba_groups=groups,
        mamba_state=_int(hf, "mamba_d_state", 256),
        mamba_chunk=_int(hf, "mamba_chunk_size", 256),
        mamba_proj_bias=_bool(hf, "mamba_proj_bias", False),
        mamba_out_bias=_bool(hf, out_bias, False),
        time_step_limit=time_step_limit,
        **more,
    )


def _parse_falcon_h1(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """Falcon-H1 as transformers' `FalconH1Config` reads it: every layer attention (Llama's, with
    `head_dim`, keys times `key_multiplier`) and a Mamba-2 mixer of `mamba_d_ssm` channels (or
    `mamba_expand` x hidden_size where it is null) on the same normed input, their outputs times
    `attention_out_multiplier` / `ssm_out_multiplier` summed into the residual; the mixer's
    output norm only with `mamba_rms_norm` (before or after the gate: `mamba_norm_before_gate`),
    its in_proj bias `mamba_proj_bias`, its out_proj bias `projectors_bias`; a gated MLP with
    `mlp_multipliers`; embeddings and logits times their multipliers."""
    if hf.get("quantization_config"):
        raise ValueError(f"quantization_config: quantized checkpoints of {arch} are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {hf.get('hidden_act')!r} is not supported for {arch}; supported: silu")
    hidden = _int(hf, "hidden_size", 4096)
    num_heads = _int(hf, "num_attention_heads", 32)
    num_layers = _int(hf, "num_hidden_layers", 32)
    check_head_counts(hf, hidden, num_heads)
    num_kv_heads = _int(hf, "num_key_value_heads", 8, null=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads: {num_kv_heads} does not divide num_attention_heads {num_heads}")
    head_dim = _int(hf, "head_dim", hidden // num_heads, null=hidden // num_heads)
    if head_dim % 2:
        raise ValueError(f"head_dim: RoPE needs an even head dimension, got {head_dim}")
    if hf.get("mamba_d_ssm", 1024) is None:
        inner, what = _int(hf, "mamba_expand", 2) * hidden, "mamba_expand x hidden_size"
    else:
        inner, what = _int(hf, "mamba_d_ssm", 1024), "mamba_d_ssm"
    heads, head, groups = _mamba_heads(hf, inner, what)
    low, high = _time_step_limit(hf)
    ssm = _multipliers(hf, "ssm_multipliers", 5)
    mlp = _multipliers(hf, "mlp_multipliers", 2)
    max_pos = _int(hf, "max_position_embeddings", 8192)
    if _bool(hf, "mamba_rms_norm", False):
        norm = "before_gate" if _bool(hf, "mamba_norm_before_gate", True) else "after_gate"
    else:
        norm = "none"
    return dict(
        hidden_size=hidden,
        intermediate_size=_int(hf, "intermediate_size", 14336),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=_int(hf, "vocab_size", 128000),
        rms_norm_eps=_eps(hf, 1e-5),
        rope=parse_rope(hf, max_pos),
        max_position_embeddings=max_pos,
        tie_word_embeddings=_bool(hf, "tie_word_embeddings", False),
        qkv_bias=_bool(hf, "attention_bias", False),
        o_proj_bias=_bool(hf, "attention_bias", False),
        mlp_bias=_bool(hf, "mlp_bias", False),
        sliding_window=None,
        encoder=None,
        layer_types=("hybrid",) * num_layers,
        embedding_multiplier=_finite(hf, "embedding_multiplier"),
        recurrent=_mamba2(
            hf,
            heads,
            head,
            groups,
            (low, high),
            out_bias="projectors_bias",
            mamba_norm=norm,
            ssm_in_multiplier=_finite(hf, "ssm_in_multiplier"),
            ssm_multipliers=(ssm[0], ssm[1], ssm[2], ssm[3], ssm[4]),
            falcon=FalconH1Multipliers(
                attention_in=_finite(hf, "attention_in_multiplier"),
                attention_out=_finite(hf, "attention_out_multiplier"),
                key=_finite(hf, "key_multiplier"),
                ssm_out=_finite(hf, "ssm_out_multiplier"),
                mlp_gate=mlp[0],
                mlp_down=mlp[1],
                lm_head=_finite(hf, "lm_head_multiplier"),
            ),
        ),
    )


_QWEN3_NEXT_LAYER_TYPES = ("linear_attention", "full_attention")


def _parse_qwen3_next(arch: str, hf: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen3-Next as transformers' `Qwen3NextConfig` reads it: `layer_types` (or every
    `full_attention_interval`-th layer full attention, the others linear) of gated attention
    (q_proj gives each head's query and a sigmoid output gate; q/k RMSNorm per head; partial
    rotary, `partial_rotary_factor` 0.25 when absent) and gated DeltaNet (`linear_*`); every
    RMSNorm scales by (1 + w) but the DeltaNet's gated one; routed experts (softmax top-k,
    `norm_topk_prob`) plus a shared expert scaled by sigmoid(`shared_expert_gate`) on the layers
    off `mlp_only_layers` and on `decoder_sparse_step`, a dense MLP elsewhere or with no experts.
    The multi-token-prediction head (`mtp_*`, `mtp.*` tensors) is not run."""
    if hf.get("quantization_config"):
        raise ValueError(f"quantization_config: quantized checkpoints of {arch} are not supported")
    if hf.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act: {hf.get('hidden_act')!r} is not supported for {arch}; supported: silu")
    hidden = _int(hf, "hidden_size", 2048)
    num_heads = _int(hf, "num_attention_heads", 16)
    num_layers = _int(hf, "num_hidden_layers", 48)
    num_kv_heads = _int(hf, "num_key_value_heads", 2, null=num_heads)
    if num_heads % num_kv_heads:
        raise ValueError(f"num_key_value_heads: {num_kv_heads} does not divide num_attention_heads {num_heads}")
    head_dim = _int(hf, "head_dim", 256)
    layer_types = hf.get("layer_types")
    if layer_types is None:
        interval = _int(hf, "full_attention_interval", 4)
        layer_types = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(num_layers)]
    if (
        not isinstance(layer_types, list)
        or len(layer_types) != num_layers
        or any(t not in _QWEN3_NEXT_LAYER_TYPES for t in layer_types)
    ):
        raise ValueError(
            f"layer_types: expected {num_layers} of {', '.join(_QWEN3_NEXT_LAYER_TYPES)}, got {layer_types!r:.80}"
        )
    if "full_attention" not in layer_types:
        raise ValueError(f"layer_types: {arch} needs at least one full_attention layer")
    max_pos = _int(hf, "max_position_embeddings", 32768)
    rope_params = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    if "partial_rotary_factor" not in hf and not (
        isinstance(rope_params, Mapping) and "partial_rotary_factor" in rope_params
    ):
        hf = {**hf, "partial_rotary_factor": 0.25}  # transformers' default for Qwen3-Next
    rotary = int(head_dim * partial_rotary_factor(hf))
    if rotary <= 0 or rotary % 2:
        raise ValueError(f"partial_rotary_factor: {partial_rotary_factor(hf)} gives {rotary} rotary dimensions")
    key_heads = _int(hf, "linear_num_key_heads", 16)
    value_heads = _int(hf, "linear_num_value_heads", 32)
    if value_heads % key_heads:
        raise ValueError(
            f"linear_num_value_heads: {value_heads} is not a multiple of linear_num_key_heads {key_heads}"
        )
    experts = _int(hf, "num_experts", 512, minimum=0)
    moe = None
    if experts:
        top_k = _int(hf, "num_experts_per_tok", 10)
        if top_k > experts:
            raise ValueError(f"num_experts_per_tok: {top_k} is more than num_experts {experts}")
        step = _int(hf, "decoder_sparse_step", 1)
        dense = hf.get("mlp_only_layers") or []
        if not isinstance(dense, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in dense):
            raise ValueError(f"mlp_only_layers: expected a list of layer indices, got {dense!r:.80}")
        moe = MoESpec(
            num_experts=experts,
            top_k=top_k,
            intermediate_size=_int(hf, "moe_intermediate_size", 512),
            renormalize=_bool(hf, "norm_topk_prob", True),
            sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(num_layers)),
            shared_intermediate_size=_int(hf, "shared_expert_intermediate_size", 512),
            shared_gate=True,
        )
    attention_bias = _bool(hf, "attention_bias", False)
    return dict(
        hidden_size=hidden,
        intermediate_size=_int(hf, "intermediate_size", 5632),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        vocab_size=_int(hf, "vocab_size", 151936),
        rms_norm_eps=_eps(hf, 1e-6),
        rope=parse_rope(hf, max_pos, allow_partial=True),
        max_position_embeddings=max_pos,
        tie_word_embeddings=_bool(hf, "tie_word_embeddings", False),
        qkv_bias=attention_bias,
        o_proj_bias=attention_bias,
        mlp_bias=False,
        sliding_window=None,
        encoder=None,
        layer_types=tuple(layer_types),
        rotary_dim=None if rotary == head_dim else rotary,
        qk_norm="head",
        norm_offset=True,
        moe=moe,
        recurrent=RecurrentSpec(
            "gated_deltanet",
            conv_kernel=_int(hf, "linear_conv_kernel_dim", 4, minimum=2),
            conv_bias=False,
            delta_key_heads=key_heads,
            delta_value_heads=value_heads,
            delta_key_dim=_int(hf, "linear_key_head_dim", 128),
            delta_value_dim=_int(hf, "linear_value_head_dim", 128),
        ),
    )


def _mamba_heads(hf: Mapping[str, Any], inner: int, what: str) -> tuple[int, int, int]:
    """A Mamba-2 mixer's (heads, head_dim, groups): `mamba_n_heads` heads of `mamba_d_head`
    channels ("auto": `inner` / heads) making `inner` channels, B and C per `mamba_n_groups`."""
    heads = _int(hf, "mamba_n_heads", 128)
    if inner % heads:
        raise ValueError(f"mamba_n_heads: {heads} does not divide {what} = {inner}")
    head = hf.get("mamba_d_head", "auto")
    head = inner // heads if head in ("auto", None) else head
    if isinstance(head, bool) or not isinstance(head, int) or head * heads != inner:
        raise ValueError(f"mamba_d_head: {head!r} x mamba_n_heads {heads} must equal {what} = {inner}")
    groups = _int(hf, "mamba_n_groups", 1)
    if heads % groups:
        raise ValueError(f"mamba_n_groups: {groups} does not divide mamba_n_heads {heads}")
    return heads, head, groups


def _time_step_limit(hf: Mapping[str, Any]) -> tuple[float, float]:
    limit = hf.get("time_step_limit") or (0.0, math.inf)
    low, high = (
        (_float_or_inf(v) for v in limit) if isinstance(limit, list | tuple) and len(limit) == 2 else (None, None)
    )
    if low is None or high is None or not low <= high:
        raise ValueError(f"time_step_limit: expected [low, high] with low <= high, got {limit!r:.80}")
    return low, high


def _finite(hf: Mapping[str, Any], key: str) -> float:
    """A multiplier: any finite number, 1.0 when absent or null."""
    value = hf.get(key)
    if value is None:
        return 1.0
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise ValueError(f"{key}: expected a finite number, got {value!r}")
    return float(value)


def _multipliers(hf: Mapping[str, Any], key: str, count: int) -> list[float]:
    """A list of `count` finite multipliers (all 1.0 when absent or null)."""
    value = hf.get(key)
    if value is None:
        return [1.0] * count
    if (
        not isinstance(value, list | tuple)
        or len(value) != count
        or not all(not isinstance(v, bool) and isinstance(v, int | float) and math.isfinite(v) for v in value)
    ):
        raise ValueError(f"{key}: expected a list of {count} finite numbers, got {value!r:.80}")
    return [float(v) for v in value]


def _number(hf: Mapping[str, Any], key: str, default: float = 1.0) -> float:
    value = hf.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"{key}: expected a positive number, got {value!r}")
    return float(value)


def _float_or_inf(value: Any) -> float | None:
    """A number, or transformers' JSON spelling of infinity (`{"__float__": "Infinity"}`)."""
    if isinstance(value, Mapping) and value.get("__float__") in ("Infinity", "inf"):
        return math.inf
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)
