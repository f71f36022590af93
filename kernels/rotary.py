"""Rotary position embeddings (the Hugging Face "rotate half" convention).

The model precomputes cos/sin tables for every position up to `max_len` once and indexes them by
position each step. The tables come from a vector of inverse frequencies; one function per RoPE
variant computes it, each in the same fp32 operations, in the same order, as transformers'
`modeling_rope_utils` (so greedy parity holds bit for bit, not just within a tolerance):

* `default_inv_freq`: theta ** (-2i / dim).
* `linear_inv_freq`: the default divided by `factor` (position interpolation).
* `ntk_inv_freq`: dynamic NTK's base stretched for a sequence length; at or below
  `max_position_embeddings` the base is unchanged (the caller decides which lengths it honours).
* `llama3_inv_freq`: Llama 3.1's per-wavelength interpolation, smoothed between the two cut-offs.
* `yarn_inv_freq`: YaRN's ramp between interpolated and extrapolated frequencies; its attention
  factor is a scalar the tables are multiplied by (`rotary_tables(..., attention_factor)`).

Which variant and which numbers a checkpoint asks for is configuration, parsed in
`engine/loading/rope_config.py`; this module is only the arithmetic (kernels import no engine code).

`apply_rotary` is the reference form. `apply_rotary_signed` is the fast one the model runs: with
rotate-half's sign folded into the sin table (`sin * rotary_sign`), rotate_half(x) * sin becomes
x.roll(half) * signed_sin, so Q and K together take three ops (roll, mul, addcmul) instead of
five per tensor; it agrees with the reference to within fp32 rounding (addcmul fuses).
"""

from __future__ import annotations

import math

import torch

__all__ = [
    "apply_rotary",
    "apply_rotary_signed",
    "default_inv_freq",
    "linear_inv_freq",
    "llama3_inv_freq",
    "ntk_inv_freq",
    "rotary_cos_sin",
    "rotary_sign",
    "rotary_tables",
    "yarn_inv_freq",
]


def _exponents(dim: int) -> torch.Tensor:
    """2i / dim for i < dim / 2, in fp32."""
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def default_inv_freq(dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** _exponents(dim))


def linear_inv_freq(dim: int, theta: float, factor: float) -> torch.Tensor:
    return default_inv_freq(dim, theta) / factor


def ntk_inv_freq(
    dim: int, theta: float, factor: float, seq_len: int, max_position_embeddings: int
) -> torch.Tensor:
    """Dynamic NTK for sequences of `seq_len` tokens (lengths below max_position_embeddings count as it)."""
    seq_len = max(seq_len, max_position_embeddings)
    base = theta * ((factor * seq_len / max_position_embeddings) - (factor - 1)) ** (
        dim / (dim - 2)
    )
    return default_inv_freq(dim, base)


def llama3_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    low_freq_factor: float,
    high_freq_factor: float,
    original_max_position_embeddings: int,
) -> torch.Tensor:
    inv = default_inv_freq(dim, theta)
    old_len = original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / low_freq_factor, old_len / high_freq_factor
    wavelen = 2 * math.pi / inv
    # Long wavelengths are interpolated by `factor`, short ones kept, the band between smoothed.
    scaled = torch.where(wavelen > low_freq_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_inv_freq(
    dim: int,
    theta: float,
    factor: float,
    original_max_position_embeddings: int,
    beta_fast: float,
    beta_slow: float,
    truncate: bool,
) -> torch.Tensor:
    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength turns num_rotations times over the original context.
        ratio = original_max_position_embeddings / (num_rotations * 2 * math.pi)
        return (dim * math.log(ratio)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1 - ramp
    pos_freqs = theta ** _exponents(dim)
    interpolated, extrapolated = 1.0 / (factor * pos_freqs), 1.0 / pos_freqs
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight


def rotary_tables(
    inv_freq: torch.Tensor, max_len: int, attention_factor: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape [max_len, 2 * len(inv_freq)] in fp32, both times attention_factor."""
    freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq.float())
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if attention_factor != 1.0:
        cos, sin = cos * attention_factor, sin * attention_factor
    return cos, sin


def rotary_cos_sin(head_dim: int, max_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Plain RoPE tables of shape [max_len, head_dim] in fp32."""
    return rotary_tables(default_inv_freq(head_dim, theta), max_len)


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


def apply_rotary_signed(
    x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor
) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos, signed_sin: broadcastable to x (e.g. [T, 1, head_dim])."""
    return torch.addcmul(x * cos, x.roll(x.shape[-1] // 2, -1), signed_sin)
