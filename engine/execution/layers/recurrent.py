"""Per-request state beside the paged KV cache, and the short convolution that keeps one.

A hybrid model (LFM2: engine/loading/hf_recurrent.py) has layers that remember a sequence by a
fixed-size state rather than by K/V per token. The state lives in a `StatePool`: per recurrent
layer one tensor `[slots, *state_shape]`, allocated once when the engine starts, with
`max_num_seqs` slots (every running request holds one, and no more than `max_num_seqs` run).

The slot's lifetime is the request's blocks' (engine/scheduling/block_manager.py): taken with
its first block on admission, given back with its blocks when it finishes, is aborted or is
preempted. A request whose step starts at position 0 (its first chunk, or its recompute after
a preemption: its blocks were freed, so it starts over) has its slot zeroed before the forward
pass (`StatePool.reset`); every later chunk continues from the state the previous one left, so
chunked prefill gives the unchunked numbers. Prefix caching cannot serve such a model (a cached
block holds K/V but not the state at its end) and is switched off at load; speculative decoding
(which rolls back rejected tokens) is refused.

`StateRows` tells a layer where each request's rows are in the flat batch: the decode rows
first (one token each, one vectorised update), then each prefill chunk (one convolution over
the chunk with its state in front).

`ShortConv` is LFM2's layer (transformers' `Lfm2ShortConv`): B, C, x = in_proj(h); y = C *
conv(B * x); out_proj(y), where conv is causal and depthwise over the last `kernel` positions.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from triollm.engine.execution.layers.linear import column, row

__all__ = ["ShortConv", "StatePool", "StateRows"]


class StatePool:
    """Per recurrent layer, `[slots, *shape]` of zeros (module note)."""

    def __init__(
        self, num_layers: int, slots: int, shape: Sequence[int], dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.num_slots = slots
        self.layers = [torch.zeros((slots, *shape), dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_needed(num_layers: int, slots: int, shape: Sequence[int], dtype: torch.dtype) -> int:
        n = 1
        for d in shape:
            n *= d
        return num_layers * slots * n * torch.empty((), dtype=dtype).element_size()

    def reset(self, slots: Sequence[int]) -> None:
        """Zero the state of requests that start over (their step begins at position 0)."""
        if slots:
            index = torch.tensor(list(slots), dtype=torch.long, device=self.layers[0].device)
            for t in self.layers:
                t.index_fill_(0, index, 0)


@dataclass
class StateRows:
    """Where each request's rows are in the step's flat batch, and its state slot."""

    decode_slots: torch.Tensor  # [num_decodes] int64: the slots of rows 0..num_decodes-1
    prefills: list[tuple[int, int, int]]  # (first row, rows, slot) of each prefill chunk
    pool: StatePool


class DepthwiseConv(nn.Module):
    """The convolution's weight `[channels, kernel]` (checkpoint: `[channels, 1, kernel]`) and bias."""

    def __init__(self, channels: int, kernel: int, bias: bool) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, kernel), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(channels), requires_grad=False) if bias else None

    def load(self, leaf: str, piece: int, source: Any) -> None:
        param = getattr(self, leaf)
        tensor = source[:]
        if leaf == "weight":
            tensor = tensor.reshape(tensor.shape[0], -1)
        if tuple(tensor.shape) != tuple(param.shape):
            raise ValueError(
                f"model: a convolution of shape {tuple(tensor.shape)} where {tuple(param.shape)} was expected"
            )
        param.data.copy_(tensor)


class ShortConv(nn.Module):
    """LFM2's gated short convolution (module note); `state_index`: its tensor in the pool."""

    def __init__(self, hidden: int, kernel: int, bias: bool, state_index: int) -> None:
        super().__init__()
        self.hidden, self.kernel, self.state_index = hidden, kernel, state_index
        self.in_proj = column(hidden, [(0, 3 * hidden)], bias)  # B | C | x, stored stacked
        self.conv = DepthwiseConv(hidden, kernel, bias)
        self.out_proj = row(hidden, hidden, bias, None, 0)

    def forward(self, h: torch.Tensor, rows: StateRows) -> torch.Tensor:
        b, c, x = self.in_proj.forward(h).split(self.hidden, dim=-1)
        bx = b * x  # [T, H]
        state = rows.pool.layers[self.state_index]  # [slots, H, kernel - 1]
        weight, bias = self.conv.weight, self.conv.bias
        out = torch.empty_like(bx)
        d = rows.decode_slots.numel()
        if d:
            window = torch.cat([state[rows.decode_slots], bx[:d, :, None]], dim=2)  # [D, H, kernel]
            y = (window * weight).sum(dim=-1)
            out[:d] = y if bias is None else y + bias
            state[rows.decode_slots] = window[:, :, 1:]
        for start, n, slot in rows.prefills:
            seq = torch.cat([state[slot], bx[start : start + n].t()], dim=1)  # [H, kernel - 1 + n]
            y = F.conv1d(seq[None], weight[:, None, :], bias, groups=self.hidden)[0]  # [H, n]
            out[start : start + n] = y.t()
            state[slot] = seq[:, n:]
        return self.out_proj.forward(c * out)
