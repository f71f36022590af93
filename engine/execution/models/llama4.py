"""Llama 4 (text): Llama's pre-norm layer with chunked local attention, NoPE layers and interleaved
experts that scale their inputs.

Per layer (transformers' Llama4TextDecoderLayer): x += attn(norm(x)), x += ffn(norm(x)). What
differs from Llama, per layer as `Llama4Spec` (hf_families.py) says:
- RoPE layers (`no_rope_layers` 1) rotate q and k and, where `use_qk_norm`, normalise both with a
  weightless RMS (L2) norm; their attention is chunked where `layer_types` says
  'chunked_attention' (a query sees only the keys of its own `attention_chunk_size` chunk of
  positions, layers/attention.py). transformers norms after the rotation; here before it, as the
  other families do: a rotation keeps each head's norm, so it is the same.
- NoPE layers attend globally without rotary and, where `attn_temperature_tuning`, scale q by
  log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 at each token's own position p (the step's
  positions: one factor per row, computed once a step in `run_layers`). They take the rotary
  path with an identity table (cos 1, sin 0: exact), so every attention kernel path serves them.
- The MoE layers (`moe_layers`): a router to one logit per expert, its top-k logits through a
  sigmoid as the scores; each chosen expert runs on the token times its score (the score scales
  the expert's *input*, not its output), the k outputs are summed, plus a shared expert every
  token runs. transformers runs every expert on every token with the unchosen ones' inputs scaled
  by sigmoid(-inf) = 0, which a bias-free SwiGLU maps to exactly 0: the same sum, with only the
  chosen experts run here (`fused_experts`, one (token, expert) row per pair at weight 1). The
  other layers have a dense gated MLP of `intermediate_size_mlp`.

The rotary: transformers rotates each pair (x[2i], x[2i+1]) as the complex number x[2i] + i x[2i+1]
times e^(i p f_i), the interleaved (GPT-J) form. It is the half-split (NeoX) form our kernels run
on heads whose dims are reordered evens-then-odds: the rotated pairs are (i, i + d/2) with the
same f_i, and the same formula. So q_proj's and k_proj's rows (and biases) are reordered that way
within each head as they load (`PairedRowsLinear`), on every layer: attention scores are dot
products of q and k, unchanged when both are permuted alike, and the L2 norm and temperature are
per-head scalings, so v, o_proj and the output are what transformers computes. Rejected: an
interleaved variant of every rotary kernel (torch, native CPU, Triton). A consequence: a
checkpoint whose q/k are already quantized could not be reordered, so those are refused at load.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import AttentionMetadata, PagedAttention
from triollm.engine.execution.layers.linear import Linear, column, load_rows
from triollm.engine.execution.layers.moe import fused_experts
from triollm.engine.execution.layers.norm import RMSNorm
from triollm.engine.execution.layers.rotary import RopeStep, RotaryEmbedding
from triollm.engine.execution.models.base import CausalLM, GatedMLP, SelfAttention
from triollm.engine.loading.hf_families import Llama4Spec
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.rope_config import RopeConfig
from triollm.kernels import KVCache

__all__ = ["Llama4ForCausalLM"]

_RENAMES = (
    (".feed_forward.experts.", ".mlp.routed."),  # off `.experts.`: Llama4Experts loads its own
    (".feed_forward.router.", ".mlp.gate."),  # `gate`: quantization leaves the router dense
    (".feed_forward.", ".mlp."),
)


class PairedRowsLinear(Linear):
    """q|k|v, with each head's q and k rows reordered from rotary pairs (2i, 2i+1) to halves
    (i, i + d/2) as they load (module note)."""

    def __init__(self, like: Linear, head_dim: int) -> None:
        super().__init__(like.in_features, like.rows, like.bias is not None)
        self.head_dim = head_dim

    def load(self, leaf: str, piece: int, source: Any) -> None:
        if piece < 2:  # q, k
            tensor = source[:]
            hd, rows = self.head_dim, tensor.shape[0]
            source = tensor.reshape(rows // hd, hd // 2, 2, *tensor.shape[1:]).transpose(1, 2).reshape(tensor.shape)
        load_rows(self, leaf, piece, source)


class Llama4Attention(SelfAttention):
    def __init__(self, cfg: ModelConfig, layer: int, spec: Llama4Spec) -> None:
        super().__init__(cfg, layer, None)
        self.qkv_proj = PairedRowsLinear(self.qkv_proj, cfg.head_dim)
        rope = spec.rope_layers[layer]
        self.rope_index = 0 if rope else 1  # 1: the identity table (CausalLM.rotaries)
        self.l2_eps = cfg.rms_norm_eps if rope and spec.qk_norm else None
        self.tuned = not rope and spec.temperature is not None
        chunk = spec.chunks[layer]
        if chunk is not None and chunk >= cfg.max_model_len:
            chunk = None  # one chunk holds any sequence: plain causal attention
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, self.head_dim, self.attn.scale, chunk=chunk)

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        q_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        t, h, kvh, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        if self.l2_eps is not None:
            qk = qkv[:, : (h + kvh) * hd].view(t, h + kvh, hd)
            qk.copy_(qk.float() * torch.rsqrt(qk.float().pow(2).mean(-1, keepdim=True) + self.l2_eps))
        if self.tuned and q_scale is not None:
            q = qkv[:, : h * hd]
            q.copy_(q.float() * q_scale[:, None])
        out = self.attn.forward(qkv, ropes[self.rope_index], meta, k_cache, v_cache)
        return self.o_proj.forward(out)


class Llama4Experts(nn.Module):
    """The routed experts in `fused_experts`' layout, `gate_up_proj` `[E, 2I, H]` (gate rows, then
    up) and `down_proj` `[E, H, I]`, loaded from transformers' `[E, H, 2I]` and `[E, I, H]`."""

    def __init__(self, experts: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * inter, hidden), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(experts, hidden, inter), requires_grad=False)

    def load(self, leaf: str, piece: int, source: Any) -> None:
        if leaf not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"model: unexpected tensor feed_forward.experts.{leaf}")
        param = getattr(self, leaf)
        tensor = source[:].transpose(1, 2)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"model: feed_forward.experts.{leaf} has shape {list(source[:].shape)}, expected "
                f"{[param.shape[0], param.shape[2], param.shape[1]]}"
            )
        with torch.no_grad():
            param.copy_(tensor)


