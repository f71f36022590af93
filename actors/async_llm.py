"""`AsyncLLM`: vLLM's async entry point as a small actor system on one anyio task group.

```
add_request() ──(validate, tokenize: the input side, in the caller's task)──▶ core inputs stream
                                                                                  │
                       engine core (in-process task, or child process over ZMQ: transport.py)
                                                                                  │
RequestStream handles ◀── output actor (detokenize, stop strings, RequestOutputs, ◀──┘
 (one per request)          in chunks of output_chunk_size with a checkpoint between)
```

Ownership: `async with AsyncLLM.from_engine_args(args) as llm:` (or `await llm.start()` ...
`await llm.shutdown()` from the same task) owns a task group holding the core client and the
output actor. Actors never raise into that task group: the engine's death is caught by the
output actor, broadcast once as `EngineDeadError` to every request's stream (the data path),
and recorded in `errored`; new requests then fail at once.

Requests: `add_request()` returns the request's `RequestStream` (request_stream.py), the one
public handle every consumer uses; `generate()` is a thin async generator over it. A consumer
may stop any way it likes (cancellation, `aclose()`, `break`, GeneratorExit): closing the handle
aborts the request exactly once, synchronously (the core's input stream is unbounded, so the
abort never has to wait, even inside a cancelled scope).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
import traceback
import warnings
from collections.abc import AsyncGenerator, Awaitable, Callable, Generator, Iterable, Mapping
from contextlib import AsyncExitStack, ExitStack
from typing import Any, Literal, cast

import anyio
import anyio.lowlevel
from anyio.abc import TaskGroup, TaskStatus

from triollm.actors.core_client import CoreClient
from triollm.actors.errors import EngineBusyError, EngineDeadError, EngineGenerateError
from triollm.actors.host import spawn_root_task
from triollm.actors.messages import (
    AbortRequests,
    AddRequest,
    CoreInput,
    EngineDead,
    OutputBatch,
    RequestError,
    StepStats,
    UtilityCall,
    UtilityOp,
    UtilityResult,
)
from triollm.actors.request_stream import RequestStream
from triollm.actors.transport import open_core_client
from triollm.engine.beam_search import BeamSearch, BeamSearchParams, prompt_token_ids
from triollm.engine.config import EngineArgs, EngineConfig, ModelConfig
from triollm.engine.core import EngineCoreFactory
from triollm.engine.metrics import Counter, Gauge, Metric
from triollm.engine.outputs import RequestOutput
from triollm.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput
from triollm.engine.pooling_params import PoolingParams
from triollm.engine.processing.processors import (
    InputProcessor,
    OutputProcessor,
    ProcessedRequest,
    PromptType,
)
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import SamplingParams

__all__ = ["AsyncEngineArgs", "AsyncLLM", "PauseMode", "ShutdownCall"]

log = logging.getLogger("triollm")

# Requests whose input is larger than this (characters to tokenize plus token ids to check, the
# prompt's and `bad_words`': `_input_size`) are processed in a worker thread, so that they do
# not stall the event loop. (The name predates `bad_words` counting; tests patch it.)
_LARGE_PROMPT = 8192
# A core that stopped taking inputs reports its death through the output stream: how long a
# caller that found the inputs closed waits for that report (it is normally there at once).
DEATH_REPORT_WAIT_S = 5.0
# What one tokenizer call costs beyond its text, in characters: measured ~5 us per call and
# ~0.23 us per character (the tiny test tokenizer, CPython 3.11), so ~20; rounded down.
_TOKENIZER_CALL_CHARS = 16

SUPPORTED_TASKS: tuple[str, ...] = ("generate",)
POOLING_TASKS: tuple[str, ...] = ("embed", "encode")  # a pooling model's (runner "pooling")
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


class ShutdownCall:
    """What `AsyncLLM.shutdown()` returns: the shutdown has begun when the call returns (vLLM's
    sync form); awaiting it waits until the engine has stopped (the structured form)."""

    def __init__(self, finish: Callable[[float], Awaitable[None]], timeout: float) -> None:
        self._finish = finish
        self._timeout = timeout

    def __await__(self) -> Generator[Any, None, None]:
        return self._finish(self._timeout).__await__()


class _EngineHost:
    """The root task that owns an engine nobody entered (actors/host.py): it enters the engine,
    reports readiness or the start-up error, and leaves when told to stop or when the event loop
    ends (the loop cancels its root tasks; the engine's teardown is shielded and bounded)."""

    def __init__(self, llm: AsyncLLM) -> None:
        self._llm = llm
        self.ready = anyio.Event()
        self.done = anyio.Event()
        self.error: BaseException | None = None
        self._stop = anyio.Event()
        self._timeout = 0.0
        self._task: int | None = None

    def stop(self, timeout: float) -> None:
        self._timeout = timeout
        self._stop.set()

    def in_host_task(self) -> bool:
        return self._task is not None and self._task == anyio.get_current_task().id

    async def run(self) -> None:
        self._task = anyio.get_current_task().id
        try:
            try:
                await self._llm.start()
            except Exception as exc:  # reported to whoever waits for the start; never raised here
                self.error = exc
                return
            finally:
                self.ready.set()
            try:
                await self._stop.wait()
            finally:
                await self._llm._shutdown(self._timeout)
        except Exception:  # never into the loop: a root task that raises crashes trio's run
            log.exception("the engine's root task failed")
        finally:
            self.done.set()


class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the engine arguments of `AsyncLLM` (the same fields)."""


class AsyncLLM:
    def __init__(
        self,
        args: EngineArgs,
        *,
        chat_template: str | None = None,
        engine_core_factory: EngineCoreFactory | str | None = None,
    ) -> None:
        """`engine_core_factory` (tests and benchmarks only): "module:function" or an
        `EngineCoreFactory` that builds the engine core, in this process or the child."""
        self.args = args
        self._chat_template = chat_template
        self._core_factory = EngineCoreFactory.coerce(engine_core_factory)
        self._output_chunk_size = 1
        self._stack: AsyncExitStack | None = None
        self._client: CoreClient | None = None
        self._streams: dict[str, RequestStream] = {}
        self._utility: dict[int, tuple[anyio.Event, list[UtilityResult]]] = {}
        self._call_ids = itertools.count()
        self._request_ids = itertools.count()
        self._core_seq = itertools.count()
        self._dead: EngineDeadError | None = None
        self._dead_event = anyio.Event()
        self._stopping = False
        self._idle = anyio.Event()
        self._idle.set()
        self.last_stats: StepStats | None = None
        self._host: _EngineHost | None = None  # owns the engine when nobody entered it
        self._paused = False
        self._held: list[AddRequest] = []  # added while paused, sent at resume
        self._num_prompt_tokens = 0
        self._num_generation_tokens = 0
        # Backpressure (see add_request): prompt tokens of core requests with no output yet.
        self._queued_prompt: dict[str, int] = {}  # core id -> prompt tokens
        self._queued_tokens = 0
        self._room = anyio.Event()  # set (and replaced) when the queue may have shrunk
        self._room_waiters = 0  # adds waiting on it: no new Event per batch when there are none
        # Ids reserved by add_request that are not in the output processor yet (validation,
        # tokenization in a thread, waiting for room); True once an abort arrived meanwhile.
        self._adding: dict[str, bool] = {}
        self._last_output = 0.0  # when the engine core last sent anything (the watchdog's clock)
        self._watchdog_scope: anyio.CancelScope | None = None  # created by start()
        self._log_mark = (time.monotonic(), 0, 0)  # (time, prompt tokens, generation tokens)
        self.config: EngineConfig | None = None
        self.tokenizer: Tokenizer | None = None

    # ------------------------------------------------------------------ construction

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Build (not start): use it as `async with AsyncLLM.from_engine_args(args) as llm:`."""
        return cls(args, **kwargs)

    @classmethod
    def from_config(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        return cls(args, **kwargs)

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # The engine's death is reported on the data path (every request, `errored`, new
        # requests) and logged at shutdown; leaving the block does not raise it once more.
        await self.shutdown()

    async def start(self) -> None:
        """Start the engine (load the model, start the core, start the actors)."""
        if self._stack is not None or self._stopping:
            raise RuntimeError("AsyncLLM is already started (or was shut down: create a new one)")
        stack = AsyncExitStack()
        try:
            self.config = config = await anyio.to_thread.run_sync(self.args.create_engine_config)
            self.tokenizer = await anyio.to_thread.run_sync(
                Tokenizer.from_pretrained, config.tokenizer, self._chat_template
            )
            self._output_chunk_size = config.actor.output_chunk_size
            self._output = OutputProcessor(self.tokenizer)
            tg: TaskGroup = await stack.enter_async_context(anyio.create_task_group())
            self._client = await stack.enter_async_context(open_core_client(config, self.args, core_factory=self._core_factory))
            ready = self._client.ready
            self._input = InputProcessor(
                config.model,
                self.tokenizer,
                max_logprobs=config.actor.max_logprobs,
                limits=config.limits,
                kv_cache_tokens=ready.num_kv_blocks * ready.block_size,
            )
            await tg.start(self._output_actor)
            if config.actor.engine_output_timeout_s is not None:
                self._watchdog_scope = anyio.CancelScope()
                tg.start_soon(self._watchdog, self._watchdog_scope, config.actor.engine_output_timeout_s)
            _freeze_heap()
        except BaseException:
            # No shield around aclose(): the stack holds a task group entered outside it, and
            # cancel scopes must be left in LIFO order. The transport shields its own teardown.
            await stack.aclose()
            raise
        self._stack = stack

    def shutdown(self, timeout: float | None = None) -> ShutdownCall:
        """Stop accepting requests, let in-flight ones finish for up to `timeout` seconds, abort
        the rest (their streams end with finish_reason "abort"), stop the engine. Idempotent.

        Callable as vLLM's `llm.shutdown()`: new requests are refused at once, and an engine that
        started on first use (no `async with`) is told to stop; its root task tears it down.
        `await llm.shutdown()` also waits until the engine has stopped (structured code)."""
        if self._stack is not None or self._host is not None:  # never started: a no-op
            self._stopping = True
        if self._host is not None:
            self._host.stop(timeout or 0.0)
        return ShutdownCall(self._shutdown, timeout or 0.0)

    async def _shutdown(self, timeout: float) -> None:  # noqa: ASYNC109
        host = self._host
        if host is not None and not host.in_host_task():
            await host.done.wait()
            return
        stack, self._stack = self._stack, None
        if stack is None:
            return
        self._stopping = True
        try:
            if timeout > 0:
                with anyio.move_on_after(timeout):
                    await self._idle.wait()
        finally:
            # Even when the drain was cancelled: every stream ends (with "abort").
            self._abort_now(list(self._streams))
            if self._watchdog_scope is not None:
                self._watchdog_scope.cancel()
            try:
                await stack.aclose()  # not shielded: see start()
            finally:
                self._client = None
        if self._dead is not None:
            log.warning("engine was dead at shutdown: %s", self._dead)

    # ------------------------------------------------------------------ state

    @property
    def is_running(self) -> bool:
        return self._client is not None and self._dead is None and not self._stopping

    @property
    def errored(self) -> bool:
        return self._dead is not None

    @property
    def rank_stats(self) -> list[StepStats | None] | None:
        """Data parallel: each rank's latest statistics (from its last step, or from the last
        `get_engine_stats()`), by rank; None with one engine core."""
        client = self._client
        return None if client is None or client.rank_stats is None else list(client.rank_stats)

    @property
    def is_stopped(self) -> bool:
        """vLLM's name: the engine no longer serves (shut down, or dead)."""
        return self._stopping or self._dead is not None

    @property
    def model_config(self) -> ModelConfig:
        """The model's configuration (vLLM's attribute); available once the engine started."""
        return self.get_model_config()

    async def get_supported_tasks(self) -> tuple[str, ...]:
        await self._ensure_started()
        return POOLING_TASKS if self.get_model_config().runner_type == "pooling" else SUPPORTED_TASKS

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._dead

    async def wait_errored(self) -> EngineDeadError:
        """Wait until the engine dies; return the error every request saw."""
        await self._dead_event.wait()
        assert self._dead is not None
        return self._dead

    async def wait_idle(self) -> None:
        """Wait until no request is in flight."""
        await self._idle.wait()

    async def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine died (vLLM's health check)."""
        if self._dead is not None:
            raise self._dead_error()
        if self._host is None:
            self._require_running()

    async def do_log_stats(self) -> None:
        """Log one line of engine statistics (vLLM's periodic stats line): prompt and generation
        throughput since the last call, running and waiting requests, KV cache usage and the
        prefix cache hit rate. Does nothing with `disable_log_stats`."""
        if self.args.disable_log_stats:
            return
        stats = await self.get_engine_stats()
        now = time.monotonic()
        elapsed = max(now - self._log_mark[0], 1e-9)
        prompt_rate = (self._num_prompt_tokens - self._log_mark[1]) / elapsed
        gen_rate = (self._num_generation_tokens - self._log_mark[2]) / elapsed
        self._log_mark = (now, self._num_prompt_tokens, self._num_generation_tokens)
        usage = 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        log.info(
            "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
            "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
            prompt_rate, gen_rate, stats.num_running, stats.num_waiting, 100 * usage,
            100 * stats.prefix_cache_hit_rate,
        )

    def get_tokenizer(self) -> Tokenizer:
        self._require_running()
        assert self.tokenizer is not None
        return self.tokenizer

    def get_model_config(self) -> ModelConfig:
        if self.config is None:
            self._require_running()  # raises: not started yet
        assert self.config is not None
        return self.config.model

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._streams)

    def unfinished_request_ids(self) -> list[str]:
        return list(self._streams)

    def _dead_error(self) -> EngineDeadError:
        """A fresh error each time: one shared instance would collect every raiser's traceback."""
        assert self._dead is not None
        return EngineDeadError(str(self._dead))

    def _require_running(self) -> None:
        if self._dead is not None:
            raise self._dead_error()
        if self._client is None or self._stopping:
            raise RuntimeError(
                "AsyncLLM is not running: use `async with AsyncLLM.from_engine_args(args) as llm:` "
                "(or `await llm.start()` ... `await llm.shutdown()`)"
            )

    async def _ensure_started(self) -> None:
        """Start on first use when nobody entered the engine (vLLM's plain-coroutine style): one
        root task of the running loop owns it (actors/host.py). Raises the start-up error."""
        if self._stack is None and self._host is None and not self._stopping and self._dead is None:
            self._host = _EngineHost(self)
            spawn_root_task(self._host.run, name="triollm AsyncLLM")
        if self._host is not None:
            await self._host.ready.wait()
            if self._host.error is not None:
                raise RuntimeError(f"AsyncLLM failed to start: {self._host.error}") from self._host.error

    # ------------------------------------------------------------------ requests

    async def add_request(
        self,
        request_id: str,
        prompt: PromptType,
        params: SamplingParams | PoolingParams | None = None,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        wait_for_room: bool = False,
    ) -> RequestStream:
        """Validate and tokenize the prompt and `bad_words` (in a worker thread when they are
        large together), send the request to the engine and return its `RequestStream`.

        Raises at once, holding nothing: `ValueError` for a bad request or an id already used by
        an unfinished request, `EngineDeadError` when the engine died, `RuntimeError` when it is
        not running. Close the stream (`with`, `async with`, `close()`) when done: an unfinished
        request is aborted then, exactly once. An `abort(request_id)` that arrives while the
        request is still being added (tokenized in a thread, waiting for room) sticks: the
        request never reaches the core and its stream ends with finish_reason "abort".

        Backpressure: over `max_num_queued_reqs` or `max_num_queued_tokens` it raises
        `EngineBusyError` (nothing added, the id free again), or with `wait_for_room=True`
        (offline batches: `LLM`, `LLMEngine`) waits until the queue has room. The frontend cannot
        see the scheduler's queue, so it counts conservatively: queued requests are the unfinished
        core requests (an n > 1 request counts n) beyond `max_num_seqs`, queued tokens the prompt
        tokens of core requests that have produced no output yet (held ones while paused included;
        a preempted request that already produced output is not counted again). A request is
        never refused when nothing is in flight (for tokens: nothing queued), so one request
        larger than a limit cannot be refused forever.
        """
        await self._ensure_started()
        self._require_running()
        if request_id in self._streams:
            raise ValueError(f"request_id: {request_id!r} is already in use by an unfinished request")
        assert self.config is not None
        if params is None:
            params = SamplingParams(**self.config.model.generation_defaults)
        stream = RequestStream(request_id, params.output_kind, self._release)
        self._streams[request_id] = stream  # reserve the id before any await
        self._adding[request_id] = False
        self._idle = anyio.Event() if self._idle.is_set() else self._idle
        arrival = time.monotonic() if arrival_time is None else arrival_time
        try:
            # A grammar (structured outputs) is compiled to check it: in a thread too.
            grammar = isinstance(params, SamplingParams) and params.structured_outputs is not None
            if _input_size(prompt, params) > _LARGE_PROMPT or grammar:
                processed = await anyio.to_thread.run_sync(
                    lambda: self._process(prompt, params, request_id, arrival, priority)
                )
                self._require_running()
            else:
                processed = self._process(prompt, params, request_id, arrival, priority)
            while not self._adding[request_id] and (busy := self._busy(processed)) is not None:
                if not wait_for_room:
                    raise EngineBusyError(f"the engine is busy: {busy}; retry later")
                self._room_waiters += 1
                try:
                    await self._room.wait()
                finally:
                    self._room_waiters -= 1
                self._require_running()
            # Core ids are unique per request, so outputs still in flight for an aborted
            # request can never be credited to a new request that reuses its id.
            seq = next(self._core_seq)
            for core_req in processed.core_requests:
                core_req.request_id = f"{core_req.request_id}#{seq}"
            self._output.add_request(processed)
            if self._adding.pop(request_id):  # aborted while being added: never sent
                for out in self._output.abort_requests([request_id]):
                    stream.put(out)
                return stream
            for core_req in processed.core_requests:
                self._num_prompt_tokens += len(core_req.prompt_token_ids)
                self._queued_prompt[core_req.request_id] = len(core_req.prompt_token_ids)
                self._queued_tokens += len(core_req.prompt_token_ids)
                if self._paused:
                    self._held.append(AddRequest(core_req))
                else:
                    await self._send_or_raise(AddRequest(core_req))
        except BaseException:
            self._adding.pop(request_id, None)
            self._drop(request_id)
            raise
        return stream

    def _process(
        self, prompt: PromptType, params: SamplingParams | PoolingParams, request_id: str, arrival: float, priority: int
    ) -> ProcessedRequest:
        if isinstance(params, PoolingParams):
            return self._input.process_pooling(prompt, params, request_id, arrival_time=arrival, priority=priority)
        return self._input.process(prompt, params, request_id, arrival_time=arrival, priority=priority)

    def _busy(self, processed: ProcessedRequest) -> str | None:
        """Why `processed` must wait (the frontend's conservative queue count), or None."""
        assert self.config is not None
        limits = self.config.limits
        new = len(processed.core_requests)
        unfinished = self._output.num_unfinished_sequences
        max_seqs = self.config.scheduler.max_num_seqs
        if limits.max_num_queued_reqs is not None and unfinished:
            queued = unfinished + new - max_seqs
            if queued > limits.max_num_queued_reqs:
                return (
                    f"{queued} requests would wait beyond max_num_seqs={max_seqs}, more than "
                    f"max_num_queued_reqs={limits.max_num_queued_reqs}"
                )
        if limits.max_num_queued_tokens is not None and self._queued_tokens:
            tokens = self._queued_tokens + new * len(processed.prompt_token_ids)
            if tokens > limits.max_num_queued_tokens:
                return (
                    f"{tokens} prompt tokens would wait for the scheduler, more than "
                    f"max_num_queued_tokens={limits.max_num_queued_tokens}"
                )
        return None

    def _unqueue(self, core_id: str) -> None:
        tokens = self._queued_prompt.pop(core_id, None)
        if tokens is not None:
            self._queued_tokens -= tokens

    def _notify_room(self) -> None:
        """Wake the adds waiting for room (they check again). Called once per output batch:
        free when nobody waits."""
        if self._room_waiters:
            self._room.set()
            self._room = anyio.Event()

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request. Wrap it in `contextlib.aclosing` so that leaving
        early aborts the request at once rather than when the generator is collected."""
        rid = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        with await self.add_request(rid, prompt, sampling_params, priority=priority) as stream:
            async for output in stream:
                yield output

    async def beam_search(
        self,
        prompt: PromptType,
        request_id: str,
        params: BeamSearchParams,
        lora_request: object = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's `EngineClient.beam_search`: one finished `RequestOutput` whose outputs are the
        `params.beam_width` best sequences, best first (engine/beam_search.py). Each round's
        beams run as concurrent requests ("{request_id}-beam{round}-{k}"); leaving early
        (cancellation, closing the generator) aborts them. Prompts as `LLM.beam_search`."""
        if lora_request is not None:
            raise ValueError("lora_request: LoRA adapters are not supported; allowed: None")
        await self._ensure_started()
        self._require_running()
        tokenizer = self.get_tokenizer()
        ids = prompt_token_ids(prompt, tokenizer)
        text = prompt if isinstance(prompt, str) else prompt.get("prompt") if isinstance(prompt, dict) else None
        search = BeamSearch([ids], params, tokenizer.eos_token_id, self.get_model_config().max_model_len)
        step = search.step_params()
        for round_ in range(params.max_tokens):
            beams = search.live([0])
            if not beams or search.aborted:
                break
            outputs = await self._beam_round(f"{request_id}-beam{round_}", [b.tokens for _, b in beams], step)
            search.advance([0], beams, outputs)
        (result,) = search.results(lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True))
        yield search.request_output(request_id, text if isinstance(text, str) else None, 0, result)

    async def _beam_round(self, base_id: str, prompts: list[list[int]], step: SamplingParams) -> list[RequestOutput]:
        """One round of a beam search: every beam as a request, their final outputs in order."""
        results: list[RequestOutput] = []
        with ExitStack() as streams:
            added = [
                streams.enter_context(
                    await self.add_request(f"{base_id}-{k}", {"prompt_token_ids": ids}, step.clone(), wait_for_room=True)
                )
                for k, ids in enumerate(prompts)
            ]
            for stream in added:  # they run together in the engine; read in order
                async for out in stream:
                    if out.finished:
                        results.append(out)
        return results

    async def encode(
        self,
        prompt: PromptType,
        pooling_params: PoolingParams | None = None,
        request_id: str | None = None,
        *,
        priority: int = 0,
        truncate_prompt_tokens: int | None = None,
    ) -> AsyncGenerator[PoolingRequestOutput[PoolingOutput], None]:
        """vLLM's `AsyncLLM.encode`: the pooled output of one prompt (one item, finished) from a
        pooling model (`runner="pooling"`). `pooling_params.task` defaults to "embed";
        `truncate_prompt_tokens` overrides the params'. Leaving early aborts the request."""
        await self._ensure_started()
        if self.get_model_config().runner_type != "pooling":
            raise ValueError(
                "AsyncLLM.encode() is only supported for pooling models. Try passing "
                "`--runner pooling` to use the model as a pooling model."
            )
        params = PoolingParams() if pooling_params is None else pooling_params.clone()
        if truncate_prompt_tokens is not None:
            params.truncate_prompt_tokens = truncate_prompt_tokens
        rid = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        with await self.add_request(rid, prompt, params, priority=priority) as stream:
            async for output in stream:
                # The stream carries one PoolingRequestOutput; anything else is the abort's
                # RequestOutput (the request ended without an embedding).
                if not isinstance(output, PoolingRequestOutput):
                    return
                yield cast(PoolingRequestOutput[PoolingOutput], output)

    def _release(self, stream: RequestStream) -> None:
        """The stream's consumer is done with it: abort the request unless it ended."""
        rid = stream.request_id
        if self._streams.get(rid) is not stream:
            return
        if not stream.finished:
            self._abort_one(rid)
        self._drop(rid)

    def _drop(self, rid: str) -> None:
        self._streams.pop(rid, None)
        if not self._streams:
            self._idle.set()

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests (vLLM's coroutine); their streams end normally with finish_reason
        "abort". Unknown or finished ids are ignored. `internal` is accepted for vLLM's signature."""
        self._abort_now(request_id)

    def _abort_now(self, request_id: str | Iterable[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        for rid in ids:
            if rid in self._adding:  # not sent yet: add_request finishes it as aborted
                self._adding[rid] = True
                self._notify_room()
                continue
            stream = self._streams.get(rid)
            for out in self._abort_one(rid):
                if stream is not None:
                    stream.put(out)

    def _abort_one(self, rid: str) -> list[RequestOutput]:
        core_ids = self._output.unfinished_core_ids(rid)
        outs = self._output.abort_requests([rid])
        if core_ids:
            for core_id in core_ids:
                self._unqueue(core_id)
            self._notify_room()
            if self._dead is None:
                self._send(AbortRequests(core_ids), quiet=True)
        return outs

    def _send(self, msg: CoreInput, quiet: bool = False) -> None:
        try:
            if self._client is None:
                raise anyio.ClosedResourceError
            self._client.inputs.send_nowait(msg)
        except (anyio.ClosedResourceError, anyio.BrokenResourceError):
            if not quiet:
                if self._dead is not None:
                    raise self._dead_error() from None
                raise EngineDeadError("the engine core is not accepting requests") from None

    async def _send_or_raise(self, msg: CoreInput) -> None:
        """`_send` for callers that can wait. A core that no longer takes inputs has died (or is
        being shut down): its death report follows on the output stream, so wait for it (briefly)
        before raising, so that the error carries the cause and `errored` is already true."""
        try:
            self._send(msg)
        except EngineDeadError:
            if self._dead is None and not self._stopping:
                with anyio.move_on_after(DEATH_REPORT_WAIT_S):
                    await self._dead_event.wait()
            if self._dead is not None:
                raise self._dead_error() from None
            raise

    # ------------------------------------------------------------------ utilities

    async def _call(self, op: UtilityOp) -> StepStats | bool | None:
        await self._ensure_started()
        self._require_running()
        cid = next(self._call_ids)
        done = anyio.Event()
        slot: list[UtilityResult] = []
        self._utility[cid] = (done, slot)
        try:
            await self._send_or_raise(UtilityCall(cid, op))
            await done.wait()
        finally:
            self._utility.pop(cid, None)
        if not slot:
            raise self._dead_error() if self._dead else EngineDeadError("the engine core stopped")
        if slot[0].error is not None:
            raise RuntimeError(slot[0].error)
        return slot[0].result

    async def get_engine_stats(self) -> StepStats:
        """Fresh statistics from the engine core (running, waiting, KV blocks, prefix cache)."""
        result = await self._call(UtilityOp.STATISTICS)
        assert isinstance(result, StepStats)
        return result

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._call(UtilityOp.RESET_PREFIX_CACHE))

    async def check_integrity(self) -> None:
        """Run the KV block manager's integrity check in the engine core (raises if broken)."""
        await self._call(UtilityOp.CHECK_INTEGRITY)

    async def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now (vLLM's `get_metrics()` shapes, the server's
        `triollm:` names)."""
        stats = await self.get_engine_stats()
        usage = 1.0 - stats.num_free_blocks / stats.num_blocks if stats.num_blocks else 0.0
        return [
            Gauge("triollm:num_requests_running", value=stats.num_running),
            Gauge("triollm:num_requests_waiting", value=stats.num_waiting),
            Gauge("triollm:kv_cache_usage_perc", value=usage),
            Gauge("triollm:prefix_cache_hit_rate", value=stats.prefix_cache_hit_rate),
            Counter("triollm:num_preemptions", value=stats.num_preemptions),
            Counter("triollm:prompt_tokens", value=self._num_prompt_tokens),
            Counter("triollm:generation_tokens", value=self._num_generation_tokens),
        ]

    async def pause_generation(
        self,
        *,
        mode: PauseMode = "abort",
        wait_for_inflight_requests: bool | None = None,
        clear_cache: bool = True,
    ) -> None:
        """Stop generating until `resume_generation()` (vLLM's, e.g. around a weight update).

        New requests are accepted and held in the frontend until resume. In-flight ones:
        `mode="abort"` aborts them (their streams end with finish_reason "abort"), `"wait"` lets
        them finish first, `"keep"` freezes them in the engine core (queue place and KV blocks
        kept) until resume. `clear_cache` then resets the prefix cache (blocks still held by
        kept requests stay). `wait_for_inflight_requests=True` is the deprecated `mode="wait"`.
        """
        if mode not in PAUSE_MODES:
            raise ValueError(f"mode: {mode!r} is not one of {', '.join(PAUSE_MODES)}")
        if wait_for_inflight_requests:
            warnings.warn(
                "pause_generation(wait_for_inflight_requests=True) is deprecated: use mode=\"wait\"",
                DeprecationWarning,
                stacklevel=2,
            )
            mode = "wait"
        await self._ensure_started()
        self._require_running()
        inflight = list(self._streams)
        self._paused = True
        if mode == "abort":
            self._abort_now(inflight)
        elif mode == "wait":
            for rid in inflight:
                stream = self._streams.get(rid)
                if stream is not None:
                    await stream.wait_finished()
        else:
            await self._call(UtilityOp.PAUSE)
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        """Generate again: frozen requests continue and held ones go to the engine core."""
        await self._ensure_started()
        self._require_running()
        if not self._paused:
            return
        await self._call(UtilityOp.RESUME)
        self._paused = False
        held, self._held = self._held, []
        for msg in held:
            if self._output.parent_id(msg.request.request_id) is not None:  # not aborted meanwhile
                await self._send_or_raise(msg)

    async def is_paused(self) -> bool:
        return self._paused

    # ------------------------------------------------------------------ the output actor

    async def _output_actor(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        assert self._client is not None
        outputs = self._client.outputs
        task_status.started()
        try:
            async with outputs:
                async for msg in outputs:
                    self._last_output = anyio.current_time()
                    match msg:
                        case OutputBatch():
                            await self._on_batch(msg)
                        case RequestError():
                            self._on_request_error(msg)
                        case UtilityResult(call_id=cid):
                            waiter = self._utility.get(cid)
                            if waiter is not None:
                                waiter[1].append(msg)
                                waiter[0].set()
                        case EngineDead(message=message, traceback=tb):
                            self._die(EngineDeadError(f"{message}\n{tb}".rstrip()))
                            return
                        case _:
                            log.warning("unexpected message from the engine core: %r", msg)
            if not self._stopping:
                self._die(EngineDeadError("the engine core stopped unexpectedly"))
        except Exception as exc:  # a bug here must not hang the requests: it kills the engine
            log.exception("output actor failed")
            self._die(EngineDeadError(f"output processing failed: {exc!r}\n{traceback.format_exc()}"))
        finally:
            for done, _ in self._utility.values():
                done.set()

    async def _on_batch(self, batch: OutputBatch) -> None:
        if batch.stats is not None:
            self.last_stats = batch.stats
        outputs = batch.to_outputs()
        if self._queued_prompt:
            for core_out in outputs:
                self._unqueue(core_out.request_id)
        if batch.pooled is not None:  # a pooling model's step: embeddings, no tokens
            for pooled in self._output.process_pooled(outputs):
                stream = self._streams.get(pooled.request_id)
                if stream is not None:
                    # A pooling request's one, final output passes through the stream as is
                    # (FINAL_ONLY: nothing to merge), read back by `encode`.
                    stream.put(cast(RequestOutput, pooled))
            self._notify_room()
            return
        size = self._output_chunk_size
        for start in range(0, len(outputs), size):
            if start:
                await anyio.lowlevel.checkpoint()
            chunk = outputs[start : start + size]
            self._num_generation_tokens += sum(len(o.new_token_ids) for o in chunk)
            processed = self._output.process_outputs(chunk)
            for out in processed.request_outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
            if processed.reqs_to_abort:
                self._send(AbortRequests(processed.reqs_to_abort), quiet=True)
        self._notify_room()

    def _on_request_error(self, msg: RequestError) -> None:
        rid = self._output.parent_id(msg.request_id) or msg.request_id
        stream = self._streams.get(rid)
        self._abort_one(rid)  # the other children of an n>1 request, and local state
        if stream is not None:
            error: Exception = (
                ValueError(msg.message) if msg.kind == "ValueError" else EngineGenerateError(msg.message)
            )
            stream.put_error(error)

    def _die(self, error: EngineDeadError) -> None:
        if self._dead is not None:
            return
        self._dead = error
        self._dead_event.set()
        self._notify_room()
        log.error("engine core died: %s", error)
        for stream in self._streams.values():
            stream.put_error(EngineDeadError(str(error)))
        for done, _ in self._utility.values():
            done.set()

    # ------------------------------------------------------------------ the watchdog

    async def _watchdog(self, scope: anyio.CancelScope, timeout: float) -> None:  # noqa: ASYNC109
        """An engine that is alive but silent is dead: with work pending (requests the core
        should be stepping, or utility calls awaiting an answer) and no message from the core
        for `timeout` seconds (`engine_output_timeout_s`), declare it dead like any other death
        (`EngineDeadError` on every stream, `errored`, new requests refused, `check_health`
        raises). Requests frozen by `pause_generation(mode="keep")` are not pending work. The
        core itself is torn down by the usual bounded teardown at shutdown (a hung in-process
        step's thread is abandoned; a hung child is killed). Checks every `timeout / 8`, so the
        death is declared between `timeout` and `1.125 * timeout` after the last message."""
        with scope:
            self._last_output = anyio.current_time()
            while self._dead is None:
                await anyio.sleep(timeout / 8)
                now = anyio.current_time()
                if not self._work_pending():
                    self._last_output = now
                elif now - self._last_output >= timeout:
                    log.error("no output from the engine core for %.1f s with work pending", now - self._last_output)
                    if self._client is not None:
                        self._client.shutdown_grace_s = 0.0  # its step will not end: no grace
                    self._die(
                        EngineDeadError(
                            f"the engine core sent nothing for {now - self._last_output:.1f} s with work "
                            f"pending (engine_output_timeout_s={timeout}): it is hung"
                        )
                    )

    def _work_pending(self) -> bool:
        if self._utility:
            return True
        return not self._paused and self._output.num_unfinished_sequences > 0


def _freeze_heap() -> None:
    """Move everything alive after start-up (torch, the tokenizer, the model config) out of the
    cyclic garbage collector's view. Without it a full collection walked those objects every
    so often under load: 150-210 ms event-loop stalls in the pipeline benchmark, none after."""
    gc.collect()
    gc.freeze()


def _input_size(prompt: object, params: SamplingParams | PoolingParams) -> int:
    """The work `InputProcessor.process` will do for this request, in characters or token ids:
    the prompt (text to tokenize, ids to check) plus every `bad_words` entry (tokenized twice,
    each call with its fixed cost), so that 8,192 one-letter bad words count as much as they
    cost. Cheap: lengths only. Values of the wrong type count 0: `process` rejects them."""
    size = 0
    if isinstance(prompt, str):
        size += len(prompt)
    elif isinstance(prompt, Mapping):
        for key in ("prompt", "prompt_token_ids"):
            value = prompt.get(key)
            if isinstance(value, str | list | tuple):
                size += len(value)
    bad_words = params.bad_words if isinstance(params, SamplingParams) else None
    if isinstance(bad_words, list):
        size += sum(
            2 * (len(word) + _TOKENIZER_CALL_CHARS) for word in bad_words if isinstance(word, str)
        )
    return size
