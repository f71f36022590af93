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
- Falcon-H1 (`FalconH1ForCausalLM`): every layer both, side by side (`FalconH1DecoderLayer`): the
  same normed input goes to attention (times `attention_in_multiplier`; keys times
  `key_multiplier`) and to a Mamba-2 mixer (its own muP multipliers, layers/recurrent.py), and
  their outputs, each times its multiplier, are added to the residual; every layer has a KV cache
  layer and a state. The MLP `feed_forward` scales its gate and output (`mlp_multipliers`), the
  logits are times `lm_head_multiplier`; norms `input_layernorm` / `pre_ff_layernorm`, the final
  norm `final_layernorm`.
- Qwen3-Next (`Qwen3NextForCausalLM`): gated attention (`GatedAttention`: q_proj gives each head's
  query and an output gate, sigmoid(gate) scales the attention's output; q/k RMSNorm per head;
  partial rotary) and gated DeltaNet layers (`linear_attn`, layers/gated_deltanet.py); every
  RMSNorm but the DeltaNet's scales by (1 + w); as MLP Qwen2-MoE's routed experts plus a shared
  expert under a sigmoid gate (models/moe.py), or a dense one off the sparse layers. The
  checkpoint's multi-token-prediction tensors (`mtp.*`) are skipped.
"""

from __future__ import annotations

from typing import ClassVar

import torch
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.attention import AttentionMetadata
from triollm.engine.execution.layers.gated_deltanet import GatedDeltaNet, ReorderedLinear
from triollm.engine.execution.layers.norm import RMSNorm
from triollm.engine.execution.layers.recurrent import Mamba2Mixer, ShortConv
from triollm.engine.execution.layers.rotary import RopeStep
from triollm.engine.execution.models.base import STACKED, CausalLM, GatedMLP, SelfAttention
from triollm.engine.execution.models.moe import SparseMoeBlock
from triollm.engine.loading.model_config import ModelConfig
from triollm.kernels import KVCache

__all__ = [
    "BambaForCausalLM",
    "FalconH1ForCausalLM",
    "GraniteMoeHybridForCausalLM",
    "HybridForCausalLM",
    "Lfm2ForCausalLM",
    "Qwen3NextForCausalLM",
]

_SHARED_EXPERTS = ("GraniteMoeHybridForCausalLM",)
_GATED_ATTENTION = ("Qwen3NextForCausalLM",)


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
        self.linear_attn: GatedDeltaNet | None = None
        spec = cfg.recurrent
        assert spec is not None
        if kv_index is not None:
            gated = cfg.architecture in _GATED_ATTENTION
            self.self_attn = GatedAttention(cfg, index) if gated else SelfAttention(cfg, index, None)
        elif spec.kind == "short_conv":
            self.conv = ShortConv(cfg.hidden_size, spec.conv_kernel, spec.conv_bias, state_index)
        elif spec.kind == "gated_deltanet":
            self.linear_attn = GatedDeltaNet(cfg.hidden_size, spec, cfg.rms_norm_eps, state_index)
        else:
            self.mamba = Mamba2Mixer(cfg.hidden_size, spec, cfg.rms_norm_eps, state_index)
        self.mlp: nn.Module = GatedMLP(cfg, None)
        if cfg.architecture in _SHARED_EXPERTS:
            self.mlp = SharedExpertMLP(cfg)
        elif cfg.moe is not None and cfg.moe.sparse_layers[index]:  # Qwen3-Next
            self.mlp = SparseMoeBlock(cfg)
        self.residual_multiplier = cfg.residual_multiplier
        exact, offset = cfg.quantization is None, cfg.norm_offset
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact, offset=offset)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact, offset=offset)

    def forward(self, x: torch.Tensor, ropes: list[RopeStep], meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        h = self.input_layernorm.forward(x, meta.triton)
        if self.self_attn is not None:
            assert self.kv_index is not None
            h = self.self_attn.forward(h, ropes, meta, kv.k[self.kv_index], kv.v[self.kv_index])
        else:
            assert meta.state_rows is not None
            mixer = self.conv or self.mamba or self.linear_attn
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
        kv_index, state_index = self.layer_slots(cfg, index)
        return HybridDecoderLayer(cfg, index, kv_index, 0 if state_index is None else state_index)

    @staticmethod
    def layer_slots(cfg: ModelConfig, index: int) -> tuple[int | None, int | None]:
        """Layer `index`'s KV cache layer and its first tensor in the state pool (None: it has none)."""
        assert cfg.recurrent is not None
        kv_layers, state_layers = cfg.kv_layers, cfg.state_layers
        per_layer = len(cfg.recurrent.state_shapes(cfg.hidden_size))
        return (
            kv_layers.index(index) if index in kv_layers else None,
            state_layers.index(index) * per_layer if index in state_layers else None,
        )

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


class ScaledKeyAttention(SelfAttention):
    """Falcon-H1's attention: Llama's, with the keys times `key_multiplier` before RoPE."""

    def __init__(self, cfg: ModelConfig, layer: int, key_multiplier: float) -> None:
        super().__init__(cfg, layer, None)
        self.key_multiplier = key_multiplier

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        if self.key_multiplier != 1.0:
            h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
            qkv[:, h * hd : (h + kvh) * hd].mul_(self.key_multiplier)
        out = self.attn.forward(qkv, ropes[self.rope_index], meta, k_cache, v_cache)
        return self.o_proj.forward(out)


