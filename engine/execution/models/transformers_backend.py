"""The Transformers modeling backend: transformers' own modeling code over triollm's paged KV cache.

A decoder with no native class (`model_impl="auto"`), or any decoder with
`model_impl="transformers"`, runs as transformers' `*ForCausalLM` built from the checkpoint's
config and loaded by transformers from the checkpoint's safetensors (names, tying and buffers as
transformers does them). Everything around the model is triollm's: the flat token batch,
continuous batching, chunked prefill, prefix caching, preemption, sampling.

The seam is transformers' attention interface, as in vLLM's backend. The model is built with
`attn_implementation="triollm"`, a function registered with `AttentionInterface`: every attention
module calls it with its already-normalised, already-rotated q, k and v (`[1, heads, T, hd]`)
and its `layer_idx`. The function writes k and v to that layer's paged cache and attends with
the same kernels and the same `PagedAttention` code the native models use (decode tokens in one
batched paged call, each prefill chunk causally over its cached context), passing the module's
`scaling`, `sliding_window` and `softcap` through, and its attention sinks (`s_aux`, gpt-oss) and
its chunk (`attention_chunk_size` where `layer_types` says 'chunked_attention', Llama 4: transformers
gives that through the mask it builds, and it builds none here). The step's `AttentionMetadata` and KV cache
reach it through `_STEP`, set by `TransformersForCausalLM.forward` around the one call and
cleared after it: explicit, and one forward at a time per process (the engine core's loop).
transformers builds no attention mask for an implementation it has no mask function for, so the
flat batch `[1, T]` with explicit `position_ids` costs no `[T, T]` mask. One module reads
positions from the batch's length rather than `position_ids`: Llama 4's NoPE layers scale q by
log1p(floor((p + 1) / floor_scale)) * attn_scale + 1 with p counted from 0 over the flat batch
(no cache); the attention function rescales each row to its token's own position
(`_retune_temperature`), which is what transformers computes for one sequence with its cache.

The forward returns the base model's last hidden states; `compute_logits` runs the causal-LM
class's own head on them (the base model swapped for one that returns them), so whatever that
class does after its `lm_head` (Cohere's logit scale, Granite's divisor, Gemma's soft-capping)
is transformers' own code too.

Refused when the model is built, naming the layer's class: recurrent or convolutional mixers
(Mamba, gated DeltaNet, short convolutions), cross-attention, a model whose attention does not go
through the attention interface (`_supports_attention_backend`), and a layer with attention sinks
that it does not hand to the attention function. Not run
here yet (refused in engine/config/model.py): tensor parallelism, LoRA, quantized weights.
Rejected: converting each architecture's weights into the native classes (that is what the
native families are; the backend exists for everything else).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from triollm.engine.execution.layers.attention import AttentionMetadata, PagedAttention
from triollm.engine.execution.models.base import CausalLM
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.transformers_config import hf_text_config, import_transformers
from triollm.kernels import KVCache, write_kv
from triollm.kernels.triton import use_triton

__all__ = ["ATTENTION_NAME", "TransformersForCausalLM", "load_transformers_model"]

ATTENTION_NAME = "triollm"
# Layer classes whose state is not a KV cache: what the backend cannot page.
_UNPAGED = re.compile(r"Mamba|Mixer|DeltaNet|ShortConv|Recurrent|RWKV|SSM|LinearAttention|CrossAttention")


@dataclass
class _Step:
    meta: AttentionMetadata
    kv: KVCache
    layers: dict[int, PagedAttention]
    positions: torch.Tensor  # [T] int64


_STEP: _Step | _Probe | None = None  # the step the running forward serves (module note)


def _paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: q `[1, H, T, dq]`, k `[1, KVH, T, dq]`, v
    `[1, KVH, T, dv]`, rotated; `s_aux` `[H]`: attention sinks; returns `[1, T, H, dv]`, having
    written k and v to the layer's paged cache. Heads narrower than the cache's (multi-head latent
    attention's v) are padded with zeros, which change no dot product and give zero output
    columns, sliced off."""
    step = _STEP
    index: int = getattr(module, "layer_idx")  # noqa: B009 - an nn.Module attribute, not a submodule
    h, t, dq = query.shape[1:]
    kvh, dv = key.shape[1], value.shape[-1]
    if isinstance(step, _Probe):
        step.seen[index] = (h, kvh, key.shape[-1], dv)
        step.windows[index] = sliding_window
        if s_aux is not None:
            step.sinks.add(index)
        return query.new_zeros(1, t, h, dv), None
    if step is None:
        raise RuntimeError("the triollm attention runs only inside TransformersForCausalLM.forward")
    k_cache, v_cache = step.kv.k[index], step.kv.v[index]
    hd = v_cache.shape[-1]
    attn = step.layers.get(index)
    if attn is None:
        scale = dq**-0.5 if scaling is None else float(scaling)
        attn = step.layers[index] = PagedAttention(
            h, kvh, hd, scale, window=sliding_window, softcap=softcap, sinks=s_aux, chunk=_layer_chunk(module)
        )
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))
    q = _retune_temperature(module, q, step.positions)
    if dq < hd:
        q, k = F.pad(q, (0, hd - dq)), F.pad(k, (0, hd - dq))
    if dv < hd:
        v = F.pad(v, (0, hd - dv))
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    write_kv(k_cache, v_cache, k, v, step.meta.slot_mapping)
    out = attn._attend(q, k, v, step.meta, k_cache, v_cache).view(1, t, h, hd)
    return (out if dv == hd else out[..., :dv]), None


