"""OLMo 2 decoders: norms after attention and after the MLP, none before.

Per layer (transformers' Olmo2DecoderLayer): x += post_attention_norm(attn(x)), then
x += post_feedforward_norm(mlp(x)). The attention normalises the whole q and k projections (all
heads at once, before RoPE: `qk_norm="full"`), which is why it is not tensor-parallel here.
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

__all__ = ["Olmo2ForCausalLM"]


class Olmo2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> None:
        super().__init__()
        self.self_attn = SelfAttention(cfg, index, shard)
        self.mlp = GatedMLP(cfg, shard)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = meta.triton
        x = x + self.post_attention_layernorm.forward(self.self_attn.forward(x, ropes, meta, k_cache, v_cache), t)
        return x + self.post_feedforward_layernorm.forward(self.mlp.forward(x), t)


class Olmo2ForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        return Olmo2DecoderLayer(cfg, index, shard)
