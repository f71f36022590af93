"""Llama-family decoders (Llama 2/3, SmolLM2, Mistral, Qwen2) over a paged KV cache.

One flat batch per step: the tokens of every scheduled sequence are concatenated (`[T]`), the
linear layers run over all of them at once, and only attention splits the batch: decode tokens
(one per sequence, placed first) go through one batched paged-decode call; each prefill chunk
gets its own causal attention call. Q/K/V and gate/up projections are fused into one matmul each
at load time (fewer, larger matmuls are faster on CPU and GPU alike).

Tensor parallel (`shard` set, docs/scaling.md): each rank holds its heads, its share of the MLP
and its vocabulary slice (engine/distributed/sharding.py), loads only those slices from the
checkpoint, and runs the collectives (`comm`) after o_proj, down_proj and the embedding. With
`shard` None (one rank) the model is exactly the unsharded one.

CPU speed (docs/benchmarks.md has the measurements):
- Linear layers run through oneDNN with weights reordered once at load (`Linear.pack`): F.linear
  goes to MKL's sgemm, which takes its AVX2 path on AMD CPUs and ran slower at every batch size
  than oneDNN with a packed weight on this AVX-512 EPYC. In bf16 (CPUs with native bf16) the
  packed oneDNN path is faster than F.linear at batch 1 too.
- The rotary embedding rotates Q and K in one call; the decode attention is planned once per step
  (`plan_decode`) and the plan is shared by every layer.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.models.quantized import (
    DecodeStack,
    QuantEmbedding,
    QuantLinear,
    StackLayer,
    read_gguf_quantized,
)
from triollm.engine.loading.model_config import ModelConfig
from triollm.kernels import KVCache, cpu_native, prefill_attention, rms_norm, write_kv
from triollm.kernels.attention import DecodePlan, decode_attention
from triollm.kernels.norm import add_rms_norm
from triollm.kernels.quant import QuantWeight, packed_linear
from triollm.kernels.rotary import apply_rotary_signed, rotary_sign, rotary_tables
from triollm.kernels.triton import use_triton

if TYPE_CHECKING:
    from triollm.engine.distributed.collectives import Collectives

__all__ = ["AttentionMetadata", "LlamaForCausalLM", "PrefillChunk", "load_model", "quantize_model"]


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
    positions: torch.Tensor | None = None  # [T] int64 (the Triton path rotates by position)
    # Whether this pass runs the Triton kernels (`use_triton`), decided once per forward pass:
    # the environment lookup behind it costs microseconds, and a layer would pay it four times.
    triton: bool | None = None


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
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        o_bias = cfg.o_proj_bias
        if shard is not None:  # this rank's heads; the row-parallel bias is added once, on rank 0
            self.num_heads = shard.split(cfg.num_heads)[1]
            self.num_kv_heads = shard.kv_heads(cfg.num_heads, cfg.num_kv_heads)[1]
            o_bias = o_bias and shard.rank == 0
        self.comm: Collectives | None = None  # set by load_model when sharded
        qkv_out = (self.num_heads + 2 * self.num_kv_heads) * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.qkv_bias)
        self.o_proj = Linear(self.num_heads * cfg.head_dim, cfg.hidden_size, bias=o_bias)
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
        qkv = self.qkv_proj.forward(x)
        plan = meta.decode_plan
        if use_triton(qkv) if meta.triton is None else meta.triton:
            # Rotary on Q and K and the cache write in one kernel; cos/sin are the whole tables.
            from triollm.kernels.triton import rotary as triton_rotary

            assert meta.positions is not None
            q, k = triton_rotary.rotary_write_kv(
                qkv[:, : h * hd].view(t, h, hd),
                qkv[:, h * hd : (h + kvh) * hd].view(t, kvh, hd),
                qkv[:, (h + kvh) * hd :].view(t, kvh, hd),
                cos, sin, meta.positions, k_cache, v_cache, meta.slot_mapping,
            )  # fmt: skip
            return self._project(self._attend(q, k, qkv[:, (h + kvh) * hd :].view(t, kvh, hd), meta, k_cache, v_cache))
        if meta.num_decodes == t and plan is not None and plan.native is not None:
            # An all-decode step on the native CPU kernels: rotary + cache write in one call.
            q = cpu_native.rotary_write_kv(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping, h, kvh)
            out = decode_attention(q, k_cache, v_cache, plan, self.scale)
            return self._project(out.view(t, h * hd))
        # Q and K rotated in one call; V stays a view of the projection.
        qk = apply_rotary_signed(qkv[:, : (h + kvh) * hd].view(t, h + kvh, hd), cos, sin)
        q, k = qk[:, :h], qk[:, h:]
        v = qkv[:, (h + kvh) * hd :].view(t, kvh, hd)
        write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        return self._project(self._attend(q, k, v, meta, k_cache, v_cache))

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
        return out.reshape(t, h * hd)

    def _project(self, out: torch.Tensor) -> torch.Tensor:
        out = self.o_proj.forward(out)
        return out if self.comm is None else self.comm.all_reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.intermediate = cfg.intermediate_size
        down_bias = cfg.mlp_bias
        if shard is not None:
            self.intermediate = shard.split(cfg.intermediate_size)[1]
            down_bias = down_bias and shard.rank == 0
        self.comm: Collectives | None = None  # set by load_model when sharded
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * self.intermediate, bias=cfg.mlp_bias)
        self.down_proj = Linear(self.intermediate, cfg.hidden_size, bias=down_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj.forward(x)
        if gate_up.device.type == "cpu" and cpu_native.available():
            out = self.down_proj.forward(cpu_native.silu_and_mul(gate_up))
        else:
            gate, up = gate_up.split(self.intermediate, dim=-1)
            out = self.down_proj.forward(F.silu(gate).mul_(up))
        return out if self.comm is None else self.comm.all_reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.eps = cfg.rms_norm_eps
        self.exact_norm = cfg.quantization is None  # quantized: the native fp32 RMSNorm too
        self.self_attn = LlamaAttention(cfg, shard)
        self.mlp = LlamaMLP(cfg, shard)
        self.input_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.post_attention_layernorm = nn.Parameter(torch.ones(cfg.hidden_size))

    def forward(self, x, cos, sin, meta, k_cache, v_cache):  # type: ignore[no-untyped-def]
        normed = rms_norm(x, self.input_layernorm, self.eps, self.exact_norm, meta.triton)
        h = self.self_attn.forward(normed, cos, sin, meta, k_cache, v_cache)
        normed, x = add_rms_norm(h, x, self.post_attention_layernorm, self.eps, self.exact_norm, meta.triton)  # x + h, normed
        return x + self.mlp.forward(normed)


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.cfg = cfg
        self.shard = shard
        self.comm: Collectives | None = None  # set by load_model when sharded
        vocab = cfg.vocab_size
        if shard is not None:
            start, stop = shard.vocab(cfg.vocab_size)
            vocab = stop - start
        # An explicit weight skips nn.Embedding's random init: on the meta device that init
        # imports torch's reference ops, a cost paid at every engine start.
        self.embed_tokens: nn.Embedding | QuantEmbedding = nn.Embedding(vocab, cfg.hidden_size, _weight=torch.empty(vocab, cfg.hidden_size))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, shard) for _ in range(cfg.num_layers))
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.lm_head: Linear | QuantLinear | None = None if cfg.tie_word_embeddings else Linear(cfg.hidden_size, vocab, bias=False)
        self.packed_tied_head: torch.Tensor | None = None  # set by pack_linears
        # A quantized model's all-decode steps in one native call (set by load_model, last).
        self.decode_stack: DecodeStack | None = None
        # Plain attributes (not buffers): computed here on the CPU (also when the model is built
        # on the meta device), never loaded; moved in load_model.
        with torch.device("cpu"):
            self.rope_cos, self.rope_sin_signed = _rope_tables(cfg)
            self.rope_sin = self.rope_sin_signed * rotary_sign(cfg.head_dim)  # the plain table

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """Hidden states `[T, hidden]` (final norm applied) for the flat batch."""
        if self.comm is None:
            x = self.embed_tokens(input_ids)
        else:
            assert isinstance(self.embed_tokens, nn.Embedding)  # quantization does not shard
            x = self.comm.embed(self.embed_tokens.weight, input_ids)
        meta.triton = use_triton(x)
        if meta.triton:  # the whole fp32 tables: the rotary kernel gathers by position
            cos, sin = self.rope_cos, self.rope_sin
        else:  # [T, 1, head_dim], broadcast over heads; sin carries rotate-half's sign.
            cos = self.rope_cos.index_select(0, positions).to(x.dtype).unsqueeze(1)
            sin = self.rope_sin_signed.index_select(0, positions).to(x.dtype).unsqueeze(1)
        plan = meta.decode_plan
        stack = self.decode_stack
        if stack is not None and plan is not None and plan.native is not None and meta.num_decodes == x.shape[0]:
            # A quantized model's all-decode step: every layer in one native call, same bits.
            x = stack(x, cos, sin, meta.slot_mapping, plan.native, kv.k, kv.v)
        else:
            # Inside the model, submodules are called through `.forward`: nn.Module.__call__
            # adds hooks and tracing checks to each of the hundreds of calls a decode step makes.
            for i, layer in enumerate(self.layers):
                x = layer.forward(x, cos, sin, meta, kv.k[i], kv.v[i])
        return rms_norm(x, self.norm, self.cfg.rms_norm_eps, self.cfg.quantization is None, meta.triton)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[n, vocab]`; sharded, gathered on rank 0 (the other ranks get their own
        slice back, which nobody reads)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif isinstance(self.embed_tokens, QuantEmbedding):  # a quantized tied head
            logits = packed_linear(hidden, self.embed_tokens.weight).float()
        elif self.packed_tied_head is not None:
            logits = _onednn_linear(hidden, self.packed_tied_head, None).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        return logits if self.comm is None else self.comm.gather_logits(logits)

    def pack_linears(self) -> None:
        """Pack every linear layer for oneDNN (a no-op off CPU fp32). A tied lm_head gets a packed
        copy of the embedding, which stays dense for the lookup: vocab x hidden more bytes for a
        faster head (docs/benchmarks.md, "What changed")."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack()
        if not isinstance(self.embed_tokens, nn.Embedding):
            return  # kept quantized (engine/execution/models/quantized.py)
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
    # The GGUF import's quantized blocks are read by quantize_model, not here.
    files = sorted(f for f in path.glob("*.safetensors") if f.name != "gguf_quantized.safetensors")
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


