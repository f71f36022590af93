"""Llama-family decoders (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One flat batch per step: the tokens of every scheduled sequence are concatenated (`[T]`), the
linear layers run over all of them at once, and only attention splits the batch: decode tokens
(one per sequence, placed first) go through one batched paged-decode call; each prefill chunk
gets its own causal attention call. Q/K/V and gate/up projections are fused into one matmul each
at load time (fewer, larger matmuls are faster on CPU and GPU alike).

CPU speed (docs/benchmarks.md has the measurements):
- Linear layers run through oneDNN with weights reordered once at load (`Linear.pack`): F.linear
  goes to MKL's sgemm, which takes its AVX2 path on AMD CPUs and ran 2x slower at batch 64
  and 1.5-2x slower at batch 1 than oneDNN with a packed weight on this AVX-512 EPYC. In bf16
  (CPUs with native bf16) the packed oneDNN path was 1.8-4x faster than F.linear at batch 1.
- The rotary embedding rotates Q and K in one call; the decode attention is planned once per step
  (`plan_decode`) and the plan is shared by every layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from triollm.engine.loading.model_config import ModelConfig
from triollm.kernels import KVCache, cpu_native, prefill_attention, rms_norm, write_kv
from triollm.kernels.attention import DecodePlan, decode_attention
from triollm.kernels.rotary import apply_rotary_signed, rotary_sign, rotary_tables

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "PrefillChunk", "load_model"]


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


def _packable(weight: torch.Tensor) -> bool:
    """Whether this weight can run through oneDNN: on CPU with torch's mkldnn ops built in, fp32,
    or bf16 where the CPU computes bf16 natively (elsewhere oneDNN would emulate it)."""
    return (
        weight.device.type == "cpu"
        and (weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and cpu_native.has_native_bf16()))
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


def _onednn_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class Linear(nn.Linear):
    """`nn.Linear` that can run through oneDNN on CPU in fp32 (see the module note).

    `pack()` replaces the weight, once loaded, by oneDNN's reordered copy (an opaque mkldnn
    tensor of the same shape and size): call it last, after loading and moving the model."""

    packed = False

    def pack(self) -> None:
        w = self.weight.detach()
        if not _packable(w):
            return
        self.weight = nn.Parameter(torch.ops.mkldnn._reorder_linear_weight(w), requires_grad=False)
        self.packed = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return _onednn_linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=cfg.o_proj_bias)
        # Softmax scale stays head_dim**-0.5 for every RoPE type: YaRN's attention factor is in
        # the cos/sin tables (it scales q and k), as in transformers' Llama.
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t = x.shape[0]
        h, kvh, hd = self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        plan = meta.decode_plan
        if meta.num_decodes == t and plan is not None and plan.native is not None:
            # An all-decode step on the native CPU kernels: rotary + cache write in one call.
            q = cpu_native.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, h, kvh)
            out = decode_attention(q, k_cache, v_cache, plan, self.scale)
            return self.o_proj(out.view(t, h * hd))
        # Q and K rotated in one call; V stays a view of the projection.
        qk = apply_rotary_signed(qkv[:, : (h + kvh) * hd].view(t, h + kvh, hd), cos, sin)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + kvh) * hd :].view(t, kvh, hd)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        d = meta.num_decodes
        if d == t:
            assert meta.decode_plan is not None
            out = decode_attention(q, k_cache, v_cache, meta.decode_plan, self.scale)
        else:
            out = q.new_empty(q.shape)
            if d:
                assert meta.decode_plan is not None
                out[:d] = decode_attention(q[:d], k_cache, v_cache, meta.decode_plan, self.scale)
            for c in meta.prefills:
                s, e = c.start, c.start + c.length
                out[s:e] = prefill_attention(
                    q[s:e], k[s:e], v[s:e], k_cache, v_cache, c.block_ids, c.num_context, self.scale
                )
        return self.o_proj(out.view(t, h * hd))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if gate_up.device.type == "cpu" and cpu_native.available():
            return self.down_proj(cpu_native.silu_and_mul(gate_up))
        gate, up = gate_up.split(self.intermediate, dim=-1)
        return self.down_proj(F.silu(gate).mul_(up))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, x, cos, sin, meta, k_cache, v_cache):  # type: ignore[no-untyped-def]
        x = x + self.self_attn(rms_norm(x, self.input_layernorm, self.eps), cos, sin, meta, k_cache, v_cache)
        return x + self.mlp(rms_norm(x, self.post_attention_layernorm, self.eps))


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # An explicit weight skips nn.Embedding's random init: on the meta device that init
        # imports torch's reference ops (~1.5 s at every engine start).
        self.embed_tokens = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=torch.empty(cfg.vocab_size, cfg.hidden_size)
        )
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.packed_tied_head: torch.Tensor | None = None  # set by pack_linears
        # Plain attributes (not buffers): computed here on the CPU (also when the model is built
        # on the meta device), never loaded; moved in load_model.
        with torch.device("cpu"):
            self.rope_cos, self.rope_sin_signed = _rope_tables(cfg)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """Hidden states `[T, hidden]` (final norm applied) for the flat batch."""
        x = self.embed_tokens(input_ids)
        # [T, 1, head_dim], broadcast over heads; sin carries rotate-half's sign.
        cos = self.rope_cos.index_select(0, positions).to(x.dtype).unsqueeze(1)
        sin = self.rope_sin_signed.index_select(0, positions).to(x.dtype).unsqueeze(1)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, meta, kv.k[i], kv.v[i])
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.lm_head is not None:
            return self.lm_head(hidden).float()
        if self.packed_tied_head is not None:
            return _onednn_linear(hidden, self.packed_tied_head, None).float()
        return F.linear(hidden, self.embed_tokens.weight).float()

    def pack_linears(self) -> None:
        """Pack every linear layer for oneDNN (a no-op off CPU fp32). A tied lm_head gets a packed
        copy of the embedding, which stays dense for the lookup: vocab x hidden more bytes
        (113 MB for SmolLM2-135M) for a 20% faster head (~1 ms per batch-1 step here)."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack()
        weight = self.embed_tokens.weight.detach()
        if self.lm_head is None and _packable(weight):
            # A plain attribute, not a parameter: the model's parameters stay the checkpoint's.
            self.packed_tied_head = torch.ops.mkldnn._reorder_linear_weight(weight)


