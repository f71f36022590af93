"""GPT-NeoX (Pythia, GPT-NeoX-20B, ...): LayerNorms with biases, a partial rotary (`rotary_pct`),
parallel or sequential residuals (`use_parallel_residual`), an ungated biased MLP and an untied
`embed_out` head (layernorm_decoder.py has the layers).

Its `query_key_value` holds q, k and v interleaved per head ([q, k, v] of head 0, then of head
1, ...), where our attention reads them stacked (all q, then all k, then all v): `InterleavedQKV`
reorders the rows as they load, so the step runs the same fused projection as every family.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.linear import Linear
from triollm.engine.execution.models.layernorm_decoder import (
    DenseMLP,
    LayerNormAttention,
    LayerNormCausalLM,
    LayerNormDecoderLayer,
)
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["GPTNeoXForCausalLM", "InterleavedQKV"]

# Checkpoint name pieces -> ours (after `gpt_neox.` becomes `model.`).
_RENAMES = (
    (".attention.query_key_value.", ".self_attn.qkv_proj."),
    (".attention.dense.", ".self_attn.o_proj."),
    (".mlp.dense_h_to_4h.", ".mlp.fc1."),
    (".mlp.dense_4h_to_h.", ".mlp.fc2."),
)
# Buffers some checkpoints carry (the causal mask and its fill value), not weights.
_BUFFERS = (".attention.bias", ".attention.masked_bias")


class InterleavedQKV(Linear):
    """The q|k|v projection of this rank's `heads` (first, count), loaded from a checkpoint that
    interleaves q, k and v per head (module note)."""

    def __init__(self, in_features: int, heads: tuple[int, int], head_dim: int, bias: bool) -> None:
        super().__init__(in_features, [(0, 3 * heads[1] * head_dim)], bias)
        self.heads, self.head_dim = heads, head_dim

    def load(self, leaf: str, piece: int, source: Any) -> None:
        (first, count), hd = self.heads, self.head_dim
        rows = source[first * 3 * hd : (first + count) * 3 * hd]  # this rank's heads, [q, k, v] each
        tail = tuple(rows.shape[1:])
        stacked = rows.reshape(count, 3, hd, *tail).transpose(0, 1).reshape(3 * count * hd, *tail)
        param = getattr(self, leaf)
        if tuple(param.shape) != tuple(stacked.shape):
            raise ValueError(
                f"model: a query_key_value {leaf} of shape {tuple(stacked.shape)} where {tuple(param.shape)} was "
                f"expected"
            )
        param.data.copy_(stacked)


class GPTNeoXForCausalLM(LayerNormCausalLM):
    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        attn = LayerNormAttention(cfg, index, shard)
        heads = (0, cfg.num_heads) if shard is None else shard.split(cfg.num_heads)
        attn.qkv_proj = InterleavedQKV(cfg.hidden_size, heads, cfg.head_dim, cfg.qkv_bias)
        return LayerNormDecoderLayer(attn, DenseMLP(cfg, shard), cfg, post_norm=True)

    def remap(self, name: str) -> str | None:
        if name.endswith(_BUFFERS) or "rotary_emb" in name:
            return None
        if name.startswith("embed_out."):  # transformers 4.x's name of the head (5.x: lm_head)
            name = "lm_head." + name.removeprefix("embed_out.")
        name = name.replace("gpt_neox.embed_in.", "model.embed_tokens.")
        name = name.replace("gpt_neox.final_layer_norm.", "model.norm.")
        name = name.replace("gpt_neox.", "model.")
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().remap(name)
