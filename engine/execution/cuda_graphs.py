"""Decode steps replayed from CUDA graphs, one captured per batch size (the GPU path).

A small model's decode step on a GPU is launch-bound (30 layers x ~10 kernels); a CUDA graph
replays the whole forward pass with one launch. Only all-decode steps use graphs: their shapes
depend on the batch size alone. The step's inputs are copied into static buffers the graphs read
(token ids, positions, cache slots, block tables, context lengths), the smallest captured size
that holds the batch is replayed, and the first rows of its static output are the hidden states;
the logits and the sampler run eagerly after it. Rows past the batch are padding: one token of
context in a spare KV block (`pad_block`, allocated beyond the block manager's blocks), so they
read and write nothing that belongs to a request.

The capture is injectable (`capture`): `cuda_capture` on CUDA; tests on CPU pass one that
records the function and re-runs it at replay (`eager_capture`), which exercises everything here
but the driver (static buffers, padding, the plan, the choice of graph) through the real model.

`enforce_eager=True`, `compilation_config={"use_cudagraph": false}` or a device other than CUDA
turn graphs off; `compilation_config={"cudagraph_capture_sizes": [...]}` picks the sizes.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from triollm.kernels import KVCache, cpu_native
from triollm.kernels.attention import DecodePlan, DecodeWorkspace
from triollm.kernels.triton import use_triton_on

if TYPE_CHECKING:
    from triollm.engine.execution.models.base import CausalLM

__all__ = ["DecodeGraphs", "Replay", "cuda_capture", "default_capture_sizes", "eager_capture"]

Replay = Callable[[], None]
Capture = Callable[[Callable[[], None]], Replay]


def default_capture_sizes(max_num_seqs: int) -> tuple[int, ...]:
    """vLLM's default ladder, 1, 2, 4 then every multiple of 8, up to `max_num_seqs` (at most 512)."""
    top = min(max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    if sizes[-1] != top:
        sizes.append(top)
    return tuple(sizes)


def cuda_capture() -> Capture:
    """Capture on CUDA: warm up on a side stream, then record into a graph sharing one memory pool
    with the others."""
    pool: list[Any] = [None]

    def capture(fn: Callable[[], None]) -> Replay:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):  # Triton's autotuning and first-launch work stay out of the graph
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool[0]):
            fn()
        pool[0] = graph.pool()
        return graph.replay

    return capture


def eager_capture() -> Capture:
    """For tests without a GPU: "replaying" re-runs the recorded function on the static buffers."""

    def capture(fn: Callable[[], None]) -> Replay:
        fn()
        return fn

    return capture


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv: KVCache,
        device: torch.device,
        sizes: tuple[int, ...],
        max_blocks_per_seq: int,
        pad_block: int,
        capture: Capture,
    ) -> None:
        if not sizes:
            raise ValueError("DecodeGraphs needs at least one batch size")
        self.model, self.kv, self.device = model, kv, device
        self.sizes = sorted(set(sizes))
        self.pad_block = pad_block
        top, width = self.sizes[-1], max_blocks_per_seq
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), pad_block * kv.block_size, dtype=torch.long, device=device)
        self.tables = torch.full((top, width), pad_block, dtype=torch.int32, device=device)
        self.lens = torch.ones(top, dtype=torch.int32, device=device)
        self.hidden = torch.empty(top, model.cfg.hidden_size, dtype=model.cfg.dtype, device=device)
        self.workspace = DecodeWorkspace()
        self.triton = use_triton_on(device)
        if not self.triton and not (device.type == "cpu" and cpu_native.available()):
            raise ValueError("decode graphs read static block tables: they need the Triton or the native CPU decode kernel")
        self._replays: dict[int, Replay] = {}
        for size in reversed(self.sizes):  # the largest first: the others reuse its memory
            self._replays[size] = capture(self._forward(size))

    def _forward(self, size: int) -> Callable[[], None]:
        from triollm.engine.execution.layers.attention import AttentionMetadata

        tables, lens = self.tables[:size], self.lens[:size]
        plan = DecodePlan([], self.workspace, triton=(tables, lens)) if self.triton else DecodePlan([], self.workspace, native=(tables, lens))
        meta = AttentionMetadata(
            slot_mapping=self.slots[:size], num_decodes=size, decode_plan=plan, positions=self.positions[:size]
        )

        def forward() -> None:
            self.hidden[:size].copy_(self.model(self.input_ids[:size], self.positions[:size], meta, self.kv))

        return forward

    def size_for(self, batch: int) -> int | None:
        """The smallest captured size that holds `batch` decodes (None: too many)."""
        i = bisect.bisect_left(self.sizes, batch)
        return self.sizes[i] if i < len(self.sizes) else None

    def run(
        self,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
    ) -> torch.Tensor:
        """The hidden states `[B, hidden]` of a decode step of B rows; `size_for(B)` must exist."""
        b = len(token_ids)
        size = self.size_for(b)
        assert size is not None, b
        dev = self.device
        self.input_ids[:b].copy_(torch.tensor(token_ids, dtype=torch.long), non_blocking=True)
        self.positions[:b].copy_(torch.tensor(positions, dtype=torch.long), non_blocking=True)
        self.slots[:b].copy_(torch.tensor(slots, dtype=torch.long), non_blocking=True)
        self.lens[:b].copy_(torch.tensor(context_lens, dtype=torch.int32), non_blocking=True)
        rows = torch.full((b, self.tables.shape[1]), self.pad_block, dtype=torch.int32)
        for i, table in enumerate(block_tables):
            rows[i, : len(table)] = torch.tensor(table, dtype=torch.int32)
        self.tables[:b].copy_(rows.to(dev), non_blocking=True)
        # Padding rows (b..size): one token in the spare block, wherever an earlier step left them.
        self.input_ids[b:size].zero_()
        self.positions[b:size].zero_()
        self.slots[b:size].fill_(self.pad_block * self.kv.block_size)
        self.tables[b:size].fill_(self.pad_block)
        self.lens[b:size].fill_(1)
        self._replays[size]()
        return self.hidden[:b]
