"""Quantized layers (`quantization=`, kernels/quant.py), and the native decoder stack over them.

The model loader decides where they go (engine/loading/weights.py `quantize_model`): with
"gguf", the GGUF's own blocks as shipped (the import's QUANTIZED_FILE, Q4_0/Q4_1/Q8_0 and
Q4_K/Q5_K/Q6_K, read by `read_gguf_quantized`), fused the way the model fuses its projections (q|k|v, gate|up); with
"int8"/"int4", the dense weights quantized at load; with a GPTQ, AWQ or compressed-tensors
checkpoint, its own codes and scales (engine/loading/quant_checkpoints.py; act order: an input
permutation, which the native stack does not take). A tied embedding in a block format stays
quantized too: the lookup dequantizes only the rows it reads, and the lm_head runs the quantized
kernel over it. Norms, biases and untied embeddings stay dense. The dense weights are dropped
once replaced.

This module knows no model class: the model hands `DecodeStack` (or, for a dense model,
`DenseDecodeStack`) its layers as `StackLayer` records (two norms, four projections), so the
layers sit below the models that use them.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from torch import nn

from triollm.engine.execution.layers.linear import Linear, load_rows
from triollm.kernels import cpu_native
from triollm.kernels.kv_quant import cache_scale
from triollm.kernels.quant import TILE_MIN_ROWS, PackedWeight, QuantWeight, packed_linear, packed_swiglu

if TYPE_CHECKING:
    from triollm.lora.layers import LoRABatch, LoRALayer

    # The native stack's LoRA arguments (DecodeStack.lora_args): the slots' A and B, their ranks
    # and masks, the pieces' bounds, the groups' row ranges and row indices.
    LoRAArgs = tuple[list[torch.Tensor], list[int], list[int], list[int], list[torch.Tensor]]

__all__ = ["DecodeStack", "GGUFQuantized", "QuantEmbedding", "QuantLinear", "StackLayer", "read_gguf_quantized"]


class _Packed(nn.Module):
    """Holds a PackedWeight as buffers (they move with the model, and count in its memory).
    `tiles`: large inputs may take the AMX bf16 tiles (kernels/quant.py; set by the model
    runner, which knows whether batch invariance rules them out)."""

    qp: torch.Tensor
    dp: torch.Tensor
    mp: torch.Tensor
    tiles = False

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
    model's batch-1 decode does not call these one by one: `DecodeStack` runs them in C++.
    `perm` (a GPTQ checkpoint's act order): the weight's columns are the input's in this
    order, so the layer reads `x[..., perm]`."""

    perm: torch.Tensor | None
    lora: LoRALayer | None = None  # adapter slots (set by lora/manager.py), as layers/linear.py's

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, perm: torch.Tensor | None = None) -> None:
        super().__init__(weight)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        if perm is not None and tuple(perm.shape) != (self.in_features,):
            raise ValueError(
                f"quantization: an input permutation of shape {tuple(perm.shape)} for {self.in_features} inputs"
            )
        self.register_buffer("perm", None if perm is None else perm.to(torch.long))
        # Which checkpoint rows its bias holds (set by the loader, as layers/linear.py's).
        self.rows: list[tuple[int, int]] = [(0, self.out_features)]
        self.cols: tuple[int, int] | None = None

    def load(self, leaf: str, piece: int, source: Any) -> None:
        load_rows(self, leaf, piece, source)

    def swiglu(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this fused gate/up projection in one kernel, where the bf16 tiles
        take x and nothing reads the projection's own output (no bias, input order or adapter):
        kernels/quant.py `packed_swiglu`; None elsewhere."""
        if not self.tiles or self.bias is not None or self.perm is not None:
            return None
        if self.lora is not None and self.lora.batch.groups:
            return None
        return packed_swiglu(x, self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xq = x if self.perm is None else x.index_select(-1, self.perm)
        out = packed_linear(xq, self.weight, self.bias, tiles=self.tiles)
        if self.lora is not None and self.lora.batch.groups:  # the adapter reads x in its own order
            out = self.lora.apply(x, out)
        return out


class QuantEmbedding(_Packed):
    """A tied embedding kept quantized: looked-up rows are dequantized, and the lm_head runs
    the quantized kernel over it."""

    def __init__(self, weight: QuantWeight, dtype: torch.dtype) -> None:
        super().__init__(weight)
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        flat = ids.reshape(-1)
        w = self.weight
        if w.qp.device.type == "cpu" and cpu_native.available():  # one call, the same values
            rows = torch.ops.triollm_cpu.packed_rows(w.qp, w.dp, w.mp, w.bits, flat.long()).to(self.dtype)
        else:
            rows = w.dequantize_rows(flat, self.dtype)
        return rows.view(*ids.shape, self.in_features)


@dataclass(frozen=True)
class StackLayer:
    """One decoder layer as the native stack reads it: its two RMSNorm weights, and its four
    projections in the stack's order (q|k|v, o, gate|up, down)."""

    input_norm: torch.Tensor
    post_attention_norm: torch.Tensor
    projections: tuple[nn.Module, nn.Module, nn.Module, nn.Module]


class DecodeStack:
    """The arguments of the native decoder stack (kernels/csrc/decoder.cpp): every layer's
    norms and packed projections as one flat list, gathered once. It runs an all-decode step
    of a quantized model in one call instead of a dozen Python-level calls per layer, whose
    dispatch cost is a large share of a small model's batch-1 token (docs/benchmarks.md).

    LoRA: a step with adapter rows passes `lora_args(batch)` (each group's slot of every
    projection, gathered once per set of slots and slot contents, and its rows); the native
    stack adds the updates by the function `LoRALayer.apply` calls (`lora_apply`)."""

    def __init__(
        self, layers: Sequence[StackLayer], num_heads: int, num_kv_heads: int, scale: float, eps: float
    ) -> None:
        self.weights: list[torch.Tensor] = []
        self.shapes: list[int] = []
        self.projections: list[QuantLinear] = []  # every layer's four, in the stack's order
        self._empty = torch.empty(0)
        self._lora_key: tuple[int, tuple[int, ...]] | None = None
        self._lora_args: tuple[list[torch.Tensor], list[int], list[int]] = ([], [], [])
        self.num_heads, self.num_kv_heads, self.scale, self.eps = num_heads, num_kv_heads, scale, eps
        for layer in layers:
            self.weights += [layer.input_norm, layer.post_attention_norm]
            for proj in layer.projections:
                assert isinstance(proj, QuantLinear)
                self.weights += [proj.qp, proj.dp, proj.mp]
                self.shapes += [proj.bits, proj.n]
                self.projections.append(proj)

    @staticmethod
    def supported(layers: Sequence[StackLayer]) -> bool:
        """Whether the native stack computes exactly what these layers would, given that the
        model runs fp32 and unsharded (the model checks that): on CPU with the native kernels,
        every projection quantized, without a bias, and reading its input in order (no `perm`)."""
        if not cpu_native.available():
            return False
        for layer in layers:
            for p in layer.projections:
                if not (isinstance(p, QuantLinear) and p.bias is None and p.perm is None and p.qp.device.type == "cpu"):
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
        lora: LoRAArgs | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last layer, before the final norm. x `[B, hidden]`;
        cos and signed sin `[B, 1, head_dim]`; `plan`: the native decode plan's tables and lengths;
        `lora`: `lora_args` of the step's adapter rows, if any. The projections take the bf16
        tiles where the layers would (their `tiles`, from `TILE_MIN_ROWS` rows), so the stack
        keeps the layer-by-layer path's bits."""
        weights, ints, bounds, ranges, rows = ([], [], [], [], []) if lora is None else lora
        k_scales = [s for s in map(cache_scale, k) if s is not None]  # a quantized cache's
        v_scales = [s for s in map(cache_scale, v) if s is not None]
        tiles = x.shape[0] >= TILE_MIN_ROWS and any(p.tiles for p in self.projections[:1])
        return torch.ops.triollm_cpu.quant_decoder_stack(  # type: ignore[no-any-return]
            x, self.weights, self.shapes, k, v, cos, sin, slots, plan[0], plan[1],
            self.num_heads, self.num_kv_heads, self.eps, self.scale, weights, ints, bounds, ranges, rows,
            k_scales, v_scales, tiles,
        )  # fmt: skip

    def lora_args(self, batch: LoRABatch) -> LoRAArgs | None:
        """The native stack's LoRA arguments for this step's groups (kernels/csrc/decoder.cpp);
        None where it cannot take them (slots `lora_apply` does not take: float16)."""
        key = (batch.version, tuple(slot for slot, _ in batch.groups))
        if key != self._lora_key:
            weights: list[torch.Tensor] = []
            ints: list[int] = []
            bounds: list[int] = []
            for proj in self.projections:
                b = [0, proj.out_features] if proj.lora is None else proj.lora.bounds
                bounds += [len(b) - 1, *b, *[b[-1]] * (4 - len(b))]
            for slot, _ in batch.groups:
                for proj in self.projections:
                    lora = proj.lora
                    info = None if lora is None else lora.info[slot]
                    if lora is None or info is None:
                        weights += (self._empty, self._empty)
                        ints += (0, 0)
                    elif not lora.native:
                        return None
                    else:
                        weights += lora.slot_ab[slot]
                        ints += info
            self._lora_key, self._lora_args = key, (weights, ints, bounds)
        ranges: list[int] = []
        rows: list[torch.Tensor] = []
        for _, r in batch.groups:
            if isinstance(r, slice):
                ranges += (r.start, r.stop - r.start)
                rows.append(self._empty)
            else:
                ranges += (0, 0)
                rows.append(r)
        return (*self._lora_args, ranges, rows)

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the stack runs this all-decode step's rows: any number."""
        return True


class DenseDecodeStack:
    """The native decoder stack of a dense fp32 or bf16 model (kernels/csrc/decoder.cpp
    `dense_decoder_stack`) for all-decode steps of 1-4 rows: each projection by the few-rows
    kernel over oneDNN's packed weight (`Linear.blocked`), RMSNorm as `kernels.norm.rms_norm`
    computes it for the dtype, so the step has the layers' bits without their ~15 Python-level
    calls a layer (a third of a small bf16 model's batch-1 step, docs/benchmarks.md). Steps with
    adapter rows, more rows, or tiled GEMMs (batch invariance) run the layers."""

    def __init__(
        self,
        layers: Sequence[StackLayer],
        num_heads: int,
        num_kv_heads: int,
        scale: float,
        eps: float,
        dtype: torch.dtype,
    ) -> None:
        self.weights: list[torch.Tensor] = []
        self.shapes: list[int] = []
        self.projections: list[Linear] = []
        self.num_heads, self.num_kv_heads, self.scale, self.eps, self.dtype = num_heads, num_kv_heads, scale, eps, dtype
        empty = torch.empty(0, dtype=dtype)
        for layer in layers:
            self.weights += [layer.input_norm.detach().to(dtype), layer.post_attention_norm.detach().to(dtype)]
            for proj in layer.projections:
                assert isinstance(proj, Linear) and proj.blocked is not None
                bias = proj.bias
                self.weights += [proj.blocked.data, empty if bias is None else bias.detach()]
                self.shapes += [proj.blocked.n, proj.blocked.kp]
                self.projections.append(proj)

    @staticmethod
    def supported(layers: Sequence[StackLayer], dtype: torch.dtype) -> bool:
        """Whether the stack computes exactly what these layers would, given a plain Llama-shaped
        model on one rank (the model checks that): every projection a packed `Linear` whose
        weight the few-rows kernel reads, its bias (if any) in the model's dtype, no
        all-reduce."""
        if not cpu_native.available() or dtype not in (torch.float32, torch.bfloat16):
            return False
        for layer in layers:
            for p in layer.projections:
                if not (isinstance(p, Linear) and p.blocked is not None and p.comm is None):
                    return False
                if p.blocked.data.dtype != dtype or (p.bias is not None and p.bias.dtype != dtype):
                    return False
        return True

    def takes(self, x: torch.Tensor) -> bool:
        """Whether the stack runs this all-decode step's rows: 1-4 of the model's dtype, no tiles."""
        return 0 < x.shape[0] <= cpu_native.FEW_ROWS and x.dtype == self.dtype and not self.projections[0].tile_rows

    def lora_args(self, batch: LoRABatch) -> LoRAArgs | None:
        """None: steps with adapter rows run the layers."""
        return None

    def __call__(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        plan: tuple[torch.Tensor, torch.Tensor],
        k: list[torch.Tensor],
        v: list[torch.Tensor],
        lora: LoRAArgs | None = None,
    ) -> torch.Tensor:
        """The residual stream after the last layer, before the final norm (as `DecodeStack`)."""
        assert lora is None
        k_scales = [s for s in map(cache_scale, k) if s is not None]
        v_scales = [s for s in map(cache_scale, v) if s is not None]
        return torch.ops.triollm_cpu.dense_decoder_stack(  # type: ignore[no-any-return]
            x, self.weights, self.shapes, k, v, cos, sin, slots, plan[0], plan[1],
            self.num_heads, self.num_kv_heads, self.eps, self.scale, k_scales, v_scales,
        )  # fmt: skip


def read_gguf_quantized(path: Path) -> dict[str, QuantWeight]:
    """The import's quantized tensors by HF name (engine/loading/gguf_import.py), all read."""
    with GGUFQuantized(path) as kept:
        return {name: kept[name] for name in kept.names}


class GGUFQuantized:
    """The import's quantized tensors by HF name, each read when asked for: the loader builds a
    layer's fused weight from its pieces and lets them go, so a load never holds the whole file
    twice (reading it all first, then concatenating, peaked at twice the weights)."""

    def __init__(self, path: Path, remap: Callable[[str], str | None] | None = None) -> None:
        from triollm.engine.loading.model_config import QUANTIZED_FILE

        self._file = str(path / QUANTIZED_FILE)
        self._stack = ExitStack()
        self._f: Any = None
        self._remap = remap
        self.names: dict[str, int] = {}
        self._stored: dict[str, str] = {}

    def __enter__(self) -> GGUFQuantized:
        self._f = self._stack.enter_context(safe_open(self._file, framework="pt"))
        self.names = {k: int(v) for k, v in (self._f.metadata() or {}).items() if k != "format"}
        self._stored = {k: k for k in self.names}
        # Also under the model's own names where its loader renames the checkpoint's (`remap`:
        # Llama 4's `feed_forward` is our `mlp`), so a layer finds its pieces by its own path.
        for name, bits in list(self.names.items()):
            ours = self._remap(name) if self._remap is not None and name.startswith("model.") else None
            if ours is not None and f"model.{ours}" != name:
                self.names[f"model.{ours}"], self._stored[f"model.{ours}"] = bits, name
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __getitem__(self, name: str) -> QuantWeight:
        stored = self._stored[name]
        q, d, m = (self._f.get_tensor(f"{stored}.{part}") for part in ("q", "d", "m"))
        return QuantWeight(q, d, m, self.names[name])

    def get(self, name: str) -> QuantWeight | None:
        return self[name] if name in self.names else None
