"""Batched LoRA in the forward pass: each step's rows by adapter slot, and one projection's slots.

vLLM's punica idea. A LoRA-able projection (q|k|v, o, gate|up, down) holds the adapters of
every slot stacked: A `[max_loras, P*max_rank, in]` and B^T `[max_loras, P*max_rank, out]`
(B stored transposed: its rows are what the update reads, contiguous), P the checkpoint pieces
the projection stacks (3 for q|k|v, 2 for gate|up, 1 else). Piece i of an adapter of rank r
sits at [i*r, (i+1)*r) of the rank axis and, in B, in the piece's own output columns: B is
block-diagonal, so one shrink (`x A^T`) and one expand (`h B^T`) cover the fused projection,
and a piece the adapter does not target is zeros (exact: the expand adds zero products). The
adapter's scale (alpha/r, or alpha/sqrt(r) with rsLoRA) is folded into B when the slot is
filled, so a step does no extra multiply. Only the first P*r rows of a slot's A and B^T are
used: an adapter of rank 8 in 16-wide slots costs rank 8.

On CPU, with fp32 activations and fp32 or bf16 slots, the update is the native `lora_apply`
(kernels/csrc/decoder.cpp): for the few rows of a decode step, loops that skip untargeted
pieces and B's zero blocks (BLAS calls on such thin matrices cost several times their
arithmetic, and at batch 1 the slots' bytes are what the update costs: bf16 halves them); for
more rows, the matmuls below. The quantized model's native decode stack calls the same
function after each projection, so both give the same bits. Elsewhere (CUDA, other dtypes,
no native kernels) the torch ops run.

Per step the model runner sets one `LoRABatch`, shared by every projection: the rows of each
slot in use. A slot whose rows are one contiguous range (always the case for one adapter on
the whole batch, and for a prompt chunk) is a slice: the update is an in-place `addmm_` on
that slice of the base output, with no gather. Otherwise the rows are gathered
(`index_select`), and the update scattered back (`index_add_`). Rows without an adapter are
in no group. A step with no adapter rows has no groups, and a projection then does nothing
but read one empty list; a model without LoRA has `lora = None` on its projections.

Rejected: per-row gathered A/B and one `bmm` (the gather copies rank x in floats per row, and
costs more than the loop over the few slots a batch holds); a separate buffer per piece (two
more matmuls per slot for q|k|v, one more for gate|up).

Tensor parallel: a projection's slots hold the same share of A and B as its base weight
(lora/manager.py fills them): a column-parallel one (q|k|v, gate|up) its output rows of B, a
row-parallel one (o, down) its input columns of A, and its update is added before the layer's
all-reduce, which then sums the partial updates as it sums the partial products.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from triollm.kernels import cpu_native

__all__ = ["LoRABatch", "LoRALayer"]

_NO_ROWS = torch.empty(0, dtype=torch.long)  # lora_apply: the rows are a range


class LoRABatch:
    """This step's rows by slot (module note), and each slot's adapter rank (0: empty)."""

    def __init__(self, num_slots: int) -> None:
        self.groups: list[tuple[int, slice | torch.Tensor]] = []
        self.ranks = [0] * num_slots
        self.version = 0  # bumped whenever a slot's contents change

    def set(self, segments: Sequence[tuple[int, int, int]], device: torch.device | str) -> None:
        """This step's rows: `(slot, start, count)` per request fed (rows [start, start + count)
        run under that slot's adapter); rows in no segment run the base model alone."""
        if not segments:
            self.groups = []
            return
        by_slot: dict[int, list[tuple[int, int]]] = {}
        for slot, start, n in segments:
            ranges = by_slot.setdefault(slot, [])
            if ranges and ranges[-1][1] == start:
                ranges[-1] = (ranges[-1][0], start + n)
            else:
                ranges.append((start, start + n))
        groups: list[tuple[int, slice | torch.Tensor]] = []
        for slot, ranges in by_slot.items():
            if len(ranges) == 1:
                groups.append((slot, slice(*ranges[0])))
            else:
                rows = [i for a, b in ranges for i in range(a, b)]
                groups.append((slot, torch.tensor(rows, dtype=torch.long, device=device)))
        self.groups = groups

    @property
    def active(self) -> bool:
        return bool(self.groups)


