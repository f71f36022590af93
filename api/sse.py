"""Running a generation request as an ASGI response (streaming as SSE, or one JSON body).

`GenerationResponse.__call__` owns one task group for the whole request:

```
disconnect watcher ── receive() until http.disconnect ──▶ cancels the task group
producer per prompt ── `with await llm.add_request(...)` ──▶ memory stream ──▶ this task:
                        (its RequestStream)                  formats and sends (one ASGI message
                                                             per wake-up: queued outputs coalesce)
```

Cancelling the group (client gone, response sent, error) closes every request's stream, which
aborts its request in the engine at once (exactly once). While this task is busy sending, a
producer waits on the memory stream and the request's stream merges the tokens that keep coming
(DELTA), so one event carries several under load. Nothing raises out of
`__call__`: errors before the response started are sent as an OpenAI error body with the
right status; after an SSE stream started, as a `data: {"error": ...}` event then `[DONE]` (the
Responses API: `event:` lines and no `[DONE]`, `Formatter.named_events`).

Streaming waits for every prompt's first output before sending the headers, so a request the
engine rejects (prompt too long, token ids outside the vocabulary, a dead engine) gets a 400 /
503 status rather than a 200 stream carrying an error.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, aclosing, nullcontext
from dataclasses import dataclass
from typing import Any, Protocol

import anyio
import msgspec
from anyio import CancelScope
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from triollm.actors.async_llm import AsyncLLM
from triollm.actors.errors import EngineGenerateError
from triollm.actors.request_stream import OutputMerger
from triollm.api.openai_errors import APIError, from_exception
from triollm.api.tracing import RequestTrace
from triollm.engine.beam_search import BeamSearchParams
from triollm.engine.inputs import PromptType
from triollm.engine.log_safe import log_safe
from triollm.engine.outputs import RequestOutput
from triollm.engine.sampling_params import SamplingParams
from triollm.lora.request import LoRARequest

__all__ = ["DONE", "Formatter", "GenerationResponse", "Job", "named_sse_event", "sse_event"]

log = logging.getLogger("triollm.api")

DONE = b"data: [DONE]\n\n"
_encoder = msgspec.json.Encoder()
_SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]
_JSON_HEADERS = [(b"content-type", b"application/json")]


def sse_event(obj: Any) -> bytes:
    return b"data: " + _encoder.encode(obj) + b"\n\n"


def named_sse_event(obj: Any) -> bytes:
    """The Responses API's framing: `event: TYPE` before the data (its `type` field)."""
    data = _encoder.encode(obj)
    kind = getattr(obj, "type", None) or "error"
    return b"event: " + kind.encode() + b"\ndata: " + data + b"\n\n"


@dataclass(frozen=True)
class Job:
    """One engine request: one prompt of the HTTP request."""

    prompt: PromptType
    params: SamplingParams
    request_id: str
    priority: int = 0
    # Set: the prompt runs as a beam search (`AsyncLLM.beam_search`), one final output.
    beam: BeamSearchParams | None = None
    # The adapter the request's `model` named (None: the base model).
    lora_request: LoRARequest | None = None


class Formatter(Protocol):
    """Turns engine outputs into response objects; one per request (it keeps counts). A
    formatter with `named_events = True` (the Responses API) streams `event: TYPE` lines and
    no `[DONE]`."""

    def stream_start(self) -> list[Any]: ...

    def stream_output(self, index: int, output: RequestOutput) -> list[Any]: ...

    def stream_end(self) -> list[Any]: ...

    def final(self, outputs: list[RequestOutput]) -> Any: ...


@dataclass
class _Item:
    index: int
    output: RequestOutput | None = None
    error: BaseException | None = None


