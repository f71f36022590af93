"""The MoE block: top-k routed SwiGLU experts (Qwen3-MoE, Mixtral), cost set by the experts used.

Routing is transformers' (`Qwen3MoeTopKRouter`, `MixtralTopKRouter` in 5.x): a softmax over all
experts in fp32, `torch.topk` (so ties pick the experts torch picks), the top-k weights divided by
their sum when `renormalize` (Mixtral always, Qwen3-MoE when `norm_topk_prob`), cast to x's dtype.
Each selected expert computes `down(silu(gate(x)) * up(x))`, scaled by its weight and summed per
token. The router's linear layer (`gate`) is the model's: the block takes its logits.

The expert computation is where the issue lies. The T*k (token, expert) pairs are sorted by
expert (a stable sort of the flat ids; `bincount` gives the run lengths), the tokens' rows are
gathered once into that order, and each expert that received tokens runs one GEMM pair on its
own rows: `w13[e]` is a view of the stacked weights, not a copy. Decode with top-2 runs two
experts per layer whether the layer holds 8 or 128, so a step reads 2 experts' weights, not E.
The run lengths come to the host once (`tolist()`); each expert costs a handful of torch calls.
The outputs land in a `[T*k, H]` buffer in pair order (`index_copy_`, the inverse of the sort),
and each token's weighted sum over its k rows is one batched product with a fixed order of
summation: no atomics, the same result on every run and device. One token (decode at batch 1)
skips the sort: its k experts are distinct, so each is a run of one pair, in routing order.

Rejected:

* transformers' eager path: a one-hot `[E, k, T]` mask built and reduced every step, then a
  `torch.where` over it per expert hit (work and memory in E*T even where 2 experts run);
* computing every expert for every token then masking: E/k times the work;
* gathering the selected experts' weights (`w13[topk_ids]`) for a batched matmul: it copies k
  experts' weights per token, more memory traffic than reading them in place;
* a C++ kernel for the whole block: the GEMMs of many rows are oneDNN/MKL calls on contiguous
  weight views, and what is left per expert is a handful of dispatches (`triollm bench moe`).
  At a few rows (decode) the expert's two products do run natively (`few_rows_matmul`,
  kernels/csrc/small_matmul.cpp): torch's unpacked bf16 GEMM read a 2 MB expert at 7-10 GB/s
  inside a decode step where the packed linears around it reached 16-25.

gpt-oss's experts (models/gpt_oss.py) run through the same dispatch with biases on both
projections and its clamped SwiGLU (`ClampedSwiGLU`): gate clamped above at `limit`, up to
[-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).

On CUDA the same code runs (the `tolist()` is one host sync per layer, so a MoE layer is not
captured in a CUDA graph). The block is for inference: call it under `torch.inference_mode()`
(the model runner does) or `torch.no_grad()`, as the GEMMs write into preallocated outputs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from triollm.engine.execution.layers.linear import few_rows_matmul

__all__ = [
    "EXPERT_WEIGHT_KINDS",
    "ClampedSwiGLU",
    "FusedMoE",
    "fused_experts",
    "load_expert_weight",
    "route",
    "route_grouped",
]

EXPERT_WEIGHT_KINDS = ("gate", "up", "down", "gate_up")


@dataclass(frozen=True)
class ClampedSwiGLU:
    """gpt-oss's expert activation (transformers' `GptOssExperts._apply_gate`)."""

    alpha: float
    limit: float

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.alpha))


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `dtype`, expert ids [T, k] int64) as transformers' top-k routers compute them."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids


def route_grouped(
    router_logits: torch.Tensor,
    correction: torch.Tensor,
    top_k: int,
    groups: int,
    topk_groups: int,
    renormalize: bool,
    scaling: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3's routing as transformers computes it (GLM-4.5's `Glm4MoeTopkRouter`): sigmoid
    scores; for the choice only, plus the correction bias; the best `topk_groups` groups by the sum
    of each group's two best; top-k among their experts; the chosen (uncorrected) scores,
    renormalised, times `scaling`."""
    scores = router_logits.float().sigmoid()
    choice = scores + correction.float()
    t, e = choice.shape
    group_scores = choice.view(t, groups, e // groups).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=topk_groups, dim=-1, sorted=False)[1]
    mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1).bool()
    choice = choice.masked_fill(~mask[..., None].expand(t, groups, e // groups).reshape(t, e), -math.inf)
    ids = torch.topk(choice, k=top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if renormalize:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return (weights * scaling).to(dtype), ids


class FusedMoE(nn.Module):
    """Top-k routed SwiGLU experts.

    `w13` `[E, 2I, H]`: rows `[0, I)` the gate projection (Mixtral `w1`), rows `[I, 2I)` the up
    projection (`w3`); `w2` `[E, H, I]`: the down projection. Both are created with
    `torch.empty` (build on the meta device, then `load_state_dict(assign=True)` or
    `load_expert_weight`)."""

    def __init__(
        self, num_experts: int, top_k: int, hidden_size: int, intermediate_size: int, *, renormalize: bool
    ) -> None:
        super().__init__()
        for field, value in (
            ("num_experts", num_experts),
            ("hidden_size", hidden_size),
            ("intermediate_size", intermediate_size),
        ):
            if value < 1:
                raise ValueError(f"{field} must be >= 1, got {value}")
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        self.num_experts = num_experts
        self.top_k = top_k
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.renormalize = renormalize
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size), requires_grad=False)
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size), requires_grad=False)

    def extra_repr(self) -> str:
        return (
            f"num_experts={self.num_experts}, top_k={self.top_k}, hidden_size={self.hidden_size}, "
            f"intermediate_size={self.intermediate_size}, renormalize={self.renormalize}"
        )

    def forward(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """x `[T, H]`, router_logits `[T, E]` -> `[T, H]` in x's dtype."""
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"x must be [T, hidden_size={self.hidden_size}], got {list(x.shape)}")
        if router_logits.shape != (x.shape[0], self.num_experts):
            raise ValueError(
                f"router_logits must be [T={x.shape[0]}, num_experts={self.num_experts}], got "
                f"{list(router_logits.shape)}"
            )
        weights, ids = route(router_logits, self.top_k, self.renormalize, x.dtype)
        return fused_experts(x, self.w13, self.w2, weights, ids)


