"""Linear layers, and which part of the checkpoint each one holds.

CPU speed: weights run through oneDNN, reordered once at load (`Linear.pack`). `F.linear` goes to
MKL's sgemm, which takes its AVX2 path on AMD CPUs and ran slower at every batch size than oneDNN
with a packed weight (docs/benchmarks.md); in bf16 on CPUs with native bf16 the packed path is
faster at batch 1 too. For 1-4 rows (decode) oneDNN's call, built for larger batches, reads its
packed weight at 0.4-0.9x the pace of a plain loop over the same bytes; where its layout is the
one that loop reads (blocks of 64 output rows, k-major: `blocked_view` checks the layout once, at
load), the native kernel reads the packed buffer in place (`BlockedWeight`, no second copy).

Loading (nano-vllm's `weight_loader`, without a class per case): a linear layer stacks one or
more checkpoint tensors along its output rows (q|k|v, gate|up, or just one) and, under tensor
parallelism, holds only some rows of each (column-parallel) or some input columns (row-parallel).
`rows[i]` is the `(start, count)` of checkpoint piece i that this rank holds, stacked in order;
`cols` the `(start, count)` of the input columns. `load` copies a checkpoint tensor (a safetensors
slice: only the rows or columns it needs are read) into place. A row-parallel layer adds its
bias on one rank only (`bias_rank0`) and all-reduces its output when `comm` is set.

LoRA (lora/layers.py): a projection an adapter may target gets a `lora` (its adapter slots) when
the engine serves adapters; each step's low-rank updates are added to the base output before the
all-reduce, so a row-parallel layer's partial updates are summed with its partial products.
`lora` is None otherwise, and costs one attribute read.

Batch invariance (`VLLM_BATCH_INVARIANT=1`, kernels/batch_invariant.py): oneDNN and MKL choose
their blocking by the number of rows, so a row's bits change with the batch. The model runner
then sets `tile_rows` on every layer, and `forward` runs the GEMM over tiles of exactly that
many rows (`tiled_rows`): one shape for every call. 0 (the default) is the plain call.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from triollm.kernels import cpu_native
from triollm.kernels.batch_invariant import tiled_rows

if TYPE_CHECKING:
    from triollm.engine.distributed.collectives import Collectives
    from triollm.lora.layers import LoRALayer

__all__ = [
    "BlockedWeight",
    "Linear",
    "blocked_view",
    "column",
    "few_rows_matmul",
    "load_rows",
    "onednn_linear",
    "packable",
    "row",
]


def packable(weight: torch.Tensor) -> bool:
    """Whether this weight can run through oneDNN: on CPU with torch's mkldnn ops built in, fp32,
    or bf16 where the CPU computes bf16 natively (elsewhere oneDNN would emulate it)."""
    return (
        weight.device.type == "cpu"
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_native.has_native_bf16()))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """oneDNN's reordered copy of `weight` (an opaque mkldnn tensor of the same shape)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight)  # type: ignore[no-any-return]


def onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")  # type: ignore[no-any-return]


class BlockedWeight:
    """oneDNN's packed copy of a linear's weight `[n, k]`, read in place by the few-rows kernel
    (kernels/csrc/small_matmul.cpp `blocked_matvec`): `data` is the packed buffer as a flat
    tensor of the weight's dtype, `kp` its padded k (0: the rows as they are, as oneDNN leaves a
    one-row weight). It holds `owner`, the packed tensor, so the buffer lives as long as this
    view of it."""

    __slots__ = ("data", "kp", "n", "owner")

    def __init__(self, data: torch.Tensor, n: int, kp: int, owner: torch.Tensor) -> None:
        self.data, self.n, self.kp, self.owner = data, n, kp, owner

    def takes(self, x: torch.Tensor) -> bool:
        """Whether `linear` takes x: `[M, k]` of the weight's dtype, 1 <= M <= cpu_native.FEW_ROWS."""
        return x.dim() == 2 and 0 < x.shape[0] <= cpu_native.FEW_ROWS and x.dtype == self.data.dtype

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, fp32_out: bool = False) -> torch.Tensor:
        return cpu_native.blocked_matvec(x, self.data, self.n, self.kp, bias, fp32_out)


