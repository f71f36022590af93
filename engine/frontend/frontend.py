"""`Frontend`: every request's state in one table, and no I/O.

The engine core is a state machine that an actor shell feeds (engine/core.py, actors/core_loop.py);
this is the same split for the other end. `Frontend` owns the state of every request between
the caller and the core: its stream, its phase, its children (one core request each for
`n > 1`), its detokenizer and stop strings (output.py), and what it adds to the queue count.
`AsyncLLM` (actors/async_llm.py) and `SyncEngine` (engine/sync_engine.py) are shells that drive it:
they do the waiting and the sending, it decides what to send and what to deliver.

```
open(id, stream) ──▶ ADDING ──add()──▶ RUNNING ──on_outputs() ... finished──▶ FINISHED ──release()──▶ gone
                       │      (paused) └──▶ HELD ──resume()──▶ RUNNING           ▲
                       └── abort() while adding: add() finishes it at once ─────┘
```

- A request enters with `open` (its id reserved before any await of the shell) and leaves with
  `release` (its consumer is done with the stream), so an id stays taken until the consumer has
  read the end. `process` (tokenize, check) touches no table state: the shell may run it in a
  worker thread. `add` registers the children and returns the core requests to send (none while
  paused: they are held, and `resume` returns them).
- Core request ids are made once, by `input.core_request_ids`, with a tag the table takes from
  a counter at `open` and never reuses.
- `abort`, `release`, `on_outputs` and `on_request_error` return the core ids the core must
  abort (a stop string ends a sequence the core still runs); outputs and errors are put into
  the streams here, synchronously: a stream's `put` never blocks.
- The queue count (backpressure): a child's prompt tokens count as queued from `add` until its
  first output (or its end); `busy` turns that and the unfinished sequences into a refusal.

The table is `_requests` (user id -> `RequestState`); `_by_core` indexes its unfinished
children by core id and is changed only next to the table. `check_integrity` checks that the
two agree and that the counts are the sums they stand for.
"""

from __future__ import annotations

import enum
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, cast

from triollm.engine.frontend.input import InputProcessor, ProcessedRequest
from triollm.engine.frontend.output import LogprobConverter, OutputState, SequenceState
from triollm.engine.inputs import PromptType
from triollm.engine.outputs import RequestOutput
from triollm.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput
from triollm.engine.pooling_params import PoolingParams
from triollm.engine.request import EngineCoreOutput, EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from triollm.engine.config import LimitsConfig
    from triollm.lora.request import LoRARequest

__all__ = [
    "Frontend",
    "TableStatistics",
    "OutputSink",
    "Phase",
    "ProcessedOutputs",
    "RequestState",
]


class OutputSink(Protocol):
    """Where the frontend delivers one request's outputs (`actors.RequestStream` is one).
    Neither call may block or raise; both are ignored once the request has ended."""

    def put(self, output: RequestOutput) -> None: ...

    def put_error(self, error: BaseException) -> None: ...


class Phase(enum.Enum):
    ADDING = "adding"  # id reserved; being processed, or waiting for room
    HELD = "held"  # added while paused: its core requests wait for resume
    RUNNING = "running"  # sent to the core
    FINISHED = "finished"  # ended (outputs, abort or error); the consumer has not let go yet


@dataclass(eq=False)
class RequestState:
    """One row of the table."""

    request_id: str
    sink: OutputSink
    tag: str  # goes into the core ids: never reused
    phase: Phase = Phase.ADDING
    abort_requested: bool = False  # an abort arrived while ADDING: add() ends it at once
    output: OutputState | None = None  # set by add()
    prompt_len: int = 0
    pending: list[EngineCoreRequest] = field(default_factory=list)  # HELD: to send at resume


@dataclass(frozen=True)
class TableStatistics:
    num_requests: int  # user requests in the table (until their consumer lets go)
    num_sequences: int  # unfinished core requests (an n > 1 request counts n), held included
    num_held: int  # requests added while paused, not sent yet
    queued_prompt_tokens: int  # prompt tokens of sequences that have produced no output yet
    paused: bool
    num_prompt_tokens: int  # in all, since start
    num_generation_tokens: int  # in all, since start


