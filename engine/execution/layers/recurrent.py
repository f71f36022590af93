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

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from triollm.engine.execution.layers.linear import column, row
from triollm.engine.loading.hf_recurrent import RecurrentSpec

__all__ = ["Mamba2Mixer", "ShortConv", "StatePool", "StateRows", "causal_conv", "load_exact"]


class StatePool:
    """One tensor `[slots, *shape]` of zeros per state of the model's recurrent layers (module
    note): `shapes` in layer order, a layer's states consecutive (a Mamba-2 mixer has two)."""

    def __init__(
        self, shapes: Sequence[tuple[int, ...]], slots: int, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.num_slots = slots
        self.layers = [torch.zeros((slots, *shape), dtype=dtype, device=device) for shape in shapes]

    @staticmethod
    def bytes_needed(shapes: Sequence[tuple[int, ...]], slots: int, dtype: torch.dtype) -> int:
        return slots * StatePool.bytes_per_slot(shapes, dtype)

    @staticmethod
    def bytes_per_slot(shapes: Sequence[tuple[int, ...]], dtype: torch.dtype) -> int:
        return sum(math.prod(shape) for shape in shapes) * torch.empty((), dtype=dtype).element_size()

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


def causal_conv(bx: torch.Tensor, state: torch.Tensor, conv: DepthwiseConv, rows: StateRows) -> torch.Tensor:
    """The causal depthwise convolution of `bx` `[T, channels]` over each request's rows, its last
    kernel - 1 inputs (`state` `[slots, channels, kernel - 1]`) in front; the states move on."""
    weight, bias = conv.weight, conv.bias
    out = torch.empty_like(bx)
    d = rows.decode_slots.numel()
    if d:
        window = torch.cat([state[rows.decode_slots], bx[:d, :, None]], dim=2)  # [D, channels, kernel]
        y = (window * weight).sum(dim=-1)
        out[:d] = y if bias is None else y + bias
        state[rows.decode_slots] = window[:, :, 1:]
    for start, n, slot in rows.prefills:
        seq = torch.cat([state[slot], bx[start : start + n].t()], dim=1)  # [channels, kernel - 1 + n]
        y = F.conv1d(seq[None], weight[:, None, :], bias, groups=weight.shape[0])[0]  # [channels, n]
        out[start : start + n] = y.t()
        state[slot] = seq[:, n:]
    return out


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
        out = causal_conv(b * x, rows.pool.layers[self.state_index], self.conv, rows)
        return self.out_proj.forward(c * out)


class GatedRMSNorm(nn.Module):
    """A gated RMSNorm over each group of `group` channels, in fp32, times the weight: with the gate
    first (transformers' `MambaRMSNormGated`: norm(x * silu(z))), or with `norm_before_gate`
    after it (Falcon-H1's `mamba_norm_before_gate`, Qwen3-Next's `Qwen3NextRMSNormGated`:
    norm(x) * silu(z))."""

    def __init__(self, width: int, group: int, eps: float, *, norm_before_gate: bool = False) -> None:
        super().__init__()
        self.group, self.eps, self.norm_before_gate = group, eps, norm_before_gate
        self.weight = nn.Parameter(torch.empty(width), requires_grad=False)

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float() if self.norm_before_gate else x.float() * F.silu(z.float())
        g = h.view(*h.shape[:-1], -1, self.group)
        g = g * torch.rsqrt(g.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * g.view(h.shape).to(dtype)
        return (out.float() * F.silu(z.float())).to(dtype) if self.norm_before_gate else out

    def load(self, leaf: str, piece: int, source: Any) -> None:
        load_exact(self, leaf, source)


class Mamba2Mixer(nn.Module):
    """A Mamba-2 mixer (transformers' `BambaMixer`, `FalconH1Mixer`): in_proj to z | x,B,C | dt;
    the causal convolution over x,B,C then SiLU; the selective scan with a state
    `[heads, head_dim, state]` per request (`A = -exp(A_log)`, `dt = softplus(dt + dt_bias)`
    clamped to `time_step_limit`, the skip `D`); the output gated by z (with the gated RMSNorm of
    `spec.mamba_norm`, or none); out_proj. Falcon-H1's muP: the input times `ssm_in_multiplier`
    and in_proj's output times `ssm_multipliers` (z, x, B, C, dt). Prefill scans in chunks of
    `mamba_chunk` (the state-space dual form: within a chunk a masked matrix product, across
    chunks the state carried); decode updates the state of every row at once."""

    def __init__(self, hidden: int, spec: RecurrentSpec, eps: float, state_index: int) -> None:
        super().__init__()
        self.spec, self.state_index = spec, state_index
        inner, channels, heads = spec.mamba_inner, spec.conv_channels, spec.mamba_heads
        self.in_proj = column(hidden, [(0, inner + channels + heads)], spec.mamba_proj_bias)
        self.conv1d = DepthwiseConv(channels, spec.conv_kernel, spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(heads), requires_grad=False)
        self.norm = (
            None
            if spec.mamba_norm == "none"
            else GatedRMSNorm(inner, inner // spec.mamba_groups, eps, norm_before_gate=spec.mamba_norm == "before_gate")
        )
        self.out_proj = row(inner, hidden, spec.mamba_out_bias, None, 0)
        gn = spec.mamba_groups * spec.mamba_state
        widths = (inner, inner, gn, gn, heads)  # z, x, B, C, dt
        self.mup: list[float] | None = None
        if any(m != 1.0 for m in spec.ssm_multipliers):
            self.mup = [m for m, w in zip(spec.ssm_multipliers, widths, strict=True) for _ in range(w)]
        self._mup: torch.Tensor | None = None  # `mup` on the activations' device, made at the first call

    def load(self, leaf: str, piece: int, source: Any) -> None:
        load_exact(self, leaf, source)

    def forward(self, h: torch.Tensor, rows: StateRows) -> torch.Tensor:
        spec = self.spec
        inner, heads, p, n = spec.mamba_inner, spec.mamba_heads, spec.mamba_head_dim, spec.mamba_state
        gn = spec.mamba_groups * n
        if spec.ssm_in_multiplier != 1.0:
            h = h * spec.ssm_in_multiplier
        proj = self.in_proj.forward(h)
        if self.mup is not None:
            if self._mup is None or self._mup.device != proj.device:
                self._mup = torch.tensor(self.mup, dtype=torch.float32, device=proj.device)
            proj = (proj.float() * self._mup).to(proj.dtype)
        z, xbc, dt = proj.split([inner, spec.conv_channels, heads], dim=-1)
        xbc = F.silu(causal_conv(xbc, rows.pool.layers[self.state_index], self.conv1d, rows))
        x, b, c = xbc.split([inner, gn, gn], dim=-1)
        t = x.shape[0]
        rep = heads // spec.mamba_groups
        xh = x.reshape(t, heads, p).float()
        bh = b.reshape(t, spec.mamba_groups, n).repeat_interleave(rep, dim=1).float()  # [T, heads, n]
        ch = c.reshape(t, spec.mamba_groups, n).repeat_interleave(rep, dim=1).float()
        low, high = spec.time_step_limit
        step = F.softplus(dt.float() + self.dt_bias.float()).clamp(low, high)  # [T, heads]
        a = -torch.exp(self.A_log.float())  # [heads]
        ssm = rows.pool.layers[self.state_index + 1]  # [slots, heads, p, n]
        y = torch.empty_like(xh)
        d = rows.decode_slots.numel()
        if d:
            s = ssm[rows.decode_slots].float()
            s = (
                s * torch.exp(step[:d] * a)[..., None, None]
                + (step[:d, :, None] * xh[:d])[..., None] * bh[:d, :, None, :]
            )
            y[:d] = (s @ ch[:d, :, :, None]).squeeze(-1)
            ssm[rows.decode_slots] = s.to(ssm.dtype)
        for start, length, slot in rows.prefills:
            rows_ = slice(start, start + length)
            out, state = _ssd_scan(xh[rows_], step[rows_], a, bh[rows_], ch[rows_], ssm[slot].float(), spec.mamba_chunk)
            y[rows_] = out
            ssm[slot] = state.to(ssm.dtype)
        y = (y + self.D.float()[None, :, None] * xh).reshape(t, inner)
        if self.norm is None:  # Falcon-H1 without mamba_rms_norm: the gate alone
            return self.out_proj.forward((y * F.silu(z.float())).to(h.dtype))
        return self.out_proj.forward(self.norm.forward(y.to(h.dtype), z))


def _ssd_scan(
    x: torch.Tensor,
    dt: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    c: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's selective scan from `state` `[heads, p, n]`: x `[T, heads, p]`, dt
    `[T, heads]`, a `[heads]`, b and c `[T, heads, n]`; returns (y without the D skip, the final
    state). s_t = exp(dt_t a) s_{t-1} + dt_t x_t b_t^T, y_t = s_t c_t, computed per chunk."""
    y = torch.empty_like(x)
    xdt = x * dt[..., None]
    log_decay = dt * a  # [T, heads], <= 0
    for c0 in range(0, x.shape[0], chunk):
        c1 = min(c0 + chunk, x.shape[0])
        cum = torch.cumsum(log_decay[c0:c1], dim=0)  # [q, heads]
        seg = cum[:, None, :] - cum[None, :, :]  # [i, j, heads]: decay from j to i
        q = c1 - c0
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
        weights = torch.exp(seg.masked_fill(~causal[..., None], -math.inf))
        scores = torch.einsum("ihn,jhn->ijh", c[c0:c1], b[c0:c1]) * weights
        inside = torch.einsum("ijh,jhp->ihp", scores, xdt[c0:c1])
        before = torch.einsum("ihn,hpn->ihp", c[c0:c1], state) * torch.exp(cum)[..., None]
        y[c0:c1] = inside + before
        to_end = torch.exp(cum[-1][None, :] - cum)  # [q, heads]
        state = state * torch.exp(cum[-1])[:, None, None] + torch.einsum(
            "jhn,jhp->hpn", b[c0:c1] * to_end[..., None], xdt[c0:c1]
        )
    return y, state


def load_exact(module: nn.Module, leaf: str, source: Any) -> None:
    param = getattr(module, leaf)
    tensor = source[:]
    if tuple(tensor.shape) != tuple(param.shape):
        raise ValueError(f"model: a tensor of shape {tuple(tensor.shape)} where {tuple(param.shape)} was expected")
    param.data.copy_(tensor)