def _layer_chunk(module: nn.Module) -> int | None:
    """The module's chunk of positions where its config's `layer_types` names it a
    'chunked_attention' layer (checked at load: transformers_config.py), else None."""
    cfg = getattr(module, "config", None)
    types = getattr(cfg, "layer_types", None)
    if types and types[getattr(module, "layer_idx")] == "chunked_attention":  # noqa: B009 - as above
        return int(cfg.attention_chunk_size)  # type: ignore[union-attr]
    return None


def _retune_temperature(module: nn.Module, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """q `[T, H, d]` of a Llama 4 NoPE layer with temperature tuning, scaled by the factor of each
    token's position instead of the one transformers took from its row in the flat batch (module
    note); any other module's q as it is."""
    if not getattr(module, "attn_temperature_tuning", False) or getattr(module, "use_rope", True):
        return q
    floor, scale = float(getattr(module, "floor_scale")), float(getattr(module, "attn_scale"))  # noqa: B009

    def factor(p: torch.Tensor) -> torch.Tensor:
        return torch.log1p(torch.floor((p.float() + 1.0) / floor)) * scale + 1.0

    rows = torch.arange(q.shape[0], device=q.device)
    return (q.float() * (factor(positions) / factor(rows))[:, None, None]).to(q.dtype)


@dataclass
class _Probe:
    """Set as the step while the model runs one token at load: each layer's (heads, KV heads,
    k head size, v head size), to check against the KV cache's sizes before any request, and the
    layers that handed over attention sinks."""

    seen: dict[int, tuple[int, int, int, int]]
    sinks: set[int]
    windows: dict[int, int | None]  # the sliding window each layer handed over


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _paged_attention)


class _Hidden(nn.Module):
    """Stands in for the base model in `compute_logits`: returns the hidden states it is given,
    in the output class the base model returns (GPT-2's head reads its cross-attention field).
    It stands in for the base model's children too, for a head that calls one of them (OPT's
    calls `model.decoder`)."""

    def __init__(self, children: tuple[str, ...]) -> None:
        super().__init__()
        self.hidden: torch.Tensor | None = None
        self.output_type: Any = None  # set at the first forward
        self.child_names = children

    def __getattr__(self, name: str) -> Any:
        if name != "child_names" and name in self.child_names:
            return self
        return super().__getattr__(name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.output_type(last_hidden_state=self.hidden)


def _base_name(hf_model: nn.Module) -> str:
    """The attribute holding the causal LM's base model: its `base_model_prefix`, or `model` where
    the class shares a prefix it does not use (Llama4ForCausalLM's is 'language_model', the
    multimodal class's name for the text model it holds as `model`)."""
    children = dict(hf_model.named_children())
    for name in (str(hf_model.base_model_prefix), "model"):
        if name in children:
            return name
    raise ValueError(
        f"model_impl: {type(hf_model).__name__} holds no base model under {hf_model.base_model_prefix!r} or "
        f"'model' (children: {', '.join(children)}); the Transformers backend cannot find its decoder"
    )


class TransformersForCausalLM(CausalLM):
    """The runner's model interface (`forward`, `compute_logits`, `cfg`) over a transformers
    causal LM. A `CausalLM` for the runner and the executor; none of the native shell is built."""

    def __init__(self, cfg: ModelConfig, hf_model: nn.Module) -> None:
        nn.Module.__init__(self)  # not CausalLM's: transformers holds the layers
        self.cfg, self.shard, self.comm = cfg, None, None
        self.triton: bool | None = None
        self.decode_stack = None
        self.hf = hf_model
        self.base_name = _base_name(hf_model)
        self.base = getattr(hf_model, self.base_name)
        self._layers: dict[int, PagedAttention] = {}  # each layer's attention, made at its first call
        self._stand_in = _Hidden(tuple(name for name, _ in self.base.named_children()))

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` (the base model's last, final norm applied) for the flat batch.
        `image_rows` is never given: vision-language checkpoints run natively (model_config.py)."""
        assert image_rows is None
        global _STEP
        if self.triton is None:
            self.triton = use_triton(input_ids)
        meta.triton = self.triton
        _STEP = _Step(meta, kv, self._layers, positions)
        try:
            out = self.base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)
        finally:
            _STEP = None
        self._stand_in.output_type = type(out)
        return out.last_hidden_state[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[n, vocab]` from the causal-LM class's own forward (module note)."""
        self._stand_in.hidden = hidden[None]
        setattr(self.hf, self.base_name, self._stand_in)
        try:
            dummy = torch.zeros(1, hidden.shape[0], dtype=torch.long, device=hidden.device)
            logits = self.hf(input_ids=dummy, use_cache=False, logits_to_keep=0).logits
        finally:
            setattr(self.hf, self.base_name, self.base)
            self._stand_in.hidden = None
        return logits[0].float()

    def pack_linears(self, few_rows: bool = True) -> None:
        """Nothing to pack: transformers' linear layers run as they are."""


def load_transformers_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> TransformersForCausalLM:
    """transformers' model for `cfg` (its weights from cfg.path) on `device`, its attention paged."""
    transformers = import_transformers()

    _register()
    hf_cfg = hf_text_config(_config_json(cfg), cfg.architecture)
    cls = getattr(transformers, cfg.architecture)
    if not getattr(cls, "_supports_attention_backend", False):
        raise ValueError(
            f"model_impl: {cfg.architecture}'s attention does not go through transformers' attention interface "
            f"(_supports_attention_backend is false in transformers {transformers.__version__}); the Transformers "
            f"backend cannot page it"
        )
    hf_model = cls.from_pretrained(cfg.path, config=hf_cfg, dtype=cfg.dtype, attn_implementation=ATTENTION_NAME)
    _check_pageable(cfg, hf_model)
    hf_model.requires_grad_(False)
    hf_model.eval()
    model = TransformersForCausalLM(cfg, hf_model)
    _check_shapes(cfg, model)
    model.to(device)
    return model


def _windowed_layers(hf_config: Any, num_layers: int) -> list[int]:
    """The layers the config gives a sliding window: those `layer_types` marks
    "sliding_attention", else every layer where `sliding_window` is set (and
    `use_sliding_window`, where the config has it, is not false)."""
    config = getattr(hf_config, "text_config", None) or hf_config
    types = getattr(config, "layer_types", None)
    if types:
        return [i for i, t in enumerate(types[:num_layers]) if t == "sliding_attention"]
    if getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True) is not False:
        return list(range(num_layers))
    return []


