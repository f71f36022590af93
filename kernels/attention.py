"""Attention over a paged KV cache: the torch path (CPU, and the reference for GPU kernels).

Layout (a detail of this module; callers only hand over block ids and slot numbers): per layer, V is
`[num_kv_heads, num_blocks, block_size, head_dim]` and K the same with each block transposed,
`[num_kv_heads, num_blocks, head_dim, block_size]` (`k_blocks` gives the untransposed view). That is
K's shape everywhere; its storage depends on who reads it. For the CPU kernels the transposed blocks
are contiguous; where the Triton kernels run (CUDA), `allocate_kv_cache` stores K with head_dim
innermost, as V, and hands out the transposed view of it: the GPU loads then read `head_dim`
contiguous elements per position (kernels/triton/attention.py, "Layout"). Every function here takes
K by its strides, so both storages work everywhere. Head-major keeps one head's blocks contiguous,
so the decode gather is one `index_select` over whole blocks and the two attention matmuls run
batched with the GQA group folded into the query rows. That was faster than vLLM's `[num_blocks,
block_size, kv_heads, head_dim]` layout with a permuted matmul (docs/benchmarks.md, "Figures that
stood in the source"). Transposed K blocks let the native kernel compute a block's scores as
vertical FMAs across its tokens, with no horizontal sums. A slot is `block_id * block_size +
offset`.

Prefill, on a CPU with AVX-512 BF16 over a bf16, fp8 or int8 cache (causal, no window, sink,
chunk or soft-cap), is one native call for the step's chunks (`cpu_native.paged_prefill_attention`,
the plan's `native` tables): each prompt row gets exactly the bits the decode kernel would give it
as a decode row, reading each block once per tile of rows (docs/architecture.md, "Prefill attention
with the decode kernel's arithmetic"). Elsewhere it uses `scaled_dot_product_attention` over what
the cache holds: K/V gathered from the cache (`gather_kv`: a quantized cache's codes times their
scales), with `is_causal` when there is no earlier context and an explicit offset-causal mask when
there is (chunked prefill, prefix-cache hits). Only where the cache holds the activations' own
dtype does a prefill without context take its fresh K/V directly (they are the cached values). So
a prompt attends over the same values prefilled whole, in chunks or after a prefix hit, and
decode later reads exactly what prefill attended over.

The cache's dtype may differ from the activations' (`kv_cache_dtype`): bf16 under fp32, or
quantized (fp8 e4m3 / e5m2 with per-layer scales, int8 with a scale per token and kv head:
kernels/kv_quant.py). `write_kv` stores values as the cache holds them; every reader dequantizes.

Decode is planned once per step and run by every layer (`plan_decode`, `decode_attention`).
On CPU, where the native kernels build (`kernels/cpu_native.py`), the plan is just the block
tables and lengths as int32 tensors, and `kernels/csrc/cpu_attention.cpp` reads K/V in place from
the paged cache with an online softmax (no gather, no padding, one pass over the cache). The
torch path below is the reference it is tested against, and the fallback:
- The batch is cut into groups of similar length, because the gather and both matmuls pay for
  every padded block: a group costs `max_blocks` blocks per row plus a fixed overhead (a dozen
  op dispatches per layer, `_GROUP_OVERHEAD_BLOCKS`), and a small dynamic program over the rows,
  sorted longest first by the caller, picks the cuts (what it bought: docs/benchmarks.md,
  "What changed").
- The padding mask is built once per step, not per layer; K/V are sliced to the group's longest
  row, so a group whose rows have equal lengths (e.g. batch 1) needs no mask at all.
- The gathered K/V go into a `DecodeWorkspace` that persists across layers and steps: a fresh
  tens-of-MB tensor per layer costs page faults.

Host-to-device work per step stays small on CUDA: the decode plan's tables and lengths go up in
one copy from one pinned buffer (`upload_int32`), filled by numpy (`fill_tables`), not one tensor
per row; the prefill plan (`plan_prefill`) likewise, and its chunks then run as one varlen
Triton launch per layer (`prefill_attention_chunks`).

Sliding windows and soft-capping are per call (`window=`, `softcap=`), since one plan serves
every layer and Gemma 3 alternates windowed and global layers. A query at position i attends
keys j with i - j < window (transformers' `kv_idx > q_idx - sliding_window`); soft-capping
(Gemma 2) replaces each score s = q.k * scale by softcap * tanh(s / softcap) before the softmax.
The native and Triton kernels take both as scalars: they start at the block (tile) holding the
window's first position and mask the positions before it. The torch decode path builds, on
first use per window, groups over the rows' tables cut to the window
(`DecodePlan.window_groups`): blocks wholly before a window are not gathered, and the mask
covers the first block's positions before it. Prefill with either runs over query chunks with an
explicit mask and gathers only the keys a chunk's window reaches; soft-capped scores are fp32
(SDPA cannot cap). With both unset every path is the code that ran before they existed.

Attention sinks (gpt-oss: `sinks=`, one learned logit per query head) join each row's softmax
denominator and carry no value: p_j = exp(s_j) / (sum_k exp(s_k) + exp(sink)), so a head can
attend to "nothing". Chunked local attention (Llama 4: `chunk=`) lets the query at position i
see only keys j <= i in its own chunk, j // chunk == i // chunk. Both are per call like windows;
the first key a row sees is `_first_key` of its position under window and chunk together. The
torch paths take them here (decode through the same per-limit groups as a window, with the sink
as one more score column in fp32; prefill through the masked path); the native CPU decode kernel
takes both (a later start per row; the sink added to the denominator once per row), and so do
the Triton kernels (kernels/triton/attention.py, constexpr switches like the window's).

Bidirectional spans (Gemma 3's images: `bidirectional=`, ordered `[first, end)` position ranges
of one prefill chunk): a query inside a span also sees the span's later keys, as transformers'
`token_type_ids` block mask ORs them onto the causal mask, before the window and the chunk
limit apply (AND). Only the torch prefill path takes them (on any device: a chunk with spans
skips the Triton kernels); the scheduler never cuts a span across prefill chunks, so every key
a span's query needs is in its chunk or already in the cache. Decode rows never need them.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain

import numpy as np
import torch
import torch.nn.functional as F

from triollm.kernels import cpu_native
from triollm.kernels.kv_quant import (
    cache_scale,
    dequantize_kv,
    is_quantized,
    layer_scale_bytes,
    new_scale,
    quantize_kv,
    scale_bytes_per_token,
    set_cache_scale,
)
from triollm.kernels.masking import check_sinks_chunk, check_spans, check_window_softcap, same_span
from triollm.kernels.triton import use_triton, use_triton_on

__all__ = [
    "DecodePlan",
    "k_blocks",
    "DecodeWorkspace",
    "KVCache",
    "PrefillPlan",
    "allocate_kv_cache",
    "decode_attention",
    "fill_tables",
    "host_int32",
    "paged_decode_attention",
    "plan_decode",
    "plan_prefill",
    "prefill_attention",
    "prefill_attention_chunks",
    "upload_int32",
    "write_kv",
]


@dataclass
class KVCache:
    """Per layer, K and V (each with its scale where the cache is quantized: `cache_scale`)."""

    k: list[torch.Tensor]  # per layer [kv_heads, num_blocks, head_dim, block_size]
    v: list[torch.Tensor]  # per layer [kv_heads, num_blocks, block_size, head_dim]
    num_blocks: int
    block_size: int

    @staticmethod
    def bytes_per_block(
        num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, dtype: torch.dtype
    ) -> int:
        """The bytes one block takes over all layers, K and V: codes plus, for int8, the
        per-token scales (kernels/kv_quant.py). fp8's per-layer scales cost no block."""
        elem = torch.empty((), dtype=dtype).element_size()
        per_token = head_dim * elem + scale_bytes_per_token(dtype)
        return 2 * num_layers * num_kv_heads * block_size * per_token

    @staticmethod
    def fixed_bytes(num_layers: int, dtype: torch.dtype) -> int:
        """The bytes a cache takes whatever its block count: fp8's per-layer K and V scales."""
        return 2 * num_layers * layer_scale_bytes(dtype)


