"""`LLMEngine`: vLLM's legacy loop for scripts that drive the engine themselves.

    engine = LLMEngine.from_engine_args(EngineArgs(model=...))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A thin shell over `AsyncLLM` behind a blocking portal, so it runs over either transport. Each
request is an `AsyncLLM.add_request` handle (`RequestStream`). `LLM` is built on it: its
`llm_engine` is one of these, and its batches run in the same portal (`portal`, `async_llm`).
`shutdown()` is idempotent; a `weakref.finalize` (holding no reference to `self`) closes a
forgotten engine at interpreter exit as a last resort.

How `step()` waits for "any of many requests": one forwarder task per request reads its stream
and sends each output into ONE memory object stream of size 0 that this engine owns; `step()`
receives one item (waiting if none is ready), then takes whatever other forwarders are already
waiting to hand theirs over (`receive_nowait`), and returns them. A forwarder blocked on the
hand-over holds one output while its request's stream keeps merging what comes next (DELTA) or
keeping the newest (CUMULATIVE / FINAL_ONLY), so `step()` returns at most one output per request,
as vLLM's does, and the output actor never waits for the script. The forwarders live in a task
group entered with the `AsyncLLM` in the portal, so `shutdown()` cancels them (closing every
stream aborts what is unfinished) before the engine stops.

Rejected: a callback on the handle (`on_ready`) waking an event here - it runs foreign code in the
output actor on every put; and a per-`step()` task per request waiting for any - O(requests)
tasks spawned on every step.

`abort_request()` closes the request's stream (the abort runs at once, in the portal call) and
forgets the request: as in vLLM, an aborted request yields no more outputs from `step()`.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import anyio
from anyio.abc import TaskGroup
from anyio.from_thread import BlockingPortal, start_blocking_portal
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from triollm.actors.async_llm import AsyncLLM
from triollm.actors.request_stream import RequestStream
from triollm.engine.config import EngineArgs
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.inputs import PromptType
from triollm.engine.loading.model_config import ModelConfig
from triollm.engine.metrics import Metric
from triollm.engine.outputs import RequestOutput
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import SamplingParams
from triollm.lora.request import LoRARequest

__all__ = ["LLMEngine"]


class LLMEngine:
    def __init__(
        self,
        args: EngineArgs,
        *,
        backend: str = "trio",
        engine_core_factory: EngineCoreFactory | str | None = None,
    ) -> None:
        if backend not in ("trio", "asyncio"):
            raise ValueError(f"backend: {backend!r} is not one of trio, asyncio")
        self._stack = contextlib.ExitStack()
        try:
            self.portal: BlockingPortal = self._stack.enter_context(start_blocking_portal(backend))
            self._loop: _Requests = self._stack.enter_context(
                self.portal.wrap_async_context_manager(_running(args, engine_core_factory))
            )
        except BaseException:
            self._stack.close()
            raise
        self.async_llm: AsyncLLM = self._loop.llm  # lives in the portal's event loop
        self._ids = itertools.count()
        loop_thread = self.portal.call(threading.get_ident)
        self._finalizer = weakref.finalize(self, _close_from_other_thread, self._stack, loop_thread)

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        *,
        backend: str = "trio",
        engine_core_factory: EngineCoreFactory | str | None = None,
    ) -> LLMEngine:
        return cls(args, backend=backend, engine_core_factory=engine_core_factory)

    @property
    def model_config(self) -> ModelConfig:
        return self.async_llm.get_model_config()

    def get_tokenizer(self) -> Tokenizer:
        return self.async_llm.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        return self.portal.call(self.async_llm.reset_prefix_cache)

    def get_metrics(self) -> list[Metric]:
        return self.portal.call(self.async_llm.get_metrics)

    def do_log_stats(self) -> None:
        self.portal.call(self.async_llm.do_log_stats)

    # vLLM's LLMEngine LoRA calls (AsyncLLM's)
    def add_lora(self, lora_request: LoRARequest) -> bool:
        return self.portal.call(self.async_llm.add_lora, lora_request)

    def remove_lora(self, lora_id: int) -> bool:
        return self.portal.call(self.async_llm.remove_lora, lora_id)

    def list_loras(self) -> set[int]:
        return self.portal.call(self.async_llm.list_loras)

    def pin_lora(self, lora_id: int) -> bool:
        return self.portal.call(self.async_llm.pin_lora, lora_id)

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        lora_request: LoRARequest | None = None,
        priority: int = 0,
    ) -> str:
        """Add one request (under the adapter `lora_request`, None: the base model); its id."""
        rid = request_id if request_id is not None else f"engine-{next(self._ids)}"
        self.portal.call(self._loop.add, rid, prompt, params, priority, lora_request)
        return rid

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self.portal.call(self._loop.abort, ids)

    def has_unfinished_requests(self) -> bool:
        return self._loop.num_unfinished() > 0

    def get_num_unfinished_requests(self) -> int:
        return self._loop.num_unfinished()

    def step(self) -> list[RequestOutput]:
        """Wait until at least one request has something new; return every output that is ready
        (at most one per request). A request that failed raises its error here, once."""
        return self.portal.call(self._loop.step)

    def shutdown(self) -> None:
        """Stop the engine and the portal thread. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()


@dataclass(frozen=True)
class _Ready:
    stream: RequestStream
    output: RequestOutput | None = None
    error: Exception | None = None


def _close_from_other_thread(stack: contextlib.ExitStack, loop_thread: int) -> None:
    # Closing from the portal's own loop thread would deadlock (the portal raises RuntimeError).
    if loop_thread == threading.get_ident():
        return
    stack.close()


@contextlib.asynccontextmanager
async def _running(args: EngineArgs, core_factory: EngineCoreFactory | str | None) -> AsyncIterator[_Requests]:
    async with AsyncLLM.from_engine_args(args, engine_core_factory=core_factory) as llm:
        ready_tx, ready_rx = anyio.create_memory_object_stream[_Ready](0)
        with ready_tx, ready_rx:
            async with anyio.create_task_group() as tg:
                try:
                    yield _Requests(llm, tg, ready_tx, ready_rx)
                finally:
                    tg.cancel_scope.cancel()  # forwarders close their streams: unfinished abort


class _Requests:
    """The engine's requests, touched only in the portal's event loop."""

    def __init__(
        self,
        llm: AsyncLLM,
        tg: TaskGroup,
        ready_tx: MemoryObjectSendStream[_Ready],
        ready_rx: MemoryObjectReceiveStream[_Ready],
    ) -> None:
        self.llm = llm
        self._tg = tg
        self.streams: dict[str, RequestStream] = {}
        self._ready_tx, self._ready_rx = ready_tx, ready_rx
        self._error: Exception | None = None  # met while draining a step that had outputs

    def num_unfinished(self) -> int:
        """Requests whose end `step()` has not returned yet (a failure counts until raised)."""
        return len(self.streams) + (self._error is not None)

    async def add(
        self,
        rid: str,
        prompt: PromptType,
        params: SamplingParams | None,
        priority: int,
        lora_request: LoRARequest | None,
    ) -> None:
        if rid in self.streams:
            raise ValueError(f"request_id: {rid!r} is already in use by an unfinished request")
        # Offline scripts add more than the queue holds: wait for room rather than EngineBusyError.
        stream = await self.llm.add_request(
            rid, prompt, params, priority=priority, wait_for_room=True, lora_request=lora_request
        )
        self.streams[rid] = stream
        self._tg.start_soon(self._forward, stream)

    async def abort(self, ids: list[str]) -> None:
        for rid in ids:
            stream = self.streams.pop(rid, None)
            if stream is not None:
                stream.close()  # aborts now; its forwarder ends, its last output is dropped

    async def _forward(self, stream: RequestStream) -> None:
        with stream:
            try:
                async for output in stream:
                    await self._ready_tx.send(_Ready(stream, output))
            except anyio.ClosedResourceError:
                return  # aborted by abort_request
            except Exception as exc:
                await self._ready_tx.send(_Ready(stream, error=exc))

    async def step(self) -> list[RequestOutput]:
        if self._error is not None:
            error, self._error = self._error, None
            raise error
        outputs: list[RequestOutput] = []
        while self.streams and not outputs:
            ready = await self._ready_rx.receive()
            while True:
                if not self._take(ready, outputs):
                    break
                try:
                    ready = self._ready_rx.receive_nowait()
                except anyio.WouldBlock:
                    break
        return outputs

    def _take(self, ready: _Ready, outputs: list[RequestOutput]) -> bool:
        """Add a hand-over to this step's outputs; False once an error stops the step."""
        rid = ready.stream.request_id
        if self.streams.get(rid) is not ready.stream:
            return True  # an output of a request aborted meanwhile
        if ready.error is not None:
            del self.streams[rid]
            if not outputs:
                raise ready.error
            self._error = ready.error  # raised by the next step, after these outputs
            return False
        assert ready.output is not None
        if ready.output.finished:
            del self.streams[rid]
        outputs.append(ready.output)
        return True
