"""The rotary embedding of one RoPE configuration: its tables, and their rows for a step.

Tables are computed once on the CPU, fp32, `[max_model_len, rotary_dim]` (YaRN's attention
factor folded into cos and sin, as transformers does), and moved with the model. A step gathers
its positions' rows once (`step`) and every layer using this configuration reads them: a model
has one `RotaryEmbedding`, or two where layers differ (Gemma 3's local and global layers).
`rotary_dim < head_dim` is a partial rotary embedding (`partial_rotary_factor`): only the first
`rotary_dim` dimensions of each head rotate.

M-RoPE (Qwen2-VL, `mrope_section`): a step's positions are `[3, T]` (engine/execution/mrope.py)
and each row's cos / sin takes each section of the half-dims (temporal, height, width; the
second half repeats the first's sections, as transformers' `recomposition_frequencies`) from
the table row of its own component: three gathers and a select, per step, shared by the layers.
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
    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_len: int,
        rotary_dim: int | None = None,
        mrope_section: tuple[int, ...] = (),
    ) -> None:
        self.rotary_dim = head_dim if rotary_dim is None else rotary_dim
        self.partial = self.rotary_dim != head_dim
        # M-RoPE: the position component (0 temporal, 1 height, 2 width) of each rotary dim.
        self.mrope_component: torch.Tensor | None = None
        if mrope_section:
            if sum(mrope_section) * 2 != self.rotary_dim:
                raise ValueError(
                    f"rope_scaling.mrope_section: {list(mrope_section)} must sum to half the rotary dim "
                    f"({self.rotary_dim // 2})"
                )
            with torch.device("cpu"):  # also when the model is built on the meta device
                half = torch.cat([torch.full((n,), i % 3, dtype=torch.long) for i, n in enumerate(mrope_section)])
                self.mrope_component = torch.cat([half, half])
        with torch.device("cpu"):
            cos, sin = rope.tables(self.rotary_dim, max_len)
            self.cos = cos
            self.sin_signed = sin * rotary_sign(self.rotary_dim)
            self.sin = sin

    def to(self, device: torch.device | str) -> RotaryEmbedding:
        self.cos, self.sin_signed, self.sin = (t.to(device) for t in (self.cos, self.sin_signed, self.sin))
        if self.mrope_component is not None:
            self.mrope_component = self.mrope_component.to(device)
        return self

    def step(self, positions: torch.Tensor, dtype: torch.dtype, triton: bool) -> RopeStep:
        """The rows of `positions` `[T]`, or M-RoPE's `[3, T]` (module note)."""
        if positions.dim() == 2:
            return self._mrope_step(positions, dtype)
        if triton and not self.partial:  # the fused Triton kernel rotates whole heads only
            return RopeStep(self.cos, self.sin, self.rotary_dim, True)
        cos = self.cos.index_select(0, positions).to(dtype).unsqueeze(1)
        sin = self.sin_signed.index_select(0, positions).to(dtype).unsqueeze(1)
        return RopeStep(cos, sin, self.rotary_dim, False)

    def _mrope_step(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeStep:
        if self.mrope_component is None:
            raise ValueError("positions: 3-D positions need an M-RoPE model (rope_scaling.mrope_section)")
        rows = positions.shape[1]
        pick = self.mrope_component.view(1, 1, -1).expand(1, rows, -1)
        flat = positions.reshape(-1)

        def select(table: torch.Tensor) -> torch.Tensor:
            three = table.index_select(0, flat).view(3, rows, -1)
            return three.gather(0, pick)[0].to(dtype).unsqueeze(1)

        return RopeStep(select(self.cos), select(self.sin_signed), self.rotary_dim, False)