_MADV_HUGEPAGE = 14  # linux/mman.h
_HUGE_PAGE = 2 << 20


def _zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zeroed cache tensor. On the CPU its memory is asked for in transparent huge pages
    before the zeroing touches it (`madvise(MADV_HUGEPAGE)` on the 2 MB-aligned inside; where
    the kernel's THP mode is "madvise", the default on many distributions, nothing else gets
    them): decode attention reads each sequence's blocks wherever the block manager put them, 2
    KB of K or V at a time, and with 4 KB pages nearly every block is a TLB miss (a scattered
    64-row decode step's attention took 0.75-0.77 ms a layer against 0.63-0.70 ms with huge
    pages on the AMX Xeon: docs/bench/decode_attention_pages.py, docs/benchmarks.md). Where
    madvise is missing or refuses, plain pages."""
    if torch.device(device).type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    t = torch.empty(shape, dtype=dtype)
    madvise = cpu_native.libc_function("madvise", (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int))
    start = -(-t.data_ptr() // _HUGE_PAGE) * _HUGE_PAGE
    end = (t.data_ptr() + t.numel() * t.element_size()) // _HUGE_PAGE * _HUGE_PAGE
    if madvise is not None and end > start:
        madvise(start, end - start, _MADV_HUGEPAGE)  # advice only: a refusal leaves plain pages
    return t.zero_()


def allocate_kv_cache(
    num_layers: int,
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device | str,
    *,
    k_head_dim_last: bool | None = None,
) -> KVCache:
    """A zeroed cache. K has the shape `[kv_heads, num_blocks, head_dim, block_size]` either way;
    `k_head_dim_last` (default: where the Triton kernels run, `use_triton_on(device)`) stores it
    with head_dim innermost, as the GPU kernels read it best, else as contiguous transposed
    blocks, as the native CPU kernel reads it (see the module docstring)."""
    if k_head_dim_last is None:
        k_head_dim_last = use_triton_on(device)
    # Zeroed, not empty: masked-out slots are multiplied by a zero probability, and 0 * NaN
    # garbage would poison the output. Zeroing writes every page, so the whole cache is resident
    # from the start: its size is the sizing's choice (kv_cache_memory_bytes), not a lazy reserve.
    k_shape = (num_kv_heads, num_blocks, head_dim, block_size)
    v_shape = (num_kv_heads, num_blocks, block_size, head_dim)
    if k_head_dim_last:
        k = [_zeros(v_shape, dtype, device).transpose(2, 3) for _ in range(num_layers)]
    else:
        k = [_zeros(k_shape, dtype, device) for _ in range(num_layers)]
    v = [_zeros(v_shape, dtype, device) for _ in range(num_layers)]
    if is_quantized(dtype):
        for t in k + v:
            scale = new_scale(dtype, num_kv_heads, num_blocks, block_size, device)
            assert scale is not None
            set_cache_scale(t, scale)
    return KVCache(k, v, num_blocks, block_size)


def host_int32(host: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """The int32 array `host` as the source of a copy to `device`: pinned when that is CUDA (so
    the copy is asynchronous; torch's caching host allocator keeps the buffer until the copy is
    done), else a view of the array."""
    if torch.device(device).type != "cuda":
        return torch.from_numpy(host)
    pinned = torch.empty(host.shape, dtype=torch.int32, pin_memory=True)
    pinned.numpy()[...] = host
    return pinned


def upload_int32(host: np.ndarray, device: torch.device | str) -> torch.Tensor:
    """The int32 array `host` on `device`, in one copy that does not wait (`host_int32`)."""
    return host_int32(host, device).to(device, non_blocking=True)


def fill_tables(out: np.ndarray, tables: Sequence[Sequence[int]], pad: int) -> None:
    """Write the rows `tables` into the 2-D int array `out` (`[>= len(tables), width]`), each row
    padded with `pad`: one vectorised scatter, not a tensor or a loop step per row."""
    out.fill(pad)
    lengths = np.fromiter(map(len, tables), dtype=np.int64, count=len(tables))
    total = int(lengths.sum())
    if total:
        rows = np.repeat(np.arange(len(tables)), lengths)
        cols = np.arange(total) - np.repeat(np.cumsum(lengths) - lengths, lengths)
        out[rows, cols] = np.fromiter(chain.from_iterable(tables), dtype=out.dtype, count=total)


def k_blocks(k_cache: torch.Tensor) -> torch.Tensor:
    """The K cache as `[kv_heads, num_blocks, block_size, head_dim]` (a view, not contiguous)."""
    return k_cache.transpose(2, 3)


def gather_k(k_cache: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """K of the given blocks, `[kv_heads, len(block_ids), block_size, head_dim]`, contiguous
    (into `out` if given). Gathers the stored (transposed) blocks, then transposes them in one
    copy: an `index_select` over the transposed view was slower."""
    blocks = k_cache.index_select(1, block_ids)
    if out is None:
        return blocks.transpose(2, 3).contiguous()
    return out.copy_(blocks.transpose(2, 3))


def write_kv(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store k, v `[T, kv_heads, head_dim]` at the given slots `[T]` (int64), as the cache's
    dtype holds them: rounded to bf16, or quantized to fp8 or int8 with their scales
    (kernels/kv_quant.py), here, once."""
    kvh, nb, bs, hd = v_cache.shape
    blocks, offsets = slot_mapping.div(bs, rounding_mode="floor"), slot_mapping.remainder(bs)
    kq, k_rows = quantize_kv(k, k_cache.dtype, cache_scale(k_cache))
    vq, v_rows = quantize_kv(v, v_cache.dtype, cache_scale(v_cache))
    k_blocks(k_cache)[:, blocks, offsets] = kq.transpose(0, 1)  # writes through the view
    # index_copy_ has no fp8 kernel: the codes are copied as bytes.
    v_bytes = v_cache.view(torch.uint8) if v_cache.element_size() == 1 else v_cache
    v_bytes.view(kvh, nb * bs, hd).index_copy_(1, slot_mapping, vq.transpose(0, 1).view(v_bytes.dtype))
    if k_rows is not None and v_rows is not None:  # int8: the per-token scales
        for cache, rows in ((k_cache, k_rows), (v_cache, v_rows)):
            scale = cache_scale(cache)
            assert scale is not None
            scale.view(kvh, nb * bs).index_copy_(1, slot_mapping, rows.transpose(0, 1))


