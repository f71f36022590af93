"""Decode steps replayed from CUDA graphs, one captured per batch size (the GPU path).

A small model's decode step on a GPU is launch-bound (30 layers x ~10 kernels); a CUDA graph
replays the whole forward pass with one launch. Only all-decode steps use graphs: their shapes
depend on the batch size alone. The smallest captured size that holds the batch is replayed, and
the first rows of its static output are the hidden states; the logits and the sampler run
eagerly after it. Rows past the batch are padding: one token of context in a spare KV block
(`pad_block`, allocated beyond the block manager's blocks), so they read and write nothing that
belongs to a request.

Inputs. A step's inputs (token ids, positions, cache slots, context lengths, block tables, the
padding rows' values included) are packed on the host into one int32 array, filled by numpy
(`fill_tables`: no tensor per table row), and sent in one copy from pinned memory into a
device staging buffer (`host_int32`); the graph itself begins by widening the first three into its
int64 static buffers, and reads the lengths and tables in place. So the host's work per step is
that one array and one asynchronous copy, whatever the batch, where it was five pageable copies,
five fills and a tensor per row. Each size has its own packing, `[ids | positions | slots | lens]`
of `size` entries each, then `[size, max_blocks]` tables, at the start of the staging buffer.

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

import numpy as np
import torch

from triollm.kernels import KVCache, cpu_native
from triollm.kernels.attention import DecodePlan, DecodeWorkspace, fill_tables, host_int32
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
        self.width = width
        self.input_ids = torch.zeros(top, dtype=torch.long, device=device)
        self.positions = torch.zeros(top, dtype=torch.long, device=device)
        self.slots = torch.full((top,), pad_block * kv.block_size, dtype=torch.long, device=device)
        # The packed inputs of the captured sizes (module docstring); before each capture, all
        # padding in that size's packing.
        self.staging = torch.empty((4 + width) * top, dtype=torch.int32, device=device)
        self.hidden = torch.empty(top, model.cfg.hidden_size, dtype=model.cfg.dtype, device=device)
        self.workspace = DecodeWorkspace()
        self.triton = use_triton_on(device)
        if not self.triton and not (device.type == "cpu" and cpu_native.available()):
            raise ValueError(
                "decode graphs read static block tables: they need the Triton or the native CPU decode kernel"
            )
        self._replays: dict[int, Replay] = {}
        for size in reversed(self.sizes):  # the largest first: the others reuse its memory
            padding = self._pack(size, [], [], [], [], [])
            self.staging[: padding.size].copy_(torch.from_numpy(padding))
            self._replays[size] = capture(self._forward(size))

    def _forward(self, size: int) -> Callable[[], None]:
        from triollm.engine.execution.layers.attention import AttentionMetadata

        packed = self.staging[: 4 * size].view(4, size)  # ids, positions, slots, lens
        tables = self.staging[4 * size : (4 + self.width) * size].view(size, self.width)
        lens = packed[3]
        plan = (
            DecodePlan([], self.workspace, triton=(tables, lens))
            if self.triton
            else DecodePlan([], self.workspace, native=(tables, lens))
        )
        ids, positions, slots = self.input_ids[:size], self.positions[:size], self.slots[:size]
        meta = AttentionMetadata(slot_mapping=slots, num_decodes=size, decode_plan=plan, positions=positions)

        def forward() -> None:
            ids.copy_(packed[0])
            positions.copy_(packed[1])
            slots.copy_(packed[2])
            self.hidden[:size].copy_(self.model(ids, positions, meta, self.kv))

        return forward

    def _pack(
        self,
        size: int,
        token_ids: list[int],
        positions: list[int],
        slots: list[int],
        block_tables: list[list[int]],
        context_lens: list[int],
    ) -> np.ndarray:
        """The packed int32 inputs of a step of `len(token_ids)` rows for the graph of `size`,
        rows past the batch padding (one token in the spare block)."""
        b, width = len(token_ids), self.width
        host = np.empty((4 + width) * size, dtype=np.int32)
        packed = host[: 4 * size].reshape(4, size)
        packed[:, :b] = (token_ids, positions, slots, context_lens) if b else 0
        packed[:, b:] = np.array([[0], [0], [self.pad_block * self.kv.block_size], [1]], dtype=np.int32)
        fill_tables(host[4 * size :].reshape(size, width), block_tables, self.pad_block)
        return host

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
        host = self._pack(size, token_ids, positions, slots, block_tables, context_lens)
        self.staging[: host.size].copy_(host_int32(host, self.device), non_blocking=True)
        self._replays[size]()
        return self.hidden[:b]