class _Output:
    """The ASGI send side; a send failing with OSError (client gone) cancels the request."""

    def __init__(self, send: Send, scope: CancelScope, done: bytes = DONE) -> None:
        self._send = send
        self._scope = scope
        self._done = done  # what ends the stream (chat and completions: `data: [DONE]`)
        self.started = False  # headers sent
        self.ending = False  # the last body message is being sent: a hang-up now is no abort
        self.complete = False  # the last body message sent (or the client is gone)
        self.encode: Callable[[Any], bytes] = sse_event

    async def _message(self, message: Message) -> None:
        if self.complete:
            return
        try:
            await self._send(message)
        except OSError:
            self.complete = True
            self._scope.cancel()

    async def json(
        self, status: int, body: bytes, headers: Sequence[tuple[bytes, bytes]] = ()
    ) -> None:
        self.started = True
        await self._message(
            {"type": "http.response.start", "status": status, "headers": [*_JSON_HEADERS, *headers]}
        )
        self.ending = True
        await self._message({"type": "http.response.body", "body": body, "more_body": False})
        self.complete = True

    async def start_stream(self) -> None:
        self.started = True
        await self._message({"type": "http.response.start", "status": 200, "headers": _SSE_HEADERS})

    async def events(self, data: bytes) -> None:
        if data:
            await self._message({"type": "http.response.body", "body": data, "more_body": True})

    async def end_stream(self, data: bytes = b"") -> None:
        self.ending = True
        await self._message({"type": "http.response.body", "body": data + self._done, "more_body": False})
        self.complete = True

    async def fail(self, error: APIError) -> None:
        if not self.started:
            headers = [(k.encode(), v.encode()) for k, v in error.headers.items()]
            await self.json(error.status, error.body(), headers)
        else:
            await self.end_stream(self.encode(error.to_struct()))