def gather_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, block_ids: torch.Tensor, start: int, stop: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """K and V `[kv_heads, stop - start, head_dim]` of positions `[start, stop)` counted from the
    first of the blocks `block_ids`, as `dtype`: what the cache holds, dequantized."""
    kvh, _, _, hd = v_cache.shape
    k = gather_k(k_cache, block_ids).view(kvh, -1, hd)[:, start:stop]
    v = v_cache.index_select(1, block_ids).view(kvh, -1, hd)[:, start:stop]
    kd = _dequantize(k, k_cache, block_ids, start, stop, dtype)
    return kd, _dequantize(v, v_cache, block_ids, start, stop, dtype)


def _dequantize(
    codes: torch.Tensor, cache: torch.Tensor, block_ids: torch.Tensor, start: int, stop: int, dtype: torch.dtype
) -> torch.Tensor:
    """Gathered codes `[kv_heads, n, hd]` of `cache` (positions `[start, stop)` of `block_ids`) as
    `dtype`; a plain cache's in its own dtype are returned as they are."""
    scale = cache_scale(cache)
    if cache.dtype == torch.int8:
        assert scale is not None
        rows = scale.index_select(1, block_ids).view(scale.shape[0], -1)[:, start:stop]
        return dequantize_kv(codes, None, dtype, rows)
    return dequantize_kv(codes, scale, dtype)


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    native: bool | None = None,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One query token per sequence. q `[B, H, hd]`; block_tables `[B, M]` (padded with any
    valid block id); context_lens `[B]` counts the tokens to attend to, the query's own included
    (its K/V must already be written). Returns `[B, H, hd]`. (One-shot form of `plan_decode` +
    `decode_attention`, which describes `window`, `softcap`, `sinks` and `chunk`.)"""
    lens = context_lens.tolist()
    bs = v_cache.shape[2]
    tables = [row[: -(-n // bs)] for row, n in zip(block_tables.tolist(), lens)]
    plan = plan_decode(tables, lens, bs, q.device, native=native)
    return decode_attention(q, k_cache, v_cache, plan, scale, window=window, softcap=softcap, sinks=sinks, chunk=chunk)


# Fixed cost of one more decode group, in blocks of padding it must save to pay off: a group's
# dozen op dispatches per layer, weighed against the gather and matmul time of one block.
_GROUP_OVERHEAD_BLOCKS = 32
# The dynamic program looks back at most this many distinct lengths (bounds its cost).
_MAX_RUNS_PER_GROUP = 32


@dataclass
class DecodeGroup:
    start: int  # rows [start, end) of the decode batch
    end: int
    block_ids: torch.Tensor  # [n * max_blocks] int64, each row padded with block 0
    max_blocks: int
    length: int  # tokens attended: the longest row's context
    pad: torch.Tensor | None  # [n, length] bool, True = masked out; None when no row is padded


class DecodeWorkspace:
    """Gather buffers for K and V, grown on demand and reused by every layer and step."""

    def __init__(self) -> None:
        self._k: torch.Tensor | None = None
        self._v: torch.Tensor | None = None

    def buffers(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> tuple[torch.Tensor, torch.Tensor]:
        n = math.prod(shape)
        k = self._k
        if k is None or k.numel() < n or k.dtype != dtype or k.device != device:
            self._k = k = torch.empty(n, dtype=dtype, device=device)
            self._v = torch.empty(n, dtype=dtype, device=device)
        assert self._v is not None
        return k[:n].view(shape), self._v[:n].view(shape)


@dataclass
class DecodePlan:
    """A step's decode batch, prepared once and shared by every layer: groups for the torch
    path, or the int32 block tables `[B, max_blocks]` and lengths `[B]` for the native kernel."""

    groups: list[DecodeGroup]
    workspace: DecodeWorkspace
    native: tuple[torch.Tensor, torch.Tensor] | None = None
    triton: tuple[torch.Tensor, torch.Tensor] | None = None  # the same, for the Triton kernel
    # The torch path's rows (block tables, context lengths), block size and device, from which
    # `window_groups` cuts the groups for a window or a chunk; those groups, built once.
    rows: tuple[list[list[int]], list[int], int, torch.device] | None = None
    _windowed: dict[tuple[int | None, int | None], list[DecodeGroup]] = field(default_factory=dict, repr=False)

    def window_groups(self, window: int | None, chunk: int | None = None) -> list[DecodeGroup]:
        """The torch path's groups for a sliding window of `window` tokens and chunks of `chunk`
        (either may be None): each row's table starts at the block holding its first key
        (`_first_key`), and the mask also covers that block's positions before it. The plan's
        own groups when every row sees its whole context. Built on first use and kept: every
        layer with these limits shares them."""
        groups = self._windowed.get((window, chunk))
        if groups is None:
            assert self.rows is not None, "window_groups: a plan of the torch path"
            tables, lens, bs, device = self.rows
            starts = [_first_key(n - 1, window, chunk) for n in lens]
            if not any(starts):
                groups = self.groups
            else:
                firsts = [k // bs for k in starts]
                groups = _make_groups(
                    [t[f:] for t, f in zip(tables, firsts)],
                    [n - f * bs for n, f in zip(lens, firsts)],
                    [k - f * bs for k, f in zip(starts, firsts)],
                    device,
                )
            self._windowed[(window, chunk)] = groups
        return groups


def _first_key(pos: int, window: int | None, chunk: int | None) -> int:
    """The first key position the query at `pos` attends, under a sliding window (i - j < window)
    and a chunk (j // chunk == i // chunk), either or both None."""
    first = 0 if window is None else max(0, pos - window + 1)
    return first if chunk is None else max(first, pos // chunk * chunk)


def plan_decode(
    block_tables: list[list[int]],
    context_lens: list[int],
    block_size: int,
    device: torch.device | str,
    workspace: DecodeWorkspace | None = None,
    *,
    native: bool | None = None,
) -> DecodePlan:
    """Plan the decode rows (each: its blocks and its context length, the new token included).
    `native` (default: on CPU when the native kernels are available) selects the native kernel;
    else the rows are grouped: contiguous runs, so sort them longest first for the best cut."""
    triton = use_triton_on(device) and not native
    if native is None:
        native = not triton and torch.device(device).type == "cpu" and cpu_native.available()
    elif native and not cpu_native.available():
        raise RuntimeError("plan_decode(native=True): the native CPU kernels are not available")
    if native or triton:
        # One host buffer, one copy: [B] lengths, then the [B, width] tables padded with block 0.
        batch, width = len(block_tables), max(map(len, block_tables))
        host = np.empty(batch * (1 + width), dtype=np.int32)
        host[:batch] = context_lens
        fill_tables(host[batch:].reshape(batch, width), block_tables, 0)
        both = upload_int32(host, device)
        lens_t, table_t = both[:batch], both[batch:].view(batch, width)
        if triton:
            return DecodePlan([], workspace or DecodeWorkspace(), triton=(table_t, lens_t))
        return DecodePlan([], workspace or DecodeWorkspace(), (table_t, lens_t))
    groups = _make_groups(block_tables, context_lens, None, device)
    source = (block_tables, context_lens, block_size, torch.device(device))
    return DecodePlan(groups, workspace or DecodeWorkspace(), rows=source)


def _make_groups(
    block_tables: list[list[int]],
    context_lens: list[int],
    firsts: list[int] | None,
    device: torch.device | str,
) -> list[DecodeGroup]:
    """The torch path's groups of the rows; `firsts`: each row's first position attended, the
    positions before it masked (None: all 0)."""
    groups = []
    for start, end in _cut_groups([len(t) for t in block_tables]):
        tables = block_tables[start:end]
        lens = context_lens[start:end]
        width = max(map(len, tables))
        flat = [b for t in tables for b in t + [0] * (width - len(t))]
        length = max(lens)
        pad = None
        if min(lens) != length:
            lens_t = torch.tensor(lens, device=device)
            pad = torch.arange(length, device=device)[None, :] >= lens_t[:, None]
        if firsts is not None and any(firsts[start:end]):
            firsts_t = torch.tensor(firsts[start:end], device=device)
            before = torch.arange(length, device=device)[None, :] < firsts_t[:, None]
            pad = before if pad is None else pad | before
        ids = torch.tensor(flat, dtype=torch.long, device=device)
        groups.append(DecodeGroup(start, end, ids, width, length, pad))
    return groups


def _cut_groups(num_blocks: list[int]) -> list[tuple[int, int]]:
    """Contiguous [start, end) groups minimising sum(overhead + rows * widest row) by dynamic
    programming over runs of equal block counts."""
    runs: list[list[int]] = []  # [start, end, blocks]
    for i, m in enumerate(num_blocks):
        if runs and runs[-1][2] == m:
            runs[-1][1] = i + 1
        else:
            runs.append([i, i + 1, m])
    # best[b]: the cheapest grouping of runs[:b]; cut[b]: where its last group starts.
    best = [0.0] + [math.inf] * len(runs)
    cut = [0] * (len(runs) + 1)
    for b in range(1, len(runs) + 1):
        width = 0
        for a in range(b - 1, max(b - _MAX_RUNS_PER_GROUP, 0) - 1, -1):
            width = max(width, runs[a][2])
            cost = best[a] + _GROUP_OVERHEAD_BLOCKS + (runs[b - 1][1] - runs[a][0]) * width
            if cost < best[b]:
                best[b], cut[b] = cost, a
    bounds = []
    b = len(runs)
    while b > 0:
        a = cut[b]
        bounds.append((runs[a][0], runs[b - 1][1]))
        b = a
    return bounds[::-1]


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: DecodePlan,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
) -> torch.Tensor:
    """One query token per row of the plan. q `[B, H, hd]`; returns `[B, H, hd]`. `window`: a
    row of context length n attends only its last `window` positions, `[max(0, n - window), n)`;
    `softcap`: scores s become softcap * tanh(s / softcap) before the softmax; `sinks` `[H]`: a
    logit per head joining the softmax's denominator; `chunk`: the query at position n - 1
    attends only positions of its own chunk, from (n - 1) // chunk * chunk (None: none of them)."""
    if window is not None or softcap is not None:
        check_window_softcap(window, softcap)
    if sinks is not None or chunk is not None:
        check_sinks_chunk(sinks, chunk, q.shape[1])
    if plan.native is not None:
        tables, lens = plan.native
        return cpu_native.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, window=window, softcap=softcap, sinks=sinks, chunk=chunk
        )
    if plan.triton is not None:
        from triollm.kernels.triton import attention as triton_attention

        tables, lens = plan.triton
        return triton_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, lens, scale, window=window, softcap=softcap, sinks=sinks, chunk=chunk
        )
    groups = plan.groups if window is None and chunk is None else plan.window_groups(window, chunk)
    if len(groups) == 1:
        return _group_attention(q, k_cache, v_cache, groups[0], plan.workspace, scale, softcap, sinks)
    out = torch.empty_like(q)
    for g in groups:
        out[g.start : g.end] = _group_attention(
            q[g.start : g.end], k_cache, v_cache, g, plan.workspace, scale, softcap, sinks
        )
    return out


