"""`RequestStream`: the handle of one request, between the output actor and one consumer.

`await llm.add_request(request_id, prompt, params)` returns it (vLLM returns its
`RequestOutputCollector` from the same call); `AsyncLLM.generate()`, the sync `LLM`, the legacy
`LLMEngine` and the server are all thin consumers of it.

```
output actor ──put / put_error (never blocks)──▶ RequestStream ──get / get_nowait / async for──▶ consumer
                                                     │
                                       close() ──────┴──▶ AsyncLLM: abort unless finished, free the id
```

Producer side: the output actor must never wait for a slow consumer, so `put` never blocks and
never queues: with DELTA outputs it merges the new piece into the one still waiting (a slow
consumer gets several tokens at once, so an SSE event carries several under load); with
CUMULATIVE or FINAL_ONLY the newer completions replace the older ones with the same index (with
n>1 an output carries only the completions that advanced). Errors (`EngineDeadError`, a
per-request failure) travel the same path: a consumer learns of the engine's death from
`get()`, not by being cancelled.

Consumer side: `get()` / `get_nowait()` (trio's `op` / `op_nowait` pair) and `async for`, which
ends after the finished output. Reading the end (the finished output, or the error) releases
the request id at once. Leaving early - `close()` (sync, for `finally` blocks), `aclose()`,
`with` / `async with`, or an exception (cancellation included) escaping `async for` - aborts the
request exactly once, unless it had already finished. A `get()` that is cancelled does not close
the handle: a timeout around one read is not the end of the consumer.

Rejected: an `on_ready` callback for "wait for any of many handles" (LLMEngine.step). A hook on
the handle lets the output actor run foreign code on every put; a consumer that needs fan-in
runs one task per handle into a memory object stream instead (sse.py, llm_engine.py).
"""

from __future__ import annotations

from collections.abc import Callable
from types import TracebackType

import anyio
import anyio.lowlevel

from triollm.engine.outputs import CompletionOutput, RequestOutput
from triollm.engine.sampling_params import RequestOutputKind

__all__ = ["OutputMerger", "RequestStream", "merge_output"]


class RequestStream:
    """The outputs of one request, in order; see the module docstring for the contract."""

    def __init__(
        self,
        request_id: str,
        output_kind: RequestOutputKind,
        on_close: Callable[[RequestStream], None],
    ) -> None:
        """`on_close(stream)` runs once, synchronously, when the consumer is done with the handle
        (closed early, or read the end); the owner aborts the request there unless it finished."""
        self.request_id = request_id
        self.output_kind = output_kind
        self._on_close: Callable[[RequestStream], None] | None = on_close
        self._pending = OutputMerger(output_kind)  # outputs not yet read, merged
        self._error: BaseException | None = None
        self._ready = anyio.Event()
        self._finished = False  # the final output or an error was put
        self._ended = anyio.Event()  # set with _finished
        self._exhausted = False  # the consumer read the final output or the error

    def __repr__(self) -> str:
        state = "exhausted" if self._exhausted else "closed" if self.closed else "open"
        return f"<RequestStream {self.request_id!r} {self.output_kind.name} {state}>"

    # ------------------------------------------------------------------ state

    @property
    def finished(self) -> bool:
        """The request has ended: its finished output or its error has arrived (read or not)."""
        return self._finished

    async def wait_finished(self) -> None:
        """Wait until the request has ended (without reading its outputs)."""
        await self._ended.wait()

    @property
    def closed(self) -> bool:
        """The consumer is done with the handle (closed it, or read the end)."""
        return self._on_close is None

    # ------------------------------------------------------------------ producer side

    def put(self, output: RequestOutput) -> None:
        """Deliver an output (the output actor's side). Never blocks: merges into a waiting one.
        Ignored once the request has ended (the first end, output or error, wins)."""
        if self._finished:
            return
        self._pending.add(output)
        self._finished = output.finished
        if self._finished:
            self._ended.set()
        self._ready.set()

    def put_error(self, error: BaseException) -> None:
        """Deliver a failure; the consumer gets it after the outputs that came before it.
        Ignored once the request has ended: a finished request is not failed afterwards."""
        if self._finished:
            return
        self._error = error
        self._finished = True
        self._ended.set()
        self._ready.set()

    # ------------------------------------------------------------------ consumer side

    def get_nowait(self) -> RequestOutput | None:
        """The waiting output (several merged, for DELTA), or None if nothing is waiting.

        Raises the request's error once the outputs before it were read; `anyio.EndOfStream`
        after the end was read; `anyio.ClosedResourceError` after an early `close()`.
        """
        if self._exhausted:
            raise anyio.EndOfStream
        if self.closed:
            raise anyio.ClosedResourceError
        output = self._pending.take()
        if output is not None:
            self._ready = anyio.Event()
            if output.finished:
                self._end()
            return output
        error = self._error
        if error is not None:
            self._end()
            raise error
        return None

    async def get(self) -> RequestOutput:
        """Wait for the next output. Cancelling the wait leaves the handle open."""
        await anyio.lowlevel.checkpoint_if_cancelled()
        while True:
            output = self.get_nowait()
            if output is not None:
                return output
            await self._ready.wait()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._exhausted:
            raise StopAsyncIteration
        try:
            return await self.get()
        except BaseException:
            # The error ends the stream, or the consuming loop is being left (cancelled).
            self.close()
            raise

    def _end(self) -> None:
        self._exhausted = True
        self.close()

    # ------------------------------------------------------------------ closing

    def close(self) -> None:
        """Done with the handle: abort the request unless it finished. Idempotent, synchronous
        (safe in a `finally` of a cancelled task)."""
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            self._pending.take()
            self._ready.set()  # a task waiting in get() wakes up to ClosedResourceError
            on_close(self)

    async def aclose(self) -> None:
        self.close()
        await anyio.lowlevel.checkpoint()

    def __enter__(self) -> RequestStream:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> RequestStream:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()  # no checkpoint: leaving the block under cancellation must not raise again


