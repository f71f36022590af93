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

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from triollm.engine.outputs import CompletionOutput, Logprob, RequestOutput
from triollm.engine.sampling_params import BeamSearchParams, RequestOutputKind, SamplingParams

if TYPE_CHECKING:
    from triollm.engine.inputs import PromptType
    from triollm.engine.processing.tokenizer import Tokenizer

# `BeamSearchParams` is defined with the other request parameters (engine/sampling_params.py)
# and re-exported here, where the search that reads it lives.
__all__ = [
    "BeamSearch",
    "BeamSearchOutput",
    "BeamSearchParams",
    "BeamSearchSequence",
    "beam_search_score",
    "prompt_token_ids",
]


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


class BeamSearch:
    """The search over several prompts, independent of how the engine is driven: `LLM` runs each
    round as one `generate` batch, `AsyncLLM.beam_search` as concurrent requests.

    A round: `live(group)` finishes the beams at the context length (once) and returns the
    others, each to be fed to the engine as a token prompt with `step_params`; `advance` takes
    their outputs (in the same order) and keeps each prompt's `beam_width` best extensions.
    After `params.max_tokens` rounds, `results` ranks finished and live beams together."""

    def __init__(
        self, prompts: Sequence[list[int]], params: BeamSearchParams, eos_token_id: int | None, max_model_len: int
    ) -> None:
        self.params = params
        self.eos = None if params.ignore_eos else eos_token_id
        self.max_model_len = max_model_len
        self.prompt_lens = [len(ids) for ids in prompts]
        self.beams: list[list[BeamSearchSequence]] = [[BeamSearchSequence(tokens=list(ids))] for ids in prompts]
        self.finished: list[list[BeamSearchSequence]] = [[] for _ in prompts]
        self.aborted = False  # a round's request was aborted: the search ends, its beams "abort"

    def score(self, beam: BeamSearchSequence) -> float:
        return beam_search_score(beam.tokens, beam.cum_logprob, self.eos, self.params.length_penalty)

    def step_params(self) -> SamplingParams:
        """The params of one round's requests: one token, and its candidates as logprobs."""
        p = self.params
        return SamplingParams(
            logprobs=2 * p.beam_width,
            max_tokens=1,
            temperature=p.temperature,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )

    def live(self, group: Sequence[int]) -> list[tuple[int, BeamSearchSequence]]:
        """The beams of the prompts in `group` to extend this round (those at the context
        length are finished now, once)."""
        for i in group:
            full = [b for b in self.beams[i] if len(b.tokens) >= self.max_model_len]
            for beam in full:
                beam.finish_reason = "length"
            self.finished[i] += full
            self.beams[i] = [b for b in self.beams[i] if len(b.tokens) < self.max_model_len]
        return [(i, b) for i in group for b in self.beams[i]]

    def advance(
        self, group: Sequence[int], beams: list[tuple[int, BeamSearchSequence]], outputs: Sequence[RequestOutput]
    ) -> None:
        grown: dict[int, list[BeamSearchSequence]] = {i: [] for i in group}
        for (i, beam), out in zip(beams, outputs, strict=True):
            if out.outputs[0].finish_reason == "abort":
                self.aborted = True
                return
            candidates = (out.outputs[0].logprobs or [{}])[0]
            for token, lp in candidates.items():
                child = BeamSearchSequence(
                    tokens=beam.tokens + [token],
                    logprobs=beam.logprobs + [candidates],
                    cum_logprob=beam.cum_logprob + lp.logprob,
                )
                if token == self.eos:
                    child.finish_reason, child.stop_reason = "stop", None
                    self.finished[i].append(child)
                else:
                    grown[i].append(child)
        for i in group:
            self.beams[i] = sorted(grown[i], key=self.score, reverse=True)[: self.params.beam_width]

    def results(self, decode: Callable[[list[int]], str], *, whole_sequence: bool = False) -> list[BeamSearchOutput]:
        """Each prompt's `beam_width` best sequences, best first, with their text: the generated
        part (without a final stop token unless asked), as vLLM's async `beam_search` gives it,
        or with `whole_sequence` the text of every token, the prompt's included, as vLLM's
        offline `LLM.beam_search` gives it."""
        results = []
        for i, n in enumerate(self.prompt_lens):
            for beam in self.beams[i]:
                beam.finish_reason = beam.finish_reason or ("abort" if self.aborted else "length")
            best = sorted(self.finished[i] + self.beams[i], key=self.score, reverse=True)[: self.params.beam_width]
            for beam in best:
                beam.text = decode(beam.tokens if whole_sequence else self.generated(beam, n))
            results.append(BeamSearchOutput(best))
        return results

    def generated(self, beam: BeamSearchSequence, prompt_len: int) -> list[int]:
        tokens = beam.tokens[prompt_len:]
        if beam.finish_reason == "stop" and not self.params.include_stop_str_in_output:
            tokens = tokens[:-1]
        return tokens

    def request_output(
        self, request_id: str, prompt: str | None, index: int, result: BeamSearchOutput
    ) -> RequestOutput:
        """One prompt's result as vLLM's `EngineClient.beam_search` yields it: a finished
        RequestOutput with one CompletionOutput per beam, best first."""
        n = self.prompt_lens[index]
        outputs = [
            CompletionOutput(
                index=k,
                text=beam.text or "",
                token_ids=self.generated(beam, n),
                cumulative_logprob=beam.cum_logprob,
                logprobs=beam.logprobs,
                finish_reason=beam.finish_reason or "length",
                stop_reason=beam.stop_reason,
            )
            for k, beam in enumerate(result.sequences)
        ]
        prompt_ids = result.sequences[0].tokens[:n] if result.sequences else []
        return RequestOutput(request_id, prompt, prompt_ids, None, outputs, finished=True)


def prompt_token_ids(prompt: PromptType, tokenizer: Tokenizer) -> list[int]:
    """A beam search prompt as token ids: a string or a `TextPrompt` tokenized as `generate`
    does, a `TokensPrompt` as given."""
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, dict) and "prompt_token_ids" in prompt:
        return list(prompt["prompt_token_ids"])
    if isinstance(prompt, dict) and "prompt" in prompt:
        return tokenizer.encode(prompt["prompt"])
    raise ValueError(
        f"prompts: a beam search prompt is a string, a TextPrompt or a TokensPrompt, got {type(prompt).__name__}"
    )