# ---------------------------------------------------------------------------------- loading


def _checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [path / s for s in shards]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ValueError(f"model: no *.safetensors weights in {path}")
    return files


_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _target(name: str) -> tuple[str, int | None]:
    """Map a Hugging Face tensor name to (our parameter name, shard index within a fused one)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if name.endswith("layernorm.weight") or name == "norm.weight":
        return name[: -len(".weight")], None
    for hf, (ours, shard) in _FUSED.items():
        if f".{hf}." in name:
            return name.replace(hf, ours), shard
    return name, None


def load_model(cfg: ModelConfig, device: str | torch.device = "cpu") -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    params = dict(model.named_parameters())
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    loaded: dict[str, torch.Tensor] = {}
    for file in _checkpoint_files(cfg.path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                if "rotary_emb" in name:
                    continue
                if name == "lm_head.weight" and cfg.tie_word_embeddings:
                    continue
                target, shard = _target(name)
                if target not in params:
                    raise ValueError(f"model: unexpected tensor {name!r} in {file.name}")
                tensor = f.get_tensor(name).to(cfg.dtype)
                if shard is None:
                    loaded[target] = tensor
                else:
                    pieces.setdefault(target, {})[shard] = tensor
    for target, parts in pieces.items():
        loaded[target] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ValueError(f"model: checkpoint in {cfg.path} lacks tensors: {', '.join(missing[:5])}")
    for name, tensor in loaded.items():
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"model: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
            )
    model.load_state_dict(loaded, strict=False, assign=True)
    model.rope_cos, model.rope_sin_signed = model.rope_cos.to(device), model.rope_sin_signed.to(device)
    model.requires_grad_(False)
    model = model.to(device).eval()
    model.pack_linears()
    return model


def _rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, `[max_model_len, head_dim]` fp32, for the checkpoint's RoPE type
    (YaRN's attention factor folded into both, as transformers does)."""
    inv_freq = cfg.rope.inv_freq(cfg.head_dim)
    cos, sin = rotary_tables(inv_freq, cfg.max_model_len, cfg.rope.attention_factor)
    return cos, sin * rotary_sign(sin.shape[-1])