def _group_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    g: DecodeGroup,
    workspace: DecodeWorkspace,
    scale: float,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    kvh, _, bs, hd = v_cache.shape
    b, h, _ = q.shape
    k, v = workspace.buffers((kvh, b * g.max_blocks, bs, hd), k_cache.dtype, k_cache.device)
    gather_k(k_cache, g.block_ids, out=k)
    torch.index_select(v_cache, 1, g.block_ids, out=v)
    k = _group_values(k, k_cache, g, b, q.dtype)  # a bf16, fp8 or int8 cache under fp32
    v = _group_values(v, v_cache, g, b, q.dtype)
    if softcap is not None or sinks is not None:  # scores, cap and softmax in fp32
        qh = (q.float() * scale).view(b, kvh, h // kvh, hd).transpose(0, 1)  # [kvh, B, group, hd]
        scores = torch.matmul(qh, k.float().transpose(-1, -2))
        if softcap is not None:
            _soft_cap(scores, softcap)
        if g.pad is not None:
            scores.masked_fill_(g.pad[None, :, None, :], float("-inf"))
        sink = None if sinks is None else sinks.float().view(kvh, 1, h // kvh, 1)
        out = torch.matmul(_softmax(scores, sink), v.float()).to(q.dtype)
        return out.transpose(0, 1).reshape(b, h, hd)
    if g.pad is None:  # nothing to mask: one fused call (fewer dispatches matter at batch 1)
        qh = q.view(b, kvh, h // kvh, hd).transpose(0, 1)  # [kvh, B, group, hd]
        out = F.scaled_dot_product_attention(qh, k, v, scale=scale)
        return out.transpose(0, 1).reshape(b, h, hd)
    qh = (q * scale).view(b, kvh, h // kvh, hd).transpose(0, 1)  # [kvh, B, group, hd]
    scores = torch.matmul(qh, k.transpose(-1, -2))  # [kvh, B, group, L]
    scores.masked_fill_(g.pad[None, :, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.matmul(probs, v)  # [kvh, B, group, hd]
    return out.transpose(0, 1).reshape(b, h, hd)


def _group_values(
    codes: torch.Tensor, cache: torch.Tensor, g: DecodeGroup, b: int, dtype: torch.dtype
) -> torch.Tensor:
    """A decode group's gathered K or V `[kvh, b * max_blocks, bs, hd]` as `[kvh, b, length, hd]`
    in `dtype` (dequantized: int8's per-token scales are gathered by the same block ids)."""
    kvh, _, bs, hd = codes.shape
    codes = codes.view(kvh, b, g.max_blocks * bs, hd)[:, :, : g.length]
    scale = cache_scale(cache)
    if cache.dtype == torch.int8:
        assert scale is not None
        rows = scale.index_select(1, g.block_ids).view(kvh, b, g.max_blocks * bs)[:, :, : g.length]
        return dequantize_kv(codes, None, dtype, rows)
    return dequantize_kv(codes, scale, dtype)


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_context: int,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    bidirectional: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:
    """Causal attention of n new tokens of one sequence. q `[n, H, hd]`, k/v `[n, kvh, hd]` (the
    new tokens, already written to the cache); `num_context` earlier tokens of the sequence live
    in the cache blocks `block_ids`. Returns `[n, H, hd]`. `window`: the token at position i
    attends positions j with i - j < window; `softcap`: scores s become
    softcap * tanh(s / softcap) before the softmax; `sinks` `[H]`, `chunk`: as
    `decode_attention` (None: none of them); `bidirectional`: spans of positions that attend to
    each other both ways (module note; empty: none)."""
    if window is not None or softcap is not None:
        check_window_softcap(window, softcap)
    if sinks is not None or chunk is not None:
        check_sinks_chunk(sinks, chunk, q.shape[1])
    if bidirectional:
        check_spans(bidirectional)
    elif use_triton(q):
        from triollm.kernels.triton import attention as triton_attention

        return triton_attention.paged_prefill_attention(
            q, k_cache, v_cache, block_ids, num_context, scale, window=window, softcap=softcap, sinks=sinks,
            chunk=chunk,
        )
    n = q.shape[0]
    if window is not None and window >= num_context + n:
        window = None  # every token sees its whole causal past
    if chunk is not None and num_context + n <= chunk:
        chunk = None  # every token is in the first chunk
    if window is not None or softcap is not None or sinks is not None or chunk is not None or bidirectional:
        return _masked_prefill(
            q, k, v, k_cache, v_cache, block_ids, num_context, scale, window, softcap, sinks, chunk, bidirectional
        )
    qh = q.transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
    if num_context == 0 and _holds_exactly(k_cache, q):
        kh = k.transpose(0, 1).unsqueeze(0)
        vh = v.transpose(0, 1).unsqueeze(0)
        out = _sdpa(qh, kh, vh, None, scale)
    else:
        # Over what the cache holds (bf16, fp8, int8 under fp32 activations), as every later
        # read of these tokens (decode, a prefix-cache hit, the next chunk) sees them.
        total = num_context + n
        kc, vc = gather_kv(k_cache, v_cache, block_ids, 0, total, q.dtype)
        mask = None  # no earlier context: plain causal
        if num_context:
            rows = torch.arange(n, device=q.device)[:, None] + num_context
            mask = torch.arange(total, device=q.device)[None, :] <= rows  # [n, total], True = attend
        out = _sdpa(qh, kc.unsqueeze(0), vc.unsqueeze(0), mask, scale)
    return out.squeeze(0).transpose(0, 1)


def _holds_exactly(cache: torch.Tensor, q: torch.Tensor) -> bool:
    """Whether the cache holds the activations' values as they are (its dtype is theirs): then a
    prefill's fresh K/V are exactly the cached ones and need not be read back."""
    return cache.dtype == q.dtype


@dataclass
class PrefillPlan:
    """A step's prefill chunks, prepared once and shared by every layer (`plan_prefill`): their
    new tokens are consecutive rows of the prefill part of the batch. The torch path runs each
    chunk (`chunks`: first row, rows, earlier tokens, block ids as int64); the Triton path runs
    them all in one launch from `triton` (int32 query starts `[N + 1]`, context lengths `[N]`,
    block tables `[N, M]`) and `max_tokens`. On CPU with the native kernels, `native` holds the
    same three for `cpu_native.paged_prefill_attention` (block tables `[N, M]`, query starts
    `[N + 1]`, context lengths `[N]`), which every layer the kernel covers takes instead of the
    torch path. `bidirectional`: per chunk, its spans (module note); set only where some chunk
    has one, and then every chunk runs the torch path."""

    chunks: list[tuple[int, int, int, torch.Tensor]]
    max_tokens: int
    triton: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    bidirectional: list[list[tuple[int, int]]] | None = None
    native: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # `prefill_attention_bf16`'s causal masks by (rows, earlier tokens), made by the first layer.
    masks: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    # `prefill_attention_bf16`'s batches of whole prompts and the chunks left, made by the first layer.
    prompt_batches: tuple[list[PromptBatch], list[int]] | None = None


@dataclass
class PromptBatch:
    """Whole prompts (no earlier context) that `prefill_attention_bf16` attends in one batched
    call, each padded to the longest one's `width` rows: `blocks`, each prompt's blocks in turn
    (a shorter one's padded with its last block) as int64; `q_rows`, the query rows of the
    padded batch (a padding row repeats its prompt's first); `spans`, each prompt's first row
    and rows in the step's batch."""

    width: int
    blocks: torch.Tensor
    q_rows: torch.Tensor
    spans: list[tuple[int, int]]


# `prefill_attention_bf16` pads whole prompts of up to PROMPT_BATCH_WIDTH tokens into one batch
# while the padding stays within PROMPT_BATCH_WASTE of the causal work (rows x keys), at most
# PROMPT_BATCH_MAX prompts a batch. Longer prompts gain nothing from batching: a call's set-up is
# small beside their work (docs/benchmarks-history.md, "Prompts attended in batches").
PROMPT_BATCH_WASTE, PROMPT_BATCH_MAX, PROMPT_BATCH_WIDTH = 0.25, 32, 512


def _prompt_batches(plan: PrefillPlan, block_size: int) -> tuple[list[PromptBatch], list[int]]:
    """The plan's whole prompts in batches of similar lengths (longest first, a batch closed where
    one more would pad more than `PROMPT_BATCH_WASTE` of its causal work), and the indices of the
    chunks left to attend one by one (earlier context, or a prompt with no partner)."""
    whole = sorted(
        (i for i, (_, n, context, _) in enumerate(plan.chunks) if context == 0 and 0 < n <= PROMPT_BATCH_WIDTH),
        key=lambda i: -plan.chunks[i][1],
    )
    groups: list[list[int]] = []
    for i in whole:
        length = plan.chunks[i][1]
        group = groups[-1] if groups else None
        if group is not None and len(group) < PROMPT_BATCH_MAX:
            width = plan.chunks[group[0]][1]
            work = sum(plan.chunks[j][1] ** 2 for j in group) + length**2
            if (len(group) + 1) * width**2 <= (1 + PROMPT_BATCH_WASTE) * work:
                group.append(i)
                continue
        groups.append([i])
    candidates = set(whole)
    batches, alone = [], [i for i in range(len(plan.chunks)) if i not in candidates]
    for group in groups:
        if len(group) == 1:
            alone.append(group[0])
            continue
        width = plan.chunks[group[0]][1]
        nb = -(-width // block_size)
        blocks, q_rows, spans = [], [], []
        for i in group:
            start, length, _, ids = plan.chunks[i]
            ids = ids.long()
            blocks.append(torch.cat([ids, ids[-1:].expand(nb - len(ids))]) if len(ids) < nb else ids[:nb])
            q_rows.append(torch.cat([torch.arange(start, start + length), torch.full((width - length,), start)]))
            spans.append((start, length))
        batches.append(PromptBatch(width, torch.cat(blocks), torch.cat(q_rows), spans))
    alone.sort()
    return batches, alone


def plan_prefill(
    chunks: Sequence[tuple[int, int, Sequence[int]]], device: torch.device | str
) -> PrefillPlan:
    """Plan prefill chunks, each `(new tokens, earlier tokens, block ids covering both)`, in the
    order their tokens sit in the batch. One host-to-device copy either way."""
    n = len(chunks)
    lengths = [length for length, _, _ in chunks]
    starts = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=starts[1:])
    if use_triton_on(device):
        width = max((len(blocks) for _, _, blocks in chunks), default=1)
        host = np.empty(2 * n + 1 + n * width, dtype=np.int32)
        host[: n + 1] = starts
        host[n + 1 : 2 * n + 1] = [c for _, c, _ in chunks]
        fill_tables(host[2 * n + 1 :].reshape(n, width), [b for _, _, b in chunks], 0)
        up = upload_int32(host, device)
        tables = up[2 * n + 1 :].view(n, width)
        plan = (up[: n + 1], up[n + 1 : 2 * n + 1], tables)
        rows = [(int(starts[i]), lengths[i], chunks[i][1], tables[i]) for i in range(n)]
        return PrefillPlan(rows, max(lengths, default=0), plan)
    flat = np.fromiter(chain.from_iterable(b for _, _, b in chunks), dtype=np.int64)
    ids = torch.from_numpy(flat).to(device, non_blocking=True)
    rows, used = [], 0
    for i, (length, context, blocks) in enumerate(chunks):
        rows.append((int(starts[i]), length, context, ids[used : used + len(blocks)]))
        used += len(blocks)
    native = None
    if n and torch.device(device).type == "cpu" and cpu_native.available():
        width = max(len(blocks) for _, _, blocks in chunks)
        host_tables = np.zeros((n, max(width, 1)), dtype=np.int32)
        fill_tables(host_tables, [b for _, _, b in chunks], 0)
        native = (
            torch.from_numpy(host_tables),
            torch.from_numpy(starts.astype(np.int32)),
            torch.tensor([c for _, c, _ in chunks], dtype=torch.int32),
        )
    return PrefillPlan(rows, max(lengths, default=0), native=native)


def prefill_attention_chunks(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    plan: PrefillPlan,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`prefill_attention` of every chunk of `plan`: q `[P, H, hd]` and k/v `[P, kvh, hd]` are the
    rows of the prefill tokens (K/V already written). Returns `[P, H, hd]` (into `out` if
    given). On the Triton path one launch runs them all."""
    if window is not None or softcap is not None:
        check_window_softcap(window, softcap)
    if plan.triton is not None and plan.bidirectional is None:
        from triollm.kernels.triton import attention as triton_attention

        starts, contexts, tables = plan.triton
        return triton_attention.paged_prefill_attention_varlen(
            q, k_cache, v_cache, tables, starts, contexts, max(plan.max_tokens, 1), scale,
            window=window, softcap=softcap, sinks=sinks, chunk=chunk, out=out,
        )  # fmt: skip
    if (
        plan.native is not None and plan.bidirectional is None and window is None and softcap is None
        and sinks is None and chunk is None and cpu_native.prefill_attention_supported(q, k_cache)
    ):  # fmt: skip
        tables, starts, contexts = plan.native
        result = cpu_native.paged_prefill_attention(q, k_cache, v_cache, tables, starts, contexts, scale)
        if out is None:
            return result
        out.copy_(result)
        return out
    if out is None:
        out = q.new_empty(q.shape)
    for i, (start, length, context, block_ids) in enumerate(plan.chunks):
        rows = slice(start, start + length)
        spans = () if plan.bidirectional is None else plan.bidirectional[i]
        out[rows] = prefill_attention(
            q[rows], k[rows], v[rows], k_cache, v_cache, block_ids.long(), context, scale,
            window=window, softcap=softcap, sinks=sinks, chunk=chunk, bidirectional=spans,
        )  # fmt: skip
    return out


def prefill_attention_bf16(
    q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: PrefillPlan, scale: float
) -> torch.Tensor:
    """Plain causal attention of every chunk of `plan` in bf16 through torch's fused CPU attention
    (oneDNN's, on AMX tiles where the CPU has them): q `[P, H, hd]` (the prefill rows, their K/V
    already written) is rounded to bf16, each chunk attends over its sequence's K/V gathered from
    the cache as bf16, causally aligned to its last key, and the result comes back in
    q's dtype. Several times the native prefill kernel's speed at 2k-8k tokens of context
    (docs/benchmarks.md "AMX Xeon"), without its per-row bits: the model runner takes it only for
    large prompt steps on a CPU with AMX bf16 tiles (engine/execution/model_runner.py
    `LARGE_PROMPT_ROWS`). Over a bf16 cache, whole prompts of similar lengths attend in padded
    batches, one call each (`PromptBatch`, planned once per step): a call per prompt cost each
    its own gathers, copies and the fused kernel's set-up. A chunk after earlier context takes an
    explicit mask, made once per step (`PrefillPlan.masks`): torch's `causal_lower_right`
    measured the same, and importing it took a second."""
    out = q.new_empty(q.shape)
    qb = q.to(torch.bfloat16)
    chunks = plan.chunks
    if k_cache.dtype == torch.bfloat16 and v_cache.dtype == torch.bfloat16 and q.device.type == "cpu":
        if plan.prompt_batches is None:
            plan.prompt_batches = _prompt_batches(plan, v_cache.shape[2])
        batches, alone = plan.prompt_batches
        for batch in batches:
            _attend_prompt_batch(qb, k_cache, v_cache, batch, scale, out)
        chunks = [plan.chunks[i] for i in alone]
    for start, length, context, block_ids in chunks:
        total = context + length
        kc, vc = gather_kv(k_cache, v_cache, block_ids.long(), 0, total, torch.bfloat16)
        qh = qb[start : start + length].transpose(0, 1).unsqueeze(0)  # [1, H, n, hd]
        mask = None  # no earlier context: plain causal
        if context:
            mask = plan.masks.get((length, context))
            if mask is None:
                rows = torch.arange(length, device=q.device)[:, None] + context
                mask = plan.masks[(length, context)] = torch.arange(total, device=q.device)[None, :] <= rows
        o = _sdpa(qh, kc.unsqueeze(0), vc.unsqueeze(0), mask, scale)
        out[start : start + length] = o.squeeze(0).transpose(0, 1)
    return out


def _attend_prompt_batch(
    qb: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, batch: PromptBatch, scale: float, out: torch.Tensor
) -> None:
    """One fused causal attention call for a batch of whole prompts padded to `batch.width` rows
    (a bf16 cache): a prompt's rows see only its own earlier rows, so the padding past a shorter
    prompt's end (its last block repeated, its first query repeated) is never attended by a real
    row, and the padding rows' results are dropped."""
    kvh, _, _, hd = v_cache.shape
    n, w = len(batch.spans), batch.width
    k = gather_k(k_cache, batch.blocks).view(kvh, n, -1, hd)[:, :, :w].transpose(0, 1)  # [P, kvh, w, hd]
    v = v_cache.index_select(1, batch.blocks).view(kvh, n, -1, hd)[:, :, :w].transpose(0, 1)
    qh = qb.index_select(0, batch.q_rows).view(n, w, -1, hd).transpose(1, 2)  # [P, H, w, hd]
    rows = _sdpa(qh, k, v, None, scale).transpose(1, 2)
    for p, (start, length) in enumerate(batch.spans):  # one pass each, widened to out's dtype
        out[start : start + length].copy_(rows[p, :length])


# Windowed or soft-capped prefill runs over chunks of query rows holding at most this many scores
# (heads x rows x keys): 16 MB of fp32 scores, however long the prompt.
_PREFILL_CHUNK_SCORES = 1 << 22


def _masked_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_context: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    bidirectional: Sequence[tuple[int, int]] = (),
) -> torch.Tensor:
    """`prefill_attention` with a window, a soft-cap, sinks, chunks or bidirectional spans: over
    chunks of query rows, each with an explicit mask over the keys its window and chunk reach
    (the cache is read from the block holding the first token's first key); with spans, a row's
    keys run to the end of the chunk (a span's later positions)."""
    n, h, hd = q.shape
    kvh, _, bs, _ = v_cache.shape
    total = num_context + n
    first = _first_key(num_context, window, chunk)  # the first key any row sees
    if num_context == 0 and _holds_exactly(k_cache, q):
        key0 = 0
        kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [kvh, n, hd]
    else:  # over what the cache holds (see prefill_attention)
        fb = first // bs
        key0 = fb * bs
        kh, vh = gather_kv(k_cache, v_cache, block_ids[fb:], 0, total - key0, q.dtype)
    qh = q.transpose(0, 1)  # [H, n, hd]
    out = q.new_empty(h, n, hd)
    # A chunk of r <= span rows reaches at most r + span - 1 < 2 * span keys.
    span = min((x for x in (window, chunk) if x is not None), default=None)
    reach = total - key0 if span is None or bidirectional else min(total - key0, 2 * span)
    rows = max(1, _PREFILL_CHUNK_SCORES // (h * reach))
    if span is not None:
        rows = min(rows, span)
    sink = None if sinks is None else sinks.float().view(kvh, h // kvh, 1, 1)
    for r0 in range(0, n, rows):
        r1 = min(n, r0 + rows)
        q_pos = torch.arange(num_context + r0, num_context + r1, device=q.device)[:, None]
        lo = max(key0, _first_key(num_context + r0, window, chunk))
        hi = total if bidirectional else num_context + r1
        k_pos = torch.arange(lo, hi, device=q.device)[None, :]
        allowed = k_pos <= q_pos  # [rows, keys], True = attend
        if bidirectional:
            allowed |= same_span(q_pos, k_pos, bidirectional)
        if window is not None:
            allowed &= k_pos > q_pos - window
        if chunk is not None:
            allowed &= k_pos // chunk == q_pos // chunk
        keys = slice(lo - key0, hi - key0)
        ks, vs = kh[:, keys], vh[:, keys]
        if softcap is None and sink is None:
            out[:, r0:r1] = _sdpa(qh[None, :, r0:r1], ks[None], vs[None], allowed, scale)[0]
            continue
        # Soft-capped or with sinks: fp32 scores [kvh, group, rows, keys] (SDPA cannot cap them
        # nor add a sink).
        qg = qh[:, r0:r1].float().reshape(kvh, h // kvh * (r1 - r0), hd) * scale
        scores = torch.matmul(qg, ks.float().transpose(1, 2))
        if softcap is not None:
            _soft_cap(scores, softcap)
        scores = scores.view(kvh, h // kvh, r1 - r0, -1).masked_fill_(~allowed, float("-inf"))
        probs = _softmax(scores, sink).view(kvh, h // kvh * (r1 - r0), -1)
        out[:, r0:r1] = torch.matmul(probs, vs.float()).view(h, r1 - r0, hd)
    return out.transpose(0, 1)


def _softmax(scores: torch.Tensor, sink: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of fp32 `scores`, with `sink` (broadcast to one logit per row)
    as one more column of the denominator that is then dropped (module note)."""
    if sink is None:
        return torch.softmax(scores, dim=-1)
    column = sink.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat((scores, column), dim=-1), dim=-1)[..., :-1]


def _soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap * tanh(scores / softcap), in place."""
    return scores.div_(softcap).tanh_().mul_(softcap)


def _sdpa(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float
) -> torch.Tensor:
    if k.shape[1] != q.shape[1]:
        if _HAS_GQA:
            return F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale, enable_gqa=True
            )
        rep = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, scale=scale)


# `enable_gqa` came with torch 2.5. Read from the version, not probed with a call: a probe at import
# would start an OpenMP team in the importing thread, and a second team slows every parallel
# region of the engine's compute thread (see actors/compute.py).
_HAS_GQA = torch.torch_version.TorchVersion(torch.__version__) >= "2.5"
