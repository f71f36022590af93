"""LFM2: Qwen3-style attention layers interleaved with gated short convolutions.

Per layer: `operator_norm`, then self-attention (q/k RMSNorm per head, RoPE; checkpoint names
`out_proj`, `q_layernorm`, `k_layernorm`) or a short convolution (layers/recurrent.py), residual
add; `ffn_norm`, the SwiGLU MLP (`feed_forward.w1/w3/w2`), residual add. The final norm is
`embedding_norm`. Only the attention layers have a KV cache (`ModelConfig.kv_layers`); each
convolution layer keeps its state in the runner's `StatePool`, and the step says where each
request's rows and state are (`AttentionMetadata.state_rows`).
"""

from __future__ import annotations

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import AttentionMetadata
from triollm.engine.execution.layers.norm import RMSNorm
from triollm.engine.execution.layers.recurrent import ShortConv
from triollm.engine.execution.layers.rotary import RopeStep
from triollm.engine.execution.models.base import CausalLM, GatedMLP, SelfAttention
from triollm.engine.loading.model_config import ModelConfig
from triollm.kernels import KVCache
from triollm.kernels.triton import use_triton

__all__ = ["Lfm2ForCausalLM"]

_RENAMES = (
    (".self_attn.out_proj.", ".self_attn.o_proj."),
    (".self_attn.q_layernorm.", ".self_attn.q_norm."),
    (".self_attn.k_layernorm.", ".self_attn.k_norm."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
)


class Lfm2DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, kv_index: int | None, state_index: int | None) -> None:
        super().__init__()
        self.kv_index = kv_index
        self.self_attn: SelfAttention | None = None
        self.conv: ShortConv | None = None
        if kv_index is not None:
            self.self_attn = SelfAttention(cfg, index, None)
        else:
            assert cfg.recurrent is not None and state_index is not None
            spec = cfg.recurrent
            self.conv = ShortConv(cfg.hidden_size, spec.conv_kernel, spec.conv_bias, state_index)
        self.mlp = GatedMLP(cfg, None)
        self.operator_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=cfg.quantization is None)
        self.ffn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=cfg.quantization is None)

    def forward(self, x: torch.Tensor, ropes: list[RopeStep], meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        h = self.operator_norm.forward(x, meta.triton)
        if self.self_attn is not None:
            assert self.kv_index is not None
            h = self.self_attn.forward(h, ropes, meta, kv.k[self.kv_index], kv.v[self.kv_index])
        else:
            assert self.conv is not None and meta.state_rows is not None
            h = self.conv.forward(h, meta.state_rows)
        normed, x = self.ffn_norm.add_forward(h, x, meta.triton)  # x + h, normed
        return x + self.mlp.forward(normed)


class Lfm2ForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        if shard is not None:
            raise ValueError(f"tensor_parallel_size: {cfg.architecture} is not supported with tensor parallelism")
        kv_layers = cfg.kv_layers
        if index in kv_layers:
            return Lfm2DecoderLayer(cfg, index, kv_layers.index(index), None)
        return Lfm2DecoderLayer(cfg, index, None, index - sum(i < index for i in kv_layers))

    def remap(self, name: str) -> str | None:
        name = name.replace("model.embedding_norm.", "model.norm.")
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().remap(name)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        if image_rows is not None:
            raise ValueError(f"multi_modal_data: {self.cfg.architecture} takes text only")
        x = self.embed_tokens(input_ids)
        if self.triton is None:
            self.triton = use_triton(x)
        meta.triton = self.triton
        ropes = [r.step(positions, x.dtype, meta.triton) for r in self.rotaries]
        for layer in self.layers:
            x = layer.forward(x, ropes, meta, kv)
        return self.norm.forward(x, meta.triton)
