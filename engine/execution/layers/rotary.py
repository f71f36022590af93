"""The rotary embedding of one RoPE configuration: its tables, and their rows for a step.

Tables are computed once on the CPU, fp32, `[max_model_len, rotary_dim]` (YaRN's attention
factor folded into cos and sin, as transformers does), and moved with the model. A step gathers
its positions' rows once (`step`) and every layer using this configuration reads them: a model
has one `RotaryEmbedding`, or two where layers differ (Gemma 3's local and global layers).
`rotary_dim < head_dim` is a partial rotary embedding (`partial_rotary_factor`): only the first
`rotary_dim` dimensions of each head rotate.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from triollm.engine.loading.rope_config import RopeConfig
from triollm.kernels.rotary import rotary_sign

__all__ = ["RopeStep", "RotaryEmbedding"]


@dataclass
class RopeStep:
    """One step's rotary rows. Torch and native paths: `cos` and signed `sin` `[T, 1, rotary_dim]`
    in the activations' dtype (sin carries rotate-half's sign); the Triton path with a full rotary:
    the whole fp32 tables (its fused kernel gathers by position), plain sin."""

    cos: torch.Tensor
    sin: torch.Tensor
    rotary_dim: int
    whole_tables: bool


class RotaryEmbedding:
    def __init__(self, rope: RopeConfig, head_dim: int, max_len: int, rotary_dim: int | None = None) -> None:
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.partial = self.rotary_dim != head_dim
        with torch.device("cpu"):
            cos, sin = rope.tables(self.rotary_dim, max_len)
            self.cos = cos
            self.sin_signed = sin * rotary_sign(self.rotary_dim)
            self.sin = sin

    def to(self, device: torch.device | str) -> RotaryEmbedding:
        self.cos, self.sin_signed, self.sin = (t.to(device) for t in (self.cos, self.sin_signed, self.sin))
        return self

    def step(self, positions: torch.Tensor, dtype: torch.dtype, triton: bool) -> RopeStep:
        if triton and not self.partial:  # the fused Triton kernel rotates whole heads only
            return RopeStep(self.cos, self.sin, self.rotary_dim, True)
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_signed.index_select(0, positions).to(dtype).unsqueeze(1)
        return RopeStep(cos, sin, self.rotary_dim, False)