def _shard_range(target: str, piece: int | None, cfg: ModelConfig, shard: TPShard) -> tuple[int, int, int] | None:
    """(dim, start, stop) of this rank's slice of the checkpoint tensor loaded into `target`
    (`piece` of it, if fused); None for a tensor every rank holds whole."""
    hd = cfg.head_dim
    if target.endswith("qkv_proj.weight") or target.endswith("qkv_proj.bias"):
        if piece == 0:
            first, count = shard.split(cfg.num_heads)
        else:
            first, count = shard.kv_heads(cfg.num_heads, cfg.num_kv_heads)
        return 0, first * hd, (first + count) * hd
    if target.endswith("gate_up_proj.weight") or target.endswith("gate_up_proj.bias"):
        first, count = shard.split(cfg.intermediate_size)
        return 0, first, first + count
    if target.endswith("o_proj.weight"):
        first, count = shard.split(cfg.num_heads)
        return 1, first * hd, (first + count) * hd
    if target.endswith("down_proj.weight"):
        first, count = shard.split(cfg.intermediate_size)
        return 1, first, first + count
    if target in ("embed_tokens.weight", "lm_head.weight"):
        return (0, *shard.vocab(cfg.vocab_size))
    return None


def _read(f, name: str, target: str, piece: int | None, cfg: ModelConfig, shard: TPShard | None) -> torch.Tensor | None:  # type: ignore[no-untyped-def]
    """Tensor `name` from open checkpoint `f`: whole, or only this rank's slice of it; None for a
    row-parallel bias that only rank 0 adds."""
    if shard is None:
        return f.get_tensor(name)
    if target.endswith(("o_proj.bias", "down_proj.bias")):
        return f.get_tensor(name) if shard.rank == 0 else None
    where = _shard_range(target, piece, cfg, shard)
    if where is None:
        return f.get_tensor(name)
    dim, start, stop = where
    part = f.get_slice(name)
    return part[start:stop] if dim == 0 else part[:, start:stop]