@dataclass
class ProcessedOutputs:
    request_outputs: list[RequestOutput] = field(default_factory=list)
    # Core request ids a stop string finished: the core still runs them and must abort them.
    reqs_to_abort: list[str] = field(default_factory=list)


class Frontend:
    def __init__(
        self,
        input: InputProcessor,
        *,
        limits: LimitsConfig | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        """`limits` and `max_num_seqs`: the queue limits `busy` applies (None: never busy)."""
        self.input = input
        self.limits = limits
        self.max_num_seqs = max_num_seqs
        self._logprobs = LogprobConverter(input.tokenizer)
        self._requests: dict[str, RequestState] = {}
        self._by_core: dict[str, SequenceState] = {}
        self._tags = itertools.count()
        self._next_tag = 0
        self._paused = False
        self._queued_tokens = 0
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0

    # ------------------------------------------------------------------ state

    @property
    def paused(self) -> bool:
        return self._paused

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def num_sequences(self) -> int:
        return len(self._by_core)

    @property
    def has_pending_work(self) -> bool:
        """Sequences the core should be stepping (none count while paused)."""
        return not self._paused and bool(self._by_core)

    def request_ids(self) -> list[str]:
        return list(self._requests)

    def get(self, request_id: str) -> RequestState | None:
        return self._requests.get(request_id)

    def unfinished_core_ids(self, request_id: str) -> list[str]:
        state = self._requests.get(request_id)
        if state is None or state.output is None:
            return []
        return [c.core_id for c in state.output.unfinished()]

    def statistics(self) -> TableStatistics:
        return TableStatistics(
            num_requests=len(self._requests),
            num_sequences=len(self._by_core),
            num_held=sum(s.phase is Phase.HELD for s in self._requests.values()),
            queued_prompt_tokens=self._queued_tokens,
            paused=self._paused,
            num_prompt_tokens=self._num_prompt_tokens,
            num_generation_tokens=self._num_generation_tokens,
        )

    # ------------------------------------------------------------------ adding

    def open(self, request_id: str, sink: OutputSink) -> RequestState:
        """Reserve `request_id` for a new request (phase ADDING). Raises `ValueError` if an
        unfinished request (or one whose consumer has not let go) uses it."""
        if request_id in self._requests:
            raise ValueError(
                f"request_id: {request_id!r} is already running (the id is already in use by an "
                "unfinished request)"
            )
        tag = next(self._tags)
        self._next_tag = tag + 1
        state = RequestState(request_id, sink, str(tag))
        self._requests[request_id] = state
        return state

    def process(
        self,
        state: RequestState,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None,
        *,
        arrival_time: float | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> ProcessedRequest:
        """Tokenize and check the request (`InputProcessor`; `lora_request` already checked by
        the shell's `LoRAChecker`). Reads no table state: safe to run in a worker thread while
        the table changes."""
        if isinstance(params, PoolingParams):
            if lora_request is not None:
                raise ValueError(
                    "lora_request: LoRA adapters apply to generation, not to pooling requests; allowed: None"
                )
            return self.input.process_pooling(
                prompt, params, state.request_id, arrival_time=arrival_time, priority=priority, tag=state.tag
            )
        return self.input.process(
            prompt,
            params,
            state.request_id,
            arrival_time=arrival_time,
            priority=priority,
            tag=state.tag,
            lora_request=lora_request,
        )

    def busy(self, processed: ProcessedRequest) -> str | None:
        """Why `processed` must wait for room (a conservative count: the frontend cannot see
        the scheduler's queue), or None. A request is never refused when nothing is in flight
        (for tokens: nothing queued), so one larger than a limit is not refused forever."""
        limits = self.limits
        if limits is None:
            return None
        new = len(processed.core_requests)
        if limits.max_num_queued_reqs is not None and self._by_core and self.max_num_seqs is not None:
            queued = len(self._by_core) + new - self.max_num_seqs
            if queued > limits.max_num_queued_reqs:
                return (
                    f"{queued} requests would wait beyond max_num_seqs={self.max_num_seqs}, more than "
                    f"max_num_queued_reqs={limits.max_num_queued_reqs}"
                )
        if limits.max_num_queued_tokens is not None and self._queued_tokens:
            tokens = self._queued_tokens + processed.num_prompt_tokens
            if tokens > limits.max_num_queued_tokens:
                return (
                    f"{tokens} prompt tokens would wait for the scheduler, more than "
                    f"max_num_queued_tokens={limits.max_num_queued_tokens}"
                )
        return None

    def add(self, processed: ProcessedRequest) -> list[EngineCoreRequest]:
        """Register a processed request; the core requests to send now (none while paused, or
        when an abort arrived while it was being added: then it has ended with "abort")."""
        state = self._requests[processed.request_id]
        if state.phase is not Phase.ADDING:
            raise ValueError(f"request_id: {processed.request_id!r} was already added")
        output = state.output = OutputState(processed, self._logprobs)
        state.prompt_len = len(processed.prompt_token_ids)
        if state.abort_requested:
            state.phase = Phase.FINISHED
            self._deliver(state, output.abort())
            return []
        for child in output.children:
            if child.core_id in self._by_core:  # cannot happen with tags: a caller bug
                raise ValueError(f"request_id: core request {child.core_id!r} is already running")
        for child in output.children:
            self._by_core[child.core_id] = child
            child.queued = True
        self._queued_tokens += processed.num_prompt_tokens
        self._num_prompt_tokens += processed.num_prompt_tokens
        if self._paused:
            state.phase = Phase.HELD
            state.pending = list(processed.core_requests)
            return []
        state.phase = Phase.RUNNING
        return list(processed.core_requests)

    def discard(self, request_id: str) -> None:
        """The shell failed to add the request (a bad request, a cancelled wait, a dead
        engine): forget it without output; the caller gets the exception."""
        state = self._requests.pop(request_id, None)
        if state is not None and state.output is not None:
            self._finish(state, deliver=False)

    # ------------------------------------------------------------------ ending

    def abort(self, request_ids: str | Iterable[str]) -> list[str]:
        """Abort requests: each stream gets a last output with finish_reason "abort" (unknown or
        finished ids are ignored; one still being added ends when `add` is reached). Returns
        the core ids to abort in the core."""
        ids = [request_ids] if isinstance(request_ids, str) else request_ids
        to_abort: list[str] = []
        for rid in ids:
            state = self._requests.get(rid)
            if state is None:
                continue
            if state.phase is Phase.ADDING:
                state.abort_requested = True
            elif state.phase is not Phase.FINISHED:
                to_abort.extend(self._finish(state, deliver=True))
        return to_abort

    def release(self, request_id: str, sink: OutputSink) -> list[str]:
        """The consumer of `sink` is done with it: the request leaves the table (aborted first
        if it had not ended). Returns the core ids to abort. A sink that no longer owns the id
        (a stale handle) changes nothing."""
        state = self._requests.get(request_id)
        if state is None or state.sink is not sink:
            return []
        to_abort = [] if state.phase is Phase.ADDING else self.abort(request_id)
        del self._requests[request_id]
        return to_abort

    def fail(self, make_error: Callable[[], BaseException]) -> None:
        """The engine died: every request ends with an error (a fresh one each)."""
        for state in self._requests.values():
            if state.phase is Phase.ADDING:
                state.abort_requested = True  # if add() is still reached, it ends there
            elif state.phase is not Phase.FINISHED:
                self._finish(state, deliver=False)
            else:
                continue
            state.sink.put_error(make_error())

    def on_request_error(self, core_id: str, error: BaseException) -> list[str]:
        """The core refused or failed one core request: its user request fails with `error`
        (its other children are aborted: the returned core ids)."""
        child = self._by_core.get(core_id)
        if child is None:
            return []
        state = self._requests[child.parent.request_id]
        to_abort = [cid for cid in self._finish(state, deliver=False) if cid != core_id]
        state.sink.put_error(error)
        return to_abort

    def _finish(self, state: RequestState, *, deliver: bool) -> list[str]:
        """End a HELD or RUNNING request here; the core ids the core still runs."""
        output = state.output
        assert output is not None
        unfinished = output.unfinished()
        for child in unfinished:
            self._drop_child(state, child)
        in_core = [c.core_id for c in unfinished] if state.phase is Phase.RUNNING else []
        state.phase = Phase.FINISHED
        state.pending = []
        request_output = output.abort()
        if deliver:
            self._deliver(state, request_output)
        return in_core

    def _drop_child(self, state: RequestState, child: SequenceState) -> None:
        self._by_core.pop(child.core_id, None)
        self._unqueue(state, child)

    def _unqueue(self, state: RequestState, child: SequenceState) -> None:
        if child.queued:
            child.queued = False
            self._queued_tokens -= state.prompt_len

    @staticmethod
    def _deliver(state: RequestState, output: RequestOutput | None) -> None:
        if output is not None:
            state.sink.put(output)

    # ------------------------------------------------------------------ pause

    def pause(self) -> None:
        """Hold new requests until `resume` (what happens to running ones is the shell's)."""
        self._paused = True

    def resume(self) -> list[EngineCoreRequest]:
        """Generate again: the held requests' core requests, to send, in the order added."""
        self._paused = False
        to_send: list[EngineCoreRequest] = []
        for state in self._requests.values():
            if state.phase is Phase.HELD:
                to_send.extend(state.pending)
                state.pending = []
                state.phase = Phase.RUNNING
        return to_send

    # ------------------------------------------------------------------ outputs

    def on_outputs(self, outputs: Sequence[EngineCoreOutput], timestamp: float | None = None) -> ProcessedOutputs:
        """Apply one chunk of core outputs: each advanced request's output is put into its
        stream (and returned); the core ids a stop string finished are returned to abort.
        `timestamp`: when the core made them (`time.monotonic()`; None: now)."""
        result = ProcessedOutputs()
        now = time.monotonic() if timestamp is None else timestamp
        advanced: dict[str, tuple[RequestState, list[SequenceState]]] = {}
        for out in outputs:
            child = self._by_core.get(out.request_id)
            if child is None:
                continue  # ended here while the core was still stepping it
            state = self._requests[child.parent.request_id]
            self._unqueue(state, child)
            self._num_generation_tokens += len(out.new_token_ids)
            if child.parent.apply(child, out, now):
                result.reqs_to_abort.append(out.request_id)
            if child.finished:
                del self._by_core[out.request_id]
            advanced.setdefault(state.request_id, (state, []))[1].append(child)
        for state, children in advanced.values():
            output = state.output
            assert output is not None
            request_output = output.make_output(children)
            if output.finished:
                state.phase = Phase.FINISHED
            if request_output is not None:
                result.request_outputs.append(request_output)
                state.sink.put(request_output)
        return result

    def on_pooled(self, outputs: Sequence[EngineCoreOutput]) -> list[PoolingRequestOutput[PoolingOutput]]:
        """A pooling model's step: each output ends its request with its pooled data."""
        results: list[PoolingRequestOutput[PoolingOutput]] = []
        for out in outputs:
            child = self._by_core.get(out.request_id)
            if child is None or out.pooled is None:
                continue  # ended here while the core was still encoding it
            state = self._requests[child.parent.request_id]
            for c in child.parent.unfinished():
                self._drop_child(state, c)
            pooled = child.parent.pooled_output(out.pooled)
            state.phase = Phase.FINISHED
            # A pooling request's one, final output passes through the stream as it is.
            state.sink.put(cast(RequestOutput, pooled))
            results.append(pooled)
        return results

    # ------------------------------------------------------------------ checks

    def check_integrity(self) -> None:
        """Raise `AssertionError` if the table and its index disagree or a count is off."""
        indexed: dict[str, SequenceState] = {}
        queued = 0
        for rid, state in self._requests.items():
            assert state.request_id == rid, (rid, state)
            assert int(state.tag) < self._next_tag, state
            output = state.output
            if state.phase is Phase.ADDING:
                assert output is None, state
                continue
            assert output is not None, state
            unfinished = output.unfinished()
            assert output.num_unfinished == len(unfinished), (rid, output.num_unfinished)
            if state.phase is Phase.FINISHED:
                assert not unfinished and not state.pending, state
                continue
            assert (state.phase is Phase.HELD) == bool(state.pending), state
            assert state.phase is not Phase.HELD or self._paused, state
            for child in unfinished:
                indexed[child.core_id] = child
                queued += state.prompt_len * child.queued
        assert indexed.keys() == self._by_core.keys(), (sorted(indexed), sorted(self._by_core))
        assert all(self._by_core[k] is v for k, v in indexed.items())
        assert queued == self._queued_tokens, (queued, self._queued_tokens)
