"""`LLM`: vLLM's synchronous entry point, driving an `AsyncLLM` through one blocking portal.

`llm.llm_engine` is an `LLMEngine` (actors/llm_engine.py), which owns the portal - an event loop
in one helper thread (`anyio.from_thread.start_blocking_portal`) - with the `AsyncLLM` entered
inside it, so its task group lives there for the `LLM`'s whole life. Each `generate()` is ONE
portal call: all requests are added and gathered inside the loop (a round trip per token
would cost more than a token's work). `enqueue()` / `wait_for_completion()` go through the
`LLMEngine`'s own `add_request` / `step` loop, as vLLM's do.

Ctrl-C: the caller's thread gets `KeyboardInterrupt` while it waits on the call's future.
`future.cancel()` returns before the in-loop aborts have run, so the batch task's `finally`
sets a `threading.Event` and the caller waits on it (bounded) before re-raising; the `LLM`
stays usable. `shutdown()` is idempotent (the `LLMEngine`'s).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import itertools
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any, TypeVar, cast

import anyio
import torch

from triollm.actors.llm_engine import LLMEngine
from triollm.actors.request_stream import RequestStream
from triollm.engine.beam_search import (
    BeamSearch,
    BeamSearchOutput,
    BeamSearchParams,
    prompt_token_ids,
)
from triollm.engine.config import EngineArgs
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.frontend import GENERATE_ON_POOLING, POOLING_ON_GENERATE
from triollm.engine.inputs import PromptType
from triollm.engine.metrics import Metric
from triollm.engine.outputs import RequestOutput
from triollm.engine.pooling_outputs import (
    ClassificationRequestOutput,
    EmbeddingRequestOutput,
    PoolingOutput,
    PoolingRequestOutput,
    ScoringRequestOutput,
)
from triollm.engine.pooling_params import POOLING_TASKS, PoolingParams
from triollm.engine.processing.chat_images import chat_images
from triollm.engine.processing.text_pairs import pair_prompt
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams
from triollm.lora.request import LoRARequest

__all__ = ["LLM", "engine_args_from_kwargs"]

_ABORT_WAIT_S = 5.0
# `lora_request=` of the list-taking calls: one adapter for every prompt, or one per prompt.
LoRAArg = LoRARequest | Sequence[LoRARequest | None] | None


def engine_args_from_kwargs(model: str | os.PathLike[str] | None = None, **kwargs: Any) -> EngineArgs:
    """vLLM's `LLM(...)` keywords -> `EngineArgs`: the same names as `EngineArgs` and the CLI
    flags, normalised and validated in one place (`EngineArgs`). An unknown keyword is a
    `TypeError` naming it, as the CLI rejects an unknown flag."""
    unknown = sorted(set(kwargs) - set(EngineArgs.field_names()))
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
    return EngineArgs(model=os.fspath(model) if model is not None else None, **kwargs)


class LLM:
    """Offline batch inference: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        backend: str = "trio",
        engine_core_factory: EngineCoreFactory | str | None = None,
        **kwargs: Any,
    ) -> None:
        """`engine_core_factory` is for tests and benchmarks (see `AsyncLLM`)."""
        self._start(engine_args_from_kwargs(model, **kwargs), backend, engine_core_factory)

    @classmethod
    def from_engine_args(
        cls,
        args: EngineArgs,
        *,
        backend: str = "trio",
        engine_core_factory: EngineCoreFactory | str | None = None,
    ) -> LLM:
        self = cls.__new__(cls)
        self._start(args, backend, engine_core_factory)
        return self

    def _start(self, args: EngineArgs, backend: str, core_factory: EngineCoreFactory | str | None) -> None:
        if args.data_parallel_size > 1:
            # vLLM's rule (its LLM would hang otherwise; here it is a choice): offline data
            # parallelism is one process per rank, each with its own LLM and share of the prompts.
            raise ValueError(
                f"data_parallel_size: {args.data_parallel_size} is not supported by LLM (allowed: 1); "
                "for offline data parallelism run one process per rank, each with its own LLM "
                "and a share of the prompts, as vLLM's examples/features/data_parallel/"
                "data_parallel_offline.py does; for serving use AsyncLLM or "
                "`triollm serve MODEL --data-parallel-size N`"
            )
        if args.num_threads is None:
            # Offline batches leave the frontend nearly idle (outputs are collected, not
            # streamed), so the engine core gets every core torch would use, where a server
            # keeps one for the frontend.
            args = dataclasses.replace(args, num_threads=torch.get_num_threads())
        self.args = args
        self._ids = itertools.count()
        self._enqueued: list[str] = []
        self.llm_engine = LLMEngine(args, backend=backend, engine_core_factory=core_factory)
        self._portal = self.llm_engine.portal
        self._engine = self.llm_engine.async_llm

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop the engine and the portal thread. Idempotent."""
        self.llm_engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self._engine.get_tokenizer()

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self._engine.get_model_config().generation_defaults)

    def reset_prefix_cache(self) -> bool:
        """Drop every cached prefix block not held by a running request (True if all were)."""
        return self.llm_engine.reset_prefix_cache()

    def get_metrics(self) -> list[Metric]:
        """The engine's counters and gauges now (`triollm.engine.metrics`)."""
        return self.llm_engine.get_metrics()

    # ------------------------------------------------------------------ sleep, reload, rpc (AsyncLLM's)

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1), and the weights (level 2), until `wake_up()`."""
        self._portal.call(self._engine.sleep, level)

    def wake_up(self, tags: list[str] | None = None) -> None:
        self._portal.call(self._engine.wake_up, tags)

    def is_sleeping(self) -> bool:
        return self._portal.call(self._engine.is_sleeping)

    def reload_weights(self, weights_path: str | None = None) -> None:
        """Read the weights again, from the running checkpoint or another of its architecture."""
        self._portal.call(self._engine.reload_weights, weights_path)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        timeout: float | None = None,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> list[Any]:
        """`method` on every rank's worker, one result per rank (`AsyncLLM.collective_rpc`)."""
        return self._portal.call(functools.partial(self._engine.collective_rpc, method, timeout, args, kwargs))

    def apply_model(self, func: Callable[[torch.nn.Module], Any]) -> list[Any]:
        """`func(model)` on every rank, one result per rank (results must pickle)."""
        return self.collective_rpc("apply_model", args=(func,))

    def start_profile(self) -> None:
        """Profile the engine core's steps until `stop_profile()`, which writes the trace into
        `VLLM_TORCH_PROFILER_DIR`."""
        self._portal.call(self._engine.start_profile)

    def stop_profile(self) -> None:
        self._portal.call(self._engine.stop_profile)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRAArg = None,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in input order. `lora_request`: the adapter every
        prompt runs under, or a list of one per prompt (None entries: the base model)."""
        self._require_runner("generate", "LLM.generate()")
        prompt_list: list[PromptType] = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)  # type: ignore[list-item]
        params = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority: {len(priority)} values given for {len(prompt_list)} prompts")
        loras = _lora_list(lora_request, len(prompt_list))
        return self._run(prompt_list, params, priority or [0] * len(prompt_list), use_tqdm, loras)

    def beam_search(
        self,
        prompts: Sequence[PromptType],
        params: BeamSearchParams,
        lora_request: LoRAArg = None,
        use_tqdm: bool = False,
        concurrency_limit: int | None = None,
    ) -> list[BeamSearchOutput]:
        """vLLM's beam search (`engine/beam_search.py`): the `params.beam_width` best sequences of
        each prompt, best first. Text prompts are tokenized as `generate` does; a beam ends at
        EOS (unless `ignore_eos`), after `max_tokens`, or at the context length. Every beam of a
        prompt runs under its adapter (`lora_request`: one, or one per prompt). Each sequence's
        `text` is the whole sequence's, the prompt's included, as vLLM's offline beam search
        decodes it (`AsyncLLM.beam_search` and the HTTP routes give the generated part)."""
        loras = _lora_list(lora_request, len(prompts))
        if concurrency_limit is not None and concurrency_limit < 1:
            raise ValueError(f"concurrency_limit: must be a positive integer or None, got {concurrency_limit!r}")
        tokenizer = self.get_tokenizer()
        ids = [prompt_token_ids(prompt, tokenizer) for prompt in prompts]
        search = BeamSearch(ids, params, tokenizer.eos_token_id, self._engine.get_model_config().max_model_len)
        step = search.step_params()
        limit = concurrency_limit or max(len(ids), 1)
        for _ in range(params.max_tokens if ids else 0):
            for start in range(0, len(ids), limit):  # `concurrency_limit` prompts at a time
                group = range(start, min(start + limit, len(ids)))
                beams = search.live(group)
                if beams:
                    token_prompts: list[PromptType] = [{"prompt_token_ids": b.tokens} for _, b in beams]
                    beam_loras = [loras[i] for i, _ in beams]
                    search.advance(
                        group, beams, self.generate(token_prompts, step, use_tqdm=use_tqdm, lora_request=beam_loras)
                    )
        return search.results(lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True), whole_sequence=True)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        lora_request: LoRAArg = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations (under `lora_request`:
        one adapter, or one per conversation). `tools` (OpenAI's function tools) reach the chat
        template, which decides how they are shown; the reply is text, as in vLLM (force a call
        with `SamplingParams(structured_outputs=...)`)."""
        self._require_runner("generate", "LLM.chat()")
        prompts = self._render_chats(
            messages, chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs, tools
        )
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm, lora_request=lora_request)

    # ------------------------------------------------------------------ pooling models

    def encode(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_task: str | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """The pooled output of every prompt (a pooling model, `runner="pooling"`), in input
        order: `pooling_task="embed"` one vector per prompt, `"token_embed"` one per token
        (`"encode"`: its deprecated name), `"classify"` / `"score"` a classifier's outputs."""
        self._require_runner("pooling", "LLM.encode()")
        prompt_list: list[PromptType] = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)  # type: ignore[list-item]
        params = self._pooling_params(pooling_params, len(prompt_list), pooling_task, truncate_prompt_tokens)
        outputs = self._run(prompt_list, params, [0] * len(prompt_list), use_tqdm)
        return [cast(PoolingRequestOutput[PoolingOutput], out) for out in outputs]

    def embed(
        self,
        prompts: PromptType | Sequence[PromptType],
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[EmbeddingRequestOutput]:
        """One embedding per prompt (`outputs.embedding`), pooled and normalised as the model's
        sentence-transformers configuration says (`pooling_params` may override)."""
        self._require_runner("pooling", "LLM.embed()")
        items = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="embed",
        )
        return [EmbeddingRequestOutput.from_base(item) for item in items]

    def classify(
        self,
        prompts: PromptType | Sequence[PromptType],
        *,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[ClassificationRequestOutput]:
        """A sequence classifier's outputs per prompt (`outputs.probs`: one value per label,
        through the model's activation; `PoolingParams(use_activation=False)`: the logits)."""
        self._require_runner("pooling", "LLM.classify()")
        items = self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="classify",
        )
        return [ClassificationRequestOutput.from_base(item) for item in items]

    def reward(
        self,
        prompts: PromptType | Sequence[PromptType],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None = None,
    ) -> list[PoolingRequestOutput[PoolingOutput]]:
        """vLLM's reward: per-token rewards of a reward model (`--convert reward`: `outputs.data`
        `[num_prompt_tokens, -1]`, pooling task "token_classify")."""
        self._require_runner("pooling", "LLM.reward()")
        return self.encode(
            prompts,
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="token_classify",
        )

    def score(
        self,
        data_1: str | Sequence[str],
        data_2: str | Sequence[str],
        /,
        *,
        truncate_prompt_tokens: int | None = None,
        use_tqdm: bool | Callable[..., Any] = True,
        pooling_params: PoolingParams | None = None,
    ) -> list[ScoringRequestOutput]:
        """vLLM's score of each pair, 1 -> 1, 1 -> N (`data_1` paired with every `data_2`) or
        N -> N (pairwise), in `data_2`'s order: a cross-encoder's relevance (the pair read as one
        sequence, text_pairs.py) when the model is a one-label classifier, else the cosine
        similarity of the two texts' embeddings."""
        self._require_runner("pooling", "LLM.score()")
        texts_1, texts_2 = score_pairs(data_1, data_2)
        config = self._engine.get_model_config()
        if config.pooler is not None and config.pooler.num_labels is not None:
            lefts = texts_1 * len(texts_2) if len(texts_1) == 1 else texts_1
            tokenizer = self.get_tokenizer()
            pairs: list[PromptType] = [
                pair_prompt(tokenizer, a, b, truncate_prompt_tokens, config.max_model_len)
                for a, b in zip(lefts, texts_2)
            ]
            scored = self.encode(
                pairs,
                pooling_params,
                truncate_prompt_tokens=truncate_prompt_tokens,
                use_tqdm=use_tqdm,
                pooling_task="score",
            )
            return [ScoringRequestOutput.from_base(item) for item in scored]
        embedded = self.encode(
            [*texts_1, *texts_2],
            pooling_params,
            truncate_prompt_tokens=truncate_prompt_tokens,
            use_tqdm=use_tqdm,
            pooling_task="embed",
        )
        firsts, seconds = embedded[: len(texts_1)], embedded[len(texts_1) :]
        if len(firsts) == 1:
            firsts = firsts * len(seconds)
        return [cosine_score(a, b) for a, b in zip(firsts, seconds)]

    def _pooling_params(
        self,
        pooling_params: PoolingParams | Sequence[PoolingParams] | None,
        n: int,
        task: str | None,
        truncate_prompt_tokens: int | None,
    ) -> list[PoolingParams]:
        given = _per_prompt(
            "pooling_params", PoolingParams() if pooling_params is None else pooling_params, PoolingParams, n
        )
        out = []
        for p in given:
            p = p.clone()
            if task is not None and p.task is not None and p.task != task:
                raise ValueError(f"pooling_task: {task!r} cannot overwrite the params' task {p.task!r}")
            p.task = task or p.task
            if p.task is None:
                raise ValueError(
                    f"pooling_task: required for LLM.encode (one of {', '.join(POOLING_TASKS)}); "
                    "use LLM.embed(...) for embeddings, LLM.score(...) for similarity scores"
                )
            if truncate_prompt_tokens is not None:
                p.truncate_prompt_tokens = truncate_prompt_tokens
            p.validate()
            out.append(p)
        return out

    def _require_runner(self, runner: str, api: str) -> None:
        """vLLM's runner checks: a generation call on a pooling model and the reverse."""
        if self._engine.get_model_config().runner_type != runner:
            template = GENERATE_ON_POOLING if runner == "generate" else POOLING_ON_GENERATE
            raise ValueError(template.format(api=api))

    def enqueue(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRAArg = None,
        priority: list[int] | None = None,
        use_tqdm: bool | Callable[..., Any] = False,
    ) -> list[str]:
        """Add the prompts without waiting (vLLM's queue API); returns their request ids.
        `wait_for_completion()` collects the outputs."""
        prompt_list: list[PromptType] = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)  # type: ignore[list-item]
        params = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority: {len(priority)} values given for {len(prompt_list)} prompts")
        loras = _lora_list(lora_request, len(prompt_list))
        ids: list[str] = []
        for i, (prompt, p) in enumerate(zip(prompt_list, params)):
            rid = self.llm_engine.add_request(
                f"llm-{next(self._ids)}", prompt, p, priority=priority[i] if priority else 0, lora_request=loras[i]
            )
            ids.append(rid)
            self._enqueued.append(rid)
        return ids

    def enqueue_chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        lora_request: LoRAArg = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[str]:
        """`enqueue` for conversations, rendered as `chat()` renders them."""
        prompts = self._render_chats(
            messages, chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs
        )
        return self.enqueue(prompts, sampling_params, lora_request=lora_request)

    def wait_for_completion(self, *, use_tqdm: bool | Callable[..., Any] = True) -> list[RequestOutput]:
        """Run the engine until every request added through `llm_engine` (`enqueue`, or
        `llm_engine.add_request`) has finished; the finished outputs, enqueued ones first in
        enqueue order."""
        finished: dict[str, RequestOutput] = {}
        bar = _progress(self.llm_engine.get_num_unfinished_requests(), use_tqdm)
        while self.llm_engine.has_unfinished_requests():
            for out in self.llm_engine.step():
                if out.finished:
                    finished[out.request_id] = out
                    if bar is not None:
                        bar.record(out)
        if bar is not None:
            bar.close()
        ordered = [finished.pop(rid) for rid in self._enqueued if rid in finished]
        self._enqueued = []
        return ordered + list(finished.values())

    def _render_chats(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        chat_template: str | None,
        add_generation_prompt: bool,
        continue_final_message: bool,
        chat_template_kwargs: dict[str, Any] | None,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[PromptType]:
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        tok = self.get_tokenizer()
        config = self.llm_engine.async_llm.config
        prompts: list[PromptType] = []
        for conv in conversations:
            rendered, images = chat_images(conv, config.model, tok, config.limits)
            text, ids = tok.render_chat(
                rendered,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                tools=tools,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompt: dict[str, Any] = {"prompt": text, "prompt_token_ids": ids}  # rendered once: text and ids
            if images:
                prompt["multi_modal_data"] = {"image": images}
            prompts.append(prompt)
        return prompts

    def _params_list(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        out = []
        for p in _per_prompt("sampling_params", sampling_params, SamplingParams, n):
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            out.append(p)
        return out

    def _run(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | PoolingParams],
        priorities: list[int],
        use_tqdm: bool | Callable[..., Any],
        loras: Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        done = threading.Event()
        loras = [None] * len(prompts) if loras is None else loras
        future = self._portal.start_task_soon(self._batch, prompts, params, priorities, use_tqdm, done, loras)
        try:
            return future.result()
        except KeyboardInterrupt:
            future.cancel()
            done.wait(_ABORT_WAIT_S)  # the aborts ran in the loop before we go on
            raise
        except CancelledError:
            raise RuntimeError("the engine was shut down during generate()") from None

    async def _batch(
        self,
        prompts: list[PromptType],
        params: Sequence[SamplingParams | PoolingParams],
        priorities: list[int],
        use_tqdm: bool | Callable[..., Any],
        done: threading.Event,
        loras: Sequence[LoRARequest | None],
    ) -> list[RequestOutput]:
        """Add every request, then gather each one's final output (FINAL_ONLY: one per request).
        A batch larger than the engine's queue (`max_num_queued_reqs` / `_tokens`) is normal
        offline: each add waits for room (`wait_for_room`) instead of raising `EngineBusyError`;
        requests finish in the engine whether or not their stream is read yet, so the adds
        make progress before the collectors start.
        Leaving in any way (a bad request, one failing, Ctrl-C) closes every stream: the
        unfinished requests are aborted before `done` is set."""
        engine = self._engine
        results: list[RequestOutput | None] = [None] * len(prompts)
        errors: list[BaseException] = []
        try:
            with contextlib.ExitStack() as streams:
                added: list[RequestStream] = []
                for prompt, p, prio, lora in zip(prompts, params, priorities, loras):
                    rid = f"llm-{next(self._ids)}"
                    stream = await engine.add_request(
                        rid, prompt, p, priority=prio, wait_for_room=True, lora_request=lora
                    )
                    added.append(streams.enter_context(stream))
                bar = _progress(len(prompts), use_tqdm)
                async with anyio.create_task_group() as tg:
                    for i, stream in enumerate(added):
                        tg.start_soon(_collect, i, stream, results, bar, errors, tg.cancel_scope)
                if bar is not None:
                    bar.close()
            if errors:
                raise errors[0]  # the first request that failed; the others were aborted
            assert all(r is not None for r in results)
            return results  # type: ignore[return-value]
        finally:
            done.set()


P = TypeVar("P")


def _per_prompt(name: str, value: P | Sequence[P], kind: type[P], n: int) -> list[P]:
    """One params object for every prompt, or a list of exactly one per prompt."""
    given: list[P] = [value] * n if isinstance(value, kind) else list(value)  # type: ignore[arg-type]
    if len(given) != n:
        raise ValueError(
            f"{name}: the list has {len(given)} entries for {n} prompts; pass one {kind.__name__} or one per prompt"
        )
    return given


def _lora_list(lora_request: LoRAArg, n: int) -> list[LoRARequest | None]:
    """`lora_request=` of a call over `n` prompts: one adapter (or None) for all, or a list of
    exactly one per prompt (each entry is checked when its request is added)."""
    if lora_request is None or isinstance(lora_request, LoRARequest):
        return [lora_request] * n
    if isinstance(lora_request, str | bytes) or not isinstance(lora_request, Sequence):
        raise ValueError(
            f"lora_request: must be a LoRARequest, a list of one per prompt, or None; got {type(lora_request).__name__}"
        )
    given = list(lora_request)
    if len(given) != n:
        raise ValueError(
            f"lora_request: the list has {len(given)} entries for {n} prompts; pass one LoRARequest or one per prompt"
        )
    return given


async def _collect(
    i: int,
    stream: RequestStream,
    results: list[RequestOutput | None],
    bar: _Bar | None,
    errors: list[BaseException],
    scope: anyio.CancelScope,
) -> None:
    try:
        async for out in stream:
            if out.finished:
                results[i] = out
                if bar is not None:
                    bar.record(out)
    except Exception as exc:  # one request failed: stop the batch, raise it as itself
        errors.append(exc)
        scope.cancel()


class _Bar:
    """tqdm with vLLM's postfix: input and output tokens per second."""

    def __init__(self, total: int, factory: Callable[..., Any]) -> None:
        self.bar = factory(total=total, desc="Processed prompts", dynamic_ncols=True)
        self.start = time.perf_counter()
        self.inp = self.outp = 0

    def record(self, out: RequestOutput) -> None:
        self.inp += len(out.prompt_token_ids)
        if isinstance(out, RequestOutput):  # a pooling output generates no tokens
            self.outp += sum(len(c.token_ids) for c in out.outputs)
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        self.bar.set_postfix_str(
            f"est. speed input: {self.inp / elapsed:.2f} toks/s, output: {self.outp / elapsed:.2f} toks/s",
            refresh=False,
        )
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _progress(total: int, use_tqdm: bool | Callable[..., Any]) -> _Bar | None:
    if use_tqdm is False:
        return None
    if use_tqdm is True:
        from tqdm.auto import tqdm

        return _Bar(total, tqdm)
    return _Bar(total, use_tqdm)


def score_pairs(data_1: str | Sequence[str], data_2: str | Sequence[str]) -> tuple[list[str], list[str]]:
    """vLLM's score inputs: a text or a list of texts each; 1 -> N or N -> N (equal lengths)."""
    texts_1 = [data_1] if isinstance(data_1, str) else list(data_1)
    texts_2 = [data_2] if isinstance(data_2, str) else list(data_2)
    for name, texts in (("data_1", texts_1), ("data_2", texts_2)):
        if not texts:
            raise ValueError(f"{name}: at least one text is needed")
        if not all(isinstance(t, str) for t in texts):
            raise ValueError(f"{name}: scores take texts (a string or a list of strings)")
    if len(texts_1) > 1 and len(texts_1) != len(texts_2):
        raise ValueError(f"data_1: {len(texts_1)} texts for {len(texts_2)} in data_2; pass one, or as many as data_2")
    return texts_1, texts_2


def cosine_score(
    a: PoolingRequestOutput[PoolingOutput], b: PoolingRequestOutput[PoolingOutput]
) -> ScoringRequestOutput:
    """The cosine similarity of two embeddings as vLLM's `ScoringRequestOutput` (its
    prompt_token_ids are both prompts', joined)."""
    score = torch.nn.functional.cosine_similarity(a.outputs.data.float(), b.outputs.data.float(), dim=0)
    base = PoolingRequestOutput(
        f"{a.request_id}_{b.request_id}", PoolingOutput(score), a.prompt_token_ids + b.prompt_token_ids, True
    )
    return ScoringRequestOutput.from_base(base)
