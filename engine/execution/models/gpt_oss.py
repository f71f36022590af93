"""gpt-oss: Llama's pre-norm layer with attention sinks, windows on alternate layers and routed
experts with biases and a clamped SwiGLU.

Per layer (transformers' GptOssDecoderLayer): x += attn(norm(x)), x += experts(norm(x)). What
differs from Llama:
- attention: q, k, v and o projections with biases (`attention_bias`), and a learned sink per
  query head (`self_attn.sinks`) in the softmax's denominator (layers/attention.py); the sliding
  layers' window comes from `layer_types` (hf_config.py);
- the MLP: a router with a bias (`mlp.router`, here `mlp.gate` so that quantization leaves it
  dense), softmax over the top-k logits, and experts whose gate|up projection is stored
  interleaved (gate in the even columns, up in the odd) and transposed, `[E, H, 2I]`, with biases;
  each expert computes (up + 1) * gate * sigmoid(alpha * gate) on clamped gate and up
  (layers/moe.py, `ClampedSwiGLU`), through the same dispatch as the other MoE families.

The checkpoint's expert tensors are converted once at load (`GptOssExperts.load`) into the
layout `fused_experts` runs: gate rows then up rows, `[E, 2I, H]`, and down `[E, H, I]`.
Rejected: keeping transformers' layout and a second expert loop (the dispatch is the same code).

MXFP4 checkpoints (the released weights: `quantization_config.quant_method` "mxfp4", experts
only) are dequantized as they load, exactly as transformers' `convert_moe_packed_tensors` does:
`<proj>_blocks` `[E, rows, cols / 32, 16]` hold two e2m1 codes a byte (low nibble first) and
`<proj>_scales` `[E, rows, cols / 32]` one E8M0 exponent (bias 127) per 32 values; the rows are
the output features (gate|up interleaved for gate_up_proj), so the dequantized gate_up is
de-interleaved and down is already `[E, H, I]`. Blocks and scales arrive as separate tensors:
the first waits for the second (`GptOssExperts.pending`), and a model left with one of a pair is
refused after loading (`pack_linears`). Kept in MXFP4 it is not: the experts run dense.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import AttentionMetadata
from triollm.engine.execution.layers.linear import column
from triollm.engine.execution.layers.moe import ClampedSwiGLU, fused_experts, route
from triollm.engine.execution.layers.rotary import RopeStep
from triollm.engine.execution.models.base import CausalLM, SelfAttention
from triollm.engine.execution.models.llama import LlamaDecoderLayer
from triollm.engine.loading.model_config import ModelConfig

__all__ = ["GptOssAttention", "GptOssExperts", "GptOssForCausalLM", "dequantize_mxfp4"]


class GptOssAttention(SelfAttention):
    """Llama's self-attention with a sink per query head (`sinks` `[H]`, loaded here)."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer, None)
        self.sinks = nn.Parameter(torch.empty(cfg.num_heads), requires_grad=False)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        # The parameter as it is now (materialised, loaded, moved), handed to the kernels.
        self.attn.extra["sinks"] = self.sinks
        return super().forward(x, ropes, meta, k_cache, v_cache)

    def load(self, leaf: str, piece: int, source: Any) -> None:
        if leaf != "sinks":
            raise ValueError(f"model: unexpected tensor self_attn.{leaf}")
        _copy(self.sinks, source[:], "self_attn.sinks")


