"""Compute kernels: one dispatch point per op, a pure-torch reference for each.

On CPU the torch implementations are the kernels. Triton kernels (GPU) plug in behind the same
functions; modules import them lazily so `import triton` is never needed on CPU.
"""

from triollm.kernels.attention import (
    KVCache,
    allocate_kv_cache,
    paged_decode_attention,
    prefill_attention,
    write_kv,
)
from triollm.kernels.norm import rms_norm
from triollm.kernels.rotary import apply_rotary, rotary_cos_sin

__all__ = [
    "KVCache",
    "allocate_kv_cache",
    "apply_rotary",
    "paged_decode_attention",
    "prefill_attention",
    "rms_norm",
    "rotary_cos_sin",
    "write_kv",
]