class MultipliedMLP(GatedMLP):
    """Falcon-H1's MLP: down(silu(gate(x) * gate_multiplier) * up(x)) * down_multiplier."""

    def __init__(self, cfg: ModelConfig, gate_multiplier: float, down_multiplier: float) -> None:
        super().__init__(cfg, None)
        self.gate_multiplier, self.down_multiplier = gate_multiplier, down_multiplier
        self.intermediate = cfg.intermediate_size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if self.gate_multiplier != 1.0:
            gate_up[:, : self.intermediate].mul_(self.gate_multiplier)
        out = self.down_proj.forward(self.act(gate_up))
        return out if self.down_multiplier == 1.0 else out * self.down_multiplier


class FalconH1DecoderLayer(nn.Module):
    """Attention and a Mamba-2 mixer side by side on the same normed input (module note)."""

    def __init__(self, cfg: ModelConfig, index: int, kv_index: int, state_index: int) -> None:
        super().__init__()
        spec = cfg.recurrent
        assert spec is not None and spec.falcon is not None
        self.kv_index, self.mult = kv_index, spec.falcon
        self.self_attn = ScaledKeyAttention(cfg, index, spec.falcon.key)
        self.mamba = Mamba2Mixer(cfg.hidden_size, spec, cfg.rms_norm_eps, state_index)
        self.mlp = MultipliedMLP(cfg, spec.falcon.mlp_gate, spec.falcon.mlp_down)
        exact = cfg.quantization is None
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=exact)

    def forward(self, x: torch.Tensor, ropes: list[RopeStep], meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        mult = self.mult
        h = self.input_layernorm.forward(x, meta.triton)
        assert meta.state_rows is not None
        mixed = self.mamba.forward(h, meta.state_rows)
        if mult.ssm_out != 1.0:
            mixed = mixed * mult.ssm_out
        attn_in = h if mult.attention_in == 1.0 else h * mult.attention_in
        attended = self.self_attn.forward(attn_in, ropes, meta, kv.k[self.kv_index], kv.v[self.kv_index])
        if mult.attention_out != 1.0:
            attended = attended * mult.attention_out
        normed, x = self.post_attention_layernorm.add_forward(mixed + attended, x, meta.triton)
        return x + self.mlp.forward(normed)


class FalconH1ForCausalLM(HybridForCausalLM):
    renames = (
        ("model.final_layernorm.", "model.norm."),
        (".pre_ff_layernorm.", ".post_attention_layernorm."),
        (".feed_forward.", ".mlp."),
    )

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        if shard is not None:
            raise ValueError(f"tensor_parallel_size: {cfg.architecture} is not supported with tensor parallelism")
        kv_index, state_index = self.layer_slots(cfg, index)
        assert kv_index is not None and state_index is not None  # every layer has both
        return FalconH1DecoderLayer(cfg, index, kv_index, state_index)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = super().compute_logits(hidden)
        spec = self.cfg.recurrent
        assert spec is not None and spec.falcon is not None
        return logits if spec.falcon.lm_head == 1.0 else logits * spec.falcon.lm_head


class GatedAttention(SelfAttention):
    """Qwen3-Next's attention: q_proj gives each head's query and, beside it, a gate; the
    attention's output times sigmoid(gate) goes to o_proj. The gate rows load after v's
    (`ReorderedLinear`), so q|k|v stay one block the attention reads as any other."""

    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__(cfg, layer, None)
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        self.qkv_width = (h + 2 * kvh) * hd
        q_rows = [
            (head * hd if j < hd else self.qkv_width + head * hd - hd) + j for head in range(h) for j in range(2 * hd)
        ]
        k_rows = list(range(h * hd, (h + kvh) * hd))
        v_rows = list(range((h + kvh) * hd, self.qkv_width))
        self.qkv_proj = ReorderedLinear(cfg.hidden_size, [q_rows, k_rows, v_rows], cfg.qkv_bias)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        out = self.qkv_proj.forward(x)
        qkv, gate = out[:, : self.qkv_width].contiguous(), out[:, self.qkv_width :]
        if self.q_norm is not None:
            self._norm_qk(qkv, meta)
        attended = self.attn.forward(qkv, ropes[self.rope_index], meta, k_cache, v_cache)
        return self.o_proj.forward(attended * torch.sigmoid(gate))


class Qwen3NextForCausalLM(HybridForCausalLM):
    # The DeltaNet's two input projections load as the two pieces of one (layers/gated_deltanet.py).
    stacked: ClassVar[dict[str, tuple[str, int]]] = {
        **STACKED,
        "in_proj_qkvz": ("in_proj", 0),
        "in_proj_ba": ("in_proj", 1),
    }

    def remap(self, name: str) -> str | None:
        if name.startswith("mtp."):
            return None  # the multi-token-prediction head: not run
        return super().remap(name)
