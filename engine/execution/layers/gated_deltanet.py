"""Qwen3-Next's gated DeltaNet: a linear-attention mixer whose per-request state is a matrix.

What a layer remembers of a sequence (in the `StatePool`, layers/recurrent.py) is its causal
convolution's last `kernel - 1` inputs of q|k|v and, per value head, a state `S` of
`key_dim x value_dim`. Each token, in fp32 (transformers' `torch_recurrent_gated_delta_rule`):

    S = exp(g) S;   S = S + k (beta (v - S^T k))^T;   o = S^T q

with q and k L2-normalised (q also times key_dim^-1/2), `beta = sigmoid(b)` and
`g = -exp(A_log) softplus(a + dt_bias)`: a decay, then the delta rule's correction of what S
holds for k towards v. The output is RMS-normalised per head, gated by silu(z) (the norm before
the gate), and projected out.

Decode runs that update for every decode row at once. A prefill chunk runs the chunked form
(transformers' `torch_chunk_gated_delta_rule`, `_chunk_delta_rule` below): within a chunk of
`spec.delta_chunk` tokens the delta rule's corrections are a unit lower-triangular system
(the WY form) solved once, so the chunk is a few matrix products, and the state is carried from
chunk to chunk and from the previous prefill chunk. The two forms are the same sums in another
order; the state is the same whichever form last wrote it, so chunked prefill, decode and a
recompute after preemption continue one another. Rejected: the per-token recurrence for
prefill (exact too, but a Python loop of small products per token; `recurrent_delta_rule` keeps
it as the reference the tests compare against).

Checkpoint layout: `in_proj_qkvz` holds, per key head, its q, k, and its group of value heads'
v and z side by side, and `in_proj_ba` per key head its value heads' b then a; both load as the
two pieces of one projection whose rows are reordered to q|k|v|z|b|a (`ReorderedLinear`), so
one GEMM serves both and the convolution reads q|k|v as one contiguous block of channels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from triollm.engine.execution.layers.linear import Linear, row
from triollm.engine.execution.layers.recurrent import DepthwiseConv, GatedRMSNorm, StateRows, causal_conv, load_exact
from triollm.engine.loading.hf_recurrent import RecurrentSpec

__all__ = ["GatedDeltaNet", "ReorderedLinear", "chunk_delta_rule", "recurrent_delta_rule"]


class ReorderedLinear(Linear):
    """A projection whose checkpoint pieces land on rows in another order: `places[i][r]` is the
    row that row r of checkpoint piece i fills (a de-interleaving, exact: weights only move)."""

    def __init__(self, in_features: int, places: Sequence[Sequence[int]], bias: bool) -> None:
        super().__init__(in_features, [(0, len(p)) for p in places], bias)
        self.places = [list(p) for p in places]  # plain ints: the model is built on the meta device

    def load(self, leaf: str, piece: int, source: Any) -> None:
        param = getattr(self, leaf)
        dest = torch.tensor(self.places[piece], dtype=torch.long, device=param.device)
        tensor = source[:]
        expected = (len(dest), *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ValueError(f"model: a tensor of shape {tuple(tensor.shape)} where {expected} was expected")
        param.data[dest] = tensor.to(param.device, param.dtype)


def _in_proj_places(spec: RecurrentSpec) -> list[list[int]]:
    """Where `in_proj_qkvz`'s and `in_proj_ba`'s rows go in q|k|v|z|b|a (module note)."""
    kh, vh, kd, vd = spec.delta_key_heads, spec.delta_value_heads, spec.delta_key_dim, spec.delta_value_dim
    rep, keys, values = vh // kh, kh * kd, vh * vd
    qkvz: list[int] = []
    ba: list[int] = []
    for head in range(kh):
        qkvz += range(head * kd, (head + 1) * kd)  # q
        qkvz += range(keys + head * kd, keys + (head + 1) * kd)  # k
        qkvz += range(2 * keys + head * rep * vd, 2 * keys + (head + 1) * rep * vd)  # v of its value heads
        qkvz += range(2 * keys + values + head * rep * vd, 2 * keys + values + (head + 1) * rep * vd)  # z
        first = 2 * keys + 2 * values
        ba += range(first + head * rep, first + (head + 1) * rep)  # b
        ba += range(first + vh + head * rep, first + vh + (head + 1) * rep)  # a
    return [qkvz, ba]


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """transformers' `l2norm` (FLA's): x / sqrt(sum(x^2) + 1e-6)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear-attention layer (module note); `state_index`: its first tensor in the
    pool (the convolution's, then the delta rule's)."""

    def __init__(self, hidden: int, spec: RecurrentSpec, eps: float, state_index: int) -> None:
        super().__init__()
        self.spec, self.state_index = spec, state_index
        vh, vd = spec.delta_value_heads, spec.delta_value_dim
        self.in_proj = ReorderedLinear(hidden, _in_proj_places(spec), False)
        self.conv1d = DepthwiseConv(spec.conv_channels, spec.conv_kernel, spec.conv_bias)
        self.dt_bias = nn.Parameter(torch.empty(vh), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(vh), requires_grad=False)
        self.norm = GatedRMSNorm(vd, vd, eps, norm_before_gate=True)
        self.out_proj = row(vh * vd, hidden, False, None, 0)

    def load(self, leaf: str, piece: int, source: Any) -> None:
        load_exact(self, leaf, source)

    def forward(self, h: torch.Tensor, rows: StateRows) -> torch.Tensor:
        spec = self.spec
        kh, vh, kd, vd = spec.delta_key_heads, spec.delta_value_heads, spec.delta_key_dim, spec.delta_value_dim
        keys, values, t = kh * kd, vh * vd, h.shape[0]
        qkv, z, b, a = self.in_proj.forward(h).split([2 * keys + values, values, vh, vh], dim=-1)
        qkv = F.silu(causal_conv(qkv, rows.pool.layers[self.state_index], self.conv1d, rows))
        q, k, v = qkv.split([keys, keys, values], dim=-1)
        q = _l2norm(q.reshape(t, kh, kd).float()) * kd**-0.5
        k = _l2norm(k.reshape(t, kh, kd).float())
        if vh != kh:  # each key head serves a group of value heads
            q, k = q.repeat_interleave(vh // kh, dim=1), k.repeat_interleave(vh // kh, dim=1)
        v = v.reshape(t, vh, vd).float()
        beta = torch.sigmoid(b).float()
        g = -torch.exp(self.A_log.float()) * F.softplus(a.float() + self.dt_bias.float())  # [T, vh], <= 0
        state = rows.pool.layers[self.state_index + 1]  # [slots, vh, kd, vd]
        out = torch.empty_like(v)
        d = rows.decode_slots.numel()
        if d:
            s, out[:d] = recurrent_delta_rule(q[:d], k[:d], v[:d], g[:d], beta[:d], state[rows.decode_slots].float())
            state[rows.decode_slots] = s.to(state.dtype)
        for start, n, slot in rows.prefills:
            r = slice(start, start + n)
            out[r], s = chunk_delta_rule(q[r], k[r], v[r], g[r], beta[r], state[slot].float(), spec.delta_chunk)
            state[slot] = s.to(state.dtype)
        y = self.norm.forward(out.to(h.dtype).reshape(t * vh, vd), z.reshape(t * vh, vd))
        return self.out_proj.forward(y.reshape(t, values))


def recurrent_delta_rule(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, state: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of each of D rows (module note): q, k `[D, H, dk]`, v `[D, H, dv]`, g, beta
    `[D, H]`, state `[D, H, dk, dv]`, fp32; returns (the new state, o `[D, H, dv]`)."""
    s = state * torch.exp(g)[..., None, None]
    held = (k[:, :, None, :] @ s).squeeze(-2)  # what S gives for k: [D, H, dv]
    delta = (v - held) * beta[..., None]
    s = s + k[..., :, None] * delta[..., None, :]
    return s, (q[:, :, None, :] @ s).squeeze(-2)


