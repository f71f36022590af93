"""StableLM (StableLM-3B-4E1T, StableLM 2, Zephyr): LayerNorms with biases (`layer_norm_eps`), a
partial rotary (`partial_rotary_factor`), Llama's gated MLP, q/k/v biases (`use_qkv_bias`), q/k
LayerNorms with a weight per head (`qk_layernorm`), and sequential or parallel residuals
(`use_parallel_residual`: then one norm feeds both; layernorm_decoder.py has the layers).
"""

from __future__ import annotations

from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.models.base import GatedMLP
from triollm.engine.execution.models.layernorm_decoder import (
    LayerNormAttention,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
)
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["StableLmForCausalLM"]


class StableLmForCausalLM(LayerNormCausalLM):
    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        return LayerNormDecoderLayer(LayerNormAttention(cfg, index, shard), GatedMLP(cfg, shard), cfg, post_norm=False)

    def remap(self, name: str) -> str | None:
        name = name.replace(".self_attn.q_layernorm.", ".self_attn.q_ln.")
        return super().remap(name.replace(".self_attn.k_layernorm.", ".self_attn.k_ln."))
