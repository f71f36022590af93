"""Quantized weights in the Llama model (`quantization=`, kernels/quant.py).

`quantize_model` swaps the dense linear layers of a loaded model for `QuantLinear`s: with
"gguf", the GGUF's own blocks as shipped (the import's QUANTIZED_FILE, Q4_0/Q4_1/Q8_0), fused
the way the model fuses its projections (q|k|v, gate|up); with "int8"/"int4", the dense weights
quantized at load. A tied embedding in a block format stays quantized too: the lookup
dequantizes only the rows it reads, and the lm_head runs the quantized kernel over it. Norms,
biases and untied embeddings stay dense. The dense weights are dropped once replaced.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
from safetensors import safe_open
from torch import nn

from triollm.kernels import cpu_native
from triollm.kernels.quant import PackedWeight, QuantWeight, packed_linear

if TYPE_CHECKING:
    from triollm.engine.execution.models.llama import LlamaDecoderLayer, LlamaForCausalLM

__all__ = ["DecodeStack", "QuantEmbedding", "QuantLinear", "quantize_model"]


class _Packed(nn.Module):
    """Holds a PackedWeight as buffers (they move with the model, and count in its memory)."""

    qp: torch.Tensor
    dp: torch.Tensor
    mp: torch.Tensor

    def __init__(self, weight: QuantWeight) -> None:
        super().__init__()
        packed = PackedWeight.pack(weight)
        self.bits, self.n = packed.bits, packed.n
        self.register_buffer("qp", packed.qp)
        self.register_buffer("dp", packed.dp)
        self.register_buffer("mp", packed.mp)
        self.out_features, self.in_features = weight.shape

    @property
    def weight(self) -> PackedWeight:
        return PackedWeight(self.qp, self.dp, self.mp, self.bits, self.n)


class QuantLinear(_Packed):
    """A linear layer over quantized blocks (kernels/quant.py `packed_linear`). A quantized
    model's batch-1 decode does not call these one by one: `DecodeStack` runs them in C++."""

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None) -> None:
        super().__init__(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.weight, self.bias)


class QuantEmbedding(_Packed):
    """A tied embedding kept quantized: looked-up rows are dequantized, and the lm_head runs
    the quantized kernel over it."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__(weight)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        return self.weight.dequantize_rows(flat, self.dtype).view(*ids.shape, self.in_features)


class DecodeStack:
    """The arguments of the native decoder stack (kernels/csrc/decoder.cpp): every layer's
    norms and packed projections as one flat list, gathered once. It runs an all-decode step
    of a quantized model in one call instead of ~12 Python-level calls per layer (~2 ms of a
    ~9 ms batch-1 token for SmolLM2-135M)."""

    def __init__(self, model: LlamaForCausalLM) -> None:
        self.weights: list[torch.Tensor] = []
        self.shapes: list[int] = []
        layers = [cast("LlamaDecoderLayer", layer) for layer in model.layers]
        attn = layers[0].self_attn
        self.num_heads, self.num_kv_heads, self.scale = attn.num_heads, attn.num_kv_heads, attn.scale
        self.eps = model.cfg.rms_norm_eps
        for layer in layers:
            self.weights += [layer.input_layernorm, layer.post_attention_layernorm]
            for proj in _projections(layer):
                assert isinstance(proj, QuantLinear)
                self.weights += [proj.qp, proj.dp, proj.mp]
                self.shapes += [proj.bits, proj.n]

    @staticmethod
    def supported(model: LlamaForCausalLM) -> bool:
        """Whether the native stack computes exactly what the model's layers would: on CPU with
        the native kernels, fp32, unsharded, every projection quantized and without a bias."""
        if model.comm is not None or model.cfg.dtype != torch.float32 or not cpu_native.available():
            return False
        for layer in model.layers:
            for p in _projections(layer):
                if not (isinstance(p, QuantLinear) and p.bias is None and p.qp.device.type == "cpu"):
                    return False
        return True

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        plan: tuple[torch.Tensor, torch.Tensor],
        k: list[torch.Tensor],
        v: list[torch.Tensor],
    ) -> torch.Tensor:
        """The residual stream after the last layer, before the final norm. x `[B, hidden]`;
        cos and signed sin `[B, 1, head_dim]`; `plan`: the native decode plan's tables and lengths."""
        return torch.ops.triollm_cpu.quant_decoder_stack(  # type: ignore[no-any-return]
            x, self.weights, self.shapes, k, v, cos, sin, slots, plan[0], plan[1],
            self.num_heads, self.num_kv_heads, self.eps, self.scale,
        )  # fmt: skip


def _projections(module: nn.Module) -> tuple[nn.Module, ...]:
    """A decoder layer's four projections, in the native stack's order."""
    layer = cast("LlamaDecoderLayer", module)
    return layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj


def read_gguf_quantized(path: Path) -> dict[str, QuantWeight]:
    """The import's quantized tensors by HF name (engine/loading/gguf_import.py)."""
    from triollm.engine.loading.gguf_import import QUANTIZED_FILE

    file = path / QUANTIZED_FILE
    out: dict[str, QuantWeight] = {}
    with safe_open(str(file), framework="pt") as f:
        bits = {k: int(v) for k, v in (f.metadata() or {}).items() if k != "format"}
        for name, b in bits.items():
            out[name] = QuantWeight(f.get_tensor(f"{name}.q"), f.get_tensor(f"{name}.d"), f.get_tensor(f"{name}.m"), b)
    return out


# Our fused projections and the checkpoint tensors they hold, in row order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def quantize_model(model: LlamaForCausalLM, scheme: str, path: Path) -> None:
    """Replace the model's linear layers (and a tied embedding in a block format) in place."""
    gguf = read_gguf_quantized(path) if scheme == "gguf" else {}
    bits = {"int8": 8, "int4": 4}.get(scheme)
    for i, layer in enumerate(model.layers):
        for fused, parts in _FUSED.items():
            owner_name, attr = fused.rsplit(".", 1)
            owner = layer.get_submodule(owner_name)
            dense = getattr(owner, attr)
            if scheme == "gguf":
                names = [f"model.layers.{i}.{p}.weight" for p in parts]
                if not all(n in gguf for n in names):
                    continue  # stored as floats in the GGUF: stays dense
                weight = QuantWeight.cat([gguf[n] for n in names])
            else:
                assert bits is not None
                weight = QuantWeight.quantize(dense.weight.detach(), bits)
            bias = None if dense.bias is None else dense.bias.detach()  # gguf: on meta, loaded later
            setattr(owner, attr, QuantLinear(weight, bias))
    embedding = gguf.get("model.embed_tokens.weight")
    if model.lm_head is None and embedding is not None:
        assert isinstance(model.embed_tokens, nn.Embedding)
        dtype = model.cfg.dtype
        model.embed_tokens = QuantEmbedding(embedding, dtype)
        model.packed_tied_head = None
    elif model.lm_head is not None and "lm_head.weight" in gguf:
        model.lm_head = QuantLinear(gguf["lm_head.weight"], None)
