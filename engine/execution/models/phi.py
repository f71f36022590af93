"""Phi-1, Phi-1.5 and Phi-2: one LayerNorm feeding attention and the MLP in parallel, a partial
rotary (`partial_rotary_factor`), biases on every projection and on the head, the ungated
GELU MLP (fc1, fc2), optional q/k LayerNorms shared by every head (`qk_layernorm`), and
`final_layernorm` (layernorm_decoder.py has the layers). Phi-3 and Phi-4 are Llama-shaped (llama.py).
"""

from __future__ import annotations

from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.models.layernorm_decoder import (
    DenseMLP,
    LayerNormAttention,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
)
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["PhiForCausalLM"]

_RENAMES = (
    ("model.final_layernorm.", "model.norm."),
    (".self_attn.dense.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_ln."),
    (".self_attn.k_layernorm.", ".self_attn.k_ln."),
)


class PhiForCausalLM(LayerNormCausalLM):
    lm_head_bias = True

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        return LayerNormDecoderLayer(LayerNormAttention(cfg, index, shard), DenseMLP(cfg, shard), cfg, post_norm=False)

    def remap(self, name: str) -> str | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().remap(name)
