"""Mixture-of-experts decoders: Mixtral and Qwen3-MoE.

Llama's layer (Qwen3-MoE: with Qwen3's q/k norms, from the config) whose MLP is a sparse block: a
router (`gate`, a linear layer to one logit per expert) and the routed experts (layers/moe.py),
which run only the experts each token picked. Qwen3-MoE layers listed in `mlp_only_layers` (or
off the `decoder_sparse_step`) keep a dense MLP. Checkpoints name the block `mlp` (Qwen3-MoE) or
`block_sparse_moe` with experts `w1`/`w3`/`w2` (Mixtral); the loader maps both.
"""

from __future__ import annotations

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.linear import column
from triollm.engine.execution.layers.moe import FusedMoE
from triollm.engine.execution.models.base import GatedMLP
from triollm.engine.execution.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["MoEForCausalLM", "SparseMoeBlock"]


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = column(cfg.hidden_size, [(0, moe.num_experts)], False)
        self.experts = FusedMoE(
            moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size, renormalize=moe.renormalize
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.experts.forward(x, self.gate.forward(x))


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral and Qwen3-MoE."""

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        moe = cfg.moe
        assert moe is not None
        if shard is not None:
            raise ValueError(
                f"tensor_parallel_size: {cfg.architecture} (routed experts) is not supported with tensor parallelism"
            )
        mlp = SparseMoeBlock(cfg) if moe.sparse_layers[index] else GatedMLP(cfg, shard)
        return LlamaDecoderLayer(cfg, index, shard, mlp)

    def remap(self, name: str) -> str | None:
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                name = name.replace(f".{theirs}.weight", f".{ours}.weight")
        return super().remap(name)
