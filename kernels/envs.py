"""The environment variables of the kernel layer, typed, read here only.

`engine/envs.py` is the one list of the variables triollm reads; the three that choose a kernel
path are read here because `kernels/` sits below `engine/` and imports nothing above it
(tests/test_import_graph.py), and `engine/envs.py` re-exports them. No other module of
`kernels/` touches `os.environ`.

- `TRIOLLM_KERNELS` ("auto", "triton" or "torch"): where the Triton kernels run (`auto`: on
  CUDA). Read when a dispatch point asks (`use_triton_on`), not at import: the interpreter tests
  pick a path with `monkeypatch.setenv` before calling a kernel. The model asks once per forward
  pass and passes the answer down (`AttentionMetadata.triton`).
- `TRIOLLM_CPU_KERNELS` ("0": off): whether the native CPU kernels are built and used; read once
  per process by `cpu_native.available()` (cached) and by the config's default quantization.
- `TRIOLLM_CPU_ISA`: forces a quantized-kernel path (`cpu_native.quant_isa()`, cached). The C++
  side (`csrc/quant_linear.cpp`) reads the same variable itself, so both agree.
- `TRITON_INTERPRET`, `TRITON_CACHE_DIR`: Triton's own; `python -m triollm.kernels.aot` clears
  the first and points the second at a fresh directory for itself (`clear_triton_interpret`,
  `triton_cache_dir`).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = [
    "CPU_KERNELS_ENV",
    "ISA_ENV",
    "KERNELS_ENV",
    "KERNEL_CHOICES",
    "clear_triton_interpret",
    "cpu_kernels_enabled",
    "forced_cpu_isa",
    "kernels_choice",
    "triton_cache_dir",
]

KERNELS_ENV = "TRIOLLM_KERNELS"  # "auto" (default), "triton" or "torch"
KERNEL_CHOICES = ("auto", "triton", "torch")
CPU_KERNELS_ENV = "TRIOLLM_CPU_KERNELS"  # "0": never build or use the native kernels
ISA_ENV = "TRIOLLM_CPU_ISA"  # force a path (tests, A/B runs): one of QUANT_ISAS the CPU can run


def kernels_choice() -> str:
    """$TRIOLLM_KERNELS: "auto" (unset), "triton" or "torch"; anything else is a ValueError."""
    choice = os.environ.get(KERNELS_ENV, "auto")
    if choice not in KERNEL_CHOICES:
        raise ValueError(f"{KERNELS_ENV}: {choice!r} is not one of {', '.join(KERNEL_CHOICES)}")
    return choice


def cpu_kernels_enabled() -> bool:
    """False when $TRIOLLM_CPU_KERNELS is "0" (the torch path everywhere), else True."""
    return os.environ.get(CPU_KERNELS_ENV, "1") != "0"


def forced_cpu_isa() -> str:
    """$TRIOLLM_CPU_ISA, stripped and lowercased; "" when unset (the best path for the CPU)."""
    return os.environ.get(ISA_ENV, "").strip().lower()


def clear_triton_interpret() -> None:
    """Drop `TRITON_INTERPRET` from this process's environment (Triton reads it when a kernel
    is decorated: set, `@triton.jit` gives interpreter objects that cannot be compiled)."""
    os.environ.pop("TRITON_INTERPRET", None)


@contextmanager
def triton_cache_dir(path: str) -> Iterator[None]:
    """Point Triton's cache (`TRITON_CACHE_DIR`) at `path` for the block; restored after."""
    previous = os.environ.get("TRITON_CACHE_DIR")
    os.environ["TRITON_CACHE_DIR"] = path
    try:
        yield
    finally:
        if previous is None:
            del os.environ["TRITON_CACHE_DIR"]
        else:
            os.environ["TRITON_CACHE_DIR"] = previous
