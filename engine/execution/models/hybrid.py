"""Hybrid decoders: attention layers interleaved with layers that keep a recurrent state.

Every layer is: norm, then self-attention or a recurrent mixer, residual add; norm, the gated
MLP, residual add. Only the attention layers have a KV cache (`ModelConfig.kv_layers`); each
recurrent layer keeps its state in the runner's `StatePool`, and the step says where each
request's rows and state are (`AttentionMetadata.state_rows`, layers/recurrent.py).

- LFM2 (`Lfm2ForCausalLM`): Qwen3-style attention (q/k RMSNorm per head; checkpoint names
  `out_proj`, `q_layernorm`, `k_layernorm`) and gated short convolutions (`conv`); norms
  `operator_norm` / `ffn_norm`, the MLP `feed_forward.w1/w3/w2`, the final norm `embedding_norm`.
- Bamba (`BambaForCausalLM`): Llama attention with partial rotary and Mamba-2 mixers (`mamba`);
  norms `input_layernorm` / `pre_ff_layernorm`, the MLP `feed_forward.*_proj`, the final norm
  `final_layernorm`.
- Granite 4.0-H (`GraniteMoeHybridForCausalLM`): Bamba's mixers, attention without rotary unless
  `position_embedding_type` is "rope", Granite's multipliers (embeddings, residuals, the softmax
  scale, the logits' divisor), and as MLP routed experts (`block_sparse_moe`: `router.layer`,
  `input_linear` gate|up and `output_linear` per expert) plus a shared MLP (`shared_mlp`:
  `input_linear` gate|up stored fused, `output_linear`).
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import AttentionMetadata
from triollm.engine.execution.layers.norm import RMSNorm
from triollm.engine.execution.layers.recurrent import Mamba2Mixer, ShortConv
from triollm.engine.execution.layers.rotary import RopeStep
from triollm.engine.execution.models.base import CausalLM, GatedMLP, SelfAttention
from triollm.engine.execution.models.moe import SparseMoeBlock
from triollm.engine.loading.model_config import ModelConfig
from triollm.kernels import KVCache

__all__ = ["BambaForCausalLM", "GraniteMoeHybridForCausalLM", "HybridForCausalLM", "Lfm2ForCausalLM"]

_SHARED_EXPERTS = ("GraniteMoeHybridForCausalLM",)


class SharedExpertMLP(nn.Module):
    """Granite 4.0-H's MLP: the shared MLP, plus the routed experts where the model has them."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.moe = SparseMoeBlock(cfg) if cfg.moe is not None else None
        self.shared = GatedMLP(cfg, None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.shared.forward(x)
        return out if self.moe is None else out + self.moe.forward(x)


class HybridDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, kv_index: int | None, state_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.self_attn: SelfAttention | None = None
        self.conv: ShortConv | None = None
        self.mamba: Mamba2Mixer | None = None
        spec = cfg.recurrent
        assert spec is not None
        if kv_index is not None:
            self.self_attn = SelfAttention(cfg, index, None)
        elif spec.kind == "short_conv":
            self.conv = ShortConv(cfg.hidden_size, spec.conv_kernel, spec.conv_bias, state_index)
        else:
            self.mamba = Mamba2Mixer(cfg.hidden_size, spec, cfg.rms_norm_eps, state_index)
        self.mlp: nn.Module = SharedExpertMLP(cfg) if cfg.architecture in _SHARED_EXPERTS else GatedMLP(cfg, None)
        self.residual_multiplier = cfg.residual_multiplier
        exact = cfg.quantization is None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact)

    def forward(self, x: torch.Tensor, ropes: list[RopeStep], meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        h = self.input_layernorm.forward(x, meta.triton)
        if self.self_attn is not None:
            assert self.kv_index is not None
            h = self.self_attn.forward(h, ropes, meta, kv.k[self.kv_index], kv.v[self.kv_index])
        else:
            assert meta.state_rows is not None
            mixer = self.conv if self.conv is not None else self.mamba
            assert mixer is not None
            h = mixer.forward(h, meta.state_rows)
        m = self.residual_multiplier
        normed, x = self.post_attention_layernorm.add_forward(h if m == 1.0 else h * m, x, meta.triton)
        out = self.mlp.forward(normed)
        return x + (out if m == 1.0 else out * m)


class HybridForCausalLM(CausalLM):
    """The shell of every hybrid family: a family names its checkpoint's differences in `renames`."""

    renames: ClassVar[tuple[tuple[str, str], ...]] = ()

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        if shard is not None:
            raise ValueError(f"tensor_parallel_size: {cfg.architecture} is not supported with tensor parallelism")
        assert cfg.recurrent is not None
        kv_layers = cfg.kv_layers
        if index in kv_layers:
            return HybridDecoderLayer(cfg, index, kv_layers.index(index), 0)
        per_layer = len(cfg.recurrent.state_shapes(cfg.hidden_size))
        before = sum(i not in kv_layers for i in range(index))  # recurrent layers before this one
        return HybridDecoderLayer(cfg, index, None, before * per_layer)

    def remap(self, name: str) -> str | None:
        for theirs, ours in self.renames:
            name = name.replace(theirs, ours)
        return super().remap(name)

    def run_layers(self, x: torch.Tensor, ropes: list[RopeStep], meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        for layer in self.layers:  # each layer knows its KV cache layer or its recurrent states
            x = layer.forward(x, ropes, meta, kv)
        return x


class Lfm2ForCausalLM(HybridForCausalLM):
    renames = (
        ("model.embedding_norm.", "model.norm."),
        (".operator_norm.", ".input_layernorm."),
        (".ffn_norm.", ".post_attention_layernorm."),
        (".self_attn.out_proj.", ".self_attn.o_proj."),
        (".self_attn.q_layernorm.", ".self_attn.q_norm."),
        (".self_attn.k_layernorm.", ".self_attn.k_norm."),
        (".feed_forward.w1.", ".mlp.gate_proj."),
        (".feed_forward.w3.", ".mlp.up_proj."),
        (".feed_forward.w2.", ".mlp.down_proj."),
    )


class BambaForCausalLM(HybridForCausalLM):
    renames = (
        ("model.final_layernorm.", "model.norm."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        (".feed_forward.", ".mlp."),
    )


class GraniteMoeHybridForCausalLM(HybridForCausalLM):
    renames = (
        (".block_sparse_moe.router.layer.", ".mlp.moe.gate."),
        (".block_sparse_moe.router.weight", ".mlp.moe.gate.weight"),  # transformers 5's own names
        (".block_sparse_moe.input_linear.weight", ".mlp.moe.experts.gate_up_proj"),
        (".block_sparse_moe.output_linear.weight", ".mlp.moe.experts.down_proj"),
        (".block_sparse_moe.experts.", ".mlp.moe.experts."),
        (".shared_mlp.input_linear.", ".mlp.shared.gate_up_proj."),
        (".shared_mlp.output_linear.", ".mlp.shared.down_proj."),
    )

    def fused_pieces(self, module: str) -> list[int] | None:
        if module.endswith("mlp.shared.gate_up_proj"):  # gate | up in one checkpoint tensor
            return [self.cfg.intermediate_size] * 2
        return None
