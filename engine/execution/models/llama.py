"""Llama-shaped decoders: Llama 2/3.x, SmolLM2, Mistral, Qwen2, Qwen3, Granite, Phi-3/Phi-4, Gemma.

Per layer: RMSNorm, self-attention, residual add fused with the next RMSNorm, gated MLP, residual
add. What the families change is in the config (hf_config.py, hf_families.py): Qwen3's q/k norms,
Granite's multipliers, Gemma's GeLU, (1 + w) norms and scaled embedding, Phi-3's partial rotary and
LongRoPE, sliding windows; and Phi-3 stores q|k|v and gate|up already fused
(`Phi3ForCausalLM.fused_pieces`).

A quantized model's all-decode steps run the whole stack in one native call (`DecodeStack`)
where it computes exactly what these layers would: fp32, one rank, no q/k norms, no multipliers,
every projection quantized without a bias, full rotary, no soft-cap, and no window a sequence
can reach (a window of at least max_model_len is full attention: Mistral 7B v0.1's 4,096). A dense fp32 or
bf16 model of the same shape runs its all-decode steps of 1-4 rows so too (`DenseDecodeStack`:
the projections over oneDNN's packed weights, read in place; biases allowed).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import AttentionMetadata
from triollm.engine.execution.layers.norm import RMSNorm
from triollm.engine.execution.layers.quantized import DecodeStack, DenseDecodeStack, StackLayer
from triollm.engine.execution.layers.rotary import RopeStep
from triollm.engine.execution.models.base import CausalLM, GatedMLP, SelfAttention
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["LlamaDecoderLayer", "LlamaForCausalLM", "Phi3ForCausalLM"]


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, shard: TPShard | None, mlp: nn.Module | None = None) -> None:
        super().__init__()
        exact, offset = cfg.quantization is None, cfg.norm_offset  # quantized: the native fp32 RMSNorm too
        self.self_attn = SelfAttention(cfg, index, shard)
        self.mlp = GatedMLP(cfg, shard) if mlp is None else mlp
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact, offset=offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact, offset=offset)
        self.residual_multiplier = cfg.residual_multiplier

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm.forward(x, meta.triton), ropes, meta, k_cache, v_cache)
        m = self.residual_multiplier
        if m != 1.0:
            h = h * m
        normed, x = self.post_attention_layernorm.add_forward(h, x, meta.triton)  # x + h, normed
        out = self.mlp.forward(normed)
        return x + (out if m == 1.0 else out * m)


class LlamaForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        return LlamaDecoderLayer(cfg, index, shard)

    def make_decode_stack(self) -> DecodeStack | DenseDecodeStack | None:
        cfg = self.cfg
        plain = (
            cfg.qk_norm is None
            and cfg.residual_multiplier == 1.0
            and cfg.embedding_multiplier == 1.0
            and cfg.attention_scale is None
            and cfg.rotary_dim is None
            and all(t in ("full_attention", "sliding_attention") for t in cfg.layer_types)
            and cfg.attn_softcap is None
            and not cfg.norm_offset
        )
        if not plain or self.comm is not None:
            return None
        layers = [cast(LlamaDecoderLayer, layer) for layer in self.layers]
        if not all(isinstance(layer.mlp, GatedMLP) for layer in layers) or cfg.hidden_act != "silu":
            return None
        # Windows as the layers keep them: one no sequence can exceed (max_model_len, e.g. Mistral
        # 7B v0.1's 4,096) is already full attention there, and the stack computes the same.
        if any(
            layer.self_attn.attn.window is not None
            or layer.self_attn.attn.chunk is not None
            or layer.self_attn.rope_index
            for layer in layers
        ):
            return None
        stack = [
            StackLayer(
                layer.input_layernorm.weight,
                layer.post_attention_layernorm.weight,
                (
                    layer.self_attn.qkv_proj,
                    layer.self_attn.o_proj,
                    cast(GatedMLP, layer.mlp).gate_up_proj,
                    cast(GatedMLP, layer.mlp).down_proj,
                ),
            )
            for layer in layers
        ]
        if not stack:
            return None
        attn = layers[0].self_attn.attn
        if cfg.dtype == torch.float32 and DecodeStack.supported(stack):
            return DecodeStack(stack, attn.num_heads, attn.num_kv_heads, attn.scale, cfg.rms_norm_eps)
        if cfg.quantization is None and DenseDecodeStack.supported(stack, cfg.dtype):
            return DenseDecodeStack(stack, attn.num_heads, attn.num_kv_heads, attn.scale, cfg.rms_norm_eps, cfg.dtype)
        return None


class Phi3ForCausalLM(LlamaForCausalLM):
    """Llama's layers; the checkpoint holds `qkv_proj` and `gate_up_proj` fused."""

    def fused_pieces(self, module: str) -> list[int] | None:
        cfg = self.cfg
        if module.endswith("self_attn.qkv_proj"):
            return [cfg.num_heads * cfg.head_dim] + [cfg.num_kv_heads * cfg.head_dim] * 2
        if module.endswith("mlp.gate_up_proj"):
            return [cfg.intermediate_size] * 2
        return None
