"""`EngineCore`: the synchronous, sans-IO heart of the engine, for a generative model.

`add_request` / `abort_requests` between steps, `step()` to advance every scheduled request by
one forward pass. No awaits, and no threads but the grammar compiler's
(engine/structured_outputs.py): the actor layer wraps it with I/O, and tests drive it directly.
It is one of the two implementations of `Core` (engine/core_protocol.py); a pooling model's
core is `PoolingEngineCore`, and `build_engine_core(config)` (engine/cores.py) picks the one
the model's runner type needs.

The core holds bookkeeping only; the device side (the model or tensor-parallel group, LoRA
manager, draft model, KV cache and its size, CUDA graphs) is the `Executor`
(engine/execution/executor.py), built first in one explicit order. A step is three calls, as
in vLLM v1 and nano-vllm: `Scheduler.schedule` -> `runner.execute` ->
`Scheduler.update_from_output` (tokens through the stop checks, grammars, draft rollback,
logprobs). Around them: grammars that finished compiling join the scheduler before it
schedules (structured outputs); each scheduled request's adapter is put in a slot before the
forward pass (LoRA: a request whose adapter fails to load ends alone with `FinishReason.ERROR`
and the reason); the speculator sets the drafts each decode wants before scheduling, fills them
after, and counts the verified ones after the pass (docs/speculative.md).

Tests and benchmarks replace the forward pass by passing a `runner` (a scripted one, or one
that raises at a given step: `engine/execution/scripted_runner.py`). Where the core runs in
another process they name a factory instead (`EngineCoreFactory`, "module:function" plus JSON
keyword arguments), which the actor layer sends to the child: such hooks are no user setting,
so they are neither `EngineArgs` fields nor CLI flags.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import replace
from typing import Any

from triollm.engine import envs, request_rules
from triollm.engine.config import EngineConfig
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.core_protocol import EngineCoreStats
from triollm.engine.execution.executor import Executor, Runner
from triollm.engine.execution.models import CausalLM
from triollm.engine.execution.profiler import Profiler
from triollm.engine.execution.sleep_mode import release_memory
from triollm.engine.request import EngineCoreOutput, EngineCoreRequest, FinishReason, RunnerOutput
from triollm.engine.scheduling.block_manager import BlockManager
from triollm.engine.scheduling.request_state import Request, RequestStatus
from triollm.engine.scheduling.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from triollm.engine.speculative import Speculator
from triollm.engine.structured_outputs import Grammar, GrammarCompiler
from triollm.lora.manager import LoRAManager

# `EngineCoreStats` is defined with the `Core` protocol and re-exported here.
__all__ = ["EngineCore", "EngineCoreFactory", "EngineCoreStats", "Runner"]

log = logging.getLogger("triollm")

# With nothing to run but grammars compiling, a step waits this long at most for one of them:
# the inputs that came meanwhile (an abort of the compiling request, say) are applied between
# two such steps.
_GRAMMAR_WAIT_S = 0.05


class EngineCore:
    def __init__(self, config: EngineConfig, *, runner: Runner | None = None) -> None:
        """Build the executor (load the model, size the KV cache); with `runner` (tests,
        benchmarks) no model is loaded, no KV memory allocated, and `runner` executes every
        step. A pooling model's config is a ValueError: its core is `PoolingEngineCore`."""
        if config.model.runner_type == "pooling":
            raise ValueError(
                "runner: EngineCore runs a generative model, and this model's runner is "
                "'pooling'; build its core with triollm.engine.cores.build_engine_core(config)"
            )
        self.config = config
        self.executor = Executor.build(config, runner)  # closes what it started if it raises
        self.runner: Runner = self.executor.runner  # tests may wrap it
        self.num_blocks = self.executor.num_blocks
        try:
            self._build_bookkeeping()
        except BaseException:
            self.executor.close()
            raise

    def _build_bookkeeping(self) -> None:
        mc = self.config.model
        # Blocks that fell out of the window are given back only if no layer attends to all.
        windowed = bool(mc.layer_types) and all(t == "sliding_attention" for t in mc.layer_types)
        w = mc.sliding_window
        window = w if windowed and w is not None and w < mc.max_model_len else None
        cache = self.config.cache
        prefix_caching = cache.enable_prefix_caching
        slots = 0
        if mc.recurrent is not None:  # a hybrid model: a state slot per running request
            slots = self.executor.num_state_slots
            if prefix_caching:
                log.info("prefix caching is off for %s: a cached block holds no recurrent state", mc.architecture)
                prefix_caching = False
        self.block_manager = BlockManager(self.num_blocks, cache.block_size, prefix_caching, window, slots)
        self.scheduler = Scheduler(self.config.scheduler, self.block_manager, mc.max_model_len)
        self.speculator = self._speculator()
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        # Structured outputs: a request's matcher is built in the compiler's threads, and the
        # request joins the scheduler once it is ready (`_compiling` until then).
        self._compiling: dict[str, tuple[Request, Future[Grammar]]] = {}
        self.grammars = GrammarCompiler(self.config.tokenizer, mc.vocab_size)
        self.profiler = Profiler(envs.torch_profiler_dir(), self.config.device)

    @property
    def model(self) -> CausalLM | None:
        return self.executor.model

    @property
    def lora(self) -> LoRAManager | None:
        return self.executor.lora

    def _speculator(self) -> Speculator | None:
        spec = self.config.speculative
        if spec is None:
            return None
        if self.config.model.recurrent is not None:
            raise ValueError(
                f"speculative_config: {self.config.model.architecture} has recurrent layers, whose state cannot "
                f"roll back rejected draft tokens; speculative decoding is not supported for it"
            )
        if spec.draft is not None and self.executor.draft is None:
            log.info("speculative decoding is off: the engine core runs an injected runner")
            return None
        return Speculator(spec, self.config.model.max_model_len, self.executor.draft)

    def close(self) -> None:
        """Stop the grammar threads and the tensor-parallel workers, if any (idempotent)."""
        if self.profiler.running:
            self.profiler.stop()
        self.grammars.close()
        self.executor.close()

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError (and changes nothing) if it is invalid: the
        prompt rules of engine/request_rules.py, checked again here (a core trusts no input)."""
        mc = self.config.model
        rid, ids = request.request_id, request.prompt_token_ids
        if self.executor.is_sleeping:
            raise ValueError(f"the engine is sleeping ({self._asleep_text()}): call wake_up() before sending requests")
        request_rules.check_new_request_id(rid, self.requests)
        request_rules.check_prompt_tokens(ids, mc.max_model_len, mc.vocab_size)
        room = mc.max_model_len - len(ids)
        max_tokens = request.sampling_params.max_tokens
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        capacity = self.num_blocks * self.config.cache.block_size
        request_rules.check_kv_fit(len(ids), max_tokens, capacity)
        req = Request(request, max_tokens)
        self.requests[rid] = req
        so = request.sampling_params.structured_outputs
        if so is None:
            self.scheduler.add_request(req)
        else:
            self._compiling[rid] = (req, self.grammars.submit(so, req.eos_token_ids))

    def abort_requests(self, request_ids: list[str] | str) -> None:
        """Finish the requests now and free their blocks; unknown ids are ignored."""
        if isinstance(request_ids, str):
            request_ids = [request_ids]
        for rid in request_ids:
            req = self.requests.pop(rid, None)
            if req is None:
                continue
            compiling = self._compiling.pop(rid, None)
            if compiling is None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            else:  # not in the scheduler yet: a compile not started is skipped
                compiling[1].cancel()
                req.status = RequestStatus.FINISHED_ABORTED

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._compiling)

    def reset_prefix_cache(self) -> bool:
        return self.block_manager.reset_prefix_cache()

    # ------------------------------------------------------------------ sleep, reload, rpc

    def sleep(self, level: int = 1) -> None:
        self._require_idle("sleep")
        self.block_manager.reset_prefix_cache()  # the blocks' contents are gone
        self.executor.sleep(level)
        self._follow_executor()
        release_memory(self.config.device)  # once no reference to the runner or model is left

    def wake_up(self, tags: list[str] | None = None) -> None:
        self.executor.wake_up(tags)
        self._follow_executor()

    def is_sleeping(self) -> bool:
        return self.executor.is_sleeping

    def reload_weights(self, weights_path: str | None = None) -> None:
        """A level-2 sleep and a wake-up from `weights_path` (checked first), so the old weights
        are gone before the new ones are read; asleep before, asleep after."""
        self._require_idle("reload_weights")
        asleep = self.executor.asleep
        self.executor.use_checkpoint(weights_path)
        self.sleep(2)
        self.wake_up()
        if asleep:
            self.sleep(2 if "weights" in asleep else 1)

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """The executor's `collective_rpc`. The names in `_CORE_RPCS` go through the core's own
        methods (their checks, the prefix cache, the requests' adapters), one result per rank."""
        kwargs = {} if kwargs is None else kwargs
        if isinstance(method, str) and method in _CORE_RPCS:
            return [getattr(self, method)(*args, **kwargs)] * self.config.tensor_parallel_size
        model, asleep = self.executor.model, self.executor.asleep
        try:
            return self.executor.collective_rpc(method, args, kwargs)
        finally:
            self._follow_executor()
            if self.executor.model is not model or self.executor.asleep != asleep:  # a callable slept or swapped
                self.block_manager.reset_prefix_cache()
                release_memory(self.config.device)

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter's weights (LoRAManager.remove); False if none were held."""
        if self.lora is None:
            return False
        in_use = {r.lora_request.lora_int_id for r in self.requests.values() if r.lora_request is not None}
        return self.lora.remove(lora_id, in_use)

    def pin_lora(self, lora_id: int) -> bool:
        """Keep an adapter loaded once it is (LoRAManager.pin)."""
        if self.lora is None:
            raise ValueError("lora_id: LoRA adapters are not enabled on this engine (enable_lora=True)")
        self.lora.pin(lora_id)
        return True

    def start_profile(self) -> None:
        self.profiler.start()

    def stop_profile(self) -> None:
        self.profiler.stop()

    def _require_idle(self, what: str) -> None:
        if self.has_unfinished_requests():
            raise ValueError(f"{what}: {len(self.requests)} requests are unfinished; wait for them or abort them first")

    def _follow_executor(self) -> None:
        """The executor's runner and draft after sleep, wake-up or reload."""
        if not self.executor.injected:
            self.runner = self.executor.runner
            spec = self.config.speculative
            if self.speculator is not None and spec is not None and spec.draft is not None:
                self.speculator.draft = self.executor.draft  # None while asleep

    def _asleep_text(self) -> str:
        return " and ".join(_PARTS[p] for p in sorted(self.executor.asleep, reverse=True)) + " freed"

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduled batch; return the outputs of the requests that advanced (and of
        those that ended without a token: a failed grammar or adapter)."""
        outputs: list[EngineCoreOutput] = []
        sched = self._schedule(outputs)
        if sched.scheduled and self.lora is not None:
            sched = self._place_adapters(sched, outputs)
        if sched.scheduled:
            if self.speculator is not None:
                self.speculator.fill(sched.scheduled)
            self.num_steps += 1
            start = time.perf_counter()
            result = self.runner.execute(sched.scheduled)
            self.scheduler.record_step(sched, time.perf_counter() - start)  # the prefill budget
            if self.speculator is not None:
                self._record_drafts(sched.scheduled, result)
            outputs += self.scheduler.update_from_output(sched, result)
        for out in outputs:
            if out.finish_reason is not None:
                del self.requests[out.request_id]
        return outputs

    def _schedule(self, outputs: list[EngineCoreOutput]) -> SchedulerOutput:
        """The grammars that finished compiling join the scheduler, then it schedules. With
        nothing to run but grammars compiling, wait up to `_GRAMMAR_WAIT_S` for one of them
        and schedule again; if still nothing runs, count a step (`num_steps`): the loop calls
        again rather than waiting for input that may never come."""
        outputs += self._take_grammars()
        sched = self._schedule_once()
        if sched.scheduled or not self._compiling:
            return sched
        self._wait_for_a_grammar()
        outputs += self._take_grammars()
        sched = self._schedule_once()
        if not sched.scheduled and self._compiling:
            self.num_steps += 1
        return sched

    def _schedule_once(self) -> SchedulerOutput:
        if not self.scheduler.has_unfinished_requests():
            return SchedulerOutput([], [])
        if self.speculator is not None:
            self.speculator.prepare(self.scheduler.running)
        return self.scheduler.schedule()

    def _record_drafts(self, scheduled: list[ScheduledRequest], result: RunnerOutput) -> None:
        """The speculator's acceptance counts (and each request's next draft length)."""
        assert self.speculator is not None
        for item in scheduled:
            tokens = result.spec_tokens.get(item.request.request_id) if item.num_draft else None
            if tokens is not None:
                self.speculator.record(item.request, item.num_draft, len(tokens) - 1)

    def _place_adapters(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput]) -> SchedulerOutput:
        """Every scheduled request's adapter in a slot; a request whose adapter fails to load
        ends alone, with the reason as its error (in `outputs`), and leaves the step."""
        assert self.lora is not None
        wanted = [s.request.lora_request for s in sched.scheduled if s.request.lora_request]
        if not wanted:
            return sched
        running = {r.lora_request.lora_int_id for r in self.scheduler.running if r.lora_request}
        failed = self.lora.prepare(wanted, running)
        if not failed:
            return sched
        kept: list[ScheduledRequest] = []
        for item in sched.scheduled:
            req, lr = item.request, item.request.lora_request
            if lr is None or lr.lora_int_id not in failed:
                kept.append(item)
                continue
            self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            reason = failed[lr.lora_int_id][:2000]
            outputs.append(_error(req.request_id, reason))
        return replace(sched, scheduled=kept)

    def _take_grammars(self) -> list[EngineCoreOutput]:
        """Schedule the structured requests whose matcher is ready; a grammar that failed ends
        its request with an error (the input processor checked it already, without the
        vocabulary, so this is rare)."""
        failed: list[EngineCoreOutput] = []
        for rid, (req, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[rid]
            try:
                req.grammar = future.result()
                so = req.sampling_params.structured_outputs
                req.grammar.start_after = tuple(so.start_after_token_ids or ())  # type: ignore[union-attr]
            except Exception as exc:  # noqa: BLE001 - whatever llguidance raised: this request's
                req.status = RequestStatus.FINISHED_ABORTED
                message = str(exc)
                if not isinstance(exc, ValueError):
                    message = f"structured_outputs: {type(exc).__name__}: {exc}"
                failed.append(_error(rid, message[:2000]))
                continue
            self.scheduler.add_request(req)
        return failed

    def _wait_for_a_grammar(self) -> None:
        # Blocks the compute thread only: the compiler's threads hold no lock it needs, and
        # llguidance compiles without the GIL.
        futures = [f for _, f in self._compiling.values()]
        wait_futures(futures, _GRAMMAR_WAIT_S, FIRST_COMPLETED)

    def statistics(self) -> EngineCoreStats:
        b = self.block_manager.statistics()
        s = self.scheduler.statistics()
        return EngineCoreStats(
            num_running=s.num_running,
            num_waiting=s.num_waiting + len(self._compiling),  # waiting for their grammar
            num_blocks=b.num_blocks,
            num_free_blocks=b.num_free_blocks,
            num_cached_blocks=b.num_cached_blocks,
            kv_cache_usage=b.usage,
            prefix_cache_hit_rate=b.prefix_cache_hit_rate,
            num_preemptions=s.num_preemptions,
            num_window_released_blocks=b.num_window_released_blocks,
            spec=None if self.speculator is None else self.speculator.statistics(),
        )

    def check_integrity(self) -> None:
        live = list(self.scheduler.live_requests())
        self.block_manager.check_integrity(live)
        # Every request is in the scheduler or compiling its grammar, never both, never neither.
        ids = sorted([r.request_id for r in live] + list(self._compiling))
        assert ids == sorted(self.requests), f"requests {sorted(self.requests)} vs {ids}"
        assert all(not r.block_ids for r, _ in self._compiling.values()), "a compiling request holds KV blocks"


_PARTS = {"weights": "weights", "kv_cache": "KV cache"}

# collective_rpc methods that change the core's state too (EngineCore.collective_rpc).
_CORE_RPCS = ("sleep", "wake_up", "reload_weights", "remove_lora", "pin_lora")


def _error(request_id: str, reason: str) -> EngineCoreOutput:
    """The output that ends a request alone, without a token, with `reason` as its error."""
    return EngineCoreOutput(request_id, [], finish_reason=FinishReason.ERROR, stop_reason=reason)
