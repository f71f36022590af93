"""DeepSeek V2 / V3: multi-head latent attention (MLA) over a cache of latents, routed experts.

Per layer (transformers' `DeepseekV2DecoderLayer`): x += attn(norm(x)), x += mlp(norm(x)), the MLP
dense on the first `first_k_dense_replace` layers and routed experts plus shared experts after.

The attention, as transformers computes it: q = q_b(norm(q_a(x))) (or q_proj(x) without a q LoRA),
split per head into q_nope and q_pe; [c_kv | k_pe] = kv_a(x), c_kv normalised; per head
k = [W_UK_h c_kv | rope(k_pe)] and v = W_UV_h c_kv (kv_b_proj holds W_UK and W_UV for every head);
softmax(q.k * scale) . v; o_proj. Here it runs in the absorbed form, on the paged attention as
multi-query attention with one KV head of `kv_lora_rank + qk_rope_head_dim` dims (hf_deepseek.py):

* the cache holds, per token and layer, c = [c_kv | rope(k_pe)] (576 values for V2/V3), where
  transformers' backend caches k and v of every head: 128 heads x (192 + 128) values for V3;
* each head's query is q' = [q_nope W_UK_h | rope(q_pe)], so q'.c = q_nope.(W_UK_h c_kv) +
  rope(q_pe).rope(k_pe): the same score;
* the attention's output over V = c is sum_j p_j c_j; its first kv_lora_rank dims are
  sum_j p_j c_kv_j, and W_UV_h of that is the head's output. The last 64 dims are dropped.

At decode (a few tokens) both per-head products read `kv_b_proj`'s weight in place through the
native few-rows kernel (`few_rows_matmul`): `bmm` over its strided W_UK / W_UV views copied them
first, every step. Longer inputs take `bmm`.

K and V are the same vector, but stored twice (the K and the V cache of the one KV head). Rejected:
aliasing them. The cache keeps K's blocks transposed for the native CPU decode kernel
(kernels/csrc/cpu_attention.cpp: a block's scores as vertical FMAs) and V's head-dim-last, so no
one tensor is both; the kernel, given a view, would copy the whole cache each call. So a token
costs 2 x 576 values per layer instead of 576: still 35 times less than V3's expanded k and v.
Prefill runs the absorbed form too (one code path for every chunk, reading what earlier chunks
and prefix-cache hits left in the cache); the non-absorbed form would need the latents expanded
per head for every earlier token of a chunked prompt. The Triton kernels take power-of-two head
dims only: on a device where they run the model is refused at load (`TRIOLLM_KERNELS=torch` runs
the torch path there).

RoPE covers `qk_rope_head_dim` dims, each pair (2i, 2i + 1) rotated by frequency i
(`rope_interleave`: V2 always, V3 by default); the rotary kernels pair (i, i + d/2), so q_pe and
k_pe are de-interleaved (evens, then odds) first: both get the same permutation, the dot
products are the same. YaRN's attention factor is in the cos/sin tables (q_pe and k_pe) and its
`mscale_all_dim` in the softmax scale (`MLASpec.softmax_scale`).

Routing (`DeepseekMoE`), in fp32 from an fp32 router weight as transformers keeps it
(`_keep_in_fp32_modules_strict`): V3 (sigmoid scores, the correction bias, groups) is GLM-4.5's,
`route_grouped`; V2 is `route_group_limited`: softmax scores, top-k within the best `topk_group`
groups (each scored by its best expert; one group for "greedy"), times `routed_scaling_factor`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import K_SCALE_RANGE, AttentionMetadata, PagedAttention
from triollm.engine.execution.layers.linear import Linear, column, few_rows_matmul, row
from triollm.engine.execution.layers.moe import FusedMoE, fused_experts, route_grouped
from triollm.engine.execution.layers.norm import RMSNorm
from triollm.engine.execution.layers.rotary import RopeStep
from triollm.engine.execution.models.base import CausalLM, GatedMLP
from triollm.engine.loading.model_config import ModelConfig
from triollm.kernels import write_kv
from triollm.kernels.kv_quant import cache_scale
from triollm.kernels.rotary import apply_rotary_signed
from triollm.kernels.triton import use_triton_on

__all__ = ["DeepseekForCausalLM", "DeepseekMoE", "LatentAttention", "route_group_limited"]

# transformers builds q_a_layernorm and kv_a_layernorm without an eps: its RMSNorm's default.
_LORA_NORM_EPS = 1e-6


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"model: {name} has shape {tuple(tensor.shape)}, expected {tuple(param.shape)}")
    param.data.copy_(tensor)


class LatentProjection(nn.Module):
    """kv_b_proj `[H * (nope + v), kv_lora_rank]`: read per head as W_UK and W_UV, never applied
    as a linear layer (so quantization and oneDNN packing, which take `Linear`s, leave it be)."""

    def __init__(self, rows: int, cols: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, cols), requires_grad=False)

    def load(self, leaf: str, piece: int, source: Any) -> None:
        _copy(self.weight, source[:], "self_attn.kv_b_proj.weight")


class LatentAttention(nn.Module):
    """Multi-head latent attention in the absorbed form (module note)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        mla = cfg.mla
        assert mla is not None
        h, hidden = cfg.num_heads, cfg.hidden_size
        self.num_heads, self.nope, self.rope_dim = h, mla.qk_nope_head_dim, mla.qk_rope_head_dim
        self.rank, self.v_dim, self.interleave = mla.kv_lora_rank, mla.v_head_dim, mla.rope_interleave
        qk = self.nope + self.rope_dim
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_b_proj: Linear | None = None
        self.q_a_layernorm: RMSNorm | None = None
        if mla.q_lora_rank is None:
            self.q_proj = column(hidden, [(0, h * qk)], False)
        else:
            self.q_a_proj = column(hidden, [(0, mla.q_lora_rank)], cfg.qkv_bias)
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, _LORA_NORM_EPS)
            self.q_b_proj = column(mla.q_lora_rank, [(0, h * qk)], False)
        self.kv_a_proj_with_mqa = column(hidden, [(0, self.rank + self.rope_dim)], cfg.qkv_bias)
        self.kv_a_layernorm = RMSNorm(self.rank, _LORA_NORM_EPS)
        self.kv_b_proj = LatentProjection(h * (self.nope + self.v_dim), self.rank)
        self.o_proj = row(h * self.v_dim, hidden, cfg.o_proj_bias)
        # The attention's settings, and the flag `calculate_kv_scales_on_first_prompt` sets.
        self.attn = PagedAttention(h, 1, self.rank + self.rope_dim, mla.softmax_scale)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t, h, nope, r = x.shape[0], self.num_heads, self.nope, self.rank
        if self.q_proj is not None:
            q = self.q_proj.forward(x)
        else:
            assert self.q_a_proj is not None and self.q_a_layernorm is not None and self.q_b_proj is not None
            q = self.q_b_proj.forward(self.q_a_layernorm.forward(self.q_a_proj.forward(x), meta.triton))
        q = q.view(t, h, nope + self.rope_dim)
        kv = self.kv_a_proj_with_mqa.forward(x)
        latent = self.kv_a_layernorm.forward(kv[:, :r].contiguous(), meta.triton)
        pe = self._rotate(torch.cat((q[:, :, nope:], kv[:, None, r:]), dim=1), ropes[0])  # [T, H + 1, rope]
        c = torch.cat((latent, pe[:, h]), dim=-1).unsqueeze(1)  # [T, 1, rank + rope]: the cached vector
        w = self.kv_b_proj.weight.view(h, nope + self.v_dim, r)  # per head: W_UK rows, then W_UV rows
        q_nope = q[:, :, :nope].transpose(0, 1)
        few = few_rows_matmul(q_nope, w[:, :nope], w_is_kn=True)
        q_latent = torch.bmm(q_nope, w[:, :nope]) if few is None else few  # [H, T, rank]
        query = torch.cat((q_latent.transpose(0, 1), pe[:, :h]), dim=-1)  # [T, H, rank + rope]
        if self.attn.calculate_kv_scales:
            self._calculate_kv_scales(c, k_cache, v_cache)
        write_kv(k_cache, v_cache, c, c, meta.slot_mapping)
        out = self.attn.attend(query, c, c, meta, k_cache, v_cache).view(t, h, r + self.rope_dim)
        latent_out = out[:, :, :r].transpose(0, 1)
        few = few_rows_matmul(latent_out, w[:, nope:])
        heads = torch.bmm(latent_out, w[:, nope:].transpose(1, 2)) if few is None else few  # [H, T, v]
        return self.o_proj.forward(heads.transpose(0, 1).reshape(t, h * self.v_dim))

    def _rotate(self, x: torch.Tensor, rope: RopeStep) -> torch.Tensor:
        """RoPE of the rotary dims `[T, n, rope]`; interleaved pairs de-interleaved first (module note)."""
        if self.interleave:
            x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
        return apply_rotary_signed(x, rope.cos, rope.sin)

    def _calculate_kv_scales(self, c: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """An fp8 cache's scales from the first prompt (PagedAttention's rule; K and V are one vector)."""
        self.attn.calculate_kv_scales = False
        amax = float(c.abs().max())
        for cache in (k_cache, v_cache):
            scale = cache_scale(cache)
            if scale is not None and scale.numel() == 1 and amax > 0:
                scale.fill_(amax / K_SCALE_RANGE)


def route_group_limited(
    router_logits: torch.Tensor, top_k: int, groups: int, topk_groups: int, scaling: float, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek V2's routing as transformers computes it (`DeepseekV2TopkRouter`): softmax scores;
    with groups, the experts outside the best `topk_groups` (by each group's best score) zeroed;
    the top-k scores times `scaling`, not renormalised."""
    scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if groups > 1:
        t, e = scores.shape
        group_scores = scores.view(t, groups, e // groups).max(dim=-1).values
        group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
        keep = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
        scores = scores.masked_fill(~keep[..., None].expand(t, groups, e // groups).reshape(t, e), 0.0)
    weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    return (weights * scaling).to(dtype), ids


class Router(nn.Module):
    """`mlp.gate`: the router's weight and V3's correction bias, fp32 whatever the model's dtype.
    Made on the CPU, not on the meta device, so that `materialize` leaves their dtype alone."""

    def __init__(self, num_experts: int, hidden: int, correction: bool) -> None:
        super().__init__()
        fp32: dict[str, Any] = {"dtype": torch.float32, "device": "cpu"}
        self.weight = nn.Parameter(torch.empty(num_experts, hidden, **fp32), requires_grad=False)
        self.e_score_correction_bias = (
            nn.Parameter(torch.zeros(num_experts, **fp32), requires_grad=False) if correction else None
        )

    def load(self, leaf: str, piece: int, source: Any) -> None:
        param = getattr(self, leaf)
        _copy(param, source[:].float(), f"mlp.gate.{leaf}")


class DeepseekMoE(nn.Module):
    """Routed experts plus `n_shared_experts` shared ones every token runs (module note)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None
        self.moe = moe
        self.gate = Router(moe.num_experts, cfg.hidden_size, moe.scoring == "sigmoid")
        self.experts = FusedMoE(
            moe.num_experts, moe.top_k, cfg.hidden_size, moe.intermediate_size, renormalize=moe.renormalize
        )
        shared = moe.shared_intermediate_size
        self.shared_experts = GatedMLP(cfg, None, shared) if shared else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        moe, gate = self.moe, self.gate
        logits = F.linear(x.float(), gate.weight)
        if gate.e_score_correction_bias is not None:
            weights, ids = route_grouped(
                logits, gate.e_score_correction_bias, moe.top_k, moe.groups, moe.topk_groups, moe.renormalize,
                moe.routed_scaling, x.dtype,
            )  # fmt: skip
        else:
            weights, ids = route_group_limited(
                logits, moe.top_k, moe.groups, moe.topk_groups, moe.routed_scaling, x.dtype
            )
        out = fused_experts(x, self.experts.w13, self.experts.w2, weights, ids)
        return out if self.shared_experts is None else out + self.shared_experts.forward(x)


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.self_attn = LatentAttention(cfg)
        self.mlp: nn.Module = DeepseekMoE(cfg) if cfg.moe.sparse_layers[index] else GatedMLP(cfg, None)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        h = self.self_attn.forward(self.input_layernorm.forward(x, meta.triton), ropes, meta, k_cache, v_cache)
        normed, x = self.post_attention_layernorm.add_forward(h, x, meta.triton)  # x + h, normed
        return x + self.mlp.forward(normed)


class DeepseekForCausalLM(CausalLM):
    """DeepSeek V2 and V3 (module note)."""

    # Only gate|up stack: the attention's projections stay apart (q_proj has no k or v beside it).
    stacked = {"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        if shard is not None:
            raise ValueError(f"tensor_parallel_size: {cfg.architecture} runs on one rank; allowed: 1")
        super().__init__(cfg, shard)

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        return DeepseekDecoderLayer(cfg, index)

    def remap(self, name: str) -> str | None:
        parts = name.split(".")
        if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit() and int(parts[2]) >= self.cfg.num_layers:
            return None  # the multi-token-prediction layers, after the decoder's
        return super().remap(name)

    def to_device(self, device: torch.device | str) -> None:
        if use_triton_on(device):
            raise ValueError(
                f"device: {self.cfg.architecture}'s latent attention runs on the CPU kernels and the torch path only "
                f"(the Triton kernels take power-of-two head dims; its cache is {self.cfg.head_dim} wide); set "
                f"TRIOLLM_KERNELS=torch on {device}"
            )
        super().to_device(device)
