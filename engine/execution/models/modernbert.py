"""ModernBERT encoders (`ModernBertModel`: modernbert-embed, gte-modernbert; and
`ModernBertForSequenceClassification`: rerankers) for the pooling runner.

What differs from BERT (bert.py): no position embeddings but RoPE on q and k (its own theta for
the global layers and for the local ones), every `global_attn_every_n_layers`-th layer attends
to the whole prompt and the others to a bidirectional window (|i - j| <= local_attention / 2),
pre-norm layers (the first without its attention norm), a GeGLU MLP (`Wi` gives input and gate,
GELU of the input times the gate), LayerNorms without biases by default, a final norm. A
classifier pools the final states ([CLS] or the mean, `classifier_pooling`), then `head.dense`,
the classifier activation and `head.norm`, then `classifier`.

The whole batch runs padded (`[B, S, H]`, one SDPA call per layer with the key-padding mask, and
the window for local layers): the module names are transformers' own, so the checkpoint loads
with `load_state_dict` after the `model.` prefix is taken off.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from triollm.engine.loading.hf_config import ModernBertSpec
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.weights import checkpoint_files

__all__ = ["ModernBertModel", "load_modernbert"]


def _gelu(kind: str) -> str:
    return "none" if kind == "gelu" else "tanh"


class _Embeddings(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModernBertSpec) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=spec.norm_bias)


class _Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModernBertSpec) -> None:
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_heads, cfg.head_dim
        self.Wqkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size, bias=spec.attention_bias)
        self.Wo = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=spec.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q, k, v = self.Wqkv(x).view(b, s, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.Wo(out.transpose(1, 2).reshape(b, s, -1))


class _MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModernBertSpec) -> None:
        super().__init__()
        self.Wi = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=spec.mlp_bias)
        self.Wo = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=spec.mlp_bias)
        assert cfg.encoder is not None
        self.approximate = _gelu(cfg.encoder.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        inp, gate = self.Wi(x).chunk(2, dim=-1)
        return self.Wo(F.gelu(inp, approximate=self.approximate) * gate)


class _Layer(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModernBertSpec, index: int) -> None:
        super().__init__()
        h, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.attn_norm: nn.Module = nn.Identity() if index == 0 else nn.LayerNorm(h, eps=eps, bias=spec.norm_bias)
        self.attn = _Attention(cfg, spec)
        self.mlp_norm = nn.LayerNorm(h, eps=eps, bias=spec.norm_bias)
        self.mlp = _MLP(cfg, spec)
        self.local = spec.layer_types[index] == "sliding_attention"

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin, mask)
        return x + self.mlp(self.mlp_norm(x))


class _Head(nn.Module):
    def __init__(self, cfg: ModelConfig, spec: ModernBertSpec) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=spec.classifier_bias)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=spec.norm_bias)
        self.approximate = _gelu(spec.classifier_activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(F.gelu(self.dense(x), approximate=self.approximate))


class ModernBertModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        assert cfg.encoder is not None and cfg.encoder.modernbert is not None
        spec = self.spec = cfg.encoder.modernbert
        self.embeddings = _Embeddings(cfg, spec)
        self.layers = nn.ModuleList([_Layer(cfg, spec, i) for i in range(cfg.num_layers)])
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.rms_norm_eps, bias=spec.norm_bias)
        num_labels = cfg.pooler.num_labels if cfg.pooler is not None else None
        self.head = _Head(cfg, spec) if num_labels is not None else None
        self.classifier = nn.Linear(cfg.hidden_size, num_labels) if num_labels is not None else None
        self.head_dim = cfg.head_dim

    def forward(
        self, input_ids: torch.Tensor, lengths: list[int], token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids` `[T]`: the prompts concatenated, of `lengths` (no token types). Returns
        the final-norm hidden states padded, `[B, S, H]`, and the mask of real tokens, `[B, S]`."""
        device, width = input_ids.device, max(lengths)
        mask = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
        flat = self.embeddings.norm(self.embeddings.tok_embeddings(input_ids))
        x = flat.new_zeros(len(lengths) * width, flat.shape[-1])
        x[mask.flatten().nonzero().squeeze(1)] = flat
        x = x.view(len(lengths), width, -1)
        keys = mask[:, None, None, :]  # [B, 1, 1, S]
        pos = torch.arange(width, device=device)
        near = (pos[:, None] - pos[None, :]).abs() <= self.spec.local_window  # [S, S]
        masks = {"global": keys, "local": keys & near}
        thetas = {"global": self.spec.global_rope_theta, "local": self.spec.local_rope_theta}
        ropes = {kind: self._rope(theta, pos, x.dtype) for kind, theta in thetas.items()}
        for layer in self.layers:
            kind = "local" if layer.local else "global"
            x = layer(x, *ropes[kind], masks[kind])
        return self.final_norm(x), mask

    def classify(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`[B, num_labels]` float32 logits: the head over [CLS] or the mean of the real tokens."""
        assert self.head is not None and self.classifier is not None, "classify() needs a classifier checkpoint"
        if self.spec.classifier_pooling == "mean":
            weights = mask.unsqueeze(-1).to(hidden.dtype)
            pooled = (hidden * weights).sum(dim=1) / weights.sum(dim=1)
        else:
            pooled = hidden[:, 0]
        return self.classifier(self.head(pooled)).float()

    def _rope(self, theta: float, pos: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin `[S, head_dim]` at positions `pos` (transformers' default RoPE)."""
        dims = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=pos.device) / self.head_dim
        inv_freq = 1.0 / theta**dims
        freqs = pos[:, None].float() * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def load_modernbert(cfg: ModelConfig, device: str | torch.device = "cpu") -> ModernBertModel:
    """The encoder (and a classifier's head) on `device` in `cfg.dtype`, every tensor checked."""
    with torch.device("meta"):
        model = ModernBertModel(cfg)
    classifier = model.head is not None
    state: dict[str, torch.Tensor] = {}
    for file in checkpoint_files(cfg.path):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                ours = name.removeprefix("model.")
                if ours.startswith("decoder.") or (ours.startswith(("head.", "classifier.")) and not classifier):
                    continue  # the masked-LM head, or a head an embedding model does not use
                state[ours] = f.get_tensor(name).to(cfg.dtype)
    expected = model.state_dict()
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    if missing:
        raise ValueError(f"model: checkpoint in {cfg.path} lacks tensors: {', '.join(missing[:5])}")
    if unexpected:
        raise ValueError(f"model: unexpected tensors in {cfg.path}: {', '.join(unexpected[:5])}")
    for name, tensor in state.items():
        if tuple(expected[name].shape) != tuple(tensor.shape):
            want = tuple(expected[name].shape)
            raise ValueError(f"model: tensor {name} has shape {tuple(tensor.shape)}, expected {want}")
    model.load_state_dict(state, strict=True, assign=True)
    model.requires_grad_(False)
    return model.to(device).eval()
