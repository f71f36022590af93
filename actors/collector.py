"""The per-request output collector: the mailbox between the output actor and one consumer.

The output actor must never wait for a slow consumer, so `put` never blocks: with DELTA outputs
it merges the new piece into the one still waiting (so a slow consumer gets several tokens at
once); with CUMULATIVE or FINAL_ONLY the newer completions replace the older ones with the same
index (with n>1 an output carries only the completions that advanced).
Errors (`EngineDeadError`, a per-request failure) travel the same path, so a consumer learns of
the engine's death from `get()`, not by being cancelled.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from triollm.engine.outputs import CompletionOutput, RequestOutput
from triollm.engine.sampling_params import RequestOutputKind

__all__ = ["RequestCollector"]


class RequestCollector:
    def __init__(self, kind: RequestOutputKind) -> None:
        self._delta = kind == RequestOutputKind.DELTA
        self._output: RequestOutput | None = None
        self._error: BaseException | None = None
        self._ready = anyio.Event()
        self.finished = False  # a finished output or an error was delivered to the consumer
        # Called on every put: lets one task wait for any of many collectors (LLMEngine.step).
        self.on_ready: Callable[[], None] | None = None

    def put(self, output: RequestOutput) -> None:
        if self._output is None:
            self._output = output
        elif self._delta:
            _merge(self._output, output)
        else:
            _replace(self._output, output)
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def put_error(self, error: BaseException) -> None:
        if self._error is None:
            self._error = error
        self._ready.set()
        if self.on_ready is not None:
            self.on_ready()

    def get_nowait(self) -> RequestOutput | None:
        """The waiting output, or None. Raises the pending error once outputs are drained."""
        output = self._output
        if output is not None:
            self._output = None
            self._ready = anyio.Event()
            self.finished = output.finished
            return output
        if self._error is not None:
            self.finished = True
            raise self._error
        return None

    async def get(self) -> RequestOutput:
        while True:
            output = self.get_nowait()
            if output is not None:
                return output
            await self._ready.wait()


def _merge(into: RequestOutput, new: RequestOutput) -> None:
    by_index = {c.index: c for c in into.outputs}
    for c in new.outputs:
        old = by_index.get(c.index)
        if old is None:
            into.outputs.append(c)
            by_index[c.index] = c
        else:
            _merge_completion(old, c)
    if new.prompt_logprobs:
        into.prompt_logprobs = (into.prompt_logprobs or []) + new.prompt_logprobs
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.metrics = new.metrics


def _replace(into: RequestOutput, new: RequestOutput) -> None:
    """A newer cumulative output: its completions replace the older ones with the same index
    (with n>1 an output may carry only the completions that advanced)."""
    by_index = {c.index: i for i, c in enumerate(into.outputs)}
    for c in new.outputs:
        if c.index in by_index:
            into.outputs[by_index[c.index]] = c
        else:
            into.outputs.append(c)
    into.outputs.sort(key=lambda c: c.index)
    into.prompt_logprobs = new.prompt_logprobs or into.prompt_logprobs
    into.finished = new.finished
    into.num_cached_tokens = new.num_cached_tokens
    into.metrics = new.metrics


def _merge_completion(old: CompletionOutput, new: CompletionOutput) -> None:
    old.text += new.text
    old.token_ids = old.token_ids + new.token_ids
    if new.logprobs is not None:
        old.logprobs = (old.logprobs or []) + new.logprobs
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason
