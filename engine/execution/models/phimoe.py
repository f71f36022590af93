"""Phi-MoE (Phi-3.5-MoE): Mixtral's layout with LayerNorms, biases and sparsemixer routing.

Per layer (transformers' PhimoeDecoderLayer): x += attn(ln1(x)), x += moe(ln2(x)), both norms
LayerNorms with a bias (the final one too), q/k/v/o with biases where `attention_bias`, a window
on every layer where `sliding_window` is set, a biased head where `lm_head_bias`; the LongRoPE
reading is hf_families.py's (`_phimoe`). The layers are layernorm_decoder.py's sequential ones.

The routing is the sparsemixer's eval-mode path (`sparsemixer`), not a top-2 softmax: the first
expert is the argmax of the router logits, weighted by its softmax over only the logits near
the max (those with (max - s) / max(|s|, max) <= 2 * eps, eps being `router_jitter_noise`, which
inference reads too); the second is the argmax with the first masked out, weighted by its softmax
over the logits near *that* max (the first still masked). The weights are not renormalised. The
training-only parts (Gumbel sampling, the Heun midpoint mask, `input_jitter_noise`) never run
under `model.eval()`. The experts are FusedMoE's SwiGLU experts, run by `fused_experts`.

Checkpoints name the block `block_sparse_moe` with `gate` and experts `w1`/`w3`/`w2` (the released
weights), or transformers 5's `mlp.router` and stacked `mlp.experts.gate_up_proj` / `down_proj`;
the loader reads either.
"""

from __future__ import annotations

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.linear import column
from triollm.engine.execution.layers.moe import FusedMoE, fused_experts
from triollm.engine.execution.models.base import SelfAttention
from triollm.engine.execution.models.layernorm_decoder import LayerNormCausalLM, LayerNormDecoderLayer
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["PhimoeForCausalLM", "SparseMixerMoE", "sparsemixer"]

_RENAMES = (
    (".block_sparse_moe.", ".mlp."),
    (".mlp.router.", ".mlp.gate."),
)
_EXPERT_NAMES = (
    (".w1.weight", ".gate_proj.weight"),
    (".w3.weight", ".up_proj.weight"),
    (".w2.weight", ".down_proj.weight"),
)


def sparsemixer(logits: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights `[T, 2]`, expert ids `[T, 2]`) as transformers' `sparsemixer` computes them in eval
    mode (module note), op for op."""

    def pick(scores: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        top, ids = scores.max(dim=-1, keepdim=True)
        factor = logits.abs().clamp(min=top)  # of the unmasked logits, as transformers has it
        gates = scores.masked_fill((top - logits) / factor > 2 * eps, float("-inf"))
        return torch.softmax(gates, dim=-1).gather(-1, ids), ids

    first_weight, first = pick(logits)
    second_weight, second = pick(logits.scatter(-1, first, float("-inf")))
    return torch.cat((first_weight, second_weight), dim=-1), torch.cat((first, second), dim=-1)


class SparseMixerMoE(nn.Module):
    """The router (`gate`) and the routed experts, every layer."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.gate = column(cfg.hidden_size, [(0, moe.num_experts)], False)
        self.experts = FusedMoE(moe.num_experts, 2, cfg.hidden_size, moe.intermediate_size, renormalize=False)
        self.eps = moe.jitter_eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = sparsemixer(self.gate.forward(x), self.eps)
        return fused_experts(x, self.experts.w13, self.experts.w2, weights.to(x.dtype), ids)


class PhimoeForCausalLM(LayerNormCausalLM):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__(cfg, shard)
        if cfg.lm_head_bias and self.lm_head is not None:
            self.lm_head = column(cfg.hidden_size, self.lm_head.rows, True)

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        if shard is not None:
            raise ValueError(
                f"tensor_parallel_size: {cfg.architecture} (routed experts) is not supported with tensor parallelism"
            )
        return LayerNormDecoderLayer(SelfAttention(cfg, index, None), SparseMixerMoE(cfg), cfg, post_norm=True)

    def remap(self, name: str) -> str | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        if ".mlp.experts." in name:
            for theirs, ours in _EXPERT_NAMES:
                name = name.replace(theirs, ours)
        return super().remap(name)
