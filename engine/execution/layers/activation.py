"""The gated MLP activations over a fused gate|up projection `[T, 2I]` -> `[T, I]`."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triollm.kernels import cpu_native

__all__ = ["ACTIVATIONS", "gelu_tanh_and_mul", "silu_and_mul"]


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU (Llama, Qwen, Mistral, Phi, OLMo, Granite); the native kernel on CPU."""
    if gate_up.device.type == "cpu" and cpu_native.available():
        return cpu_native.silu_and_mul(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate).mul_(up)


def gelu_tanh_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """GeGLU with tanh-approximated GELU (Gemma's `gelu_pytorch_tanh`)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.gelu(gate, approximate="tanh").mul_(up)


ACTIVATIONS = {"silu": silu_and_mul, "gelu_tanh": gelu_tanh_and_mul}
