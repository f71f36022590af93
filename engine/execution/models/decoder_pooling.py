"""Decoder models as pooling models: a causal LM's trunk, run over whole prompts, pooled.

A decoder embedder (Qwen3-Embedding, gte-Qwen2, e5-mistral: a `*ForCausalLM` checkpoint served
with `--runner pooling`) and a decoder classifier (`Qwen3ForSequenceClassification`,
`LlamaForSequenceClassification`: a reranker or reward model) are the family's own `CausalLM`
(engine/execution/models/) without its LM head: embeddings, layers and final norm, loaded by the
same loader. A classifier adds `score`, a bias-free linear layer to `num_labels` logits read at
each prompt's last token (transformers' `*ForSequenceClassification`). With vLLM's
`classifier_from_token` the checkpoint is a causal LM and `score` is made from its LM head: the
named tokens' rows (vLLM's method "no_post_processing"), or for two tokens (Qwen3-Reranker's
"no", "yes"; method "from_2_way_softmax") the second's row minus the first's, so the one
label's logit is their logit difference. The same trunk serves vLLM's `--convert`: "embed"
and "reward" read its hidden states, "classify" adds `score` as above.

Each step is one causal prefill of whole prompts (no chunking, no reuse): a KV cache sized for
this batch alone is allocated and dropped, so the pooling core keeps its one-pass-per-batch
shape. Rejected: serving these through the generative core, whose scheduler, block manager and
sampler a prompt that is read once and never decoded does not need. The outputs are padded
`[B, S, H]` with their mask, the encoders' layout (bert.py), so the pooler and the core treat
both alike.
"""

from __future__ import annotations

import dataclasses

import torch
from safetensors import safe_open
from torch import nn

from triollm.engine.execution.layers.attention import AttentionMetadata, PrefillChunk
from triollm.engine.execution.models import MODELS, CausalLM
from triollm.engine.loading.hf_config import causal_architecture
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.loading.weights import checkpoint_files, load_weights, materialize
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.kernels.attention import allocate_kv_cache, plan_prefill

__all__ = ["DecoderPooler", "load_decoder_pooler"]

_BLOCK = 16  # the per-batch cache's block size


class DecoderPooler(nn.Module):
    def __init__(self, trunk: CausalLM, score: nn.Linear | None) -> None:
        super().__init__()
        self.trunk, self.score = trunk, score

    def forward(
        self, input_ids: torch.Tensor, lengths: list[int], token_type_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`input_ids` `[T]`: the prompts concatenated, of `lengths` (token types are an
        encoder's: ignored). Returns the final-norm hidden states padded, `[B, S, H]`, and the
        mask of real tokens, `[B, S]`."""
        cfg, device = self.trunk.cfg, input_ids.device
        blocks = [-(-n // _BLOCK) for n in lengths]
        kv = allocate_kv_cache(
            cfg.num_layers, sum(blocks), _BLOCK, cfg.num_kv_heads, cfg.head_dim, cfg.dtype, device
        )
        tables: list[list[int]] = []
        slots: list[int] = []
        positions: list[int] = []
        first = 0
        for n, count in zip(lengths, blocks):
            table = list(range(first, first + count))
            tables.append(table)
            slots.extend(table[p // _BLOCK] * _BLOCK + p % _BLOCK for p in range(n))
            positions.extend(range(n))
            first += count
        plan = plan_prefill([(n, 0, table) for n, table in zip(lengths, tables)], device)
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            prefills=[PrefillChunk(s, n, c, ids) for s, n, c, ids in plan.chunks],
            prefill_plan=plan,
        )
        meta.positions = torch.tensor(positions, dtype=torch.long, device=device)
        hidden = self.trunk.forward(input_ids, meta.positions, meta, kv)
        width = max(lengths)
        mask = torch.arange(width, device=device).unsqueeze(0) < torch.tensor(lengths, device=device).unsqueeze(1)
        padded = hidden.new_zeros(len(lengths) * width, hidden.shape[-1])
        padded[mask.flatten().nonzero().squeeze(1)] = hidden
        return padded.view(len(lengths), width, -1), mask

    def classify(self, hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """`[B, num_labels]` float32 logits at each prompt's last token."""
        assert self.score is not None, "classify() needs a *ForSequenceClassification checkpoint"
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), mask.sum(dim=1) - 1]
        return self.score(last).float()


