"""`LLM`: vLLM's synchronous entry point, driving an `AsyncLLM` through one blocking portal.

The portal is an event loop in one helper thread (`anyio.from_thread.start_blocking_portal`);
the `AsyncLLM` is entered inside it with `wrap_async_context_manager`, so its task group lives
there for the `LLM`'s whole life. Each `generate()` is ONE portal call: all requests are added
and gathered inside the loop (a round trip costs ~0.2-0.3 ms, too much per token).

Ctrl-C: the caller's thread gets `KeyboardInterrupt` while it waits on the call's future.
`future.cancel()` returns before the in-loop aborts have run, so the batch task's `finally`
sets a `threading.Event` and the caller waits on it (bounded) before re-raising; the `LLM`
stays usable. `shutdown()` is idempotent; a `weakref.finalize` (holding no reference to `self`)
closes a forgotten `LLM` at interpreter exit as a last resort.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Sequence
from concurrent.futures import CancelledError
from typing import Any

import anyio
from anyio.from_thread import BlockingPortal, start_blocking_portal

from triollm.actors.async_llm import AsyncLLM
from triollm.actors.request_stream import RequestStream
from triollm.engine.config import EngineArgs
from triollm.engine.outputs import RequestOutput
from triollm.engine.processing.processors import PromptType
from triollm.engine.processing.tokenizer import Tokenizer
from triollm.engine.sampling_params import RequestOutputKind, SamplingParams

__all__ = ["LLM", "engine_args_from_kwargs"]

# Keywords vLLM's LLM accepts that have no effect here (documented, accepted silently).
_IGNORED = frozenset(
    {
        "trust_remote_code", "tokenizer_mode", "skip_tokenizer_init", "revision", "tokenizer_revision",
        "enforce_eager", "disable_custom_all_reduce", "hf_token", "download_dir", "quantization",
        "gpu_memory_utilization", "max_seq_len_to_capture", "cpu_offload_gb", "allowed_local_media_path",
    }
)
_ABORT_WAIT_S = 5.0


def engine_args_from_kwargs(model: str | None = None, **kwargs: Any) -> EngineArgs:
    """Map vLLM's `LLM(...)` keywords onto `EngineArgs` (one place for every normalisation)."""
    if "swap_space" in kwargs:
        kwargs.pop("swap_space")
        warnings.warn(
            "swap_space is deprecated and ignored (preempted requests are recomputed)",
            DeprecationWarning,
            stacklevel=3,
        )
    for key in _IGNORED & kwargs.keys():
        kwargs.pop(key)
    names = set(EngineArgs.field_names())
    unknown = sorted(set(kwargs) - names)
    if unknown:
        raise TypeError(f"LLM() got unexpected keyword arguments: {', '.join(unknown)}")
    return EngineArgs(model=model, **kwargs)


class LLM:
    """Offline batch inference: `LLM(model=...).generate(prompts, SamplingParams(...))`."""

    def __init__(self, model: str | None = None, *, backend: str = "trio", **kwargs: Any) -> None:
        self._start(engine_args_from_kwargs(model, **kwargs), backend)

    @classmethod
    def from_engine_args(cls, args: EngineArgs, *, backend: str = "trio") -> LLM:
        self = cls.__new__(cls)
        self._start(args, backend)
        return self

    def _start(self, args: EngineArgs, backend: str) -> None:
        if backend not in ("trio", "asyncio"):
            raise ValueError(f"backend: {backend!r} is not one of trio, asyncio")
        self.args = args
        self._ids = itertools.count()
        self._stack = contextlib.ExitStack()
        try:
            portal: BlockingPortal = self._stack.enter_context(start_blocking_portal(backend))
            self._engine: AsyncLLM = self._stack.enter_context(
                portal.wrap_async_context_manager(AsyncLLM.from_engine_args(args))
            )
        except BaseException:
            self._stack.close()
            raise
        self._portal = portal
        loop_thread = portal.call(threading.get_ident)
        self._finalizer = weakref.finalize(self, _close_from_other_thread, self._stack, loop_thread)

    # ------------------------------------------------------------------ lifecycle

    def shutdown(self) -> None:
        """Stop the engine and the portal thread. Idempotent."""
        self._finalizer()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self) -> Tokenizer:
        return self._engine.get_tokenizer()

    @property
    def llm_engine(self) -> AsyncLLM:
        return self._engine

    def get_default_sampling_params(self) -> SamplingParams:
        return SamplingParams(**self._engine.get_model_config().generation_defaults)

    # ------------------------------------------------------------------ generation

    def generate(
        self,
        prompts: PromptType | Sequence[PromptType],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        priority: list[int] | None = None,
    ) -> list[RequestOutput]:
        """Complete every prompt; outputs in input order."""
        prompt_list: list[PromptType] = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)  # type: ignore[list-item]
        params = self._params_list(sampling_params, len(prompt_list))
        if priority is not None and len(priority) != len(prompt_list):
            raise ValueError(f"priority: {len(priority)} values given for {len(prompt_list)} prompts")
        return self._run(prompt_list, params, priority or [0] * len(prompt_list), use_tqdm)

    def chat(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of conversations."""
        if messages and isinstance(messages[0], dict):
            conversations = [messages]
        else:
            conversations = list(messages)  # type: ignore[arg-type]
        tok = self.get_tokenizer()
        prompts: list[PromptType] = []
        for conv in conversations:
            text, ids = tok.render_chat(
                conv,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                chat_template=chat_template,
                chat_template_kwargs=chat_template_kwargs,
            )
            prompts.append({"prompt": text, "prompt_token_ids": ids})  # rendered once: text and ids
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _params_list(
        self, sampling_params: SamplingParams | Sequence[SamplingParams] | None, n: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        if isinstance(sampling_params, SamplingParams):
            sampling_params = [sampling_params] * n
        if len(sampling_params) != n:
            raise ValueError(
                f"sampling_params: the list has {len(sampling_params)} entries for {n} prompts; "
                "pass one SamplingParams or one per prompt"
            )
        out = []
        for p in sampling_params:
            p = p.clone()
            p.output_kind = RequestOutputKind.FINAL_ONLY
            out.append(p)
        return out

    def _run(
        self,
        prompts: list[PromptType],
        params: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool | Callable[..., Any],
    ) -> list[RequestOutput]:
        done = threading.Event()
        future = self._portal.start_task_soon(self._batch, prompts, params, priorities, use_tqdm, done)
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
        params: list[SamplingParams],
        priorities: list[int],
        use_tqdm: bool | Callable[..., Any],
        done: threading.Event,
    ) -> list[RequestOutput]:
        """Add every request, then gather each one's final output (FINAL_ONLY: one per request).
        Leaving in any way (a bad request, one failing, Ctrl-C) closes every stream: the
        unfinished requests are aborted before `done` is set."""
        engine = self._engine
        results: list[RequestOutput | None] = [None] * len(prompts)
        errors: list[BaseException] = []
        try:
            with contextlib.ExitStack() as streams:
                added: list[RequestStream] = []
                for prompt, p, prio in zip(prompts, params, priorities):
                    rid = f"llm-{next(self._ids)}"
                    added.append(streams.enter_context(await engine.add_request(rid, prompt, p, priority=prio)))
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


def _close_from_other_thread(stack: contextlib.ExitStack, loop_thread: int) -> None:
    # Closing from the portal's own loop thread would deadlock (the portal raises RuntimeError).
    if loop_thread == threading.get_ident():
        return
    stack.close()
