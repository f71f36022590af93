"""Mixture-of-experts decoders: Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE (and Shared).

Llama's layer (with the family's q/k norms and multipliers, from the config) whose MLP is a
sparse block: a router (`gate`, a linear layer to one logit per expert) and the routed experts
(layers/moe.py), which run only the experts each token picked, plus a shared expert every token
runs where the family has one (Qwen2-MoE: scaled per token by sigmoid(`shared_expert_gate`);
Granite MoE Shared: `shared_mlp`, added as is). Qwen2/3-MoE layers listed in `mlp_only_layers`
(or off the `decoder_sparse_step`) keep a dense MLP. Checkpoints name the block `mlp` (Qwen, OLMoE)
or `block_sparse_moe` with experts `w1`/`w3`/`w2` (Mixtral) or `input_linear` (gate|up of every
expert) / `output_linear` and `router.layer` (Granite); the loader maps them all.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.linear import column
from triollm.engine.execution.layers.moe import FusedMoE, fused_experts, route_grouped
from triollm.engine.execution.models.base import GatedMLP
from triollm.engine.execution.models.llama import LlamaDecoderLayer, LlamaForCausalLM
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["MoEForCausalLM", "SparseMoeBlock"]

# Granite MoE's checkpoint names: every expert's gate|up and down stacked in one tensor each (read
# as transformers 5's stacked form), the router's linear layer one level down.
_GRANITE_NAMES = (
    (".block_sparse_moe.input_linear.weight", ".mlp.experts.gate_up_proj"),
    (".block_sparse_moe.output_linear.weight", ".mlp.experts.down_proj"),
    (".block_sparse_moe.router.layer.", ".mlp.gate."),
    (".shared_mlp.input_linear.", ".mlp.shared_expert.gate_up_proj."),
    (".shared_mlp.output_linear.", ".mlp.shared_expert.down_proj."),
    # GLM-4.5 (DeepSeek V3's names): the shared experts, the grouped router's correction bias.
    (".mlp.shared_experts.", ".mlp.shared_expert."),
    (".mlp.gate.e_score_correction_bias", ".mlp.e_score_correction_bias"),
)


class SparseMoeBlock(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = column(cfg.hidden_size, [(0, moe.num_experts)], False)
        self.experts = FusedMoE(
            moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size, renormalize=moe.renormalize
        )
        self.shared_expert = GatedMLP(cfg, None, moe.shared_intermediate_size) if moe.shared_intermediate_size else None
        self.shared_expert_gate = column(cfg.hidden_size, [(0, 1)], False) if moe.shared_gate else None
        self.moe = moe
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(moe.num_experts), requires_grad=False) if moe.scoring == "sigmoid" else None
        )

    def load(self, leaf: str, piece: int, source: Any) -> None:
        """The grouped router's correction bias (checkpoint: `mlp.gate.e_score_correction_bias`)."""
        param = getattr(self, leaf)
        tensor = source[:]
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(f"model: a tensor of shape {tuple(tensor.shape)} where {tuple(param.shape)} was expected")
        param.data.copy_(tensor)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate.forward(x)
        if self.e_score_correction_bias is None:
            out = self.experts.forward(x, logits)
        else:
            moe, experts = self.moe, self.experts
            weights, ids = route_grouped(
                logits, self.e_score_correction_bias, moe.top_k, moe.groups, moe.topk_groups, moe.renormalize,
                moe.routed_scaling, x.dtype,
            )  # fmt: skip
            out = fused_experts(x, experts.w13, experts.w2, weights, ids)
        if self.shared_expert is None:
            return out
        shared = self.shared_expert.forward(x)
        if self.shared_expert_gate is not None:
            shared = torch.sigmoid(self.shared_expert_gate.forward(x)) * shared
        return out + shared


class MoEForCausalLM(LlamaForCausalLM):
    """Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, Granite MoE."""

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
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= self.cfg.num_layers:
            return None  # GLM-4.5's multi-token-prediction layers, after the decoder's
        for theirs, ours in _GRANITE_NAMES:
            name = name.replace(theirs, ours)
        if ".block_sparse_moe." in name:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            for ours, theirs in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                name = name.replace(f".{theirs}.weight", f".{ours}.weight")
        return super().remap(name)

    def fused_pieces(self, module: str) -> list[int] | None:
        moe = self.cfg.moe
        if moe is not None and module.endswith("mlp.shared_expert.gate_up_proj") and self.cfg.architecture.startswith(
            "GraniteMoe"
        ):  # Granite's shared MLP: gate | up in one checkpoint tensor
            return [moe.shared_intermediate_size] * 2
        return None