# Our projections that quantization replaces and the checkpoint tensors each holds, in row order.
_QUANTIZED_PROJECTIONS = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def quantize_model(model: LlamaForCausalLM, scheme: str, path: Path) -> None:
    """Replace the model's linear layers (and a tied embedding in a block format) in place by
    quantized ones (engine/execution/models/quantized.py)."""
    gguf = read_gguf_quantized(path) if scheme == "gguf" else {}
    bits = {"int8": 8, "int4": 4}.get(scheme)
    for i, layer in enumerate(model.layers):
        for fused, parts in _QUANTIZED_PROJECTIONS.items():
            owner_name, attr = fused.rsplit(".", 1)
            owner = layer.get_submodule(owner_name)
            dense = getattr(owner, attr)
            if scheme == "gguf":
                names = [f"model.layers.{i}.{p}.weight" for p in parts]
                if not all(n in gguf for n in names):
                    continue  # stored as floats in the GGUF: stays dense
                weight = QuantWeight.cat([gguf[n] for n in names])
            else:
                assert bits is not None
                weight = QuantWeight.quantize(dense.weight.detach(), bits)
            bias = None if dense.bias is None else dense.bias.detach()  # gguf: on meta, loaded later
            setattr(owner, attr, QuantLinear(weight, bias))
    embedding = gguf.get("model.embed_tokens.weight")
    if model.lm_head is None and embedding is not None:
        assert isinstance(model.embed_tokens, nn.Embedding)
        dtype = model.cfg.dtype
        model.embed_tokens = QuantEmbedding(embedding, dtype)
        model.packed_tied_head = None
    elif model.lm_head is not None and "lm_head.weight" in gguf:
        model.lm_head = QuantLinear(gguf["lm_head.weight"], None)


