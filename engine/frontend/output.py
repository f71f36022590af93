"""The frontend's output half: core outputs of one request in, `RequestOutput`s out.

`OutputState` is what the request table keeps per user request for its outputs: one
`SequenceState` per child (core request) with its incremental detokenizer, stop strings,
logprobs and the output kind (CUMULATIVE, DELTA or FINAL_ONLY), and the prompt logprobs. One
`RequestOutput` per user request per step carries the children that advanced in that step
(FINAL_ONLY: one output with every child, once all finished). Per token the work is O(1) apart
from CUMULATIVE's inherent copy of everything so far; text is joined lazily.

No registry lives here: the table (frontend.py) finds the state by core id and drops it.

Differences from vLLM, on purpose:
* A core output finished with `FinishReason.ERROR` becomes finish_reason "abort" with the
  error text as stop_reason (RequestOutput has no error field; nothing is raised here).
* DELTA outputs carry prompt_logprobs only when new rows arrived (None otherwise).
* `spaces_between_special_tokens` has no effect: the `tokenizers` decoder decides spacing.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from triollm.engine.outputs import (
    CompletionOutput,
    Logprob,
    PromptLogprobs,
    RequestOutput,
    RequestStateStats,
    SampleLogprobs,
)
from triollm.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput, unpack_pooled
from triollm.engine.pooling_params import TOKEN_TASKS
from triollm.engine.processing.detokenizer import IncrementalDetokenizer, StopChecker
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreOutput, FinishReason, Logprobs
from triollm.engine.sampling_params import RequestOutputKind

if TYPE_CHECKING:
    from triollm.engine.frontend.input import ProcessedRequest

__all__ = ["LogprobConverter", "OutputState", "SequenceState"]


class LogprobConverter:
    """Core logprob rows to vLLM's `{token id: Logprob}` dicts, with each token's text cached
    (shared by every request of one frontend)."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._token_text: dict[int, str] = {}

    def convert(self, rows: Logprobs) -> list[dict[int, Logprob]]:
        """Core logprob rows → one {token id: Logprob} per position (chosen token first)."""
        converted: list[dict[int, Logprob]] = []
        for ids, values, rank in zip(rows.token_ids, rows.logprobs, rows.ranks, strict=True):
            ranks = [rank, *range(1, len(ids))]
            # A chosen token that is also in the top-k keeps the top-k entry, as in vLLM.
            converted.append(
                {
                    t: Logprob(float(v), r, self._decoded(t))
                    for t, v, r in zip(ids, values, ranks, strict=True)
                }
            )
        return converted

    def _decoded(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            self._token_text[token_id] = text
        return text


class SequenceState:
    """One sampled sequence (one core request) of a user request."""

    def __init__(
        self, parent: OutputState, index: int, core_id: str, prompt_ids: list[int], eos_ids: Sequence[int]
    ) -> None:
        params = parent.params
        self.parent = parent
        self.index = index
        self.core_id = core_id
        self.delta = params.output_kind == RequestOutputKind.DELTA
        self.min_tokens = params.min_tokens
        self.include_stop = params.include_stop_str_in_output
        # The tokens whose text a "stop" finish leaves out: EOS and stop_token_ids. (A grammar
        # that completes also finishes with "stop", on a token that is part of the output.)
        eos = () if params.ignore_eos else eos_ids
        self.stop_ids = frozenset((*eos, *(params.stop_token_ids or ())))
        self.detok: IncrementalDetokenizer | None = None
        self.stops: StopChecker | None = None
        if params.detokenize:
            self.detok = IncrementalDetokenizer(
                parent.tokenizer, prompt_ids, params.skip_special_tokens
            )
            stop = [params.stop] if isinstance(params.stop, str) else params.stop or []
            if stop:
                self.stops = StopChecker(stop, params.include_stop_str_in_output)
        self.token_ids: list[int] = []
        # CUMULATIVE/FINAL_ONLY: all the text; DELTA: the text not output yet.
        self.text_parts: list[str] = []
        self.sent_tokens = 0
        self.logprobs: SampleLogprobs | None = [] if params.logprobs is not None else None
        self.cumulative_logprob: float | None = 0.0 if params.logprobs is not None else None
        self.sent_logprobs = 0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        self.num_cached_tokens = 0
        # No output yet: its prompt waits for the scheduler (the frontend's queue count).
        self.queued = False

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def update(self, out: EngineCoreOutput) -> bool:
        """Apply one core output; True when a stop string (not the core) finished the sequence.

        An output of several tokens (speculative decoding) meets the stop strings one token at
        a time, as it would have one step at a time: a stop string that ends at its second token
        leaves the tokens after it (and their logprobs) out, so the text, token ids and logprobs
        are those of plain decoding."""
        if self.stops is not None and len(out.new_token_ids) > 1:
            return any(self._update(part) for part in _one_token_each(out))
        return self._update(out)

    def _update(self, out: EngineCoreOutput) -> bool:
        new_ids = out.new_token_ids
        self.token_ids.extend(new_ids)
        self.num_cached_tokens = max(self.num_cached_tokens, out.num_cached_tokens)
        if out.new_logprobs is not None and self.logprobs is not None:
            self._add_logprobs(out.new_logprobs)
        if self.detok is None:
            self._finish_from_core(out)
            return False
        if (
            out.finish_reason == FinishReason.STOP
            and not self.include_stop
            and new_ids
            and new_ids[-1] in self.stop_ids
        ):
            new_ids = new_ids[:-1]  # the stop token's own text is not output (vLLM)
        piece = self.detok.step(new_ids)
        if out.finished:
            piece += self.detok.flush()
        stopped = self._add_text(piece, out.finished)
        if not stopped:
            self._finish_from_core(out)
        return stopped

    def _add_text(self, piece: str, core_finished: bool) -> bool:
        stop: str | None = None
        if self.stops is not None:
            piece, stop = self.stops.feed(piece, check=len(self.token_ids) > self.min_tokens)
            if stop is None and core_finished:
                piece += self.stops.flush()
        if piece:
            self.text_parts.append(piece)
        if stop is not None:
            self.finish_reason, self.stop_reason = str(FinishReason.STOP), stop
        return stop is not None

    def _finish_from_core(self, out: EngineCoreOutput) -> None:
        reason = out.finish_reason
        if reason is None:
            return
        self.finish_reason = str(FinishReason.ABORT if reason == FinishReason.ERROR else reason)
        self.stop_reason = out.stop_reason

    def abort(self) -> None:
        """Finish locally (user abort), releasing any held-back text."""
        if self.finished:
            return
        if self.detok is not None:
            self._add_text(self.detok.flush(), core_finished=True)
        if not self.finished:
            self.finish_reason, self.stop_reason = str(FinishReason.ABORT), None

    def _add_logprobs(self, rows: Logprobs) -> None:
        assert self.logprobs is not None and self.cumulative_logprob is not None
        converted = self.parent.convert_logprobs(rows)
        self.logprobs.extend(converted)
        self.cumulative_logprob += sum(row[0] for row in rows.logprobs if row)

    def completion(self, delta: bool) -> CompletionOutput:
        if delta:
            text = "".join(self.text_parts)
            self.text_parts.clear()
            token_ids = self.token_ids[self.sent_tokens :]
            logprobs = None if self.logprobs is None else self.logprobs[self.sent_logprobs :]
        else:
            if len(self.text_parts) > 1:
                self.text_parts[:] = ["".join(self.text_parts)]
            text = self.text_parts[0] if self.text_parts else ""
            token_ids = list(self.token_ids)
            logprobs = None if self.logprobs is None else list(self.logprobs)
        self.sent_tokens = len(self.token_ids)
        self.sent_logprobs = 0 if self.logprobs is None else len(self.logprobs)
        return CompletionOutput(
            index=self.index,
            text=text,
            token_ids=token_ids,
            cumulative_logprob=self.cumulative_logprob,
            logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
        )


def _one_token_each(out: EngineCoreOutput) -> Iterator[EngineCoreOutput]:
    """`out` as one output per token: the finish on the last, the logprobs row by row."""
    lps, last = out.new_logprobs, len(out.new_token_ids) - 1
    for i, token in enumerate(out.new_token_ids):
        yield EngineCoreOutput(
            out.request_id,
            [token],
            finish_reason=out.finish_reason if i == last else None,
            stop_reason=out.stop_reason if i == last else None,
            new_logprobs=None
            if lps is None
            else Logprobs(lps.token_ids[i : i + 1], lps.logprobs[i : i + 1], lps.ranks[i : i + 1]),
            num_cached_tokens=out.num_cached_tokens,
        )


class OutputState:
    """A user request's outputs: its children (one `SequenceState` each) and its prompt
    logprobs. One lives in each entry of the frontend's request table."""

    def __init__(self, processed: ProcessedRequest, logprobs: LogprobConverter) -> None:
        self.request_id = processed.request_id
        self.prompt = processed.prompt
        self.prompt_token_ids = processed.prompt_token_ids
        self.params = processed.params
        self.kind = processed.params.output_kind
        self.tokenizer = logprobs.tokenizer
        self.convert_logprobs = logprobs.convert
        self.prompt_logprobs: PromptLogprobs | None = None
        if processed.params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]  # the first prompt token has no logprob
        self.sent_prompt_logprobs = 0
        self.prompt_logprobs_from: str | None = None  # the child whose rows are used
        self.task = None if processed.pooling_params is None else processed.pooling_params.task
        self.children = [
            SequenceState(self, i, req.request_id, processed.prompt_token_ids, req.eos_token_ids)
            for i, req in enumerate(processed.core_requests)
        ]
        self.num_unfinished = len(self.children)
        self.metrics = RequestStateStats(arrival_time=processed.arrival_time)

    @property
    def finished(self) -> bool:
        return self.num_unfinished == 0

    def record_times(self, out: EngineCoreOutput, timestamp: float) -> None:
        """Fold one core output's stamps into `metrics` (`timestamp`: when the core made it).
        With n > 1 the earliest child's queue stamps count, as the request's."""
        m = self.metrics
        m.num_preemptions += out.num_preemptions
        if out.scheduled_ts:
            m.queued_ts = min(m.queued_ts or out.queued_ts, out.queued_ts)
            m.scheduled_ts = min(m.scheduled_ts or out.scheduled_ts, out.scheduled_ts)
        if out.new_token_ids:
            if not m.first_token_ts:
                m.first_token_ts = timestamp
                m.first_token_latency = time.time() - m.arrival_time
            m.last_token_ts = timestamp
            m.num_generation_tokens += len(out.new_token_ids)

    def add_prompt_logprobs(self, child: SequenceState, rows: Logprobs) -> None:
        # Every child has the same prompt: take the rows of the first child that sends any.
        if self.prompt_logprobs is None or self.prompt_logprobs_from not in (None, child.core_id):
            return
        self.prompt_logprobs_from = child.core_id
        self.prompt_logprobs.extend(self.convert_logprobs(rows))

    def make_output(self, advanced: Iterable[SequenceState]) -> RequestOutput | None:
        if self.kind == RequestOutputKind.FINAL_ONLY:
            if not self.finished:
                return None
            advanced = self.children
        delta = self.kind == RequestOutputKind.DELTA
        children = sorted(set(advanced), key=lambda c: c.index)
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self._prompt_logprobs_out(delta),
            outputs=[c.completion(delta) for c in children],
            finished=self.finished,
            num_cached_tokens=children[0].num_cached_tokens if children else None,
            metrics=self.metrics,
        )

    def _prompt_logprobs_out(self, delta: bool) -> PromptLogprobs | None:
        if self.prompt_logprobs is None:
            return None
        start = self.sent_prompt_logprobs if delta else 0
        self.sent_prompt_logprobs = len(self.prompt_logprobs)
        rows = self.prompt_logprobs[start:]
        return rows if rows or not delta else None

    def apply(self, child: SequenceState, out: EngineCoreOutput, timestamp: float) -> bool:
        """Apply one core output (made by the core at `timestamp`, monotonic) to `child`; True
        when a stop string finished it while the core still runs it (the core must then abort
        it)."""
        was_finished = child.finished
        self.record_times(out, timestamp)
        if out.new_prompt_logprobs is not None:
            self.add_prompt_logprobs(child, out.new_prompt_logprobs)
        stopped = child.update(out)
        if child.finished and not was_finished:
            self.num_unfinished -= 1
        return stopped and not out.finished

    def unfinished(self) -> list[SequenceState]:
        return [c for c in self.children if not c.finished]

    def abort(self) -> RequestOutput | None:
        """Finish every unfinished child locally with finish_reason "abort"; the output that
        says so (None if nothing was unfinished, or FINAL_ONLY had nothing left to say)."""
        aborted = self.unfinished()
        for child in aborted:
            child.abort()
            self.num_unfinished -= 1
        return self.make_output(aborted) if aborted else None

    def pooled_output(self, pooled: bytes) -> PoolingRequestOutput[PoolingOutput]:
        """A pooling request's one output: its embedding (`[H]`), its classes (`[num_labels]`),
        its score, or for the token tasks one row per prompt token (`[num_prompt_tokens, -1]`).
        Finishes the request."""
        for child in self.children:
            if not child.finished:
                child.finish_reason = str(FinishReason.STOP)
                self.num_unfinished -= 1
        rows = len(self.prompt_token_ids) if self.task in TOKEN_TASKS else None
        return PoolingRequestOutput(
            self.request_id, PoolingOutput(unpack_pooled(pooled, rows)), self.prompt_token_ids, True
        )
