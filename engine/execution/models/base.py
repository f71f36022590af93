"""What every decoder family shares: self-attention, the gated MLP, and the causal-LM shell.

`CausalLM` holds the embedding, the layers (each family's own class, built by `make_layer`), the
final norm, the head and the rotary tables, and runs a step: embed, every layer, final norm;
`compute_logits` applies the head, Granite's divisor and Gemma 2's soft-capping. A family's file
(llama.py, gemma.py, olmo2.py, moe.py) defines its decoder layer and, where its checkpoint names
differ, `remap`. Submodules are called through `.forward` inside the model: `nn.Module.__call__`
adds hooks and tracing checks to each of the hundreds of calls a decode step makes.

Tensor parallel (`shard` set, docs/scaling.md): each rank holds its heads, its share of the MLP
and its vocabulary slice (engine/distributed/sharding.py), loads only those slices
(layers/linear.py), and the row-parallel layers and the embedding run the collectives. With
`shard` None the model is exactly the unsharded one.

LoRA (lora/): the projections carry the adapter slots and `lora_batch` says which rows use
which slot this step; a quantized model's native decode stack applies them too (in fp32).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from triollm.engine.distributed.sharding import TPShard
from triollm.engine.execution.layers.activation import ACTIVATIONS, silu_and_mul
from triollm.engine.execution.layers.attention import AttentionMetadata, PagedAttention
from triollm.engine.execution.layers.linear import (
    BlockedWeight,
    Linear,
    blocked_view,
    column,
    load_rows,
    onednn_linear,
    pack_weight,
    packable,
    row,
)
from triollm.engine.execution.layers.norm import RMSNorm
from triollm.engine.execution.layers.quantized import DecodeStack, DenseDecodeStack, QuantEmbedding, QuantLinear
from triollm.engine.execution.layers.rotary import RopeStep, RotaryEmbedding
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.multimodal_config import decoder_tensor_name
from triollm.kernels import KVCache
from triollm.kernels.quant import packed_linear
from triollm.kernels.triton import use_triton

if TYPE_CHECKING:
    from triollm.engine.distributed.collectives import Collectives
    from triollm.lora.layers import LoRABatch

__all__ = ["CausalLM", "Embedding", "GatedMLP", "SelfAttention"]

# The checkpoint tensors that land stacked in one of our projections: name -> (ours, piece).
STACKED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}


class SelfAttention(nn.Module):
    """q|k|v projection, optional q/k RMSNorm, RoPE, paged attention, output projection."""

    def __init__(self, cfg: ModelConfig, layer: int, shard: TPShard | None) -> None:
        super().__init__()
        hd = cfg.head_dim
        h, kvh = cfg.num_heads, cfg.num_kv_heads
        q_rows, kv_rows = (0, h * hd), (0, kvh * hd)
        o_cols, rank = None, 0
        if shard is not None:
            (qf, qn), (kf, kn) = shard.split(h), shard.kv_heads(h, kvh)
            h, kvh, rank = qn, kn, shard.rank
            q_rows, kv_rows, o_cols = (qf * hd, qn * hd), (kf * hd, kn * hd), (qf * hd, qn * hd)
            if cfg.qk_norm == "full":
                raise ValueError(
                    f"tensor_parallel_size: {cfg.architecture}'s q/k norm spans all heads; tensor parallelism is not "
                    f"supported for it"
                )
        self.num_heads, self.num_kv_heads, self.head_dim = h, kvh, hd
        self.qkv_proj = column(cfg.hidden_size, [q_rows, kv_rows, kv_rows], cfg.qkv_bias)
        self.o_proj = row(h * hd, cfg.hidden_size, cfg.o_proj_bias, o_cols, rank)
        offset, eps = cfg.norm_offset, cfg.rms_norm_eps
        self.q_norm = self.k_norm = None
        if cfg.qk_norm == "head":
            self.q_norm, self.k_norm = RMSNorm(hd, eps, offset=offset), RMSNorm(hd, eps, offset=offset)
        elif cfg.qk_norm == "full":
            self.q_norm, self.k_norm = RMSNorm(h * hd, eps), RMSNorm(kvh * hd, eps)
        self.qk_norm = cfg.qk_norm
        self.rope_index = 1 if cfg.local_rope is not None and cfg.layer_window(layer) is not None else 0
        # YaRN's and LongRoPE's attention factors are in the cos/sin tables (they scale q and k).
        scale = cfg.head_dim**-0.5 if cfg.attention_scale is None else cfg.attention_scale
        window = cfg.layer_window(layer)
        if window is not None and window >= cfg.max_model_len:
            window = None  # no sequence is longer than the window: full attention is the same
        self.attn = PagedAttention(h, kvh, hd, scale, window=window, softcap=cfg.attn_softcap)

    def forward(
        self,
        x: torch.Tensor,
        ropes: list[RopeStep],
        meta: AttentionMetadata,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        qkv = self.qkv_proj.forward(x)
        if self.q_norm is not None:
            self._norm_qk(qkv, meta)
        out = self.attn.forward(qkv, ropes[self.rope_index], meta, k_cache, v_cache)
        return self.o_proj.forward(out)

    def _norm_qk(self, qkv: torch.Tensor, meta: AttentionMetadata) -> None:
        """q and k normalised in place in the fused projection (the attention reads them there)."""
        assert self.q_norm is not None and self.k_norm is not None
        t, h, kvh, hd = qkv.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        q, k = qkv[:, : h * hd], qkv[:, h * hd : (h + kvh) * hd]
        if self.qk_norm == "head":
            q.copy_(self.q_norm.forward(q.reshape(t * h, hd), meta.triton).view(t, h * hd))
            k.copy_(self.k_norm.forward(k.reshape(t * kvh, hd), meta.triton).view(t, kvh * hd))
        else:
            q.copy_(self.q_norm.forward(q.contiguous(), meta.triton))
            k.copy_(self.k_norm.forward(k.contiguous(), meta.triton))


class GatedMLP(nn.Module):
    """down(act(gate(x)) * up(x)), gate and up fused into one projection."""

    def __init__(self, cfg: ModelConfig, shard: TPShard | None, intermediate: int | None = None) -> None:
        super().__init__()
        size = cfg.intermediate_size if intermediate is None else intermediate
        rows, cols, rank = (0, size), None, 0
        if shard is not None:
            rows = cols = shard.split(size)
            rank = shard.rank
        self.gate_up_proj = column(cfg.hidden_size, [rows, rows], cfg.mlp_bias)
        self.down_proj = row(rows[1], cfg.hidden_size, cfg.mlp_bias, cols, rank)
        self.act = ACTIVATIONS[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.act is silu_and_mul and isinstance(self.gate_up_proj, QuantLinear):
            fused = self.gate_up_proj.swiglu(x)  # on the AMX tiles: one kernel, or None
            if fused is not None:
                return self.down_proj.forward(fused)
        return self.down_proj.forward(self.act(self.gate_up_proj.forward(x)))


class Embedding(nn.Embedding):
    """The token embedding (this rank's vocabulary slice, `rows`)."""

    def __init__(self, rows: tuple[int, int], hidden: int) -> None:
        # An explicit weight skips nn.Embedding's random init: on the meta device that init
        # imports torch's reference ops, a cost paid at every engine start.
        super().__init__(rows[1], hidden, _weight=torch.empty(rows[1], hidden))
        self.rows, self.cols = [rows], None

    def load(self, leaf: str, piece: int, source: Any) -> None:
        load_rows(self, leaf, piece, source)


class CausalLM(nn.Module):
    """The shell every family shares (module note). Subclasses define `make_layer`."""

    # Checkpoint names stacked into our projections (see STACKED); a family may change them.
    stacked: ClassVar[dict[str, tuple[str, int]]] = STACKED
    # The step's rows by LoRA adapter slot (lora/layers.py), set when the engine serves adapters.
    lora_batch: LoRABatch | None = None

    def __init__(self, cfg: ModelConfig, shard: TPShard | None = None) -> None:
        super().__init__()
        self.cfg, self.shard = cfg, shard
        # Whether the forward passes run the Triton kernels: $TRIOLLM_KERNELS and the device,
        # decided at the first pass (the weights' device is known then) and kept.
        self.triton: bool | None = None
        self.comm: Collectives | None = None  # set by load_model when sharded
        vocab = (0, cfg.vocab_size)
        if shard is not None:
            start, stop = shard.vocab(cfg.vocab_size)
            vocab = (start, stop - start)
        self.embed_tokens: Embedding | QuantEmbedding = Embedding(vocab, cfg.hidden_size)
        self.layers = nn.ModuleList(self.make_layer(cfg, i, shard) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, exact=cfg.quantization is None, offset=cfg.norm_offset)
        self.lm_head: Linear | QuantLinear | None = (
            None if cfg.tie_word_embeddings else column(cfg.hidden_size, [vocab], False)
        )
        self.packed_tied_head: torch.Tensor | None = None  # set by pack_linears
        self.blocked_tied_head: BlockedWeight | None = None  # the same, as the few-rows kernel reads it
        # The native decode stack, a quantized model's or a dense one's (set at load).
        self.decode_stack: DecodeStack | DenseDecodeStack | None = None
        # Not modules: computed on the CPU (also when the model is built on the meta device),
        # never loaded; moved by `to_device`.
        rotary_dim = cfg.rotary_dim
        mrope = () if cfg.multimodal is None else cfg.multimodal.mrope_section  # Qwen2-VL's M-RoPE
        self.rotaries = [RotaryEmbedding(cfg.rope, cfg.head_dim, cfg.max_model_len, rotary_dim, mrope)]
        if cfg.local_rope is not None:
            self.rotaries.append(RotaryEmbedding(cfg.local_rope, cfg.head_dim, cfg.max_model_len, rotary_dim))
        # Gemma rounds its embedding scale to the activations' dtype first.
        self.embed_scale = float(torch.tensor(cfg.embedding_multiplier, dtype=cfg.dtype, device="cpu"))

    def make_layer(self, cfg: ModelConfig, index: int, shard: TPShard | None) -> nn.Module:
        raise NotImplementedError

    def remap(self, name: str) -> str | None:
        """Our name for checkpoint tensor `name`, or None to skip it."""
        if self.cfg.multimodal is not None:  # a vision-language checkpoint: its decoder's tensors
            text_name = decoder_tensor_name(name)
            if text_name is None:
                return None
            name = text_name
        if "rotary_emb" in name:
            return None
        if name == "lm_head.weight" and self.cfg.tie_word_embeddings:
            return None
        return name.removeprefix("model.")

    def fused_pieces(self, module: str) -> list[int] | None:
        """For a checkpoint tensor already stacked as our `module` (Phi-3's qkv_proj), the row
        counts of its pieces; None where the checkpoint stores the pieces apart."""
        return None

    def to_device(self, device: torch.device | str) -> None:
        for r in self.rotaries:
            r.to(device)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv: KVCache,
        image_rows: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Hidden states `[T, hidden]` (final norm applied) for the flat batch. `image_rows`:
        (flat rows, image features `[rows, hidden]`) that replace those rows' (scaled) token
        embeddings, as transformers' vision-language wrappers scatter them."""
        if self.comm is None:
            x = self.embed_tokens(input_ids)
        else:
            assert isinstance(self.embed_tokens, nn.Embedding)  # quantization does not shard
            x = self.comm.embed(self.embed_tokens.weight, input_ids)
        if self.embed_scale != 1.0:
            x = x * self.embed_scale
        if image_rows is not None:
            x[image_rows[0]] = image_rows[1].to(x.dtype)
        if self.triton is None:
            self.triton = use_triton(x)
        meta.triton = self.triton
        # M-RoPE's 3-D positions where the step has images (model_runner.py), else the plain ones.
        rope_positions = positions if meta.mrope_positions is None else meta.mrope_positions
        ropes = [r.step(rope_positions, x.dtype, meta.triton) for r in self.rotaries]
        plan, stack, lora = meta.decode_plan, self.decode_stack, self.lora_batch
        native = (
            stack is not None
            and plan is not None
            and plan.native is not None
            and meta.num_decodes == x.shape[0]
            and stack.takes(x)
        )
        lora_args = None
        if native and lora is not None and lora.active:
            assert stack is not None
            lora_args = stack.lora_args(lora)
            native = lora_args is not None  # None: slots the native stack cannot take
        if native:
            # An all-decode step: every layer in one native call, same bits (a quantized model's,
            # or a dense one's of 1-4 rows).
            assert stack is not None and plan is not None and plan.native is not None
            x = stack(x, ropes[0].cos, ropes[0].sin, meta.slot_mapping, plan.native, kv.k, kv.v, lora_args)
        else:
            x = self.run_layers(x, ropes, meta, kv)
        return self.norm.forward(x, meta.triton)

    def run_layers(self, x: torch.Tensor, ropes: list[RopeStep], meta: AttentionMetadata, kv: KVCache) -> torch.Tensor:
        """Every decoder layer in turn, layer i on the cache's layer i (a hybrid family maps them)."""
        for i, layer in enumerate(self.layers):
            x = layer.forward(x, ropes, meta, kv.k[i], kv.v[i])
        return x

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits `[n, vocab]`; sharded, gathered on rank 0 (the other ranks get their own
        slice back, which nobody reads)."""
        if self.lm_head is not None:
            logits = self.lm_head(hidden).float()
        elif isinstance(self.embed_tokens, QuantEmbedding):  # a quantized tied head
            logits = packed_linear(hidden, self.embed_tokens.weight, tiles=self.embed_tokens.tiles).float()
        elif self.packed_tied_head is not None:
            blocked = self.blocked_tied_head
            if blocked is not None and blocked.takes(hidden):
                logits = blocked.linear(hidden, None, fp32_out=True)
            else:
                logits = onednn_linear(hidden, self.packed_tied_head, None).float()
        else:
            logits = F.linear(hidden, self.embed_tokens.weight).float()
        cfg = self.cfg
        if cfg.logits_divisor != 1.0:
            logits = logits / cfg.logits_divisor
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits if self.comm is None else self.comm.gather_logits(logits)

    def pack_linears(self, few_rows: bool = True) -> None:
        """Pack every linear layer for oneDNN (a no-op off CPU fp32). A tied lm_head gets a packed
        copy of the embedding, which stays dense for the lookup: vocab x hidden more bytes for a
        faster head (docs/benchmarks.md, "What changed"). `few_rows`: as `Linear.pack`'s."""
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(few_rows)
        if not isinstance(self.embed_tokens, nn.Embedding):
            return  # kept quantized (layers/quantized.py)
        weight = self.embed_tokens.weight.detach()
        if self.lm_head is None and packable(weight):
            # A plain attribute, not a parameter: the model's parameters stay the checkpoint's.
            self.packed_tied_head = pack_weight(weight)
            self.blocked_tied_head = blocked_view(self.packed_tied_head, weight)

    def make_decode_stack(self) -> DecodeStack | DenseDecodeStack | None:
        """The native decoder stack for all-decode steps (a quantized model's, or a dense one's
        of 1-4 rows), where the family's layers compute exactly what it does (Llama's); None
        elsewhere."""
        return None