def _decode_stack(model: LlamaForCausalLM) -> DecodeStack | None:
    """The native decoder stack for a quantized model's all-decode steps, where it computes
    exactly what the layers would: fp32, unsharded, and what `DecodeStack.supported` checks."""
    if model.comm is not None or model.cfg.dtype != torch.float32:
        return None
    layers = [cast(LlamaDecoderLayer, layer) for layer in model.layers]
    stack = [
        StackLayer(
            layer.input_layernorm,
            layer.post_attention_layernorm,
            (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj),
        )
        for layer in layers
    ]
    if not stack or not DecodeStack.supported(stack):
        return None
    attn = layers[0].self_attn
    return DecodeStack(stack, attn.num_heads, attn.num_kv_heads, attn.scale, model.cfg.rms_norm_eps)


def load_model(
    cfg: ModelConfig,
    device: str | torch.device = "cpu",
    shard: TPShard | None = None,
    comm: Collectives | None = None,
) -> LlamaForCausalLM:
    """The model on `device`; with `shard` (and its `comm`), only this rank's slices."""
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, shard)
    replaced: set[str] = set()
    if cfg.quantization == "gguf":  # the blocks as shipped: their dense copies are never read
        before = set(dict(model.named_parameters()))
        quantize_model(model, "gguf", cfg.path)
        replaced = before - set(dict(model.named_parameters()))
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
                target, piece = _target(name)
                if target in replaced:
                    continue
                if target not in params:
                    raise ValueError(f"model: unexpected tensor {name!r} in {file.name}")
                read = _read(f, name, target, piece, cfg, shard)
                if read is None:
                    continue
                tensor = read.to(cfg.dtype)
                if piece is None:
                    loaded[target] = tensor
                else:
                    pieces.setdefault(target, {})[piece] = tensor
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
    model.rope_sin = model.rope_sin.to(device)
    model.requires_grad_(False)
    model = model.to(device).eval()
    if cfg.quantization in ("int8", "int4"):  # quantized from the dense weights just loaded
        quantize_model(model, cfg.quantization, cfg.path)
    model.pack_linears()
    if comm is not None:
        model.comm = comm
        for m in model.modules():
            if isinstance(m, (LlamaAttention, LlamaMLP)):
                m.comm = comm
    model.decode_stack = _decode_stack(model)
    return model


def _rope_tables(cfg: ModelConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and signed sin, `[max_model_len, head_dim]` fp32, for the checkpoint's RoPE type
    (YaRN's attention factor folded into both, as transformers does)."""
    inv_freq = cfg.rope.inv_freq(cfg.head_dim)
    cos, sin = rotary_tables(inv_freq, cfg.max_model_len, cfg.rope.attention_factor)
    return cos, sin * rotary_sign(sin.shape[-1])
