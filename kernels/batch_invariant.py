"""Batch invariance on CPU (vLLM's `VLLM_BATCH_INVARIANT=1`): a request's numbers do not depend
on what else runs in its step, how its prompt was chunked, or whether its prefix came from the
cache.

Why they do otherwise. A token's hidden state passes through three kinds of op:
- per-row ops whose arithmetic for a row depends only on that row: the native RMSNorm, SwiGLU,
  rotary + cache write, the quantized linear (kernels/csrc/quant_linear.cpp: the same bits at
  every batch size), the embedding lookup, elementwise adds;
- dense GEMMs (oneDNN, MKL), which pick their kernels, blockings and thread splits by the
  number of rows M: a row's bits change with M (K = 2,048: at almost every M);
- attention. Decode reads K/V from the paged cache with the native kernel, an online softmax
  block by block (kernels/csrc/cpu_attention.cpp). Where the native prefill kernel runs (a CPU
  with AVX-512 BF16, a bf16 / fp8 / int8 cache, causal attention), a prompt row's arithmetic is
  the decode kernel's, so attention is per-row there too, and a quantized model (whose linears
  are per-row) is batch-invariant without the switch, unless the CPU has AMX bf16 tiles, where
  a step of `TILE_MIN_ROWS` rows or more runs its linears on the tiles (kernels/quant.py: a
  token's kernel then depends on the size of its step), and a large prompt step attends in bf16
  through torch's fused attention; the switch keeps both off. Elsewhere a prefill chunk runs SDPA, whose
  blocking follows the query and key lengths, over the new K/V in the activations' dtype when
  nothing came before, else over K/V read back from the cache (bf16 under a quantized model's
  fp32). So the same token attends differently as part of a 64-token prompt, a 16-token chunk,
  a prompt after a prefix-cache hit, or a preempted request's recomputed prompt.

What the switch does (engine/execution/model_runner.py applies it):
- Every token of a step is a decode row (`plan_rows`): its own row of the native decode plan,
  its block table and its context length (position + 1), so the whole step takes the model's
  all-decode path (the native rotary + cache write, the native decode kernel; a quantized
  model's native decoder stack, kernels/csrc/decoder.cpp). Every layer writes the step's K/V
  before any row attends (the path speculative drafts already take), and each row attends over
  the cache's representation, block by block in block order: the reduction order is fixed by
  block boundaries, not by chunk boundaries, and a prompt token computes exactly what it would
  as a decode token. By construction, not by tolerance: it is the same code. Where every
  attention layer takes the native prefill kernel instead (its prompt rows run the decode
  kernel's per-block code, kernels/csrc/cpu_attention.cpp), prompts stay prompts: the same bits,
  without each row re-reading its blocks (`ModelRunner._native_prompt_rows`).
- Dense linear layers run over fixed tiles of `TILE_ROWS` rows (`tiled_rows`), the last one
  padded with zero rows: every GEMM call has the same shape, and the tests check that a row's
  bits do not depend on its tile's other rows or its place in the tile
  (tests/kernels/test_batch_invariant_kernels.py). A dense lm_head too (the runner tiles
  `compute_logits`); a quantized one is invariant as it is.

What it costs (docs/benchmarks.md, "Batch invariance"): where prompt rows become decode rows,
prefill attention through the decode kernel re-reads each row's K/V blocks (quadratic in the
prompt: the cost grows with its length); where the native prefill kernel runs, nothing. A dense
model's GEMMs run in tiles (batch-1 decode pays for a whole tile). Hence a switch, off by
default; a quantized model on a CPU with the native prefill kernel is invariant without it.

Torch's elementwise ops are per-row too, with one caveat the tests probe: a transcendental op
(GELU's tanh) over a contiguous 2-D tensor splits the flat range between threads, and each part
ends in a scalar tail whose bits may differ from the vector loop's, so a row whose length is not
a multiple of the vector width can change with the batch. The model's such ops run on views
(GeGLU's gate) or over widths that are (a vocabulary's soft-cap), where every row is alike.

What it does not cover, refused when the engine starts (`unsupported`): the GPU (the Triton
kernels are not batch-invariant here), a CPU without the native kernels (the torch fallback
groups decode rows by length), LoRA adapters (their update switches from loops to BLAS above
16 rows, lora/layers.py) and MoE layers (each expert's GEMM has as many rows as tokens routed
to it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from triollm.kernels import cpu_native
from triollm.kernels.attention import DecodePlan, DecodeWorkspace, fill_tables
from triollm.kernels.triton import use_triton_on

__all__ = ["TILE_ROWS", "plan_rows", "tiled_rows", "unsupported"]

# The rows of every dense GEMM call under the switch: batch-1 decode pays for this many rows,
# a prefill runs ceil(T / TILE_ROWS) calls (docs/benchmarks.md, "Batch invariance").
TILE_ROWS = 32


def unsupported(device: torch.device | str) -> str | None:
    """Why batch invariance cannot be had on `device` in this process (None: it can)."""
    if torch.device(device).type != "cpu" or use_triton_on(device):
        return f"only the CPU's native kernels are batch-invariant here, not the {torch.device(device).type} path"
    if not cpu_native.available():
        return "the native CPU kernels are not available (no compiler, or TRIOLLM_CPU_KERNELS=0)"
    return None


def plan_rows(
    decode_tables: Sequence[Sequence[int]],
    decode_lens: Sequence[int],
    prefills: Sequence[tuple[int, int, int, Sequence[int]]],
    device: torch.device | str,
    workspace: DecodeWorkspace | None = None,
) -> DecodePlan:
    """The native decode plan of a step in which every token is a decode row: the decode rows
    as given (block table, context length), then each prefill chunk `(first row, tokens n,
    earlier tokens c, block ids)` as n rows of context lengths c + 1 .. c + n, each with the
    chunk's whole block table (the kernel reads a row's first ceil(len / block_size) entries).
    Rows in the flat batch's order: decodes first, then the chunks in order."""
    n_rows = len(decode_lens) + sum(n for _, n, _, _ in prefills)
    width = max([len(t) for t in decode_tables] + [len(b) for _, _, _, b in prefills] + [1])
    host = np.zeros(n_rows * (1 + width), dtype=np.int32)
    lens, tables = host[:n_rows], host[n_rows:].reshape(n_rows, width)
    d = len(decode_lens)
    if d:
        lens[:d] = decode_lens
        fill_tables(tables[:d], decode_tables, 0)
    row = d
    for _, n, c, blocks in prefills:
        lens[row : row + n] = np.arange(c + 1, c + n + 1, dtype=np.int32)
        tables[row : row + n, : len(blocks)] = np.asarray(blocks, dtype=np.int32)
        row += n
    both = torch.from_numpy(host).to(device)
    return DecodePlan([], workspace or DecodeWorkspace(), (both[n_rows:].view(n_rows, width), both[:n_rows]))


def tiled_rows(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, rows: int = TILE_ROWS) -> torch.Tensor:
    """`fn(x)` for a row-wise `fn` (a GEMM: `[M, K]` -> `[M, N]`), called on tiles of exactly
    `rows` rows, the last padded with zero rows: every call has one shape whatever M is."""
    lead, k = x.shape[:-1], x.shape[-1]
    flat = x.reshape(-1, k)
    m = flat.shape[0]
    if m == rows:
        return fn(flat).view(*lead, -1)
    pad = -m % rows
    if pad:
        flat = torch.cat([flat, flat.new_zeros(pad, k)])
    tiles = [fn(flat[i : i + rows]) for i in range(0, m + pad, rows)]
    out = tiles[0] if len(tiles) == 1 else torch.cat(tiles)
    return out[:m].view(*lead, -1)
