"""Attention over the paged KV cache, and the metadata a step hands every layer.

One flat batch per step: the tokens of every scheduled sequence are concatenated (`[T]`) and only
attention splits them: decode tokens (one per sequence, placed first) go through one batched
paged-decode call; each prefill chunk gets its own causal attention call (kernels/attention.py).

`PagedAttention` takes the fused projection `qkv` `[T, (H + 2 KVH) * hd]` with Q and K not yet
rotated (a model with q/k norms normalises them in place first), rotates Q and K, writes K and V
to the cache and attends. Where the kernels allow it, rotation and cache write are one call: the
Triton kernel on GPU, the native CPU kernel in an all-decode step (full rotary only: a partial
rotary's step brings gathered rows, layers/rotary.py). A layer's
sliding window (`window`: the query at position i sees keys j with i - j < window) and attention
logit soft-capping (`softcap`, Gemma 2) are passed to every kernel; the decode plan is shared by
all layers, windowed or not. So are attention sinks (`sinks`, gpt-oss: a learned logit per query
head in the softmax's denominator) and chunked local attention (`chunk`, Llama 4: a query sees
only the keys of its own chunk of positions); kernels/attention.py says which kernels take them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from triollm.engine.execution.layers.rotary import RopeStep
from triollm.kernels import cpu_native, prefill_attention, write_kv
from triollm.kernels.attention import (
    DecodePlan,
    PrefillPlan,
    decode_attention,
    prefill_attention_bf16,
    prefill_attention_chunks,
)
from triollm.kernels.kv_quant import cache_scale
from triollm.kernels.rotary import apply_rotary_signed

if TYPE_CHECKING:
    from triollm.engine.execution.layers.recurrent import StateRows

__all__ = ["AttentionMetadata", "PagedAttention", "PrefillChunk", "calculate_kv_scales_on_first_prompt"]

# vLLM's K_SCALE_CONSTANT and V_SCALE_CONSTANT: a calculated fp8 scale maps |K| max to 200 and
# |V| max to 100, well inside e4m3's 448, so the values land in its normal range.
K_SCALE_RANGE = 200.0
V_SCALE_RANGE = 100.0


@dataclass
class PrefillChunk:
    start: int  # index of the chunk's first token in the flat batch
    length: int
    num_context: int  # tokens of this sequence already in the cache before this chunk
    block_ids: torch.Tensor  # the sequence's blocks covering num_context + length tokens


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: where each token's K/V is written
    num_decodes: int = 0  # the first num_decodes tokens are single-token decodes
    decode_plan: DecodePlan | None = None  # their attention plan (kernels.attention.plan_decode)
    prefills: list[PrefillChunk] = field(default_factory=list)
    prefill_plan: PrefillPlan | None = None  # the same chunks, planned once a step (kernels.attention.plan_prefill)
    positions: torch.Tensor | None = None  # [T] int64 (the Triton path rotates by position)
    # M-RoPE (Qwen2-VL) where the step feeds a request with images: [3, T] int64 (execution/mrope.py).
    mrope_positions: torch.Tensor | None = None
    # Whether this pass runs the Triton kernels (`use_triton`), decided once per forward pass:
    # the environment lookup behind it costs microseconds, and a layer would pay it four times.
    triton: bool | None = None
    # A hybrid model's recurrent layers: each request's rows and state slot (layers/recurrent.py).
    state_rows: StateRows | None = None
    # A large prompt step on AMX (set by the model runner, `LARGE_PROMPT_ROWS`): its prompt
    # chunks attend in bf16 through torch's fused attention (`prefill_attention_bf16`).
    bf16_prefill: bool = False


class PagedAttention(nn.Module):
    """No parameters: the attention of one layer's heads (this rank's, under tensor parallelism)."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        *,
        window: int | None = None,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim, self.scale = num_heads, num_kv_heads, head_dim, scale
        self.window, self.softcap, self.chunk = window, softcap, chunk
        # Passed to the kernels only when set: the plain call stays the plain call. `sinks`
        # `[num_heads]` is held here only, not as a parameter: the model's module owns it.
        limits = (("window", window), ("softcap", softcap), ("sinks", sinks), ("chunk", chunk))
        self.extra: dict[str, Any] = {k: v for k, v in limits if v is not None}
        self.calculate_kv_scales = False  # set by `calculate_kv_scales_on_first_prompt`
        self._prefill_kernel: dict[tuple[torch.dtype, torch.dtype, torch.Size], bool] = {}  # _native_prefill's

    def forward(
        self, qkv: torch.Tensor, rope: RopeStep, meta: AttentionMetadata, k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> torch.Tensor:
        t = qkv.shape[0]
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        if self.calculate_kv_scales:  # the engine's first forward pass: a prompt (module note)
            self._calculate_kv_scales(qkv, k_cache, v_cache)
        full = rope.rotary_dim == hd
        plan = meta.decode_plan
        if full and meta.num_decodes == t and plan is not None and plan.native is not None:
            # An all-decode step on the native CPU kernels: rotary + cache write in one call.
            q = cpu_native.rotary_write_kv(qkv, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping, h, kvh)
            return decode_attention(q, k_cache, v_cache, plan, self.scale, **self.extra).view(t, h * hd)
        if full and self._native_prefill(qkv, meta, k_cache):
            # Prompt rows (and decode rows beside them) on the native CPU kernels: the same
            # rotary + cache write as a decode step, then the chunks by the native prefill kernel,
            # whose arithmetic is the decode kernel's (a token's bits do not depend on its step),
            # or, in a large prompt step on AMX, in bf16 through torch's fused attention
            # (kernels/attention.py `prefill_attention_bf16`).
            q = cpu_native.rotary_write_kv(qkv, rope.cos, rope.sin, k_cache, v_cache, meta.slot_mapping, h, kvh)
            d = meta.num_decodes
            assert meta.prefill_plan is not None and meta.prefill_plan.native is not None
            if meta.bf16_prefill:
                prompts = prefill_attention_bf16(q[d:], k_cache, v_cache, meta.prefill_plan, self.scale)
            else:
                tables, starts, contexts = meta.prefill_plan.native
                prompts = cpu_native.paged_prefill_attention(
                    q[d:], k_cache, v_cache, tables, starts, contexts, self.scale
                )
            if not d:
                return prompts.view(t, h * hd)
            assert meta.decode_plan is not None
            decodes = decode_attention(q[:d], k_cache, v_cache, meta.decode_plan, self.scale)
            return torch.cat((decodes, prompts)).view(t, h * hd)
        v = qkv[:, (h + kvh) * hd :].view(t, kvh, hd)
        if rope.whole_tables:
            # Rotary on Q and K and the cache write in one Triton kernel.
            from triollm.kernels.triton import rotary as triton_rotary

            assert meta.positions is not None
            q, k = triton_rotary.rotary_write_kv(
                qkv[:, : h * hd].view(t, h, hd), qkv[:, h * hd : (h + kvh) * hd].view(t, kvh, hd), v,
                rope.cos, rope.sin, meta.positions, k_cache, v_cache, meta.slot_mapping,
            )  # fmt: skip
            return self._attend(q, k, v, meta, k_cache, v_cache)
        qk = self._rotate(qkv[:, : (h + kvh) * hd].view(t, h + kvh, hd), rope)
        q, k = qk[:, :h], qk[:, h:]
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return self._attend(q, k, v, meta, k_cache, v_cache)

    def attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """`[T, H * hd]`: q `[T, H, hd]` over the cache, where a family that projects, rotates and
        writes its own K and V (models/deepseek.py) has written the step's k, v `[T, KVH, hd]`."""
        return self._attend(q, k, v, meta, k_cache, v_cache)

    def _native_prefill(self, qkv: torch.Tensor, meta: AttentionMetadata, k_cache: torch.Tensor) -> bool:
        """Whether this step's prompt chunks run the native prefill kernel (plain causal
        attention, the plan's native tables, a cache and CPU it takes: kernels/attention.py) and
        its decode rows, if any, the native decode kernel."""
        prefill, decode = meta.prefill_plan, meta.decode_plan
        if self.extra or prefill is None or prefill.native is None or prefill.bidirectional is not None:
            return False
        if meta.num_decodes and (decode is None or decode.native is None):
            return False
        return self.prefill_kernel_takes(qkv.dtype, k_cache)

    def prefill_kernel_takes(self, dtype: torch.dtype, k_cache: torch.Tensor) -> bool:
        """Whether the native prefill kernel takes this layer's prompts in `dtype` over `k_cache`:
        plain causal attention (no window, sink, soft-cap or chunk) and a cache, head size and CPU
        it has instances for. Fixed for a layer: checked once per dtype and cache, not per step."""
        if self.extra:
            return False
        key = (dtype, k_cache.dtype, k_cache.shape)
        if key not in self._prefill_kernel:
            q = torch.empty(0, self.num_heads, self.head_dim, dtype=dtype, device=k_cache.device)  # shapes, dtypes only
            self._prefill_kernel[key] = cpu_native.prefill_attention_supported(q, k_cache)
        return self._prefill_kernel[key]

    def _calculate_kv_scales(self, qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        """Set the layer's fp8 K and V scales from this first prompt (vLLM's
        `calculate_kv_scales`), before anything is written with them. K is not rotated yet here:
        a rotation moves a pair's values within sqrt(2) times the larger, so |K| max is taken as
        sqrt(2) times the unrotated one (at most 283 stored, inside e4m3's 448)."""
        self.calculate_kv_scales = False
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        k_amax = qkv[:, h * hd : (h + kvh) * hd].abs().max().float() * 2**0.5
        v_amax = qkv[:, (h + kvh) * hd :].abs().max().float()
        for cache, amax, span in ((k_cache, k_amax, K_SCALE_RANGE), (v_cache, v_amax, V_SCALE_RANGE)):
            scale = cache_scale(cache)
            if scale is not None and scale.numel() == 1 and float(amax) > 0:
                scale.fill_(float(amax) / span)

    def _rotate(self, qk: torch.Tensor, rope: RopeStep) -> torch.Tensor:
        """Q and K rotated in one call (a new tensor; the first `rotary_dim` dims only, if partial)."""
        d = rope.rotary_dim
        if d == qk.shape[-1]:
            return apply_rotary_signed(qk, rope.cos, rope.sin)
        return torch.cat((apply_rotary_signed(qk[..., :d], rope.cos, rope.sin), qk[..., d:]), dim=-1)

    def _attend(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        """Attention of the step's tokens (their K/V already in the cache), `[T, H * hd]`."""
        t, h, hd = q.shape
        d = meta.num_decodes
        if d == t:
            assert meta.decode_plan is not None
            out = decode_attention(q, k_cache, v_cache, meta.decode_plan, self.scale, **self.extra)
        else:
            out = q.new_empty(q.shape)
            if d:
                assert meta.decode_plan is not None
                out[:d] = decode_attention(q[:d], k_cache, v_cache, meta.decode_plan, self.scale, **self.extra)
            if meta.prefill_plan is not None:  # every chunk in one call (one launch on the Triton path)
                prefill_attention_chunks(
                    q[d:], k[d:], v[d:], k_cache, v_cache, meta.prefill_plan, self.scale, out=out[d:], **self.extra
                )
                return out.reshape(t, h * hd)
            for c in meta.prefills:
                s, e = c.start, c.start + c.length
                out[s:e] = prefill_attention(
                    q[s:e], k[s:e], v[s:e], k_cache, v_cache, c.block_ids, c.num_context, self.scale, **self.extra
                )
        return out.reshape(t, h * hd)


def calculate_kv_scales_on_first_prompt(model: nn.Module) -> None:
    """Have every attention layer of `model` set its fp8 cache's K and V scales from the first
    prompt chunk it sees (`ModelConfig.calculate_kv_scales`): once, then the scales stay."""
    for m in model.modules():
        if isinstance(m, PagedAttention):
            m.calculate_kv_scales = True