def chunk_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence from `state` `[H, dk, dv]` in chunks of `chunk` tokens (module note): q, k
    `[T, H, dk]`, v `[T, H, dv]`, g, beta `[T, H]`, fp32; returns (o `[T, H, dv]`, the final
    state). A chunk shorter than `chunk` is not padded: padding adds zero keys and no decay,
    which change nothing."""
    q, k, v = (x.transpose(0, 1) for x in (q, k, v))  # [H, T, .]
    g, beta = g.t(), beta.t()
    out = torch.empty_like(v)
    total = q.shape[1]
    for c0 in range(0, total, chunk):
        c1 = min(c0 + chunk, total)
        qc, kc, bc = q[:, c0:c1], k[:, c0:c1], beta[:, c0:c1, None]
        cum = g[:, c0:c1].cumsum(-1)  # [H, n]: the decay from the chunk's start, in log space
        above = torch.ones(c1 - c0, c1 - c0, dtype=torch.bool, device=q.device).triu(1)
        decay = (cum[:, :, None] - cum[:, None, :]).masked_fill(above, -math.inf).exp()  # [H, i, j]: j to i
        kb = kc * bc
        # The delta rule's corrections inside the chunk: I + strictly_lower(beta K K^T decay).
        system = (kb @ kc.transpose(-1, -2)) * decay
        rhs = torch.cat([v[:, c0:c1] * bc, kb * cum.exp()[..., None]], dim=-1)  # one solve for both
        values, keys = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True).split(
            [v.shape[-1], k.shape[-1]], dim=-1
        )
        fresh = values - keys @ state  # what the chunk's tokens add, given the state before it
        attn = (qc @ kc.transpose(-1, -2)) * decay
        out[:, c0:c1] = (qc * cum.exp()[..., None]) @ state + attn @ fresh
        last = cum[:, -1:]
        state = state * last.exp()[..., None] + (kc * (last - cum).exp()[..., None]).transpose(-1, -2) @ fresh
    return out.transpose(0, 1), state
