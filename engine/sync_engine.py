"""`SyncEngine`: the in-process, single-threaded driver of the engine (not public API).

InputProcessor → EngineCore → OutputProcessor in one loop, no event loop, no threads. It is the
sans-IO harness of the engine: the engine tests drive the core through it without an event loop,
and the benchmarks use it as the "engine alone" baseline that `LLM`'s overhead is measured
against. Users run the engine through `LLM`, `AsyncLLM` or `LLMEngine`, which wire the same
three parts through tasks and streams; this class is not exported from `triollm`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from typing import Any

from triollm.engine.config import EngineArgs, EngineConfig
from triollm.engine.core import EngineCore
from triollm.engine.outputs import RequestOutput
from triollm.engine.processing.processors import InputProcessor, OutputProcessor
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["SyncEngine"]

PromptType = str | dict[str, Any]


class SyncEngine:
    def __init__(self, config: EngineConfig, tokenizer: Tokenizer | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer or Tokenizer.from_pretrained(config.tokenizer)
        self.core = EngineCore(config)
        self.input = InputProcessor(config.model, self.tokenizer, max_logprobs=config.actor.max_logprobs)
        self.output = OutputProcessor(self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> SyncEngine:
        return cls(args.create_engine_config())

    def add_request(
        self, prompt: PromptType, params: SamplingParams | None = None, request_id: str | None = None, priority: int = 0
    ) -> str:
        rid = request_id if request_id is not None else str(next(self._ids))
        processed = self.input.process(prompt, params, rid, arrival_time=time.monotonic(), priority=priority)
        self.output.add_request(processed)  # first: it rejects a duplicate user request id
        added: list[str] = []
        try:
            for core_req in processed.core_requests:
                self.core.add_request(core_req)
                added.append(core_req.request_id)
        except BaseException:
            self.core.abort_requests(added)
            self.output.abort_requests([rid])
            raise
        return rid

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        core_ids = [cid for rid in request_ids for cid in self.output.unfinished_core_ids(rid)]
        outs = self.output.abort_requests(list(request_ids))
        self.core.abort_requests(core_ids)
        return outs

    def step(self) -> list[RequestOutput]:
        processed = self.output.process_outputs(self.core.step())
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        return processed.request_outputs

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.output.has_unfinished_requests()

    def run(self) -> Iterator[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)  # type: ignore[list-item]
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p in zip(prompts, params):
                p = (p or SamplingParams(**self.config.model.generation_defaults)).clone()
                p.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(self.add_request(prompt, p))
            results: dict[str, RequestOutput] = {}
            for out in self.run():
                if out.finished:
                    results[out.request_id] = out
        except BaseException:
            self.abort(ids)
            raise
        return [results[rid] for rid in ids]
