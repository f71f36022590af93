"""`AsyncLLM`: vLLM's async entry point, a shell around the sans-IO `Frontend`.

```
add_request() ──Frontend: open, process, add──▶ CoreLink ──▶ engine core (actors/transport.py)
RequestStream ◀──Frontend.on_outputs──── OutputActor ◀── core outputs ◀──┘
```

The request table, the id scheme, the queue count, pause and hold, and what an abort must send
live in `engine/frontend/` (no awaits there); the running parts (task group, output actor,
watchdog, the root task for an engine nobody entered) and a request's way in (processing in a
worker thread, waiting for queue room, sending: `EngineRuntime.admit`) in `EngineRuntime`
(actors/runtime.py). This class is vLLM's API over them: which requests go to a thread, utility
calls, pause modes.

Requests: `add_request()` returns the request's `RequestStream` (request_stream.py), the one
public handle every consumer uses; `generate()` is a thin async generator over it. A consumer
may stop any way it likes (cancellation, `aclose()`, `break`, GeneratorExit): closing the handle
aborts the request exactly once, synchronously (the core's input stream is unbounded, so the
abort never has to wait, even inside a cancelled scope). The engine's death reaches every
stream as `EngineDeadError` (the data path); new requests then fail at once.
"""

from __future__ import annotations

import itertools
import logging
import pickle
import time
import warnings
from collections.abc import AsyncGenerator, Callable, Iterable
from typing import Any, Literal, cast

import anyio
import cloudpickle

from triollm.actors.beam_search import run_beam_search
from triollm.actors.core_link import InputTap
from triollm.actors.errors import EngineDeadError
from triollm.actors.host import ShutdownCall
from triollm.actors.messages import AddRequest, UtilityOp
from triollm.actors.request_stream import RequestStream
from triollm.actors.runtime import EngineRuntime
from triollm.actors.stats import FrontendStatistics, StatsLog, engine_metrics, frontend_statistics
from triollm.engine.beam_search import BeamSearchParams
from triollm.engine.config import EngineArgs, EngineConfig, ModelConfig
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.core_protocol import EngineCoreStats
from triollm.engine.execution.sleep_mode import check_level, check_tags
from triollm.engine.frontend import Frontend, LoRAChecker, input_size
from triollm.engine.frontend.input import LARGE_INPUT, ProcessedRequest
from triollm.engine.inputs import PromptType
from triollm.engine.metrics import Metric
from triollm.engine.outputs import RequestOutput
from triollm.engine.pooling_outputs import PoolingOutput, PoolingRequestOutput
from triollm.engine.pooling_params import PoolingParams
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.request import EngineCoreRequest
from triollm.engine.sampling_params import SamplingParams
from triollm.lora.request import LoRARequest

__all__ = ["AsyncEngineArgs", "AsyncLLM", "FrontendStatistics", "PauseMode", "ShutdownCall"]

log = logging.getLogger("triollm")

# Inputs larger than this (`input_size`) are processed in a worker thread (tests patch it).
_LARGE_PROMPT = LARGE_INPUT

SUPPORTED_TASKS: tuple[str, ...] = ("generate",)
PauseMode = Literal["abort", "wait", "keep"]
PAUSE_MODES: tuple[str, ...] = ("abort", "wait", "keep")


class AsyncEngineArgs(EngineArgs):
    """vLLM's name for the engine arguments of `AsyncLLM` (the same fields)."""


