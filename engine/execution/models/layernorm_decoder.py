"""What GPT-NeoX, Phi (1, 1.5, 2) and StableLM share: LayerNorms, partial rotary, parallel residuals.

Per layer, as transformers' GPTNeoXLayer / PhiDecoderLayer / StableLmDecoderLayer compute it:
- sequential: x += attn(input_norm(x)), then x += mlp(post_attention_norm(x));
- parallel: x += attn(input_norm(x)) + mlp(n(x)), where n is the layer's second norm (GPT-NeoX)
  or the same input norm (Phi, StableLM: they have no second one then).

The MLP is ungated (`DenseMLP`: fc1, activation, fc2, with biases: GPT-NeoX and Phi) or Llama's
gated one (StableLM). q and k may be LayerNormed over each head before RoPE (`qk_norm`
"layernorm": one weight and bias shared by every head, Phi; "layernorm_head": a weight per head,
StableLM). The partial rotary itself is the rotary layer's (`rotary_dim`), the final norm a
LayerNorm. Each family's file says where its checkpoint names differ (`remap`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import AttentionMetadata
from triollm.engine.execution.layers.linear import column, row
from triollm.engine.execution.layers.norm import LayerNorm
from triollm.engine.execution.layers.rotary import RopeStep
from triollm.engine.execution.models.base import CausalLM, SelfAttention
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["DenseMLP", "LayerNormAttention", "LayerNormCausalLM", "LayerNormDecoderLayer"]

# The ungated MLP's activations, by HfConfig.hidden_act.
PLAIN_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
}


class DenseMLP(nn.Module):
    """fc2(act(fc1(x))), with biases."""

    def __init__(self, cfg: ModelConfig, shard: TPShard | None) -> None:
        super().__init__()
        rows, cols, rank = (0, cfg.intermediate_size), None, 0
        if shard is not None:
            rows = cols = shard.split(cfg.intermediate_size)
            rank = shard.rank
        self.fc1 = column(cfg.hidden_size, [rows], True)
        self.fc2 = row(rows[1], cfg.hidden_size, True, cols, rank)
        self.act = PLAIN_ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2.forward(self.act(self.fc1.forward(x)))


class HeadLayerNorms(nn.Module):
    """A LayerNorm without bias per head (StableLM's `StableLmLayerNormPerHead`): `norms[i]`
    normalises head i."""

    def __init__(self, heads: int, head_dim: int, eps: float) -> None:
        super().__init__()
        self.norms = nn.ModuleList(LayerNorm(head_dim, eps, bias=False) for _ in range(heads))
        self.head_dim, self.eps = head_dim, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """`x` `[T, heads * head_dim]`."""
        weight = torch.stack([cast(LayerNorm, n).weight for n in self.norms])  # [heads, head_dim]
        t, hd = x.shape[0], self.head_dim
        return (F.layer_norm(x.view(t, -1, hd), (hd,), None, None, self.eps) * weight).view(t, -1)


class LayerNormAttention(SelfAttention):
    """Self-attention whose q and k may be LayerNormed over each head (module note)."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: TPShard | None) -> None:
        super().__init__(cfg, layer, shard)
        hd, eps = cfg.head_dim, cfg.rms_norm_eps
        self.q_ln: nn.Module | None = None
        self.k_ln: nn.Module | None = None
        if cfg.qk_norm == "layernorm":
            self.q_ln, self.k_ln = LayerNorm(hd, eps), LayerNorm(hd, eps)
        elif cfg.qk_norm == "layernorm_head":
            if shard is not None:
                raise ValueError(
                    f"tensor_parallel_size: {cfg.architecture}'s per-head q/k LayerNorms (qk_layernorm) are not "
                    f"sharded; allowed: 1"
                )
            self.q_ln = HeadLayerNorms(self.num_heads, hd, eps)
            self.k_ln = HeadLayerNorms(self.num_kv_heads, hd, eps)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        if self.q_ln is not None and self.k_ln is not None:
            t, q_size, k_size = qkv.shape[0], self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
            q, k = qkv[:, :q_size], qkv[:, q_size : q_size + k_size]
            if isinstance(self.q_ln, LayerNorm):  # one norm for every head
                q.copy_(self.q_ln.forward(q.reshape(-1, self.head_dim)).view(t, q_size))
                k.copy_(self.k_ln.forward(k.reshape(-1, self.head_dim)).view(t, k_size))
            else:
                q.copy_(self.q_ln.forward(q.contiguous()))
                k.copy_(self.k_ln.forward(k.contiguous()))
        out = self.attn.forward(qkv, ropes[self.rope_index], meta, k_cache, v_cache)
        return self.o_proj.forward(out)


class LayerNormDecoderLayer(nn.Module):
    """One layer, sequential or parallel (module note). `post_norm`: whether the layer has a
    second norm (sequential layers always do)."""

    def __init__(self, attn: nn.Module, mlp: nn.Module, cfg: ModelConfig, *, post_norm: bool) -> None:
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.parallel = cfg.parallel_residual
        self.input_layernorm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = (
            LayerNorm(cfg.hidden_size, cfg.rms_norm_eps) if post_norm or not self.parallel else None
        )

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        normed = self.input_layernorm.forward(x)
        h = self.self_attn.forward(normed, ropes, meta, k_cache, v_cache)
        post = self.post_attention_layernorm
        if not self.parallel:
            assert post is not None
            x = x + h
            return x + self.mlp.forward(post.forward(x))
        return x + h + self.mlp.forward(normed if post is None else post.forward(x))


class LayerNormCausalLM(CausalLM):
    """The causal-LM shell with a final LayerNorm; `lm_head_bias`: the head has a bias (Phi)."""

    lm_head_bias = False

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__(cfg, shard)
        self.norm = LayerNorm(cfg.hidden_size, cfg.rms_norm_eps)  # type: ignore[assignment]
        if self.lm_head_bias and self.lm_head is not None:
            self.lm_head = column(cfg.hidden_size, self.lm_head.rows, True)