class GptOssExperts(nn.Module):
    """The routed experts (module note): `gate_up_proj` `[E, 2I, H]` (gate rows, then up rows),
    `gate_up_proj_bias` `[E, 2I]`, `down_proj` `[E, H, I]`, `down_proj_bias` `[E, H]`, each filled
    from the checkpoint's tensor of the same name by `load`."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        assert moe is not None and moe.swiglu is not None
        e, h, i = moe.num_experts, cfg.hidden_size, moe.intermediate_size
        self.top_k, self.act = moe.top_k, ClampedSwiGLU(*moe.swiglu)
        self.gate_up_proj = nn.Parameter(torch.empty(e, 2 * i, h), requires_grad=False)
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i), requires_grad=False)
        self.down_proj = nn.Parameter(torch.empty(e, h, i), requires_grad=False)
        self.down_proj_bias = nn.Parameter(torch.empty(e, h), requires_grad=False)
        # An MXFP4 checkpoint's blocks or scales of a projection, until the other arrives.
        self.pending: dict[str, torch.Tensor] = {}

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        weights, ids = route(router_logits, self.top_k, True, x.dtype)
        return fused_experts(
            x, self.gate_up_proj, self.down_proj, weights, ids,
            b13=self.gate_up_proj_bias, b2=self.down_proj_bias, act=self.act,
        )  # fmt: skip

    def load(self, leaf: str, piece: int, source: Any) -> None:
        """One checkpoint tensor, from transformers' layout into ours (module note)."""
        tensor = source[:]
        if tensor.dtype == torch.uint8:  # MXFP4 blocks (4-D) or scales (3-D): remap named both `leaf`
            self._load_mxfp4(leaf, tensor)
            return
        if leaf == "gate_up_proj":  # [E, H, 2I], gate|up interleaved in the last dim
            tensor = torch.cat((tensor[..., ::2], tensor[..., 1::2]), dim=-1).transpose(1, 2)
        elif leaf == "gate_up_proj_bias":
            tensor = torch.cat((tensor[..., ::2], tensor[..., 1::2]), dim=-1)
        elif leaf == "down_proj":  # [E, I, H]
            tensor = tensor.transpose(1, 2)
        elif leaf != "down_proj_bias":
            raise ValueError(f"model: unexpected tensor mlp.experts.{leaf}")
        _copy(getattr(self, leaf), tensor, f"mlp.experts.{leaf}")

    def _load_mxfp4(self, leaf: str, tensor: torch.Tensor) -> None:
        other = self.pending.pop(leaf, None)
        if other is None:
            self.pending[leaf] = tensor
            return
        blocks, scales = (tensor, other) if tensor.dim() == 4 else (other, tensor)
        if blocks.dim() != 4 or scales.dim() != 3 or blocks.shape[:3] != scales.shape or blocks.shape[3] != 16:
            raise ValueError(
                f"model: mlp.experts.{leaf}_blocks {list(blocks.shape)} and _scales {list(scales.shape)}: expected "
                f"[E, rows, groups, 16] and [E, rows, groups]"
            )
        param = getattr(self, leaf)
        for e in range(blocks.shape[0]):  # one expert at a time: the fp32 copy stays small
            dense = dequantize_mxfp4(blocks[e], scales[e])  # [rows, cols]
            if leaf == "gate_up_proj":
                dense = torch.cat((dense[::2], dense[1::2]))
            _copy(param[e], dense, f"mlp.experts.{leaf} (MXFP4) of expert {e}")


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """fp32 `[..., groups * 32]` of MXFP4 `blocks` `[..., groups, 16]` (uint8, two e2m1 codes a
    byte, low nibble first) and `scales` `[..., groups]` (uint8 E8M0, bias 127)."""
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2).long()  # [..., groups, 32]
    values = _E2M1[codes]
    return torch.ldexp(values, scales.to(torch.int32)[..., None] - 127).flatten(-2)


# The 16 e2m1 values by code: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
_E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


class GptOssMoE(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.moe is not None
        self.gate = column(cfg.hidden_size, [(0, cfg.moe.num_experts)], True)
        self.routed = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.routed.forward(x, self.gate.forward(x))


class GptOssForCausalLM(CausalLM):
    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        if shard is not None:
            raise ValueError(
                f"tensor_parallel_size: {cfg.architecture} (routed experts) is not supported with tensor parallelism"
            )
        layer = LlamaDecoderLayer(cfg, index, None, GptOssMoE(cfg))
        layer.self_attn = GptOssAttention(cfg, index)
        return layer

    def remap(self, name: str) -> str | None:
        # Off `.experts.` (the loader's path for FusedMoE's tensors): GptOssExperts loads its own,
        # an MXFP4 pair's blocks and scales both under the projection's name.
        name = name.replace(".mlp.router.", ".mlp.gate.").replace(".mlp.experts.", ".mlp.routed.")
        name = name.removesuffix("_blocks").removesuffix("_scales")
        return super().remap(name)

    def pack_linears(self, few_rows: bool = True) -> None:
        """After loading (load_model calls this next): no MXFP4 blocks without their scales."""
        for name, m in self.named_modules():
            if isinstance(m, GptOssExperts) and m.pending:
                leaf = next(iter(m.pending))
                raise ValueError(f"model: the checkpoint has only one of {name}.{leaf}_blocks / _scales (MXFP4)")
        super().pack_linears(few_rows)


def _copy(param: torch.Tensor, tensor: torch.Tensor, name: str) -> None:
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"model: {name} has shape {list(tensor.shape)}, expected {list(param.shape)}")
    with torch.no_grad():
        param.copy_(tensor)