class AsyncLLM:
    def __init__(
        self,
        args: EngineArgs,
        *,
        chat_template: str | None = None,
        engine_core_factory: EngineCoreFactory | str | None = None,
        input_tap: InputTap | None = None,
    ) -> None:
        """Resolve the configuration (a bad model or argument raises here, as in vLLM); the
        engine starts with `async with`, `start()`, or on first use. `engine_core_factory` and
        `input_tap` are test seams (triollm.testing): what builds the engine core, and a
        function every message to the core passes through."""
        self.args = args
        self.config: EngineConfig = args.create_engine_config()
        self._rt = EngineRuntime(
            self.config,
            chat_template=chat_template,
            core_factory=EngineCoreFactory.coerce(engine_core_factory),
            input_tap=input_tap,
        )
        self._link = self._rt.link
        self._request_ids = itertools.count()
        self._stats_log = StatsLog()
        self._lora = LoRAChecker(self.config.lora, self.config.model)  # every adapter passes here

    @classmethod
    def from_engine_args(cls, args: EngineArgs, **kwargs: Any) -> AsyncLLM:
        """Build (not start): use it as `async with AsyncLLM.from_engine_args(args) as llm:`."""
        return cls(args, **kwargs)

    from_config = from_engine_args

    # ------------------------------------------------------------------ lifecycle

    async def __aenter__(self) -> AsyncLLM:
        await self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # The engine's death is reported on the data path; leaving the block does not raise it.
        await self.shutdown()

    async def start(self) -> None:
        """Start the engine (load the model, start the core, start the actors)."""
        await self._rt.start()

    def shutdown(self, timeout: float | None = None) -> ShutdownCall:
        """Stop accepting requests, let in-flight ones finish for up to `timeout` seconds, abort
        the rest (their streams end with finish_reason "abort"), stop the engine. Idempotent.

        Callable as vLLM's `llm.shutdown()`: new requests are refused at once, and an engine that
        started on first use (no `async with`) is told to stop; its root task tears it down.
        `await llm.shutdown()` also waits until the engine has stopped (structured code)."""
        return self._rt.shutdown(timeout or 0.0)

    # ------------------------------------------------------------------ state

    @property
    def _table(self) -> Frontend:
        if self._rt.frontend is None:
            self._rt.require_running()  # raises: not started
        assert self._rt.frontend is not None
        return self._rt.frontend

    @property
    def tokenizer(self) -> Tokenizer | None:
        return self._rt.tokenizer

    @property
    def is_running(self) -> bool:
        return self._rt.running

    @property
    def errored(self) -> bool:
        return self._link.dead is not None

    @property
    def is_stopped(self) -> bool:
        """vLLM's name: the engine no longer serves (shut down, or dead)."""
        return self._link.stopping or self._link.dead is not None

    @property
    def dead_error(self) -> EngineDeadError | None:
        return self._link.dead

    @property
    def last_stats(self) -> EngineCoreStats | None:
        """The engine core's statistics from its latest step that carried them."""
        return None if self._rt.outputs is None else self._rt.outputs.last_stats

    @property
    def rank_stats(self) -> list[EngineCoreStats | None] | None:
        """Data parallel: each rank's latest statistics, by rank; None with one engine core."""
        client = self._link.client
        return None if client is None or client.rank_stats is None else list(client.rank_stats)

    @property
    def model_config(self) -> ModelConfig:
        return self.config.model

    def get_model_config(self) -> ModelConfig:
        return self.config.model

    def get_tokenizer(self) -> Tokenizer:
        self._rt.require_running()
        assert self.tokenizer is not None
        return self.tokenizer

    async def get_supported_tasks(self) -> tuple[str, ...]:
        await self._rt.ensure_started()
        pooler = self.config.model.pooler
        return pooler.tasks if pooler is not None else SUPPORTED_TASKS

    @property
    def num_unfinished_requests(self) -> int:
        return 0 if self._rt.frontend is None else self._rt.frontend.num_requests

    def unfinished_request_ids(self) -> list[str]:
        return [] if self._rt.frontend is None else self._rt.frontend.request_ids()

    def statistics(self) -> FrontendStatistics:
        """The frontend's counts now (trio's `statistics()` manner; no round trip)."""
        return frontend_statistics(self._rt.frontend, self._link.client)

    async def wait_errored(self) -> EngineDeadError:
        """Wait until the engine dies; return the error every request saw."""
        return await self._link.wait_dead()

    async def wait_idle(self) -> None:
        """Wait until no request is in flight."""
        await self._rt.idle.wait()

    async def check_health(self) -> None:
        """Raise `EngineDeadError` if the engine died (vLLM's health check)."""
        if self._link.dead is not None:
            raise self._link.dead_error()
        if not self._rt.hosted:
            self._rt.require_running()

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
        lora_request: LoRARequest | None = None,
    ) -> RequestStream:
        """Validate and tokenize the request (in a worker thread when its input is large or it
        has a grammar), send it to the engine and return its `RequestStream`.

        Raises at once, holding nothing: `ValueError` for a bad request or an id already used by
        an unfinished request, `EngineDeadError` when the engine died, `RuntimeError` when it is
        not running. Close the stream (`with`, `async with`, `close()`) when done: an unfinished
        request is aborted then, exactly once. An `abort(request_id)` that arrives while the
        request is still being added sticks: it never reaches the core and its stream ends with
        finish_reason "abort".

        Backpressure: over `max_num_queued_reqs` or `max_num_queued_tokens` (the frontend's
        count, `Frontend.busy`) it raises `EngineBusyError` (nothing added, the id free again),
        or with `wait_for_room=True` (offline batches: `LLM`, `LLMEngine`) waits for room.

        `lora_request`: the adapter the request runs under (None: the base model), checked
        first (`LoRAChecker`: LoRA enabled, the adapter's config and tensors; read once per adapter, in a
        worker thread).
        """
        await self._rt.ensure_started()
        self._rt.require_running()
        table = self._table
        if params is None:
            params = SamplingParams(**self.config.model.generation_defaults)
        lora = self._lora
        grammar = isinstance(params, SamplingParams) and params.structured_outputs is not None
        # A grammar is compiled, an adapter seen for the first time has its config read.
        slow = input_size(prompt, params) > _LARGE_PROMPT or grammar or lora.needs_io(lora_request)
        stream = RequestStream(request_id, params.output_kind, self._release)
        state = table.open(request_id, stream)  # the id is reserved before any await
        arrival = time.time() if arrival_time is None else arrival_time  # wall-clock, as vLLM's

        def process() -> ProcessedRequest:
            checked = lora.check(lora_request)
            return table.process(state, prompt, params, arrival_time=arrival, priority=priority, lora_request=checked)

        await self._rt.admit(state, process, in_thread=slow, wait_for_room=wait_for_room)
        return stream

    async def generate(
        self,
        prompt: PromptType,
        sampling_params: SamplingParams | None = None,
        request_id: str | None = None,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the outputs of one request (under the adapter `lora_request`, None: the base
        model). Wrap it in `contextlib.aclosing` so that leaving early aborts the request at
        once rather than when the generator is collected."""
        rid = request_id if request_id is not None else f"req-{next(self._request_ids)}"
        with await self.add_request(
            rid, prompt, sampling_params, priority=priority, lora_request=lora_request
        ) as stream:
            async for output in stream:
                yield output

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
        await self._rt.ensure_started()
        if self.config.model.runner_type != "pooling":
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
                # One PoolingRequestOutput; anything else is the abort's RequestOutput.
                if not isinstance(output, PoolingRequestOutput):
                    return
                yield cast(PoolingRequestOutput[PoolingOutput], output)

    async def beam_search(
        self,
        prompt: PromptType,
        request_id: str,
        params: BeamSearchParams,
        lora_request: LoRARequest | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """vLLM's `EngineClient.beam_search`: one finished `RequestOutput` whose outputs are the
        `params.beam_width` best sequences, best first (actors/beam_search.py), every beam under
        the adapter `lora_request`. Leaving early (cancellation, closing the generator) aborts
        the round's requests."""
        await self._rt.ensure_started()
        yield await run_beam_search(self, prompt, request_id, params, await self._checked(lora_request))

    # ------------------------------------------------------------------ LoRA adapters

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """vLLM's `add_lora`: check the adapter (LoRA enabled, its `adapter_config.json`: the
        PEFT fields and `r <= max_lora_rank`; every tensor readable and of the base model's
        shape; in a worker thread) so that requests under it are accepted without reading it
        again; `ValueError` naming the field and the file otherwise. The engine core reads the
        weights again when a request first uses the adapter. True once checked."""
        if not isinstance(lora_request, LoRARequest):
            raise ValueError(f"lora_request: must be a LoRARequest, got {type(lora_request).__name__}")
        await self._checked(lora_request)
        return True

    async def _checked(self, lora_request: LoRARequest | None) -> LoRARequest | None:
        if self._lora.needs_io(lora_request):
            return await anyio.to_thread.run_sync(self._lora.check, lora_request)
        return self._lora.check(lora_request)

    async def remove_lora(self, lora_id: int) -> bool:
        """vLLM's `remove_lora`: forget the adapter (checked config, pin, the engine core's copy
        of its weights; a slot a running request uses is kept until it finishes). Requests may
        name it again, and it is read again then. False if it was not known."""
        if not self._lora.enabled:
            return False
        known = self._lora.forget(lora_id)
        held = await self.collective_rpc("remove_lora", args=(lora_id,))
        return known or any(held)

    async def list_loras(self) -> set[int]:
        """vLLM's `list_loras`: the ids of the adapters added or used and still remembered."""
        return self._lora.ids()

    async def pin_lora(self, lora_id: int) -> bool:
        """vLLM's `pin_lora`: keep the adapter (added first: `add_lora`) remembered and, once the
        engine core has loaded it, in host memory and in its slot; ValueError naming `lora_id`
        when it is unknown or no slot would stay free."""
        self._lora.pin(lora_id)
        await self.collective_rpc("pin_lora", args=(lora_id,))
        return True

    async def abort(self, request_id: str | Iterable[str], internal: bool = False) -> None:
        """Abort requests (vLLM's coroutine); their streams end normally with finish_reason
        "abort". Unknown or finished ids are ignored. `internal` is accepted for vLLM's signature."""
        self._abort_now(request_id)

    def _abort_now(self, request_id: str | Iterable[str]) -> None:
        if self._rt.frontend is not None:
            self._link.abort(self._rt.frontend.abort(request_id))
            self._rt.notify_room()

    def _release(self, stream: RequestStream) -> None:
        """The stream's consumer is done with it: abort the request unless it ended."""
        if self._rt.frontend is not None:
            self._link.abort(self._rt.frontend.release(stream.request_id, stream))
            self._rt.notify_room()
            self._rt.check_idle()

    # ------------------------------------------------------------------ utilities

    async def _call(self, op: UtilityOp, payload: bytes = b"") -> EngineCoreStats | bool | bytes | None:
        await self._rt.ensure_started()
        self._rt.require_running()
        return await self._link.call(op, payload)

    async def _core_method(self, op: UtilityOp, *args: Any, **kwargs: Any) -> Any:
        """The engine core's method `op` names (actors/core_loop.py), its arguments and result
        cloudpickled across the process boundary."""
        result = await self._call(op, cloudpickle.dumps((args, kwargs)))
        assert isinstance(result, bytes)
        return pickle.loads(result)

    async def get_engine_stats(self) -> EngineCoreStats:
        """Fresh statistics from the engine core (running, waiting, KV blocks, prefix cache)."""
        result = await self._call(UtilityOp.STATISTICS)
        assert isinstance(result, EngineCoreStats)
        return result

    async def reset_prefix_cache(self) -> bool:
        return bool(await self._call(UtilityOp.RESET_PREFIX_CACHE))

    async def check_integrity(self) -> None:
        """The frontend's request table, then the engine core's KV block manager (raises if
        either is inconsistent)."""
        if self._rt.frontend is not None:
            self._rt.frontend.check_integrity()
        await self._call(UtilityOp.CHECK_INTEGRITY)

    async def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now (vLLM's `get_metrics()` shapes)."""
        return engine_metrics(await self.get_engine_stats(), self.statistics())

    async def do_log_stats(self) -> None:
        """Log vLLM's periodic stats line (throughput since the last call, requests, KV cache,
        prefix cache). Does nothing with `disable_log_stats`."""
        if not self.args.disable_log_stats:
            self._stats_log.log(await self.get_engine_stats(), self.statistics())

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
        await self._rt.ensure_started()
        self._rt.require_running()
        table = self._table
        inflight = table.request_ids()
        table.pause()
        if mode == "abort":
            self._abort_now(inflight)
        elif mode == "wait":
            for rid in inflight:
                state = table.get(rid)
                if state is not None:
                    await cast(RequestStream, state.sink).wait_finished()
        else:
            await self._call(UtilityOp.PAUSE)
        if clear_cache:
            await self.reset_prefix_cache()

    async def resume_generation(self) -> None:
        """Generate again: frozen requests continue and held ones go to the engine core."""
        await self._rt.ensure_started()
        self._rt.require_running()
        if not self._table.paused:
            return
        await self._call(UtilityOp.RESUME)
        held: list[EngineCoreRequest] = self._table.resume()
        for core_request in held:
            await self._link.send_or_raise(AddRequest(core_request))

    async def is_paused(self) -> bool:
        return self._rt.frontend is not None and self._rt.frontend.paused

    # ------------------------------------------------------------------ sleep, reload, rpc

    async def sleep(self, level: int = 1) -> None:
        """vLLM's sleep mode: free the KV cache (level 1), and the weights (level 2); the prefix
        cache is forgotten. Requests sent while asleep fail with a ValueError naming the state;
        refused while requests are unfinished (engine/execution/sleep_mode.py)."""
        await self._core_method(UtilityOp.SLEEP, check_level(level))

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `tags` names ("weights", "kv_cache"; None: all): level 2's weights are
        read from the checkpoint again."""
        await self._core_method(UtilityOp.WAKE_UP, None if tags is None else sorted(check_tags(tags)))

    async def is_sleeping(self) -> bool:
        return bool(await self._core_method(UtilityOp.IS_SLEEPING))

    async def reload_weights(self, weights_path: str | None = None) -> None:
        """Read the weights again: from the running checkpoint, or from `weights_path`, another
        checkpoint whose config.json describes the same model (a ValueError naming the field
        that differs). The prefix cache is forgotten."""
        await self._core_method(UtilityOp.RELOAD_WEIGHTS, weights_path)

    async def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,  # noqa: ASYNC109 - vLLM's signature
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """vLLM's `collective_rpc`: `method` on every tensor-parallel rank's worker, one result
        per rank (per data-parallel rank too, in rank order). A name is a method of the worker
        (rank 0's is the executor: engine/execution/executor.py); a callable is run with the
        worker as its first argument. Arguments and results must pickle (cloudpickle: lambdas
        too). `timeout`: seconds to wait (TimeoutError after; the call itself is not undone)."""
        if not (isinstance(method, str) or callable(method)):
            raise ValueError(f"method: a method name or a callable, got {type(method).__name__}")
        with anyio.fail_after(timeout):
            result = await self._core_method(UtilityOp.COLLECTIVE_RPC, method, tuple(args), dict(kwargs or {}))
        return cast(list[Any], result)

    async def start_profile(self) -> None:
        """Start the torch profiler in the engine core; `stop_profile()` writes its trace into
        `VLLM_TORCH_PROFILER_DIR` (unset: a ValueError naming it)."""
        await self._core_method(UtilityOp.START_PROFILE)

    async def stop_profile(self) -> None:
        await self._core_method(UtilityOp.STOP_PROFILE)
