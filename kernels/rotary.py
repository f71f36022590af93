"""Rotary position embeddings (the Hugging Face "rotate half" convention).

`rotary_cos_sin` precomputes cos/sin tables for every position up to `max_len` once; the model
indexes them by position each step. Supports plain `rope_theta` and Llama 3 frequency scaling.

`apply_rotary` is the reference form. `apply_rotary_signed` is the fast one the model runs: with
rotate-half's sign folded into the sin table (`sin * rotary_sign`), rotate_half(x) * sin becomes
x.roll(half) * signed_sin, so Q and K together take three ops (roll, mul, addcmul) instead of
five per tensor; it agrees with the reference to within fp32 rounding (addcmul fuses).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def _inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    # fp32 exactly as Hugging Face computes it, so greedy parity holds bit for bit.
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type"))
    if kind in (None, "default"):
        return inv
    assert scaling is not None
    if kind == "linear":
        return inv / float(scaling["factor"])
    if kind == "llama3":
        factor = float(scaling["factor"])
        low = float(scaling.get("low_freq_factor", 1.0))
        high = float(scaling.get("high_freq_factor", 4.0))
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"rope_scaling: rope_type {kind!r} is not supported (default, linear, llama3)")


def rotary_cos_sin(
    head_dim: int, max_len: int, theta: float, scaling: dict[str, Any] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_len, head_dim] in fp32."""
    inv = _inv_freq(head_dim, theta, scaling)
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/sin: [T, head_dim] (already gathered by position)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rotated = torch.cat((-x2, x1), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


def rotary_sign(head_dim: int) -> torch.Tensor:
    """[-1] * (head_dim / 2) + [1] * (head_dim / 2): multiply a sin table by it once."""
    half = head_dim // 2
    return torch.cat((torch.full((half,), -1.0), torch.ones(head_dim - half)))


def apply_rotary_signed(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, signed_sin: broadcastable to x (e.g. [T, 1, head_dim])."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)
