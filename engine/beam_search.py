"""Beam search, as vLLM's `LLM.beam_search` does it: on top of the engine, one token per round.

Each round feeds every live beam (its prompt plus the tokens chosen so far) to the engine as a
token prompt with `max_tokens=1` and `logprobs=2 * beam_width`, extends each beam by each of its
top tokens, moves extensions that end in EOS to the finished list (unless `ignore_eos`), and keeps
the `beam_width` best of the rest. Beams of one prompt share their prefix, so after the first
round each request's prompt is served from the prefix cache and only the last block is computed.

Scores are vLLM's: the cumulative logprob divided by the sequence length (prompt included, a
final EOS not counted) to the power `length_penalty`. transformers divides by the generated length
instead; with beams of equal length (no EOS, or `ignore_eos`) the two rank alike, and the tests
compare against transformers in that setting.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from triollm.engine.outputs import Logprob

__all__ = ["BeamSearchOutput", "BeamSearchParams", "BeamSearchSequence", "beam_search_score"]


class BeamSearchParams(msgspec.Struct, kw_only=True):
    """vLLM's beam search parameters."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False

    def __post_init__(self) -> None:
        for name in ("beam_width", "max_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: must be a positive integer, got {value!r}")
        if not self.temperature >= 0:
            raise ValueError(f"temperature: must be >= 0, got {self.temperature!r}")


@dataclass
class BeamSearchSequence:
    """One beam: `tokens` holds the prompt's tokens and the generated ones, `logprobs` one dict
    per generated position (the candidates that round offered), `text` the generated text."""

    tokens: list[int]
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class BeamSearchOutput:
    """The best `beam_width` sequences of one prompt, best first."""

    sequences: list[BeamSearchSequence]


def beam_search_score(tokens: list[int], cum_logprob: float, eos_token_id: int | None, length_penalty: float) -> float:
    length = len(tokens)
    if eos_token_id is not None and tokens and tokens[-1] == eos_token_id:
        length -= 1
    return cum_logprob / (length**length_penalty)
