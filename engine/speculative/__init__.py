"""Speculative decoding: several tokens per forward pass of the target model, with exactly the
target's output distribution (docs/speculative.md).

A batch-1 decode step reads every weight once for one token. Here a cheap proposer guesses the
next k tokens of a request, the target scores all of them in one pass, and the longest prefix it
agrees with is kept, plus one token of its own: 1 to k + 1 tokens for the weights read once.

- Proposers: `ngram.py` (prompt lookup: what followed the context's tail earlier in it) and
  `draft.py` (a draft model, or the target's own checkpoint quantized: a self-draft).
- `Speculator` (below) sits in the engine core: before each schedule it says how many drafts
  each decoding request wants (`Request.spec_wanted`); the scheduler budgets them as tokens and
  KV slots; after scheduling it fills them in (`ScheduledRequest.draft_token_ids`); the model
  runner feeds each draft as a decode row of its own; the sampler's `verify` checks them (greedy:
  the target's argmax; sampled: the rejection rule that keeps the target's distribution); the
  core appends the accepted tokens one by one through the stop checks, and `Scheduler.advance`
  counts the rejected drafts' K/V slots out of the computed tokens (the rollback).
- Requests with structured outputs, and steps where `disable_by_batch_size` or more requests
  decode, run plain decodes. A request proposes at most 2 * (its last accepted drafts) + 1
  tokens (`Speculator.record`), so free text, where drafts rarely hold, costs little.
"""

from __future__ import annotations

from triollm.engine.config import SpeculativeConfig
from triollm.engine.core_protocol import SpecDecodingStats
from triollm.engine.scheduling.request_state import Request
from triollm.engine.scheduling.scheduler import ScheduledRequest
from triollm.engine.speculative.draft import DraftModel
from triollm.engine.speculative.ngram import NgramIndex

__all__ = ["DraftModel", "NgramIndex", "Speculator"]


class Speculator:
    """The engine core's proposer and acceptance counters (vLLM's `spec_decode_*` metrics)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, draft: DraftModel | None = None) -> None:
        if config.method == "draft_model" and draft is None:
            raise ValueError("speculative_config: the draft_model method needs its draft model loaded")
        self.config = config
        self.k = config.num_speculative_tokens
        self.max_model_len = max_model_len
        self.draft = draft
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.k

    def prepare(self, running: list[Request]) -> None:
        """Set each running request's `spec_wanted` for the coming schedule."""
        decoding = [r for r in running if r.num_tokens - r.num_computed_tokens == 1]
        limit = self.config.disable_by_batch_size
        off = limit is not None and len(decoding) >= limit
        for r in running:
            r.spec_wanted = 0
        if off:
            return
        cfg = self.config
        for r in decoding:
            # Every emitted token must fit max_tokens and the context: 1 + drafts of them.
            room = min(
                r.spec_limit or self.k, r.max_tokens - r.num_output_tokens - 1, self.max_model_len - r.num_tokens - 1
            )
            if room <= 0 or r.grammar is not None:
                continue
            if self.draft is not None:
                r.spec_wanted = room
                continue
            if r.spec_state is None:
                r.spec_state = NgramIndex(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
            r.spec_proposal = r.spec_state.propose(r.all_token_ids, room)
            r.spec_wanted = len(r.spec_proposal)

    def fill(self, scheduled: list[ScheduledRequest]) -> None:
        """Give every scheduled item with drafts its draft tokens."""
        items = [s for s in scheduled if s.num_draft]
        if self.draft is not None:
            self.draft.propose(items)
            return
        for s in items:
            s.draft_token_ids = s.request.spec_proposal[: s.num_draft]

    def record(self, request: Request, num_draft: int, num_accepted: int) -> None:
        """Count a verified draft, and set how many drafts the request proposes next: up to
        2 * accepted + 1 (at most k). A request whose drafts keep failing proposes one token at
        a time, which costs one row per step instead of k; one whose drafts are accepted gets
        back to k within two steps (1, 3, 7)."""
        request.spec_limit = min(self.k, 2 * num_accepted + 1)
        self.num_drafts += 1
        self.num_draft_tokens += num_draft
        self.num_accepted_tokens += num_accepted
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def statistics(self) -> SpecDecodingStats:
        """The counters since start, for the core's `EngineCoreStats.spec`."""
        return SpecDecodingStats(
            num_drafts=self.num_drafts,
            num_draft_tokens=self.num_draft_tokens,
            num_accepted_tokens=self.num_accepted_tokens,
            accepted_per_pos=tuple(self.accepted_per_pos),
        )