def fused_experts(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    weights: torch.Tensor,
    ids: torch.Tensor,
    *,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    act: ClampedSwiGLU | None = None,
) -> torch.Tensor:
    """`sum_j weights[t, j] * expert_{ids[t, j]}(x[t])`, running only the experts in `ids`.

    x `[T, H]`, w13 `[E, 2I, H]`, w2 `[E, H, I]`, weights `[T, k]` (x's dtype), ids `[T, k]`;
    gpt-oss's: biases b13 `[E, 2I]` and b2 `[E, H]`, and its activation `act` (None: SiLU)."""
    tokens, top_k = ids.shape

    def expert_fn(e: int, rows: torch.Tensor, out: torch.Tensor) -> None:
        bias13 = None if b13 is None else b13[e]
        _swiglu(rows, w13[e], w2[e], out, bias13, None if b2 is None else b2[e], act)

    if tokens == 1:  # decode at batch 1: a token's top-k experts are distinct, one pair each
        ys = x.new_empty(top_k, x.shape[1])
        for j, expert in enumerate(ids[0].tolist()):
            expert_fn(expert, x, ys[j : j + 1])
        return torch.mm(weights, ys)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert, tokens ascending in each
    counts = torch.bincount(flat, minlength=w13.shape[0]).tolist()
    xs = x.index_select(0, order // top_k)  # each pair's token row, in expert order
    ys = torch.empty_like(xs)
    start = 0
    for expert, n in enumerate(counts):
        if n:
            expert_fn(expert, xs[start : start + n], ys[start : start + n])
            start += n
    per_pair = torch.empty_like(ys).index_copy_(0, order, ys).view(tokens, top_k, x.shape[1])
    return torch.bmm(weights.unsqueeze(1), per_pair).squeeze(1)


def _swiglu(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    out: torch.Tensor,
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    act: ClampedSwiGLU | None = None,
) -> None:
    """out = down(silu(gate(x)) * up(x)) for one expert: w13 `[2I, H]`, w2 `[H, I]`; with
    gpt-oss's biases and activation where given."""
    few = few_rows_matmul(x[None], w13[None])  # decode's rows: the native kernel (module note)
    h = F.linear(x, w13, b13) if few is None else (few[0] if b13 is None else few[0].add_(b13))
    inter = w2.shape[1]
    gated = F.silu(h[:, :inter]).mul_(h[:, inter:]) if act is None else act(h[:, :inter], h[:, inter:])
    few = few_rows_matmul(gated[None], w2[None])
    if few is not None:
        out.copy_(few[0] if b2 is None else few[0].add_(b2))
    elif b2 is None:
        torch.mm(gated, w2.t(), out=out)
    else:
        torch.addmm(b2, gated, w2.t(), out=out)


def load_expert_weight(moe: FusedMoE, kind: str, expert: int | None, tensor: torch.Tensor) -> None:
    """Copy one checkpoint tensor into `moe.w13` / `moe.w2` (real tensors by then).

    kind "gate" | "up" | "down" with an expert id: a per-expert `[I, H]` / `[I, H]` / `[H, I]`
    weight (Qwen3-MoE `experts.{e}.gate_proj.weight`, Mixtral `experts.{e}.w1/w3/w2.weight`);
    "gate_up" | "down" with expert None: transformers 5's stacked `[E, 2I, H]` / `[E, H, I]`."""
    if kind not in EXPERT_WEIGHT_KINDS:
        raise ValueError(f"kind must be one of {', '.join(EXPERT_WEIGHT_KINDS)}, got {kind!r}")
    if expert is None:
        if kind == "gate_up":
            target, name = moe.w13.data, "gate_up_proj"
        elif kind == "down":
            target, name = moe.w2.data, "down_proj"
        else:
            raise ValueError(f"kind {kind!r} needs an expert id (expert=None is for the stacked kinds gate_up, down)")
    else:
        if kind == "gate_up":
            raise ValueError("kind 'gate_up' is the stacked [E, 2I, H] tensor: expert must be None")
        if not 0 <= expert < moe.num_experts:
            raise ValueError(f"expert must be in [0, {moe.num_experts}), got {expert}")
        inter = moe.intermediate_size
        if kind == "gate":
            target, name = moe.w13.data[expert, :inter], f"experts.{expert}.gate_proj"
        elif kind == "up":
            target, name = moe.w13.data[expert, inter:], f"experts.{expert}.up_proj"
        else:
            target, name = moe.w2.data[expert], f"experts.{expert}.down_proj"
    if tuple(tensor.shape) != tuple(target.shape):
        raise ValueError(f"{name} ({kind}) has shape {list(tensor.shape)}, expected {list(target.shape)}")
    if target.is_meta:
        raise ValueError(f"cannot load {name}: the MoE weights are still on the meta device (allocate them first)")
    with torch.no_grad():
        target.copy_(tensor)
