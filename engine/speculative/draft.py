"""The draft model: a smaller model with the target's vocabulary, or the target's own checkpoint
under a cheaper quantization (a self-draft), proposing its greedy continuation.

It has a KV cache of its own, indexed by the target's block ids: a request's block `b` holds
positions [b * bs, (b + 1) * bs) in both caches, so the draft needs no block manager, and the
target's allocation for a step (1 + k slots) covers every position the draft writes. What the
draft has computed is `Request.draft_computed`. Each step, for every request with k drafts:
pass 1 feeds the tokens the draft has not seen, [draft_computed, num_tokens) (one or two after
a verified step, the whole prompt the first time), and takes the argmax of the last; passes 2..k
feed the previous proposal. Only draft tokens the target accepts keep their K/V: after the
verification the core lowers `draft_computed` to the target's computed tokens, and where the
blocks go (preemption) the scheduler sets it to 0. Blocks taken from the prefix cache hold the
target's K/V but not necessarily the draft's, so a new request starts at 0 and the draft computes
its whole prompt once.

Its passes run through a `ModelRunner` of its own (`last_hidden`), so a quantized draft's
all-decode passes take the native decode stack like any decode step.
"""

from __future__ import annotations

import torch

from triollm.engine.execution.model_runner import ModelRunner
from triollm.engine.execution.sampler import argmax
from triollm.engine.scheduling.scheduler import ScheduledRequest

__all__ = ["DraftModel"]


class DraftModel:
    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    @torch.inference_mode()
    def propose(self, items: list[ScheduledRequest]) -> None:
        """Fill each item's `draft_token_ids` with its `num_draft` greedy draft tokens."""
        if not items:
            return
        model = self.runner.model
        feeds: list[tuple[list[int], int, list[int]]] = []
        for s in items:
            req = s.request
            start = min(req.draft_computed, req.num_tokens - 1)
            feeds.append((req.all_token_ids[start:], start, req.block_ids))
            s.draft_token_ids = []
        live = list(range(len(items)))
        while live:
            hidden = self.runner.last_hidden([feeds[i] for i in live])
            tokens = argmax(model.compute_logits(hidden).float()).tolist()
            still: list[int] = []
            for i, token in zip(live, tokens):
                s = items[i]
                s.draft_token_ids.append(token)
                ids, start, blocks = feeds[i]
                s.request.draft_computed = start + len(ids)
                if len(s.draft_token_ids) < s.num_draft:
                    feeds[i] = ([token], start + len(ids), blocks)
                    still.append(i)
            live = still
