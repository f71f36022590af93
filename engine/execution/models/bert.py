"""BERT and XLM-R encoders (`BertModel`: all-MiniLM, BGE, E5, ...; `XLMRobertaModel`: bge-m3,
multilingual-e5) and their sequence classifiers (`*ForSequenceClassification`: cross-encoder
rerankers) for the pooling runner.

An encoder sees a whole prompt at once, every token attending to every other (no causal mask),
so there is no KV cache and no decode: one forward pass per batch of whole prompts, returning
the last layer's hidden states for the pooler (engine/execution/pooler.py).

Layout: the linear layers run over the real tokens only, concatenated (`[T, H]`, no padding
computed); attention alone pads the batch to `[B, heads, S, D]` and runs one SDPA call with a
key-padding mask (padded query rows are computed and dropped; each row has at least one real
key, so no NaN). Per layer, as transformers' BertLayer: self-attention (Q/K/V fused into one
matmul at load), output dense, residual + LayerNorm (post-norm), GELU MLP, residual +
LayerNorm. Embeddings: word + absolute position + token type (type 0 unless the prompt carries
`token_type_ids`: the second text of a pair), then LayerNorm. XLM-R is the same network with
RoBERTa's position ids (from pad_token_id + 1; `EncoderSpec.position_offset`).

A classifier adds `ClassifierHead` on the first token ([CLS] / <s>): dense, tanh, then a linear
layer to `num_labels` logits. BERT's is its `pooler.dense` + `classifier`, RoBERTa's its
`classifier.dense` + `classifier.out_proj`: the same computation under two sets of names. An
embedding model's `pooler.*` (the NSP head) is not used and is not loaded; tensors under a
`bert.` / `roberta.` prefix (the *For* checkpoints) are accepted.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from triollm.engine.execution.layers.linear import Linear, column
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.weights import checkpoint_files

__all__ = ["BertModel", "ClassifierHead", "load_bert"]


def _dense(in_features: int, out_features: int) -> Linear:
    return column(in_features, [(0, out_features)], True)


class BertLayer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.encoder is not None
        h, eps = cfg.hidden_size, cfg.encoder.layer_norm_eps
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.qkv = _dense(h, 3 * h)
        self.attn_out = _dense(h, h)
        self.attn_norm = nn.LayerNorm(h, eps=eps)
        self.intermediate = _dense(h, cfg.intermediate_size)
        self.output = _dense(cfg.intermediate_size, h)
        self.out_norm = nn.LayerNorm(h, eps=eps)
        self.gelu_approximate = "none" if cfg.encoder.hidden_act == "gelu" else "tanh"

    def forward(self, x: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        qkv = batch.pad(self.qkv(x))  # [B, S, 3H]
        b, s, _ = qkv.shape
        q, k, v = qkv.view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attn = F.scaled_dot_product_attention(q, k, v, attn_mask=batch.attn_mask)
        attn = batch.unpad(attn.transpose(1, 2).reshape(b, s, -1))
        x = self.attn_norm(x + self.attn_out(attn))
        mlp = self.output(F.gelu(self.intermediate(x), approximate=self.gelu_approximate))
        return self.out_norm(x + mlp)


class PaddedBatch:
    """Where each sequence's tokens sit in the `[B, S]` padded layout (real tokens first)."""

    def __init__(self, lengths: list[int], device: torch.device) -> None:
        self.batch, self.width = len(lengths), max(lengths)
        lens = torch.tensor(lengths, device=device)
        self.mask = torch.arange(self.width, device=device).unsqueeze(0) < lens.unsqueeze(1)  # [B, S]
        self.index = self.mask.flatten().nonzero().squeeze(1)  # [T] rows of the flat padded batch
        self.attn_mask = self.mask[:, None, None, :]  # [B, 1, 1, S]: keys that exist
        self.positions = torch.cat([torch.arange(n, device=device) for n in lengths])

    def pad(self, flat: torch.Tensor) -> torch.Tensor:
        out = flat.new_zeros(self.batch * self.width, flat.shape[-1])
        out[self.index] = flat
        return out.view(self.batch, self.width, -1)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded.reshape(self.batch * self.width, -1)[self.index]


class ClassifierHead(nn.Module):
    """The first token's hidden state -> dense -> tanh -> `num_labels` logits (dropout is the
    identity at inference)."""

    def __init__(self, hidden: int, num_labels: int) -> None:
        super().__init__()
        self.dense = _dense(hidden, hidden)
        self.out_proj = _dense(hidden, num_labels)

    def forward(self, first: torch.Tensor) -> torch.Tensor:
        return self.out_proj(torch.tanh(self.dense(first)))


class BertModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.encoder is not None
        h = cfg.hidden_size
        self.pad_token_id = cfg.encoder.pad_token_id
        self.roberta_positions = cfg.encoder.position_offset > 0
        self.word_embeddings = nn.Embedding(cfg.vocab_size, h)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, h)
        self.token_type_embeddings = nn.Embedding(cfg.encoder.type_vocab_size, h)
        self.embed_norm = nn.LayerNorm(h, eps=cfg.encoder.layer_norm_eps)
        self.layers = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.num_layers)])
        num_labels = cfg.pooler.num_labels if cfg.pooler is not None else None
        self.head = ClassifierHead(h, num_labels) if num_labels is not None else None

    def forward(
        self, input_ids: torch.Tensor, lengths: list[int], token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids` `[T]`: the prompts concatenated, of `lengths`; `token_type_ids` `[T]` or
        None (all type 0). Returns the last hidden states padded, `[B, S, H]`, and the mask of
        real tokens, `[B, S]`."""
        batch = PaddedBatch(lengths, input_ids.device)
        positions = self._roberta_positions(input_ids, batch) if self.roberta_positions else batch.positions
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            x = self.embed_norm(x + self.token_type_embeddings.weight[0])
        else:
            x = self.embed_norm(x + self.token_type_embeddings(token_type_ids))
        for layer in self.layers:
            x = layer(x, batch)
        return batch.pad(x), batch.mask

    def classify(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`[B, num_labels]` float32 logits from the padded last hidden states `[B, S, H]` (the
        first token's: `mask` is not needed)."""
        assert self.head is not None, "classify() needs a *ForSequenceClassification checkpoint"
        return self.head(hidden[:, 0].contiguous()).float()

    def _roberta_positions(self, input_ids: torch.Tensor, batch: PaddedBatch) -> torch.Tensor:
        """transformers' `create_position_ids_from_input_ids`: real tokens count from pad + 1
        within each prompt; a pad token sits at position pad."""
        real = batch.pad((input_ids != self.pad_token_id).long().unsqueeze(1)).squeeze(-1)  # [B, S]
        positions = real.cumsum(dim=1) * real + self.pad_token_id
        return batch.unpad(positions.unsqueeze(-1)).squeeze(-1)

    def pack_linears(self) -> None:
        for m in self.modules():
            if isinstance(m, Linear):
                m.pack(few_rows=False)  # prefill only: a prompt's bits whatever its batch (Linear.pack)


# HF name (after the optional "bert." prefix) -> ours; q/k/v are fused into one tensor.
_RENAMES = {
    "embeddings.LayerNorm": "embed_norm",
    "attention.output.dense": "attn_out",
    "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "intermediate",
    "output.dense": "output",
    "output.LayerNorm": "out_norm",
}
_QKV = {"attention.self.query": 0, "attention.self.key": 1, "attention.self.value": 2}


# A classifier's head, by its HF names: BERT's pooler + classifier, RoBERTa's classification head.
_HEAD = {
    "pooler.dense": "head.dense",
    "classifier": "head.out_proj",
    "classifier.dense": "head.dense",
    "classifier.out_proj": "head.out_proj",
}


def _target(name: str, classifier: bool) -> tuple[str | None, int | None]:
    """Our parameter for an HF tensor name and, for Q/K/V, its piece; (None, None): not loaded."""
    name = name.removeprefix("bert.").removeprefix("roberta.")
    module, _, leaf = name.rpartition(".")
    if classifier and module in _HEAD:
        return f"{_HEAD[module]}.{leaf}", None
    if name.startswith(("pooler.", "cls.", "lm_head.")) or name.endswith("position_ids"):
        return None, None
    if name.startswith("embeddings."):
        module, _, leaf = name.rpartition(".")
        module = _RENAMES.get(module, module.removeprefix("embeddings."))
        return f"{module}.{leaf}", None
    if name.startswith("encoder.layer."):
        rest = name.removeprefix("encoder.layer.")
        index, _, rest = rest.partition(".")
        module, _, leaf = rest.rpartition(".")
        if module in _QKV:
            return f"layers.{index}.qkv.{leaf}", _QKV[module]
        if module in _RENAMES:
            return f"layers.{index}.{_RENAMES[module]}.{leaf}", None
    return name, None  # unknown: reported by load_bert


def load_bert(cfg: ModelConfig, device: str | torch.device = "cpu") -> BertModel:
    """The encoder (and a classifier's head) on `device` in `cfg.dtype`, every tensor checked for
    presence and shape."""
    with torch.device("meta"):
        model = BertModel(cfg)
    params = dict(model.named_parameters())
    pieces: dict[str, dict[int, torch.Tensor]] = {}
    loaded: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(cfg.path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                target, piece = _target(name, model.head is not None)
                if target is None:
                    continue
                if target not in params:
                    raise ValueError(f"model: unexpected tensor {name!r} in {file.name}")
                tensor = f.get_tensor(name).to(cfg.dtype)
                if piece is None:
                    loaded[target] = tensor
                else:
                    pieces.setdefault(target, {})[piece] = tensor
    for target, parts in pieces.items():
        if len(parts) != 3:
            raise ValueError(
                f"model: checkpoint in {cfg.path} lacks part of {target} (query, key and value are needed)"
            )
        loaded[target] = torch.cat([parts[i] for i in sorted(parts)], dim=0)
    missing = sorted(set(params) - set(loaded))
    if missing:
        raise ValueError(f"model: checkpoint in {cfg.path} lacks tensors: {', '.join(missing[:5])}")
    for name, tensor in loaded.items():
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(
                f"model: tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(params[name].shape)}"
            )
    model.load_state_dict(loaded, strict=True, assign=True)
    model.requires_grad_(False)
    model = model.to(device).eval()
    model.pack_linears()
    return model