class GenerationResponse(Response):
    def __init__(
        self,
        llm: AsyncLLM,
        jobs: Sequence[Job],
        formatter: Formatter,
        *,
        stream: bool,
        label: str,
        timer: Any = None,
        admission: Callable[[], AbstractContextManager[None]] | None = None,
        error_shape: Callable[[APIError], APIError] | None = None,
        trace: RequestTrace | None = None,
        model: str = "",
    ) -> None:
        """`timer`: a metrics `RequestTimer` (on_tokens / finished) or None. `admission`: entered
        around each `add_request` (the server's `ServerState.admission`: refused once the drain
        began, and known to the drain while inside). `error_shape`: how the route's errors are
        written (the Messages API's: `as_anthropic`); None, OpenAI's. `trace`: the request's
        OpenTelemetry context (api/tracing.py): a span per prompt as it finishes, naming `model`."""
        super().__init__()
        self.llm = llm
        self.jobs = list(jobs)
        self.formatter = formatter
        self.stream = stream
        self.label = label
        self.timer = timer
        self.admission = admission or nullcontext
        self.error_shape = error_shape
        self.trace = trace
        self.model = model
        self._prompt_tokens: dict[int, int] = {}
        self._completion_tokens = 0
        self._finish_reason: str | None = None  # the first choice's, for the metrics
        self._finished_choices = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        async with anyio.create_task_group() as tg:
            named = getattr(self.formatter, "named_events", False)
            out = _Output(send, tg.cancel_scope, b"" if named else DONE)
            out.encode = named_sse_event if named else sse_event
            tg.start_soon(self._watch_disconnect, receive, out, tg.cancel_scope)
            tx, rx = anyio.create_memory_object_stream[_Item](max(1, len(self.jobs)))
            async with tx:
                for index, job in enumerate(self.jobs):
                    tg.start_soon(self._produce, index, job, tx.clone())
            with rx:
                try:
                    if self.stream:
                        await self._stream(rx, out)
                    else:
                        await self._respond(rx, out)
                except Exception as exc:  # a bug in formatting: still answer the client
                    await out.fail(self._error(exc))
                finally:
                    self._record_finish()
            tg.cancel_scope.cancel()

    def _observe(self, item: _Item) -> None:
        """Token counts and finish reasons for the metrics timer."""
        output = item.output
        assert output is not None
        self._prompt_tokens[item.index] = len(output.prompt_token_ids)
        new = 0
        for c in output.outputs:
            new += len(c.token_ids)
            if c.finish_reason is not None:
                self._finished_choices += 1  # once per choice (DELTA and FINAL_ONLY alike)
                if self._finish_reason is None or (item.index == 0 and c.index == 0):
                    self._finish_reason = c.finish_reason
        self._completion_tokens += new
        if self.timer is not None and new:
            self.timer.on_tokens(new, time.perf_counter())

    def _record_finish(self) -> None:
        """Once per request that the engine admitted (a rejected one is not a finished request)."""
        if self.timer is None or not self._prompt_tokens:
            return
        finished = self._finished_choices >= sum(job.params.n for job in self.jobs)
        self.timer.finished(
            self._finish_reason if finished else "abort",
            sum(self._prompt_tokens.values()),
            self._completion_tokens,
            time.perf_counter(),
        )

    def _error(self, exc: BaseException) -> APIError:
        error = from_exception(exc, engine_running=self.llm.is_running)
        return error if self.error_shape is None else self.error_shape(error)

    async def _watch_disconnect(self, receive: Receive, out: _Output, scope: CancelScope) -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception as exc:  # a server that raises instead: the client is gone all the same
            log.debug("%s: receive() failed: %r", log_safe(self.label), exc)
        if not (out.complete or out.ending):
            log.info("%s: client disconnected; aborting the request", log_safe(self.label))
        scope.cancel()

    async def _produce(self, index: int, job: Job, tx: MemoryObjectSendStream[_Item]) -> None:
        async with tx:
            try:
                if job.beam is not None:
                    # Not held across the search (its rounds are separate requests): a drain
                    # aborts the round in flight, which ends the search with "abort".
                    with self.admission():
                        pass
                    search = self.llm.beam_search(job.prompt, job.request_id, job.beam, job.lora_request)
                    async with aclosing(search) as beams:
                        async for output in beams:
                            _raise_if_failed(output)
                            await tx.send(_Item(index, output))
                    return
                with self.admission():
                    stream = await self.llm.add_request(
                        job.request_id, job.prompt, job.params, priority=job.priority, lora_request=job.lora_request
                    )
                with stream:
                    async for output in stream:
                        _raise_if_failed(output)
                        if output.finished and self.trace is not None:
                            self.trace.record(job.request_id, self.model, job.params, output)
                        await tx.send(_Item(index, output))
            except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                return  # the consumer is gone; the stream was closed (request aborted)
            except Exception as exc:
                try:
                    await tx.send(_Item(index, error=exc))
                except (anyio.BrokenResourceError, anyio.ClosedResourceError):
                    pass

    async def _respond(self, rx: MemoryObjectReceiveStream[_Item], out: _Output) -> None:
        # One output per prompt (several merged: DELTA when a metrics timer wants every token's
        # time), joined once at the end.
        merged = [OutputMerger(job.params.output_kind) for job in self.jobs]
        async for item in rx:
            if item.error is not None:
                await out.fail(self._error(item.error))
                return
            assert item.output is not None
            self._observe(item)
            merged[item.index].add(item.output)
        outputs = [o for o in (m.take() for m in merged) if o is not None]
        if len(outputs) != len(self.jobs):
            raise RuntimeError("a prompt's request ended without an output")
        await out.json(200, _encoder.encode(self.formatter.final(outputs)))

    async def _stream(self, rx: MemoryObjectReceiveStream[_Item], out: _Output) -> None:
        fmt = self.formatter
        waiting = set(range(len(self.jobs)))
        first: list[_Item] = []
        while waiting:  # every prompt admitted (first output) before the headers go out
            item = await rx.receive()
            if item.error is not None:
                await out.fail(self._error(item.error))
                return
            self._observe(item)
            first.append(item)
            waiting.discard(item.index)
        await out.start_stream()
        chunks = fmt.stream_start()
        for item in first:
            assert item.output is not None
            chunks.extend(fmt.stream_output(item.index, item.output))
        await out.events(b"".join(map(out.encode, chunks)))
        while True:
            try:
                batch = [await rx.receive()]
            except anyio.EndOfStream:
                break
            while True:  # coalesce what queued up while we were sending
                try:
                    batch.append(rx.receive_nowait())
                except (anyio.WouldBlock, anyio.EndOfStream):
                    break
            chunks = []
            for item in batch:
                if item.error is not None:
                    await out.events(b"".join(map(out.encode, chunks)))
                    await out.fail(self._error(item.error))
                    return
                self._observe(item)
                assert item.output is not None
                chunks.extend(fmt.stream_output(item.index, item.output))
            await out.events(b"".join(map(out.encode, chunks)))
        await out.end_stream(b"".join(map(out.encode, fmt.stream_end())))


def _raise_if_failed(output: RequestOutput) -> None:
    """A request the engine failed (an adapter that no longer reads, a grammar that broke: the
    frontend ends it "abort" with the error text as its stop_reason, engine/frontend/output.py)
    is an error for the client, as vLLM's `finish_reason == "error"` is: a 500 naming the cause,
    or an error event once the stream started; not a 200 with empty text."""
    for c in output.outputs:
        if c.finish_reason == "abort" and isinstance(c.stop_reason, str):
            raise EngineGenerateError(c.stop_reason)