_BLOCK = 64  # output rows a block of the layout the kernel reads


def blocked_view(packed: torch.Tensor, dense: torch.Tensor) -> BlockedWeight | None:
    """`packed` (`pack_weight(dense)`) as a `BlockedWeight`, where oneDNN laid it out as the
    kernel reads it: its size must be whole blocks of 64 rows by some padded k, and one product
    of a random row with it must equal the dense weight's (float64, to 1e-4 of |x| |w_n| per
    output: a different layout is off by ~|x| |w_n| / sqrt(k)). None where it is not (oneDNN
    chooses its layout by the CPU: other ISAs may block differently) or where the torch build
    lacks the ops that expose the buffer; such a layer keeps oneDNN's call for every batch."""
    mkldnn = torch.ops.mkldnn
    if not cpu_native.available() or not (hasattr(mkldnn, "data_ptr") and hasattr(mkldnn, "_nbytes")):
        return None
    n, k = dense.shape
    nbytes = int(mkldnn._nbytes(packed))
    kp, rest = divmod(nbytes, -(-n // _BLOCK) * _BLOCK * dense.element_size())
    if nbytes == dense.numel() * dense.element_size() and n < _BLOCK:
        kp, rest = 0, 0  # rows as they are (oneDNN leaves a one-row weight so)
    elif rest or kp < k or (dense.dtype == torch.bfloat16 and (kp % 2 or kp < k + k % 2)):
        return None
    raw = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(int(mkldnn.data_ptr(packed))))
    view = BlockedWeight(torch.from_numpy(raw).view(dense.dtype), n, kp, packed)
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(0)).to(dense.dtype)
    got = view.linear(x, None, fp32_out=True).double()[0]
    xd = x.double()[0]
    step = max(1, (1 << 22) // k)  # rows a slice: ~32 MB of float64
    for r in range(0, n, step):
        w = dense[r : r + step].double()
        if not bool(((got[r : r + step] - w @ xd).abs() <= 1e-4 * xd.norm() * w.norm(dim=1)).all()):
            return None
    return view


_FEW_ROWS_DTYPES = (torch.float32, torch.bfloat16)


def few_rows_matmul(x: torch.Tensor, w: torch.Tensor, *, w_is_kn: bool = False) -> torch.Tensor | None:
    """`x @ w.transpose(-1, -2)` (w `[B, N, K]`: linears' weights) or, `w_is_kn`, `x @ w` (w
    `[B, K, N]`) for x `[B, M, K]` of a few rows (any strides: the kernel reads it as one
    contiguous fp32 copy), by the native kernel where it takes the case:
    on the CPU, M <= `cpu_native.FEW_ROWS`, fp32/bf16, each of w's matrices row-contiguous (a view
    into stacked expert weights or a fused projection is read in place; kernels/csrc/small_matmul.cpp).
    None elsewhere: the caller runs torch's product. Decode's expert and per-head products (MoE
    experts, DeepSeek's absorbed W_UK / W_UV) went to unpacked GEMMs and `bmm`, which copied a
    strided weight first: 2.5-3.5x the bandwidth floor in a small DeepSeek's decode step."""
    if (
        x.shape[1] > cpu_native.FEW_ROWS
        or x.device.type != "cpu"
        or x.dtype not in _FEW_ROWS_DTYPES
        or w.dtype not in _FEW_ROWS_DTYPES
        or w.stride(2) != 1
        or w.stride(1) != w.shape[2]
        or not cpu_native.available()
    ):
        return None
    return cpu_native.few_rows_matmul(x, w, w_is_kn=w_is_kn)


class Linear(nn.Linear):
    """`nn.Linear` that runs through oneDNN on CPU once packed, and loads its share of the
    checkpoint (module note). Build it with `column` or `row`."""

    packed = False
    blocked: BlockedWeight | None = None  # the packed weight as the few-rows kernel reads it
    lora: LoRALayer | None = None  # adapter slots (set by lora/manager.py)
    tile_rows = 0  # > 0: the GEMM runs over tiles of this many rows (batch invariance, module note)

    def __init__(
        self,
        in_features: int,
        rows: list[tuple[int, int]],
        bias: bool,
        *,
        cols: tuple[int, int] | None = None,
        bias_rank0: bool = True,
    ) -> None:
        super().__init__(in_features if cols is None else cols[1], sum(n for _, n in rows), bias=bias and bias_rank0)
        self.rows, self.cols = rows, cols
        self.bias_elsewhere = bias and not bias_rank0  # the checkpoint's bias, added on rank 0
        self.comm: Collectives | None = None  # row-parallel: all-reduce the output (set at load)

    def pack(self, few_rows: bool = True) -> None:
        """Replace the weight, once loaded, by oneDNN's reordered copy: call it last, after loading
        and moving the model. `few_rows`: 1-4 rows read that copy in place (`BlockedWeight`:
        decode's speed); a model that only prefills (a pooler) passes False and keeps oneDNN's call
        for every batch, so that a prompt's output does not depend on how it was batched (oneDNN
        gives 3 rows and 6 the same bits on the shapes tested; the kernel's are its own)."""
        w = self.weight.detach()
        if not packable(w):
            return
        self.weight = nn.Parameter(pack_weight(w), requires_grad=False)
        self.packed = True
        self.blocked = blocked_view(self.weight, w) if few_rows else None

    def load(self, leaf: str, piece: int, source: Any) -> None:
        load_rows(self, leaf, piece, source)

    def _gemm(self, x: torch.Tensor) -> torch.Tensor:
        return onednn_linear(x, self.weight, self.bias) if self.packed else F.linear(x, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tile_rows:
            out = tiled_rows(self._gemm, x, self.tile_rows)
        elif self.blocked is not None and self.blocked.takes(x):
            out = self.blocked.linear(x, self.bias)
        else:  # the plain call, inline (a step calls it hundreds of times)
            out = onednn_linear(x, self.weight, self.bias) if self.packed else F.linear(x, self.weight, self.bias)
        if self.lora is not None and self.lora.batch.groups:
            out = self.lora.apply(x, out)
        return out if self.comm is None else self.comm.all_reduce(out)


def load_rows(module: nn.Module, leaf: str, piece: int, source: Any) -> None:
    """Copy checkpoint piece `piece` (a tensor or safetensors slice) into `module.<leaf>` (weight
    or bias), at its stacked offset, reading only this rank's rows / columns."""
    rows: list[tuple[int, int]] = module.rows  # type: ignore[assignment]
    cols: tuple[int, int] | None = module.cols  # type: ignore[assignment]
    param = getattr(module, leaf)
    if param is None:  # a row-parallel bias that another rank adds
        return
    if piece >= len(rows):
        raise ValueError(f"model: piece {piece} of a layer stacking {len(rows)} tensors")
    start, count = rows[piece]
    offset = sum(n for _, n in rows[:piece])
    if leaf == "bias" or cols is None:
        tensor = source[start : start + count]
    else:
        tensor = source[start : start + count, cols[0] : cols[0] + cols[1]]
    dest = param.data[offset : offset + count]
    if tuple(dest.shape) != tuple(tensor.shape):
        raise ValueError(f"model: a tensor of shape {tuple(tensor.shape)} where {tuple(dest.shape)} was expected")
    dest.copy_(tensor)


def column(in_features: int, rows: list[tuple[int, int]], bias: bool) -> Linear:
    """A layer stacking checkpoint tensors along its output: `rows[i]` is this rank's
    `(start, count)` of checkpoint piece i."""
    return Linear(in_features, rows, bias)


def row(
    in_features: int, out_features: int, bias: bool, shard_cols: tuple[int, int] | None = None, rank: int = 0
) -> Linear:
    """A row-parallel layer: this rank holds input columns `shard_cols` (None: all); its bias is
    added on rank 0 only."""
    return Linear(in_features, [(0, out_features)], bias, cols=shard_cols, bias_rank0=rank == 0)
