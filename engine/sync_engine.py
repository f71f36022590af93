"""`SyncEngine`: the in-process, single-threaded driver of the engine (not public API).

The same `Frontend` as `AsyncLLM` (one request table, one id scheme, one `PromptType`) in front
of an `EngineCore`, in one loop: no event loop, no threads. It is the sans-IO harness of the
engine: the engine tests drive the core through it without an event loop, and the benchmarks
use it as the "engine alone" baseline that `LLM`'s overhead is measured against. Users run the
engine through `LLM`, `AsyncLLM` or `LLMEngine`; this class is not exported from `triollm`.

Each request's outputs go to a sink that collects them for the current call (`step`, `abort`);
a request leaves the table once its finished output has been handed out.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence

from triollm.engine.config import EngineArgs, EngineConfig
from triollm.engine.core import EngineCore
from triollm.engine.frontend import Frontend, InputProcessor, LoRAChecker
from triollm.engine.inputs import PromptType
from triollm.engine.outputs import RequestOutput
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams
from triollm.lora.request import LoRARequest

__all__ = ["SyncEngine"]


class _Collect:
    """A request's sink: its outputs join the engine's list of outputs of the current call."""

    def __init__(self, into: list[RequestOutput]) -> None:
        self._into = into
        self.error: BaseException | None = None

    def put(self, output: RequestOutput) -> None:
        self._into.append(output)

    def put_error(self, error: BaseException) -> None:
        self.error = error


class SyncEngine:
    def __init__(
        self, config: EngineConfig, tokenizer: Tokenizer | None = None, core: EngineCore | None = None
    ) -> None:
        """`core`: an engine core built elsewhere (tests inject a runner into one)."""
        self.config = config
        self.tokenizer = tokenizer or Tokenizer.from_pretrained(config.tokenizer)
        self.core = core or EngineCore(config)
        self.input = InputProcessor(
            config.model,
            self.tokenizer,
            max_logprobs=config.actor.max_logprobs,
            scheduling_policy=config.scheduler.policy,
        )
        self.frontend = Frontend(self.input)
        self.lora = LoRAChecker(config.lora, config.model)
        self._delivered: list[RequestOutput] = []
        self._ids = itertools.count()

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> SyncEngine:
        return cls(args.create_engine_config())

    def add_request(
        self,
        prompt: PromptType,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> str:
        rid = request_id if request_id is not None else str(next(self._ids))
        state = self.frontend.open(rid, _Collect(self._delivered))  # rejects an id in use
        added: list[str] = []
        try:
            processed = self.frontend.process(
                state,
                prompt,
                params,
                arrival_time=time.time(),
                priority=priority,
                lora_request=self.lora.check(lora_request),
            )
            for core_request in self.frontend.add(processed):
                self.core.add_request(core_request)
                added.append(core_request.request_id)
        except BaseException:
            self.core.abort_requests(added)
            self.frontend.discard(rid)
            raise
        return rid

    def abort(self, request_ids: Sequence[str]) -> list[RequestOutput]:
        self.core.abort_requests(self.frontend.abort(request_ids))
        return self._hand_out()

    def step(self) -> list[RequestOutput]:
        processed = self.frontend.on_outputs(self.core.step())
        if processed.reqs_to_abort:
            self.core.abort_requests(processed.reqs_to_abort)
        return self._hand_out()

    def _hand_out(self) -> list[RequestOutput]:
        outputs, self._delivered[:] = list(self._delivered), []
        for out in outputs:
            if out.finished:
                state = self.frontend.get(out.request_id)
                if state is not None:
                    self.frontend.release(out.request_id, state.sink)
        return outputs

    def unfinished_request_ids(self) -> list[str]:
        return self.frontend.request_ids()

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or self.frontend.num_requests > 0

    def run(self) -> Iterator[RequestOutput]:
        while self.has_unfinished_requests():
            yield from self.step()

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in input order (`lora_request`: one adapter, or one
        per prompt)."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params] * len(prompts)  # type: ignore[list-item]
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: {len(params)} given for {len(prompts)} prompts")
        loras = (
            [lora_request] * len(prompts)
            if lora_request is None or isinstance(lora_request, LoRARequest)
            else list(lora_request)
        )
        if len(loras) != len(prompts):
            raise ValueError(f"lora_request: {len(loras)} given for {len(prompts)} prompts")
        ids: list[str] = []
        try:
            for prompt, p, lora in zip(prompts, params, loras):
                p = (p or SamplingParams(**self.config.model.generation_defaults)).clone()
                p.output_kind = RequestOutputKind.FINAL_ONLY
                ids.append(self.add_request(prompt, p, lora_request=lora))
            results: dict[str, RequestOutput] = {}
            for out in self.run():
                if out.finished:
                    results[out.request_id] = out
        except BaseException:
            self.abort(ids)
            raise
        return [results[rid] for rid in ids]
