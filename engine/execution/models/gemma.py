"""Gemma 2 and Gemma 3 (text) decoders: norms before and after both attention and MLP.

Per layer (transformers' Gemma2DecoderLayer): x += post_attention_norm(attn(input_norm(x))), then
x += post_feedforward_norm(mlp(pre_feedforward_norm(x))); every norm scales by (1 + w). The rest
is configuration (hf_families.py): GeLU-tanh, the embedding times sqrt(hidden), the softmax scale
from `query_pre_attn_scalar`, attention and final logit soft-capping (Gemma 2), sliding windows
on the layers `layer_types` marks, Gemma 3's q/k norms and its local layers' own RoPE.
Gemma (1) is Llama-shaped and runs as `LlamaForCausalLM` with its configuration.
"""

from __future__ import annotations

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import AttentionMetadata
from triollm.engine.execution.layers.norm import RMSNorm
from triollm.engine.execution.layers.rotary import RopeStep
from triollm.engine.execution.models.base import CausalLM, GatedMLP, SelfAttention
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["Gemma2ForCausalLM", "SandwichDecoderLayer"]


class SandwichDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> None:
        super().__init__()
        size, eps, offset = cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_offset
        self.self_attn = SelfAttention(cfg, index, shard)
        self.mlp = GatedMLP(cfg, shard)
        self.input_layernorm = RMSNorm(size, eps, offset=offset)
        self.post_attention_layernorm = RMSNorm(size, eps, offset=offset)
        self.pre_feedforward_layernorm = RMSNorm(size, eps, offset=offset)
        self.post_feedforward_layernorm = RMSNorm(size, eps, offset=offset)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = meta.triton
        h = self.self_attn.forward(self.input_layernorm.forward(x, t), ropes, meta, k_cache, v_cache)
        normed, x = self.pre_feedforward_layernorm.add_forward(self.post_attention_layernorm.forward(h, t), x, t)
        return x + self.post_feedforward_layernorm.forward(self.mlp.forward(normed), t)


class Gemma2ForCausalLM(CausalLM):
    """Gemma 2 and Gemma 3 text (the differences are configuration)."""

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        return SandwichDecoderLayer(cfg, index, shard)
