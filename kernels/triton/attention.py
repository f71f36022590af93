"""Paged attention in Triton: decode (one query token per sequence) and prefill (n new tokens of
one sequence), over the KV cache layout of `kernels/attention.py` (its torch functions are the
references these kernels are tested against).

Layout. Per layer, V is `[kv_heads, num_blocks, block_size, head_dim]` and K the same with each
block transposed, `[kv_heads, num_blocks, head_dim, block_size]`; a sequence's token at position
p lives in block `table[p // block_size]` at offset `p % block_size`. Every stride is a kernel
argument (nothing assumes contiguity) and `block_id * stride` is computed in int64, so caches
past 2**31 elements are addressed correctly. Loading a K tile through the transposed view gives
`K^T` `[head_dim, TILE_N]` directly, the right operand of `q @ K^T`. Where these kernels run,
`allocate_kv_cache` stores K with head_dim innermost (`stride_kd == 1`, as vLLM keeps it) behind
that same transposed view: each column of the tile is then `head_dim` contiguous elements, and
the loads are 16-byte vectors (asynchronous copies into shared memory, pipelined over the
tiles). With the contiguous transposed blocks (`stride_kt == 1`, the CPU kernel's layout) the
same code is correct but, since every column has its own gathered block id, the compiler can
prove no contiguity along the positions and loads K one 2-byte element at a time;
tests/kernels/test_triton_launches.py reads that off the sm_90 PTX of real launches.

Tiles. A KV tile is `TILE_N` consecutive positions of one sequence, a power of two that is a
multiple of the block size and at least 16 (`tl.dot` needs M, N, K >= 16 on the GPU): with
blocks of 8, one tile spans two blocks; each column looks up its own block id, so a tile may
cross blocks freely. Scores, running max and running sum are fp32 and in log2 units (the scale
is folded with log2(e), so the softmax uses `exp2`); the online softmax rescales the fp32
accumulator by `exp2(m_old - m_new)` whenever the running max grows. Masked-out scores are -inf;
each loop starts at position 0 or at a split's first tile, whose first column every row may
attend, so the running max is finite from the first tile on and no NaN can appear.

Decode. Grid `(sequence, kv head, split)`. A tile is `TILE_N` positions (default
`DECODE_TILE_N`, at least the block size) run by `num_warps` warps (`DECODE_NUM_WARPS`); both are
arguments of `paged_decode_attention` so that tests/gpu_check.py's sweep can time others on the
device. The GQA group (the `H // kv_heads` query heads
sharing a KV head) is folded into the M dimension of `tl.dot`, padded to at least 16 rows
(padding rows load zeros and are never stored), so each K/V tile is read once per group rather
than once per head. Split-KV: when `B * kv_heads` programs cannot fill the GPU and contexts
are long, each sequence's tiles are cut into `num_splits` contiguous ranges; each split writes
its unnormalised fp32 accumulator, running max and running sum to scratch, and a second small
kernel (grid `(sequence, head)`) merges them, weighting split s by `exp2(m_s - max_s m_s)`. An
empty split (a context shorter than the splits) leaves max -inf and sum 0 and weighs nothing.
With one split the kernel normalises and writes the output directly.

Prefill. Grid `(sequence, query tile, kv head)`: `paged_prefill_attention` runs one sequence's
new tokens, `paged_prefill_attention_varlen` every prefill chunk of a step in one launch (the
chunks' tokens concatenated, their starts, context lengths and block tables as int32 tensors
built once per step, `kernels.attention.plan_prefill`); a sequence with fewer query tiles than
the longest leaves its surplus programs to return at once. Rows of a query tile are (token,
group member) pairs,
`row = token * group + member`, so GQA is folded into M here too. Token i of the new ones sits
at position `num_context + i` and attends positions `0..num_context + i` (its own K/V, like the
earlier context, is already in the cache); a tile's loop stops at its last row's position.
Programs are launched heaviest tile (latest queries) first, across the sequences. Every tile applies the causal mask
(a mask-free loop for the tiles wholly below the diagonal would save a few instructions; not
measured yet).

Sliding window and soft-capping (`window`, `softcap`; constexpr switches `WINDOWED`, `SOFTCAP`,
so the kernels without them are the code that ran before). A query at position i attends keys
j with i - j < window. Decode starts at the tile holding `context_len - window` (the splits share
the tiles from there on) and masks the columns before it; its first column is attended, so the
running max is still finite from the first tile on. Prefill starts at the tile holding the
window start of the tile's first query; a later row may then see whole tiles before its own
window, so the running max starts at -1e30 rather than -inf (rescaling by exp2(-1e30 - -1e30) = 1
adds exp2(-inf) = 0), and padding rows take the last real token's position (they are never
stored, but must keep a column to attend). Soft-capping maps each score s (here in log2 units,
as is the cap) to softcap * tanh(s / softcap), with tanh from exp2 of a non-positive argument
(no overflow).

Attention sinks and chunks (`sinks`, `chunk`; constexpr switches `SINKS`, `CHUNKED`, gpt-oss and
Llama 4). A sink is a logit per query head (fp32 `[H]`) that joins the softmax's denominator: after
the loop the running max and sum move to max(m, sink) and the sink's exp2 is added to the sum (a
split decode adds it in the reduce kernel, as one more split with no value). A chunk lets the query
at position i see keys j with j // chunk == i // chunk: one more lower bound on the first key, like
a window's (decode: `(context_len - 1) // chunk * chunk`; prefill: per row, the tile starting at the
chunk of its first row's position, with the -1e30 running max as for windows).

Numerics. An fp32 `tl.dot` runs in tf32 on the GPU unless told otherwise (about 3e-4 relative
error, where fp32 would be 1e-6): with an fp32 cache the dots here ask for "ieee" (constexpr
`DOT_PRECISION`); fp16 and bf16 operands are unaffected.

Recompiles. Triton specialises integer arguments on their value (1, or a multiple of 16) and
compiles one variant per combination: an argument that changes every step (a prefill's token
and context counts, the width of a step's block tables) would compile new variants inside
timed steps. Those arguments are `do_not_specialize`; tests/kernels/test_triton_launches.py
checks that two different steps bind to the same compiled variant.

What the interpreter (`TRITON_INTERPRET=1`, the CPU tests) cannot check: speed, register
and shared-memory pressure, the `tl.dot` shape rules (M, N, K >= 16) and bf16 (numpy has no
bf16 matmul), and the GPU's numerics. `AOT_SPECS` compiles every kernel for sm_90 without a
GPU (`kernels/aot.py`), and `kernels/triton/launches.py` compiles the variant a given launch
would compile, which is how the tests read load widths and dot precision off the PTX;
tests/gpu_check.py checks the numbers and the speed on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from triollm.kernels.masking import check_sinks_chunk, check_window_softcap
from triollm.kernels.triton import AotSpec
from triollm.kernels.triton.kv_quant import INT8, cache_args, fp8_to_float, kv_quant_mode

__all__ = [
    "AOT_SPECS",
    "DECODE_NUM_STAGES",
    "DECODE_NUM_WARPS",
    "DECODE_TILE_N",
    "choose_num_splits",
    "paged_decode_attention",
    "paged_prefill_attention",
    "paged_prefill_attention_varlen",
]

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs M, N and K of at least 16
_NO_WINDOW = 0  # the `window` argument of a kernel built without WINDOWED (unused)

# Decode launch defaults: KV tiles of this many positions (or the block size, if larger), this
# many warps and pipeline stages. tests/gpu_check.py's `sweep` part times the alternatives.
DECODE_TILE_N = 16
DECODE_NUM_WARPS = 4
DECODE_NUM_STAGES = 2

# Split-KV policy: a split covers at least this many KV tiles (below that the reduce kernel and
# the scratch traffic cost more than the parallelism gains), and there are at most this many.
_MIN_TILES_PER_SPLIT = 8
_MAX_SPLITS = 16

# Prefill tiles: at most 64 query rows (token x group member) per program, and KV tiles of 64
# positions, or fewer for wide heads so a K tile stays at 4096 elements, with 8 warps: at head
# dim 128, 64 positions or 4 warps spill registers on sm_90 (the per-element gathered
# addresses are costly), `python -m triollm.kernels.aot` shows it.
_PREFILL_BLOCK_M = 64
_PREFILL_TILE_N = 64
_PREFILL_TILE_ELEMENTS = 4096
_PREFILL_WARPS = 8


@triton.jit
def _soft_cap(scores, softcap):
    """softcap * tanh(scores / softcap), tanh(x) = sign(x) (1 - e) / (1 + e) with e = exp(-2|x|)."""
    x = scores / softcap
    e = tl.exp2(tl.abs(x) * -2.8853900817779268)  # exp(-2|x|), 2 log2(e)
    t = (1.0 - e) / (1.0 + e)
    return softcap * tl.where(x < 0, -t, t)


# The table width changes with the step's longest context (see "Recompiles" above).
@triton.jit(do_not_specialize=["stride_tb"])
def _paged_decode_kernel(
    out_ptr,  # [B, H, hd] in q's dtype, or fp32 partials [B, H, S, hd] when split
    max_ptr,  # fp32 [B, H, S] (split only)
    sum_ptr,  # fp32 [B, H, S] (split only)
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,  # a quantized cache's scales (read only when KV_QUANT)
    v_scale_ptr,
    block_tables_ptr,
    context_lens_ptr,
    sinks_ptr,  # fp32 [H] (read only when SINKS)
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in positions (read only when WINDOWED)
    softcap,  # soft-cap * log2(e) (read only when SOFTCAP)
    chunk,  # chunk of positions (read only when CHUNKED)
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kh,
    stride_kb,
    stride_kd,
    stride_kt,
    stride_vh,
    stride_vb,
    stride_vt,
    stride_vd,
    stride_sh,  # int8's per-token scales [kv_heads, num_blocks, block_size] (unit last stride)
    stride_sb,
    stride_tb,
    stride_tm,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    SINKS: tl.constexpr = False,
    CHUNKED: tl.constexpr = False,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    if KV_QUANT == 1 or KV_QUANT == 2:  # fp8: the layer's K scale folds into the query's
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    members = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + members
    is_head = members < GROUP
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    q = tl.load(q_ptrs, mask=is_head[:, None], other=0.0)

    context_len = tl.load(context_lens_ptr + seq)
    num_tiles = tl.cdiv(context_len, TILE_N)
    if WINDOWED or CHUNKED:
        window_start = context_len * 0
        if WINDOWED:
            window_start = tl.maximum(context_len - window, 0)
        if CHUNKED:
            window_start = tl.maximum(window_start, (context_len - 1) // chunk * chunk)
        start_tile = window_start // TILE_N
        tiles_per_split = tl.cdiv(num_tiles - start_tile, NUM_SPLITS)
        first_tile = start_tile + split * tiles_per_split
    else:
        tiles_per_split = tl.cdiv(num_tiles, NUM_SPLITS)
        first_tile = split * tiles_per_split
    end_tile = tl.minimum(first_tile + tiles_per_split, num_tiles)

    table = block_tables_ptr + seq.to(tl.int64) * stride_tb
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    cols = tl.arange(0, TILE_N)

    running_max = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    running_sum = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_DIM], tl.float32)
    for tile in range(first_tile, end_tile):
        pos = tile * TILE_N + cols
        in_context = pos < context_len
        if WINDOWED or CHUNKED:
            in_context = in_context & (pos >= window_start)
        block_ids = tl.load(table + (pos // BLOCK_SIZE) * stride_tm, mask=in_context, other=0)
        k_cols = k_head + block_ids.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt
        v_rows = v_head + block_ids.to(tl.int64) * stride_vb + (pos % BLOCK_SIZE) * stride_vt
        k_t = tl.load(k_cols[None, :] + dims[:, None] * stride_kd, mask=in_context[None, :], other=0)
        v = tl.load(v_rows[:, None] + dims[None, :] * stride_vd, mask=in_context[:, None], other=0)
        if KV_QUANT == 1 or KV_QUANT == 2:
            k_t = fp8_to_float(k_t, KV_QUANT).to(q.dtype)
            v = fp8_to_float(v, KV_QUANT).to(q.dtype)
        elif KV_QUANT == 3:
            k_t = k_t.to(q.dtype)
            v = v.to(q.dtype)

        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        if KV_QUANT == 3:  # int8: each position's K scale on its score, V scale on its weight
            s_offs = kv_head.to(tl.int64) * stride_sh + block_ids.to(tl.int64) * stride_sb + pos % BLOCK_SIZE
            scores = scores * tl.load(k_scale_ptr + s_offs, mask=in_context, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            scores = _soft_cap(scores, softcap)
        scores = tl.where(in_context[None, :], scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        if KV_QUANT == 3:
            v_scale = tl.load(v_scale_ptr + s_offs, mask=in_context, other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(
                (probs * v_scale[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION
            )
        else:
            acc = acc * rescale[:, None] + tl.dot(
                probs.to(v.dtype), v, input_precision=DOT_PRECISION
            )
        running_max = new_max
    if KV_QUANT == 1 or KV_QUANT == 2:  # fp8: the layer's V scale on the output
        acc = acc * tl.load(v_scale_ptr)

    out_ptrs = (
        out_ptr
        + seq * stride_ob
        + heads[:, None] * stride_oh
        + split * stride_os
        + dims[None, :] * stride_od
    )
    if NUM_SPLITS == 1:
        if SINKS:  # the sink joins the denominator (module note)
            sink = tl.load(sinks_ptr + heads, mask=is_head, other=0.0) * 1.4426950408889634
            new_max = tl.maximum(running_max, sink)
            rescale = tl.exp2(running_max - new_max)
            acc = acc * rescale[:, None]
            running_sum = running_sum * rescale + tl.exp2(sink - new_max)
        out = acc / running_sum[:, None]
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=is_head[:, None])
    else:
        tl.store(out_ptrs, acc, mask=is_head[:, None])
        stat = (seq * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(max_ptr + stat, running_max, mask=is_head)
        tl.store(sum_ptr + stat, running_sum, mask=is_head)


@triton.jit
def _split_kv_reduce_kernel(
    out_ptr,  # [B, H, hd] in q's dtype
    partial_ptr,  # fp32 [B, H, S, hd], contiguous
    max_ptr,  # fp32 [B, H, S], contiguous
    sum_ptr,  # fp32 [B, H, S], contiguous
    sinks_ptr,  # fp32 [H] (read only when SINKS)
    stride_ob,
    stride_oh,
    stride_od,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    SINKS: tl.constexpr = False,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    is_split = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM)

    stats = (seq * tl.num_programs(1) + head) * NUM_SPLITS + splits
    split_max = tl.load(max_ptr + stats, mask=is_split, other=float("-inf"))
    split_sum = tl.load(sum_ptr + stats, mask=is_split, other=0.0)
    partial = tl.load(
        partial_ptr + stats[:, None] * HEAD_DIM + dims[None, :], mask=is_split[:, None], other=0.0
    )
    top = tl.max(split_max, 0)
    if SINKS:  # one more split: the sink, with no value (module note)
        sink = tl.load(sinks_ptr + head) * 1.4426950408889634
        top = tl.maximum(top, sink)
    weight = tl.exp2(split_max - top)
    denominator = tl.sum(split_sum * weight, 0)
    if SINKS:
        denominator += tl.exp2(sink - top)
    out = tl.sum(partial * weight[:, None], 0) / denominator
    out_ptrs = out_ptr + seq * stride_ob + head * stride_oh + dims * stride_od
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty))


# A prefill's token and context counts change every call, and so does the varlen tables' width.
@triton.jit(do_not_specialize=["num_tokens", "num_context", "stride_tb"])
def _paged_prefill_kernel(
    out_ptr,  # [n, H, hd]
    q_ptr,
    k_ptr,
    v_ptr,
    k_scale_ptr,  # a quantized cache's scales (read only when KV_QUANT)
    v_scale_ptr,
    block_table_ptr,  # [M], or [N, M] when VARLEN
    query_start_ptr,  # int32 [N + 1] (VARLEN only): sequence s's tokens are rows start[s]..start[s+1]
    num_context_ptr,  # int32 [N] (VARLEN only)
    num_tokens,  # (not VARLEN)
    num_context,  # (not VARLEN)
    sinks_ptr,  # fp32 [H] (read only when SINKS)
    qk_scale,  # softmax scale * log2(e)
    window,  # sliding window in positions (read only when WINDOWED)
    softcap,  # soft-cap * log2(e) (read only when SOFTCAP)
    chunk,  # chunk of positions (read only when CHUNKED)
    stride_qn,
    stride_qh,
    stride_qd,
    stride_kh,
    stride_kb,
    stride_kd,
    stride_kt,
    stride_vh,
    stride_vb,
    stride_vt,
    stride_vd,
    stride_sh,  # int8's per-token scales [kv_heads, num_blocks, block_size] (unit last stride)
    stride_sb,
    stride_tb,  # (VARLEN only)
    stride_tm,
    stride_on,
    stride_oh,
    stride_od,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    TILE_N: tl.constexpr,
    WINDOWED: tl.constexpr,
    SOFTCAP: tl.constexpr,
    VARLEN: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    SINKS: tl.constexpr = False,
    CHUNKED: tl.constexpr = False,
):
    seq = tl.program_id(0)
    query_tile = tl.num_programs(1) - 1 - tl.program_id(1)  # heaviest (latest) tiles first
    kv_head = tl.program_id(2)
    if VARLEN:
        first_token = tl.load(query_start_ptr + seq)
        num_tokens = tl.load(query_start_ptr + seq + 1) - first_token
        num_context = tl.load(num_context_ptr + seq)
        block_table_ptr += seq.to(tl.int64) * stride_tb
        q_ptr += first_token.to(tl.int64) * stride_qn
        out_ptr += first_token.to(tl.int64) * stride_on
    if query_tile * BLOCK_M >= num_tokens * GROUP:
        return  # a shorter sequence than the launch's longest: no rows here
    if KV_QUANT == 1 or KV_QUANT == 2:  # fp8: the layer's K scale folds into the query's
        qk_scale = qk_scale * tl.load(k_scale_ptr)

    rows = query_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    tokens = rows // GROUP
    heads = kv_head * GROUP + rows % GROUP
    is_token = tokens < num_tokens
    dims = tl.arange(0, HEAD_DIM)
    q_ptrs = (
        q_ptr + tokens[:, None] * stride_qn + heads[:, None] * stride_qh + dims[None, :] * stride_qd
    )
    q = tl.load(q_ptrs, mask=is_token[:, None], other=0.0)
    q_pos = num_context + tokens

    # Positions this tile attends: up to its last real token's own.
    last_token = tl.minimum((query_tile * BLOCK_M + BLOCK_M - 1) // GROUP, num_tokens - 1)
    kv_len = num_context + last_token + 1
    k_head = k_ptr + kv_head.to(tl.int64) * stride_kh
    v_head = v_ptr + kv_head.to(tl.int64) * stride_vh
    cols = tl.arange(0, TILE_N)

    if WINDOWED or CHUNKED:
        # From the window's (chunk's) start of the tile's first token; padding rows act as the
        # last token.
        q_pos = num_context + tl.minimum(tokens, num_tokens - 1)
        first_pos = num_context + (query_tile * BLOCK_M) // GROUP
        kv_start = first_pos * 0
        if WINDOWED:
            kv_start = tl.maximum(first_pos - window + 1, 0)
        if CHUNKED:
            kv_start = tl.maximum(kv_start, first_pos // chunk * chunk)
        start_tile = kv_start // TILE_N
        running_max = tl.full([BLOCK_M], -1e30, tl.float32)  # see the module docstring
    else:
        start_tile = 0
        running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for tile in range(start_tile, tl.cdiv(kv_len, TILE_N)):
        pos = tile * TILE_N + cols
        in_range = pos < kv_len
        if WINDOWED or CHUNKED:
            in_range = in_range & (pos >= kv_start)
        block_ids = tl.load(
            block_table_ptr + (pos // BLOCK_SIZE) * stride_tm, mask=in_range, other=0
        )
        k_cols = k_head + block_ids.to(tl.int64) * stride_kb + (pos % BLOCK_SIZE) * stride_kt
        v_rows = v_head + block_ids.to(tl.int64) * stride_vb + (pos % BLOCK_SIZE) * stride_vt
        k_t = tl.load(k_cols[None, :] + dims[:, None] * stride_kd, mask=in_range[None, :], other=0)
        v = tl.load(v_rows[:, None] + dims[None, :] * stride_vd, mask=in_range[:, None], other=0)
        if KV_QUANT == 1 or KV_QUANT == 2:
            k_t = fp8_to_float(k_t, KV_QUANT).to(q.dtype)
            v = fp8_to_float(v, KV_QUANT).to(q.dtype)
        elif KV_QUANT == 3:
            k_t = k_t.to(q.dtype)
            v = v.to(q.dtype)

        scores = tl.dot(q, k_t, input_precision=DOT_PRECISION) * qk_scale
        if KV_QUANT == 3:  # int8: each position's K scale on its score, V scale on its weight
            s_offs = kv_head.to(tl.int64) * stride_sh + block_ids.to(tl.int64) * stride_sb + pos % BLOCK_SIZE
            scores = scores * tl.load(k_scale_ptr + s_offs, mask=in_range, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            scores = _soft_cap(scores, softcap)
        # Causal: for real rows this also masks every position >= kv_len; padding rows (never
        # stored) may see zero-filled columns, which keeps them finite.
        attend = pos[None, :] <= q_pos[:, None]
        if WINDOWED:
            attend = attend & (pos[None, :] > q_pos[:, None] - window)
        if CHUNKED:
            attend = attend & (pos[None, :] // chunk == q_pos[:, None] // chunk)
        scores = tl.where(attend, scores, float("-inf"))
        new_max = tl.maximum(running_max, tl.max(scores, 1))
        rescale = tl.exp2(running_max - new_max)
        probs = tl.exp2(scores - new_max[:, None])
        running_sum = running_sum * rescale + tl.sum(probs, 1)
        if KV_QUANT == 3:
            v_scale = tl.load(v_scale_ptr + s_offs, mask=in_range, other=0.0).to(tl.float32)
            acc = acc * rescale[:, None] + tl.dot(
                (probs * v_scale[None, :]).to(v.dtype), v, input_precision=DOT_PRECISION
            )
        else:
            acc = acc * rescale[:, None] + tl.dot(
                probs.to(v.dtype), v, input_precision=DOT_PRECISION
            )
        running_max = new_max

    if SINKS:  # the sink joins the denominator (module note)
        sink = tl.load(sinks_ptr + heads) * 1.4426950408889634
        new_max = tl.maximum(running_max, sink)
        rescale = tl.exp2(running_max - new_max)
        acc = acc * rescale[:, None]
        running_sum = running_sum * rescale + tl.exp2(sink - new_max)
    out = acc / running_sum[:, None]
    if KV_QUANT == 1 or KV_QUANT == 2:  # fp8: the layer's V scale on the output
        out = out * tl.load(v_scale_ptr)
    out_ptrs = (
        out_ptr
        + tokens[:, None] * stride_on
        + heads[:, None] * stride_oh
        + dims[None, :] * stride_od
    )
    tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=is_token[:, None])


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    tile_n: int | None = None,
    num_warps: int = DECODE_NUM_WARPS,
    num_stages: int = DECODE_NUM_STAGES,
) -> torch.Tensor:
    """One query token per sequence. q `[B, H, hd]`; block_tables `[B, M]` int32 (rows padded
    with any valid block id); context_lens `[B]` int32, each >= 1, counts the tokens to attend
    to, the query's own included (its K/V already written). Returns `[B, H, hd]` in q's dtype
    (written into `out` if given, any strides). `window`: a row of length n attends positions
    `[max(0, n - window), n)`; `softcap`: scores s become softcap * tanh(s / softcap) before the
    softmax; `sinks` `[H]`: a logit per head in the denominator; `chunk`: the row attends only
    positions of its own chunk (module note). `num_splits` cuts each sequence's KV into that many parts run in parallel
    (default: chosen from the batch and the table width, no sync). `tile_n` (a power of two, at
    least 16 and the block size; default `DECODE_TILE_N` or the block size), `num_warps` and
    `num_stages` are the launch's tuning knobs (tests/gpu_check.py sweeps them)."""
    if window is not None or softcap is not None:
        check_window_softcap(window, softcap)
    batch, num_heads, head_dim = q.shape
    sinks_arg = _sinks_arg(sinks, chunk, q)
    kv_heads, _, block_size, _ = v_cache.shape
    group = _check_shapes(num_heads, head_dim, kv_heads, block_size, v_cache.shape[3])
    floor = max(block_size, _MIN_DOT)
    if tile_n is None:
        tile_n = max(floor, DECODE_TILE_N)
    elif tile_n < floor or not _is_power_of_two(tile_n):
        raise ValueError(f"tile_n: {tile_n} must be a power of two >= {floor} (16 and the block size)")
    if num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"num_warps: {num_warps} must be one of 1, 2, 4, 8, 16")
    if num_stages < 1:
        raise ValueError(f"num_stages: {num_stages} must be >= 1")
    if num_splits is None:
        max_tiles = triton.cdiv(block_tables.shape[1] * block_size, tile_n)
        for span in (window, chunk):  # a window or a chunk spans at most this many tiles
            if span is not None:
                max_tiles = min(max_tiles, triton.cdiv(span, tile_n) + 1)
        num_splits = choose_num_splits(batch, kv_heads, max_tiles, _num_sms(q.device))
    if num_splits < 1:
        raise ValueError(f"num_splits: {num_splits} must be >= 1")
    if out is None:
        out = torch.empty_like(q)
    if batch == 0:
        return out

    if num_splits == 1:
        target = out
        max_scratch = sum_scratch = torch.empty(0, dtype=torch.float32, device=q.device)  # unused
        target_strides: tuple[int, ...] = (out.stride(0), out.stride(1), 0, out.stride(2))
    else:
        target = torch.empty(
            (batch, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        max_scratch = torch.empty(
            (batch, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
        sum_scratch = torch.empty_like(max_scratch)
        target_strides = target.stride()
    (k_arg, k_scale), (v_arg, v_scale) = cache_args(k_cache), cache_args(v_cache)
    _paged_decode_kernel[(batch, kv_heads, num_splits)](
        target,
        max_scratch,
        sum_scratch,
        q,
        k_arg,
        v_arg,
        k_scale,
        v_scale,
        block_tables,
        context_lens,
        sinks_arg,
        scale * _LOG2E,
        _NO_WINDOW if window is None else window,
        0.0 if softcap is None else softcap * _LOG2E,
        _NO_WINDOW if chunk is None else chunk,
        *q.stride(),
        *k_arg.stride(),
        *v_arg.stride(),
        *_scale_strides(k_cache, k_scale),
        *block_tables.stride(),
        *target_strides,
        GROUP=group,
        GROUP_PAD=max(_MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        TILE_N=tile_n,
        NUM_SPLITS=num_splits,
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        DOT_PRECISION=_dot_precision(q, k_cache, v_cache),
        KV_QUANT=kv_quant_mode(k_cache),
        SINKS=sinks is not None and num_splits == 1,
        CHUNKED=chunk is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    if num_splits > 1:
        _split_kv_reduce_kernel[(batch, num_heads)](
            out,
            target,
            max_scratch,
            sum_scratch,
            sinks_arg,
            *out.stride(),
            HEAD_DIM=head_dim,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            SINKS=sinks is not None,
            num_warps=1,
        )
    return out


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_table: torch.Tensor,
    num_context: int,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of n new tokens of one sequence. q `[n, H, hd]`; the new tokens' K/V are
    already in the cache after `num_context` earlier tokens; block_table `[M]` (int32 or int64)
    covers all `num_context + n` positions. Query i attends positions `0..num_context + i`, the
    last `window` of them if given; `softcap`: scores s become softcap * tanh(s / softcap)
    before the softmax; `sinks`, `chunk`: as `paged_decode_attention`. Returns `[n, H, hd]` in
    q's dtype (written into `out` if given, any strides)."""
    if block_table.dim() != 1:
        raise ValueError(f"block_table: must be 1-D, got shape {tuple(block_table.shape)}")
    unused = block_table  # the varlen pointers: never read without VARLEN
    return _launch_prefill(
        q, k_cache, v_cache, block_table, unused, unused, 1, q.shape[0], num_context, scale,
        window, softcap, sinks, chunk, out, varlen=False,
    )  # fmt: skip


def paged_prefill_attention_varlen(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start: torch.Tensor,
    num_context: torch.Tensor,
    max_tokens: int,
    scale: float,
    *,
    window: int | None = None,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    chunk: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """`paged_prefill_attention` for N sequences in one launch. q `[T, H, hd]` holds their new
    tokens one sequence after another: sequence s's are rows `query_start[s]..query_start[s+1]`
    (int32 `[N + 1]`, from 0), after `num_context[s]` earlier tokens (int32 `[N]`), in the
    blocks of row s of `block_tables` (int32 `[N, M]`, padded with any valid id). `max_tokens`
    (a host int: no sync) bounds every sequence's new tokens; it sizes the grid. Returns
    `[T, H, hd]` (into `out` if given, any strides)."""
    n = num_context.shape[0]
    if block_tables.dim() != 2 or block_tables.shape[0] != n or query_start.shape != (n + 1,):
        raise ValueError(
            f"block_tables {tuple(block_tables.shape)}, query_start {tuple(query_start.shape)}: "
            f"must be [N, M] and [N + 1] for num_context [N = {n}]"
        )
    if max_tokens < 1:
        raise ValueError(f"max_tokens: {max_tokens} must be >= 1")
    return _launch_prefill(
        q, k_cache, v_cache, block_tables, query_start, num_context, n, max_tokens, 0, scale,
        window, softcap, sinks, chunk, out, varlen=True,
    )  # fmt: skip


def _launch_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    tables: torch.Tensor,
    query_start: torch.Tensor,
    contexts: torch.Tensor,
    num_seqs: int,
    max_tokens: int,
    num_context: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    sinks: torch.Tensor | None,
    chunk: int | None,
    out: torch.Tensor | None,
    *,
    varlen: bool,
) -> torch.Tensor:
    if window is not None or softcap is not None:
        check_window_softcap(window, softcap)
    num_tokens, num_heads, head_dim = q.shape
    sinks_arg = _sinks_arg(sinks, chunk, q)
    kv_heads, _, block_size, _ = v_cache.shape
    group = _check_shapes(num_heads, head_dim, kv_heads, block_size, v_cache.shape[3])
    if out is None:
        out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0:
        return out
    block_m = min(_PREFILL_BLOCK_M, max(_MIN_DOT, triton.next_power_of_2(max_tokens * group)))
    grid = (num_seqs, triton.cdiv(max_tokens * group, block_m), kv_heads)
    table_strides = tables.stride() if varlen else (0, tables.stride(0))
    (k_arg, k_scale), (v_arg, v_scale) = cache_args(k_cache), cache_args(v_cache)
    _paged_prefill_kernel[grid](
        out,
        q,
        k_arg,
        v_arg,
        k_scale,
        v_scale,
        tables,
        query_start,
        contexts,
        num_tokens,
        num_context,
        sinks_arg,
        scale * _LOG2E,
        _NO_WINDOW if window is None else window,
        0.0 if softcap is None else softcap * _LOG2E,
        _NO_WINDOW if chunk is None else chunk,
        *q.stride(),
        *k_arg.stride(),
        *v_arg.stride(),
        *_scale_strides(k_cache, k_scale),
        *table_strides,
        *out.stride(),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_M=block_m,
        TILE_N=_prefill_tile_n(head_dim, block_size),
        WINDOWED=window is not None,
        SOFTCAP=softcap is not None,
        VARLEN=varlen,
        DOT_PRECISION=_dot_precision(q, k_cache, v_cache),
        KV_QUANT=kv_quant_mode(k_cache),
        SINKS=sinks is not None,
        CHUNKED=chunk is not None,
        num_warps=_PREFILL_WARPS,
        num_stages=2,
    )
    return out


def _sinks_arg(sinks: torch.Tensor | None, chunk: int | None, q: torch.Tensor) -> torch.Tensor:
    """The kernels' `sinks_ptr`: the sinks as fp32 `[H]` (checked with `chunk`), or q when
    there are none (never read without SINKS)."""
    if sinks is None and chunk is None:
        return q
    check_sinks_chunk(sinks, chunk, q.shape[1])
    return q if sinks is None else sinks.detach().to(device=q.device, dtype=torch.float32).contiguous()


def choose_num_splits(batch: int, kv_heads: int, max_tiles: int, num_sms: int) -> int:
    """Split-KV parts for a decode batch whose longest row has at most `max_tiles` KV tiles: 1
    when the `batch * kv_heads` programs already fill the `num_sms` multiprocessors or contexts
    are short, else enough to fill them (a power of two, so few kernel variants get compiled),
    each covering at least `_MIN_TILES_PER_SPLIT` tiles."""
    programs = batch * kv_heads
    by_length = max_tiles // _MIN_TILES_PER_SPLIT
    if programs >= num_sms or by_length < 2:
        return 1
    wanted = min(_MAX_SPLITS, by_length, triton.cdiv(num_sms, programs))
    return 1 << (wanted.bit_length() - 1)


def _check_shapes(
    num_heads: int, head_dim: int, kv_heads: int, block_size: int, cache_dim: int
) -> int:
    """The GQA group size, after checking what the kernels rely on."""
    if cache_dim != head_dim:
        raise ValueError(f"head_dim: q has {head_dim}, the cache {cache_dim}")
    if head_dim < _MIN_DOT or not _is_power_of_two(head_dim):
        raise ValueError(f"head_dim: {head_dim} must be a power of two >= {_MIN_DOT}")
    if not _is_power_of_two(block_size):
        raise ValueError(f"block_size: {block_size} must be a power of two")
    if num_heads % kv_heads:
        raise ValueError(f"num_heads: {num_heads} is not a multiple of kv_heads {kv_heads}")
    return num_heads // kv_heads


def _scale_strides(cache: torch.Tensor, scale: torch.Tensor) -> tuple[int, int]:
    """Strides of int8's per-token scales over kv heads and blocks (unread otherwise: 0)."""
    return (scale.stride(0), scale.stride(1)) if kv_quant_mode(cache) == INT8 else (0, 0)


def _prefill_tile_n(head_dim: int, block_size: int) -> int:
    return max(block_size, min(_PREFILL_TILE_N, _PREFILL_TILE_ELEMENTS // head_dim))


def _dot_precision(*tensors: torch.Tensor) -> str:
    """"ieee" when an operand is fp32 (Triton would run its dots in tf32), else the default."""
    return "ieee" if any(t.dtype == torch.float32 for t in tensors) else "tf32"


def _is_power_of_two(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 1  # the interpreter: no parallelism to gain from splitting
    return torch.cuda.get_device_properties(device).multi_processor_count


# Ahead-of-time compilation for sm_90 (`kernels/aot.py`): cache dtypes x head dims x GQA groups
# (3, padded to 16 rows, and 8) at block size 16, without window and soft-cap; and each kernel
# once with both (bf16, head dim 256, group 2: Gemma 2's shape); prefill once and varlen. Unit
# strides are constexpr 1, as the JIT specialises them at launch: K's is head_dim's, the layout
# `allocate_kv_cache` gives the GPU. (These specs carry no divisibility hints, so their loads
# are narrower than a real launch's: `kernels/triton/launches.py` compiles a launch as it is.)
_AOT_BLOCK_SIZE = 16
_AOT_SPLITS = 4
_UNIT_STRIDES = ("stride_qd", "stride_kd", "stride_vd", "stride_tm", "stride_od")


def _aot_spec(
    name: str,
    kernel: object,
    pointers: dict[str, str],
    constexprs: dict[str, object],
    num_warps: int = 4,
) -> AotSpec:
    """The spec of `kernel`: pointer arguments typed as given, `qk_scale` and `softcap` fp32,
    unit strides and `constexprs` constexpr, every other argument (strides, lengths, window)
    i32."""
    constexprs = {arg: 1 for arg in _UNIT_STRIDES if arg in kernel.arg_names} | constexprs  # type: ignore[attr-defined]
    signature = {}
    for arg in kernel.arg_names:  # type: ignore[attr-defined]
        if arg in constexprs:
            signature[arg] = "constexpr"
        elif arg in pointers:
            signature[arg] = pointers[arg]
        else:
            signature[arg] = "fp32" if arg in ("qk_scale", "softcap") else "i32"
    return AotSpec(name, kernel, signature, constexprs, num_warps=num_warps)


# A quantized cache's AOT specs: its codes' pointer type, its scales' and KV_QUANT (kv_quant.py).
_CACHE_SPECS = {"fp8": ("*u8", "*fp32", 1), "int8": ("*i8", "*fp16", 3)}


def _cache_pointers(dtype: str, cache: str | None) -> tuple[dict[str, str], int]:
    codes, scales, mode = _CACHE_SPECS[cache] if cache else (f"*{dtype}", f"*{dtype}", 0)
    return dict.fromkeys(("k_ptr", "v_ptr"), codes) | dict.fromkeys(("k_scale_ptr", "v_scale_ptr"), scales), mode


def _decode_spec(
    dtype: str, head_dim: int, group: int, num_splits: int, masked: bool = False, cache: str | None = None
) -> AotSpec:
    cache_pointers, mode = _cache_pointers(dtype, cache)
    pointers = dict.fromkeys(("q_ptr",), f"*{dtype}") | cache_pointers
    pointers |= {
        "out_ptr": f"*{dtype}" if num_splits == 1 else "*fp32",
        "max_ptr": "*fp32",
        "sum_ptr": "*fp32",
    }
    pointers |= {"block_tables_ptr": "*i32", "context_lens_ptr": "*i32", "sinks_ptr": "*fp32"}
    constexprs = {
        "GROUP": group,
        "GROUP_PAD": max(_MIN_DOT, triton.next_power_of_2(group)),
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": _AOT_BLOCK_SIZE,
        "TILE_N": max(_AOT_BLOCK_SIZE, _MIN_DOT),
        "NUM_SPLITS": num_splits,
        "WINDOWED": masked,
        "SOFTCAP": masked,
        "DOT_PRECISION": "tf32",
        "KV_QUANT": mode,
        "SINKS": masked and num_splits == 1,
        "CHUNKED": masked,
    }
    extra = (", window, softcap, sinks, chunk" if masked else "") + (f", {cache} cache" if cache else "")
    name = f"paged_decode[hd={head_dim}, group={group}, splits={num_splits}, {dtype}{extra}]"
    return _aot_spec(name, _paged_decode_kernel, pointers, constexprs)


def _reduce_spec(dtype: str, head_dim: int, sinks: bool = False) -> AotSpec:
    pointers = {
        "out_ptr": f"*{dtype}",
        "partial_ptr": "*fp32",
        "max_ptr": "*fp32",
        "sum_ptr": "*fp32",
        "sinks_ptr": "*fp32",
    }
    constexprs = {
        "HEAD_DIM": head_dim,
        "NUM_SPLITS": _AOT_SPLITS,
        "SPLITS_PAD": triton.next_power_of_2(_AOT_SPLITS),
        "SINKS": sinks,
    }
    name = f"split_kv_reduce[hd={head_dim}, splits={_AOT_SPLITS}, {dtype}{', sinks' if sinks else ''}]"
    return _aot_spec(name, _split_kv_reduce_kernel, pointers, constexprs, num_warps=1)


def _prefill_spec(
    dtype: str, head_dim: int, group: int, masked: bool = False, varlen: bool = False, cache: str | None = None
) -> AotSpec:
    cache_pointers, mode = _cache_pointers(dtype, cache)
    pointers = dict.fromkeys(("out_ptr", "q_ptr"), f"*{dtype}") | cache_pointers
    pointers |= dict.fromkeys(("block_table_ptr", "query_start_ptr", "num_context_ptr"), "*i32")
    pointers |= {"sinks_ptr": "*fp32"}
    constexprs = {
        "GROUP": group,
        "HEAD_DIM": head_dim,
        "BLOCK_SIZE": _AOT_BLOCK_SIZE,
        "BLOCK_M": _PREFILL_BLOCK_M,
        "TILE_N": _prefill_tile_n(head_dim, _AOT_BLOCK_SIZE),
        "WINDOWED": masked,
        "SOFTCAP": masked,
        "VARLEN": varlen,
        "DOT_PRECISION": "tf32",
        "KV_QUANT": mode,
        "SINKS": masked,
        "CHUNKED": masked,
    }
    extra = (", window, softcap, sinks, chunk" if masked else "") + (", varlen" if varlen else "")
    extra += f", {cache} cache" if cache else ""
    name = f"paged_prefill[hd={head_dim}, group={group}, {dtype}{extra}]"
    return _aot_spec(name, _paged_prefill_kernel, pointers, constexprs, _PREFILL_WARPS)


AOT_SPECS: list[AotSpec] = [
    spec
    for dtype in ("fp16", "bf16")
    for head_dim in (64, 128)
    for spec in (
        *(
            _decode_spec(dtype, head_dim, group, splits)
            for group in (3, 8)
            for splits in (1, _AOT_SPLITS)
        ),
        _reduce_spec(dtype, head_dim),
        *(_prefill_spec(dtype, head_dim, group) for group in (3, 8)),
        _prefill_spec(dtype, head_dim, 3, varlen=True),
    )
] + [
    _decode_spec("bf16", 256, 2, 1, masked=True),
    _decode_spec("bf16", 256, 2, _AOT_SPLITS, masked=True),
    _reduce_spec("bf16", 256, sinks=True),
    _prefill_spec("bf16", 256, 2, masked=True),
] + [
    spec
    for cache in _CACHE_SPECS
    for spec in (
        _decode_spec("bf16", 128, 8, 1, cache=cache),
        _decode_spec("bf16", 128, 8, _AOT_SPLITS, cache=cache),
        _prefill_spec("bf16", 128, 8, varlen=True, cache=cache),
    )
]
