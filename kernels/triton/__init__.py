"""Triton kernels (the GPU path), each tested against its torch reference on CPU under the
interpreter (`TRITON_INTERPRET=1`, set by tests/conftest.py before these modules are imported)
and compiled ahead of time for sm_90 in CI (`python -m triollm.kernels.aot`).

Nothing here is imported on the CPU path: the dispatch points (`kernels/attention.py`,
`kernels/norm.py`, `kernels/rotary.py`) import these modules lazily, when a tensor is on CUDA
(or `TRIOLLM_KERNELS=triton` forces them, as the interpreter tests do).

Each kernel module lists `AOT_SPECS`: representative signatures (`AotSpec`) that
`kernels/aot.py` compiles for the GPU without a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from triollm.kernels.envs import KERNELS_ENV, kernels_choice

__all__ = ["KERNELS_ENV", "AotSpec", "use_triton", "use_triton_on"]


@dataclass(frozen=True)
class AotSpec:
    """One ahead-of-time compilation of a `@triton.jit` kernel: `signature` maps every argument
    to a Triton type ("*fp16", "*fp32", "*i32", "i32", "i64", "fp32", "constexpr"), `constexprs`
    gives the constexpr values, `num_warps`/`num_stages` the launch configuration."""

    name: str  # what the report prints, e.g. "paged_decode[hd=64, group=3, fp16]"
    kernel: Any  # the JITFunction
    signature: dict[str, str]
    constexprs: dict[str, Any] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2


def use_triton(t: torch.Tensor) -> bool:
    """Whether the op on `t` runs its Triton kernel: on CUDA unless `TRIOLLM_KERNELS=torch`,
    anywhere with `TRIOLLM_KERNELS=triton` (on CPU that needs `TRITON_INTERPRET=1`)."""
    return use_triton_on(t.device)


def use_triton_on(device: torch.device | str) -> bool:
    """`use_triton` for a device ($TRIOLLM_KERNELS read now: `kernels/envs.py`)."""
    choice = kernels_choice()
    if choice == "auto":
        return torch.device(device).type == "cuda"
    return choice == "triton"