def load_decoder_pooler(cfg: ModelConfig, device: str | torch.device = "cpu") -> DecoderPooler:
    """The trunk of the family's `*ForCausalLM` class with the checkpoint's weights, and a
    classifier's `score` head when `cfg.pooler` has labels."""
    family = causal_architecture(cfg.architecture)
    trunk_cfg = dataclasses.replace(cfg, architecture=family, tie_word_embeddings=True)
    with torch.device("meta"):
        trunk = _trunk_class(MODELS[family])(trunk_cfg)
    materialize(trunk, device, cfg.dtype)
    trunk.requires_grad_(False)
    trunk.to(device)
    load_weights(trunk, cfg.path)
    trunk.to_device(device)
    trunk.eval()
    trunk.pack_linears(few_rows=False)  # prefill only: a prompt's bits whatever its batch (Linear.pack)
    # No LM head: the packed copy of the embedding is not needed.
    trunk.packed_tied_head = trunk.blocked_tied_head = None
    score = None
    num_labels = cfg.pooler.num_labels if cfg.pooler is not None else None
    if num_labels is not None:
        weight = _score_weight(cfg)
        if tuple(weight.shape) != (num_labels, cfg.hidden_size):
            raise ValueError(
                f"model: tensor score.weight has shape {tuple(weight.shape)}, expected {(num_labels, cfg.hidden_size)}"
            )
        score = nn.Linear(cfg.hidden_size, num_labels, bias=False, device=device, dtype=cfg.dtype)
        score.weight.data.copy_(weight)
        score.requires_grad_(False)
    return DecoderPooler(trunk, score).eval()


def _trunk_class(base: type[CausalLM]) -> type[CausalLM]:
    """The family's class reading its checkpoint without the heads: `lm_head` and a classifier's
    `score` are not the trunk's."""

    def remap(self: CausalLM, name: str) -> str | None:
        if name.startswith(("lm_head.", "score.")):
            return None
        return base.remap(self, name)

    return type(f"{base.__name__}Trunk", (base,), {"remap": remap})


def _score_weight(cfg: ModelConfig) -> torch.Tensor:
    """`score.weight`, or made from the LM head's rows of `classifier_from_token`."""
    assert cfg.pooler is not None
    tokens = cfg.pooler.classifier_from_token
    if not tokens:
        try:
            return _tensor(cfg, "score.weight")
        except ValueError:
            raise ValueError(
                f"model: a classifier needs its score head, and the checkpoint in {cfg.path} lacks score.weight; "
                "for a causal LM read as a classifier set classifier_from_token (and method: "
                "from_2_way_softmax or no_post_processing) in hf_overrides"
            ) from None
    tokenizer = Tokenizer.from_pretrained(cfg.path)
    ids = []
    for token in tokens:
        token_id = tokenizer.backend.token_to_id(token)
        if token_id is None:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of {cfg.path.name}'s tokenizer")
        ids.append(token_id)
    head = _tensor(cfg, "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight")
    rows = head[ids]
    return (rows[1] - rows[0]).unsqueeze(0) if cfg.pooler.two_way else rows


def _tensor(cfg: ModelConfig, name: str) -> torch.Tensor:
    for file in checkpoint_files(cfg.path):
        with safe_open(str(file), framework="pt") as f:
            if name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                return f.get_tensor(name)
    raise ValueError(f"model: checkpoint in {cfg.path} lacks tensors: {name}")
