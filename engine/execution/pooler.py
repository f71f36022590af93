"""Pooling math: from an encoder's hidden states to one vector per sequence (or per token).

The batch is padded: `hidden` `[B, S, H]` and `mask` `[B, S]` (True on real tokens, a prefix of
each row). MEAN averages the real tokens only, CLS takes position 0, LAST the last real token
(sentence-transformers' `lasttoken`). Matryoshka truncation (`dimensions`) keeps the first d
values and comes before the L2 normalisation, as in vLLM and sentence-transformers.
Everything is computed in float32 whatever the model's dtype.

A classifier's logits go through its activation (`activate`: PoolerConfig.activation, as
sentence-transformers' CrossEncoder applies it): sigmoid and tanh elementwise, softmax over the
labels, identity for raw logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from triollm.engine.loading.pooler_config import PoolingType

__all__ = ["activate", "finish_embedding", "pool"]


def pool(hidden: torch.Tensor, mask: torch.Tensor, pooling_type: PoolingType) -> torch.Tensor:
    """`[B, H]` float32: one vector per row of the padded batch."""
    hidden = hidden.float()
    if pooling_type == "CLS":
        return hidden[:, 0]
    lengths = mask.sum(dim=1)
    if pooling_type == "LAST":
        return hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
    if pooling_type == "MEAN":
        summed = (hidden * mask.unsqueeze(-1).to(hidden.dtype)).sum(dim=1)
        return summed / lengths.clamp(min=1).unsqueeze(-1).to(hidden.dtype)
    raise ValueError(f"pooling_type: {pooling_type!r} is not one of MEAN, CLS, LAST")


def finish_embedding(vector: torch.Tensor, dimensions: int | None, normalize: bool) -> torch.Tensor:
    """Matryoshka truncation, then L2 normalisation over the last dimension (float32)."""
    vector = vector.float()
    if dimensions is not None:
        vector = vector[..., :dimensions]
    if normalize:
        vector = F.normalize(vector, p=2.0, dim=-1)
    return vector


def activate(logits: torch.Tensor, activation: str) -> torch.Tensor:
    """`logits` `[..., num_labels]` through the classifier's activation (float32)."""
    logits = logits.float()
    if activation == "sigmoid":
        return torch.sigmoid(logits)
    if activation == "softmax":
        return torch.softmax(logits, dim=-1)
    if activation == "tanh":
        return torch.tanh(logits)
    if activation == "identity":
        return logits
    raise ValueError(f"activation: {activation!r} is not one of sigmoid, softmax, tanh, identity")