def _check_shapes(cfg: ModelConfig, model: TransformersForCausalLM) -> None:
    """One token through the model with the probe as its attention (`_Probe`): every layer's
    heads must fit the KV cache sized from the config, or the load fails here, not a step."""
    global _STEP
    probe = _Probe({}, set(), {})
    _STEP = probe
    try:
        with torch.inference_mode():
            model.base(input_ids=torch.zeros(1, 1, dtype=torch.long), position_ids=torch.zeros(1, 1, dtype=torch.long),
                       use_cache=False)  # fmt: skip
    finally:
        _STEP = None
    want = (cfg.num_kv_heads, cfg.head_dim)
    for name, m in model.hf.named_modules():
        if getattr(m, "sinks", None) is not None and getattr(m, "layer_idx", None) not in probe.sinks:
            raise ValueError(
                f"model_impl: {cfg.architecture}'s {type(m).__name__} ({name}) has attention sinks that it does not "
                f"hand to the attention function (s_aux); the Transformers backend cannot apply them"
            )
    for layer in range(cfg.num_layers):
        if layer not in probe.seen:
            raise ValueError(f"model_impl: {cfg.architecture}'s layer {layer} did not call the paged attention")
    for layer in _windowed_layers(model.hf.config, cfg.num_layers):
        if probe.windows.get(layer) is None:
            raise ValueError(
                f"model_impl: {cfg.architecture}'s layer {layer} has a sliding window (sliding_window) that its "
                f"attention does not hand to the attention function (it relies on a mask, which the paged cache "
                f"does not use): through the Transformers backend it would attend past the window"
            )
        h, kvh, dk, dv = probe.seen[layer]
        if kvh != cfg.num_kv_heads or max(dk, dv) != cfg.head_dim or h % kvh:
            raise ValueError(
                f"model_impl: {cfg.architecture}'s layer {layer} attends with {h} query heads, {kvh} KV heads of "
                f"sizes k {dk} / v {dv}; the config gives {want[0]} KV heads of {want[1]} (num_key_value_heads, "
                f"head_dim): the Transformers backend cannot size its KV cache for it"
            )


def _config_json(cfg: ModelConfig) -> dict[str, Any]:
    import json

    return dict(json.loads((cfg.path / "config.json").read_text()))


def _check_pageable(cfg: ModelConfig, hf_model: nn.Module) -> None:
    """Every layer's state is a KV cache the paged cache can hold (module note)."""
    attention: list[int] = []
    for name, m in hf_model.named_modules():
        cls = type(m).__name__
        if _UNPAGED.search(cls) or getattr(m, "is_cross_attention", False):
            raise ValueError(
                f"model_impl: {cfg.architecture} has a {cls} layer ({name}): recurrent state, convolutions and "
                f"cross-attention cannot be paged by the Transformers backend"
            )
        if cls.endswith("Attention") and isinstance(getattr(m, "layer_idx", None), int):
            attention.append(m.layer_idx)
    if sorted(attention) != list(range(cfg.num_layers)):
        raise ValueError(
            f"model_impl: {cfg.architecture} has attention layers {sorted(attention)} for {cfg.num_layers} decoder "
            f"layers; the Transformers backend pages one self-attention per layer"
        )
