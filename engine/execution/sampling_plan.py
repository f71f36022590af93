"""What one request's sampling and stop checks need, prepared once when the core takes it.

A request's token-id lists (EOS ids, `stop_token_ids`, `allowed_token_ids`, `logit_bias`, the
tokenized `bad_words`) do not change while it runs, but the scheduler and the sampler used to
walk them every step: `token in list` for stop tokens, a fresh list of EOS plus stop ids below
`min_tokens`, Python lists turned into tensors for the allowed-token mask and the logit bias,
and every bad word compared with the output's tail. With lists of thousands of entries, every
request in the batch paid for that each step. `SamplingPlan.prepare` deduplicates them once, as
frozensets for membership, tensors for the logit processors, and the bad words as a table
keyed by the tokens before the last, so a step looks up one tuple per distinct word length
instead of comparing every word.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from triollm.engine.sampling_params import SamplingParams

__all__ = ["BadWords", "SamplingPlan"]


@dataclass(frozen=True, slots=True)
class BadWords:
    """Bad words by what precedes their last token: a word's last token is banned when the
    output ends with the rest of the word."""

    always: tuple[int, ...]  # one-token words: banned at every step
    # Length of the prefix -> the prefix (token ids) -> the last tokens of the words with it.
    by_prefix: Mapping[int, Mapping[tuple[int, ...], tuple[int, ...]]]

    @classmethod
    def prepare(cls, words: Sequence[Sequence[int]]) -> BadWords | None:
        unique = dict.fromkeys(tuple(w) for w in words if w)
        if not unique:
            return None
        always = tuple(dict.fromkeys(w[0] for w in unique if len(w) == 1))
        by_prefix: dict[int, dict[tuple[int, ...], tuple[int, ...]]] = {}
        for w in unique:
            if len(w) > 1:
                table = by_prefix.setdefault(len(w) - 1, {})
                table[w[:-1]] = (*table.get(w[:-1], ()), w[-1])
        return cls(always, by_prefix)

    def bans(self, output: Sequence[int]) -> list[int]:
        """The tokens banned after `output`."""
        banned = list(self.always)
        n = len(output)
        for length, table in self.by_prefix.items():
            if length <= n:
                banned += table.get(tuple(output[n - length :]), ())
        return banned


@dataclass(frozen=True, slots=True)
class SamplingPlan:
    """One request's token-id sets and tensors, deduplicated (CPU tensors, dtype long/float)."""

    eos_token_ids: frozenset[int]
    stop_token_ids: frozenset[int]
    min_tokens_bans: tuple[int, ...]  # EOS and stop token ids, banned below min_tokens
    allowed_token_ids: torch.Tensor | None
    logit_bias_ids: torch.Tensor | None
    logit_bias_values: torch.Tensor | None
    bad_words: BadWords | None

    @classmethod
    def prepare(
        cls,
        params: SamplingParams,
        eos_token_ids: Sequence[int] = (),
        bad_words_token_ids: Sequence[Sequence[int]] = (),
    ) -> SamplingPlan:
        eos = tuple(dict.fromkeys(eos_token_ids))
        stop = tuple(dict.fromkeys(params.stop_token_ids or ()))
        allowed = None
        if params.allowed_token_ids is not None:
            ids = list(dict.fromkeys(params.allowed_token_ids))
            allowed = torch.tensor(ids, dtype=torch.long)
        bias_ids = bias_values = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long)
            bias_values = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32)
        return cls(
            eos_token_ids=frozenset(eos),
            stop_token_ids=frozenset(stop),
            min_tokens_bans=tuple(dict.fromkeys(eos + stop)),
            allowed_token_ids=allowed,
            logit_bias_ids=bias_ids,
            logit_bias_values=bias_values,
            bad_words=BadWords.prepare(bad_words_token_ids),
        )