class LoRALayer:
    """One projection's adapter slots (module note): `apply(x, out)` adds each row's update."""

    def __init__(
        self,
        batch: LoRABatch,
        counts: Sequence[int],
        in_features: int,
        out_features: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        slots, pieces = len(batch.ranks), len(counts)
        self.batch, self.pieces = batch, pieces
        self.bounds = [0, *itertools.accumulate(counts)]  # the pieces' output rows
        if self.bounds[-1] != out_features:
            raise ValueError(f"lora: pieces of {list(counts)} rows in a projection of {out_features} outputs")
        self.a = torch.zeros(slots, pieces * max_rank, in_features, dtype=dtype, device=device)
        self.bt = torch.zeros(slots, pieces * max_rank, out_features, dtype=dtype, device=device)  # B^T
        # Per slot: (A^T `[in, P*r]`, B^T `[P*r, out]`) views of the slot's used part, or None
        # where the slot's adapter does not target this projection.
        self.views: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * slots
        self.slot_ab = [(self.a[s], self.bt[s]) for s in range(slots)]
        self.info: list[tuple[int, int] | None] = [None] * slots  # (rank, targeted pieces bit mask)
        self.native = (
            self.a.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16) and cpu_native.available()
        )

    def clear(self, slot: int) -> None:
        self.a[slot].zero_()
        self.bt[slot].zero_()
        self.views[slot] = None
        self.info[slot] = None

    def fill(self, slot: int, rank: int, piece: int, a: torch.Tensor, b: torch.Tensor, rows: tuple[int, int]) -> None:
        """Piece `piece` of a rank-`rank` adapter: A `[rank, in]`, B `[count, rank]` (scale
        folded in) going to this projection's output rows `rows` = (offset, count)."""
        lo, hi = piece * rank, (piece + 1) * rank
        self.a[slot, lo:hi].copy_(a)
        self.bt[slot, lo:hi, rows[0] : rows[0] + rows[1]].copy_(b.t())
        k = self.pieces * rank
        self.views[slot] = (self.a[slot, :k].t(), self.bt[slot, :k])
        old = self.info[slot]
        self.info[slot] = (rank, (0 if old is None else old[1]) | 1 << piece)

    def apply(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """`out` (the base projection of `x`, `[T, out]`) plus each grouped row's update, in place."""
        native = self.native and x.dtype == torch.float32 and x.stride(-1) == 1
        for slot, rows in self.batch.groups:
            ab, info = self.views[slot], self.info[slot]
            if ab is None or info is None:
                continue
            if native:
                a, b = self.slot_ab[slot]
                if isinstance(rows, slice):
                    torch.ops.triollm_cpu.lora_apply(
                        out, x, a, b, self.bounds, info[0], info[1], _NO_ROWS, rows.start, rows.stop - rows.start
                    )
                else:
                    torch.ops.triollm_cpu.lora_apply(out, x, a, b, self.bounds, info[0], info[1], rows, 0, rows.numel())
                continue
            at, bt = ab
            cast = at.dtype != x.dtype
            if isinstance(rows, slice):
                xs = x[rows]
                h = torch.mm(xs.to(at.dtype) if cast else xs, at)
                if cast:
                    out[rows].add_(torch.mm(h, bt).to(out.dtype))
                else:
                    out[rows].addmm_(h, bt)
            else:
                xs = x.index_select(0, rows)
                delta = torch.mm(torch.mm(xs.to(at.dtype) if cast else xs, at), bt)
                out.index_add_(0, rows, delta.to(out.dtype) if cast else delta)
        return out