class Llama4MoE(nn.Module):
    """Sigmoid-scored top-k experts on scaled inputs, plus the shared expert (module note)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.top_k = moe.top_k
        self.gate = column(cfg.hidden_size, [(0, moe.num_experts)], False)
        self.routed = Llama4Experts(moe.num_experts, cfg.hidden_size, moe.intermediate_size)
        self.shared_expert = GatedMLP(cfg, None, moe.shared_intermediate_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scores, ids = torch.topk(self.gate.forward(x), self.top_k, dim=1)
        scores = torch.sigmoid(scores.float()).to(x.dtype)
        t, k = ids.shape
        rows = (x.unsqueeze(1) * scores.unsqueeze(-1)).reshape(t * k, -1)  # each pair's scaled input
        ones = rows.new_ones(t * k, 1)
        routed = fused_experts(rows, self.routed.gate_up_proj, self.routed.down_proj, ones, ids.reshape(t * k, 1))
        routed = routed if k == 1 else routed.view(t, k, -1).sum(dim=1)
        return self.shared_expert.forward(x) + routed


class Llama4DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int, spec: Llama4Spec) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        exact = cfg.quantization is None
        self.self_attn = Llama4Attention(cfg, index, spec)
        self.mlp: nn.Module = (
            Llama4MoE(cfg) if moe.sparse_layers[index] else GatedMLP(cfg, None, spec.dense_intermediate_size)
        )
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        q_scale: torch.Tensor | None,
    ) -> torch.Tensor:
        normed = self.input_layernorm.forward(x, meta.triton)
        h = self.self_attn.forward(normed, ropes, meta, k_cache, v_cache, q_scale)
        normed, x = self.post_attention_layernorm.add_forward(h, x, meta.triton)  # x + h, normed
        return x + self.mlp.forward(normed)


class _IdentityRotary(RotaryEmbedding):
    """cos 1 and sin 0 at every position: the NoPE layers' "rotation" (module note)."""

    def __init__(self, head_dim: int, max_len: int) -> None:
        super().__init__(RopeConfig(), head_dim, 1)
        with torch.device("cpu"):
            self.cos = torch.ones(max_len, head_dim)
            self.sin = self.sin_signed = torch.zeros(max_len, head_dim)


class Llama4ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__(cfg, shard)
        self.rotaries.append(_IdentityRotary(cfg.head_dim, cfg.max_model_len))

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        if shard is not None:
            raise ValueError(
                f"tensor_parallel_size: {cfg.architecture} (routed experts) is not supported with tensor parallelism"
            )
        assert cfg.llama4 is not None
        return Llama4DecoderLayer(cfg, index, cfg.llama4)

    def run_layers(self, x: torch.Tensor, ropes: list[RopeStep], meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        spec = self.cfg.llama4
        assert spec is not None
        q_scale = None
        if spec.temperature is not None:  # each row's factor at its own position (module note)
            assert meta.positions is not None
            floor, scale = spec.temperature
            q_scale = torch.log1p(torch.floor((meta.positions.float() + 1.0) / floor)) * scale + 1.0
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, ropes, meta, kv.k[i], kv.v[i], q_scale)
        return x

    def remap(self, name: str) -> str | None:
        for theirs, ours in _RENAMES:
            name = name.replace(theirs, ours)
        return super().remap(name)