# ---------------------------------------------------------------------------------- merging


class OutputMerger:
    """The outputs of one request folded into one as they arrive, for a consumer that reads
    later (`add` many, then `take`). DELTA: each completion's new text, tokens and logprobs are
    appended (the lists of a DELTA output are fresh slices, so extending them is safe).
    CUMULATIVE / FINAL_ONLY: the newer completions replace the ones with the same index.

    Linear in what arrives, however long the consumer stays away: lists are extended in place
    and DELTA text pieces are kept in a list and joined once, in `take()`. Rejected: `text +=`
    at each merge, which copies the whole text every time (quadratic for a client that stops
    reading, and for a long non-streamed DELTA response).
    """

    def __init__(self, kind: RequestOutputKind) -> None:
        self.kind = kind
        self._output: RequestOutput | None = None
        self._texts: dict[int, list[str]] = {}  # completion index -> its text pieces, in order
        self._own_prompt_logprobs = False  # into.prompt_logprobs is our copy, safe to extend

    def add(self, new: RequestOutput) -> None:
        into = self._output
        if into is None:
            self._output = new
            return
        if self.kind == RequestOutputKind.DELTA:
            self._merge_delta(into, new)
        else:
            _replace(into, new)
        into.finished = new.finished
        into.num_cached_tokens = new.num_cached_tokens
        into.metrics = new.metrics

    def take(self) -> RequestOutput | None:
        """The merged output (None if nothing arrived since the last take); starts afresh."""
        output, self._output = self._output, None
        if output is not None and self._texts:
            for c in output.outputs:
                pieces = self._texts.get(c.index)
                if pieces is not None:
                    c.text = "".join(pieces)
        self._texts.clear()
        self._own_prompt_logprobs = False
        return output

    def _merge_delta(self, into: RequestOutput, new: RequestOutput) -> None:
        by_index = {c.index: c for c in into.outputs}
        for c in new.outputs:
            old = by_index.get(c.index)
            if old is None:
                into.outputs.append(c)
                by_index[c.index] = c
                continue
            pieces = self._texts.get(c.index)
            if pieces is None:
                self._texts[c.index] = [old.text, c.text]
            else:
                pieces.append(c.text)
            _merge_completion(old, c)
        if new.prompt_logprobs:
            if not self._own_prompt_logprobs:
                into.prompt_logprobs = list(into.prompt_logprobs or ())
                self._own_prompt_logprobs = True
            assert into.prompt_logprobs is not None
            into.prompt_logprobs.extend(new.prompt_logprobs)


def merge_output(into: RequestOutput, new: RequestOutput, kind: RequestOutputKind) -> None:
    """Fold the newer output `new` of one request into `into` (which the caller owns), by
    `OutputMerger`'s rule. For many merges into one output, keep an `OutputMerger` instead: it
    joins the text once. The one place this rule lives: the stream merges while a consumer is
    slow; the server merges a non-streamed DELTA request into its response.
    """
    merger = OutputMerger(kind)
    merger.add(into)
    merger.add(new)
    merger.take()


def _merge_completion(old: CompletionOutput, new: CompletionOutput) -> None:
    """Tokens, logprobs and the latest state; the text is the merger's (joined on take)."""
    old.token_ids.extend(new.token_ids)
    if new.logprobs is not None:
        if old.logprobs is None:
            old.logprobs = list(new.logprobs)
        else:
            old.logprobs.extend(new.logprobs)
    old.cumulative_logprob = new.cumulative_logprob
    old.finish_reason = new.finish_reason
    old.stop_reason = new.stop_reason


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
