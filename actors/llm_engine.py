"""`LLMEngine`: vLLM's legacy loop for scripts that drive the engine themselves.

    engine = LLMEngine.from_engine_args(EngineArgs(model=...))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=8))
    while engine.has_unfinished_requests():
        for out in engine.step(): ...

A thin shell over `AsyncLLM` behind a blocking portal (the same machinery as `LLM`), so it runs
over either transport. `step()` waits until at least one request has something new and returns
every output that is ready.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Sequence

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from triollm.actors.async_llm import AsyncLLM
from triollm.actors.collector import RequestCollector
from triollm.engine.config import EngineArgs
from triollm.engine.outputs import RequestOutput
from triollm.engine.processing.processors import PromptType
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import SamplingParams

__all__ = ["LLMEngine"]


class LLMEngine:
    def __init__(self, args: EngineArgs, *, backend: str = "trio") -> None:
        self._stack = contextlib.ExitStack()
        try:
            self._portal: BlockingPortal = self._stack.enter_context(start_blocking_portal(backend))
            self._engine: AsyncLLM = self._stack.enter_context(
                self._portal.wrap_async_context_manager(AsyncLLM.from_engine_args(args))
            )
        except BaseException:
            self._stack.close()
            raise
        self._collectors: dict[str, RequestCollector] = {}
        self._ids = itertools.count()
        self._wake: anyio.Event | None = None

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, backend: str = "trio") -> LLMEngine:
        return cls(args, backend=backend)

    def get_tokenizer(self) -> Tokenizer:
        return self._engine.get_tokenizer()

    def add_request(
        self,
        request_id: str | None,
        prompt: PromptType,
        params: SamplingParams | None = None,
        *,
        priority: int = 0,
    ) -> str:
        rid = request_id if request_id is not None else f"engine-{next(self._ids)}"
        if rid in self._collectors:
            raise ValueError(f"request_id: {rid!r} is already in use by an unfinished request")
        _, collector = self._portal.call(self._engine._add_request, prompt, params, rid, priority)
        collector.on_ready = self._notify
        self._collectors[rid] = collector
        return rid

    def abort_request(self, request_id: str | Sequence[str]) -> None:
        ids = [request_id] if isinstance(request_id, str) else list(request_id)
        self._portal.call(self._abort, ids)

    async def _abort(self, ids: list[str]) -> None:
        for rid in ids:
            collector = self._collectors.pop(rid, None)
            if collector is not None:
                self._engine._release(rid, collector)

    def has_unfinished_requests(self) -> bool:
        return bool(self._collectors)

    def get_num_unfinished_requests(self) -> int:
        return len(self._collectors)

    def step(self) -> list[RequestOutput]:
        return self._portal.call(self._step)

    def _notify(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _step(self) -> list[RequestOutput]:
        while self._collectors:
            self._wake = anyio.Event()
            outputs = self._drain()
            if outputs:
                return outputs
            await self._wake.wait()
        return []

    def _drain(self) -> list[RequestOutput]:
        outputs: list[RequestOutput] = []
        for rid, collector in list(self._collectors.items()):
            try:
                out = collector.get_nowait()
            except BaseException:
                self._collectors.pop(rid)
                self._engine._release(rid, collector)
                raise
            if out is None:
                continue
            outputs.append(out)
            if out.finished:
                self._collectors.pop(rid)
                self._engine._release(rid, collector)
        return outputs

    def shutdown(self) -> None:
        self._stack.close()

    def __enter__(self) -> LLMEngine:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()
