"""`EngineCore`: the synchronous, sans-IO heart of the engine, for a generative model.

`add_request` / `abort_requests` between steps, `step()` to advance every scheduled request by
one forward pass. No awaits, and no threads but the grammar compiler's
(engine/structured_outputs.py): the actor layer wraps it with I/O, and tests drive it directly.
It is one of the two implementations of `Core` (engine/core_protocol.py); a pooling model's
core is `PoolingEngineCore`, and `build_engine_core(config)` (engine/cores.py) picks the one
the model's runner type needs.

Tests and benchmarks replace the forward pass by passing a `runner` (a scripted one, or one
that raises at a given step: `engine/execution/scripted_runner.py`). Where the core runs in
another process they name a factory instead (`EngineCoreFactory`, "module:function" plus JSON
keyword arguments), which the actor layer sends to the child: such hooks are no user setting,
so they are neither `EngineArgs` fields nor CLI flags.

With `tensor_parallel_size` N > 1 the core is rank 0 of N (engine/distributed/group.py): it
starts N-1 worker processes, holds its own shard of the model and KV cache, and `close()` stops
the workers (they also leave by themselves when this process exits).

Speculative decoding (`speculative_config`, engine/speculative/): the core owns the `Speculator`
(and a draft model with its own KV cache over the same blocks). Before each schedule it sets how
many drafts each decoding request wants, after scheduling it fills them in, and after the
forward pass the accepted drafts and the model's own token go through the stop checks one by one
before `Scheduler.advance` counts the rejected drafts' slots out (docs/speculative.md).

LoRA (`enable_lora`): the core owns the adapters' `LoRAManager` (lora/manager.py). Before each
forward pass every scheduled request's adapter is put in a slot, read from disk on first use; a
request whose adapter fails to load (gone, malformed, not fitting the model) ends alone with
`FinishReason.ERROR` and the reason, and the step runs without it.
"""

from __future__ import annotations

import importlib
import logging
import math
import os
import time
from concurrent.futures import FIRST_COMPLETED, Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from triollm.engine.config import EngineConfig, SpeculativeConfig
from triollm.engine.core_protocol import Core, EngineCoreStats
from triollm.engine.execution.cuda_graphs import DecodeGraphs, cuda_capture
from triollm.engine.execution.model_runner import ModelRunner, RunnerOutput
from triollm.engine.execution.models import CausalLM, load_model
from triollm.engine.request import EngineCoreOutput, EngineCoreRequest, FinishReason, Logprobs
from triollm.engine.scheduling.block_manager import BlockManager
from triollm.engine.scheduling.request_state import Request, RequestStatus
from triollm.engine.scheduling.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from triollm.engine.speculative import DraftModel, Speculator
from triollm.engine.structured_outputs import Grammar, GrammarCompiler
from triollm.kernels import KVCache, allocate_kv_cache
from triollm.lora.manager import LoRAManager

if TYPE_CHECKING:
    from triollm.engine.distributed.group import TensorParallelGroup

# `EngineCoreStats` is defined with the `Core` protocol and re-exported here.
__all__ = ["EngineCore", "EngineCoreFactory", "EngineCoreStats", "Runner"]

log = logging.getLogger("triollm")

_DEFAULT_CPU_KV_FRACTION = 0.2
_DEFAULT_CPU_KV_MAX = 2 << 30
# With nothing to run but grammars compiling, a step waits this long at most for one of them:
# the inputs that came meanwhile (an abort of the compiling request, say) are applied between
# two such steps.
_GRAMMAR_WAIT_S = 0.05


class Runner(Protocol):
    """What the core needs of a model runner: one forward pass (and sampling) per step."""

    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput: ...


class EngineCore:
    def __init__(self, config: EngineConfig, *, runner: Runner | None = None) -> None:
        """Load the model and size the KV cache; with `runner` (tests, benchmarks) no model is
        loaded, no KV memory allocated, and `runner` executes every step.

        A pooling model (runner "pooling") is no generative model: its core is
        `PoolingEngineCore`, and `build_engine_core(config)` builds whichever core a config
        needs; here such a config is a ValueError."""
        if config.model.runner_type == "pooling":
            raise ValueError(
                "runner: EngineCore runs a generative model, and this model's runner is "
                "'pooling'; build its core with triollm.engine.cores.build_engine_core(config)"
            )
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        if config.seed is not None:
            torch.manual_seed(config.seed)
        mc = config.model
        self.group: TensorParallelGroup | None = None
        self.model: CausalLM | None = None
        self.num_kv_heads = mc.num_kv_heads  # this rank's
        # Structured outputs: a request's matcher is built in the compiler's threads, and the
        # request joins the scheduler once it is ready (`_compiling` until then).
        self.grammars = GrammarCompiler(config.tokenizer, mc.vocab_size)
        self._compiling: dict[str, tuple[Request, Future[Grammar]]] = {}
        self.lora: LoRAManager | None = None  # the adapters' slots (a loaded model with enable_lora)
        self.draft_model: CausalLM | None = None  # speculative decoding's draft (draft_model method)
        self.speculator: Speculator | None = None
        try:
            self._build(runner)
        except BaseException:
            self.close()
            raise

    def _build(self, runner: Runner | None) -> None:
        config, mc = self.config, self.config.model
        if runner is None and config.tensor_parallel_size > 1:
            self.model = self._load_shard(config.tensor_parallel_size)
        elif runner is None:
            self.model = load_model(mc, config.device)
        if self.model is not None and config.lora is not None:  # before the KV cache is sized
            self.lora = LoRAManager(self.model, config.lora, config.device, keep_loads=self.group is not None)
        spec = config.speculative
        if spec is not None and spec.draft is not None and self.model is not None:  # before the KV cache is sized
            self.draft_model = load_model(spec.draft, config.device)
        self.num_blocks = self._num_kv_blocks()
        if self.group is not None:
            self.group.send_cache(self.num_blocks)
        bs = config.cache.block_size
        if self.num_blocks * bs < mc.max_model_len and config.cache.num_kv_blocks is None:
            raise ValueError(
                f"max_model_len: {mc.max_model_len} tokens do not fit in the KV cache "
                f"({self.num_blocks} blocks x {bs} = {self.num_blocks * bs} tokens); "
                "raise kv_cache_memory_bytes or lower max_model_len"
            )
        # Blocks that fell out of the window are given back only if no layer attends to all.
        windowed = bool(mc.layer_types) and all(t == "sliding_attention" for t in mc.layer_types)
        w = mc.sliding_window
        window = w if windowed and w is not None and w < mc.max_model_len else None
        self.block_manager = BlockManager(self.num_blocks, bs, config.cache.enable_prefix_caching, window)
        self.scheduler = Scheduler(config.scheduler, self.block_manager, mc.max_model_len)
        self.runner: Runner
        if runner is not None:
            self.runner = runner
        else:
            assert self.model is not None
            sizes = config.cuda_graph_sizes
            # With CUDA graphs, one spare block beyond the block manager's: the padding rows' slot.
            kv = allocate_kv_cache(
                mc.num_layers, self.num_blocks + (1 if sizes else 0), bs, self.num_kv_heads, mc.head_dim, mc.cache_dtype, config.device
            )
            self.runner = ModelRunner(self.model, kv, config.device, self.group, self._capture_graphs(kv, sizes), self.lora)
        if spec is not None:
            self.speculator = self._speculator(spec)
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB) for %s on %s",
            self.num_blocks,
            bs,
            self.num_blocks * bs,
            self.num_blocks * self._bytes_per_block() / 2**20,
            mc.path.name,
            config.device,
        )

    def _speculator(self, spec: SpeculativeConfig) -> Speculator | None:
        """The speculator, with the draft model's runner over a KV cache of its own (same blocks)."""
        mc = self.config.model
        if spec.draft is None:
            return Speculator(spec, mc.max_model_len)
        if self.draft_model is None:  # an injected runner (tests): no model, so no draft either
            log.info("speculative decoding is off: the engine core runs an injected runner, not the model")
            return None
        d = spec.draft
        kv = allocate_kv_cache(d.num_layers, self.num_blocks, self.config.cache.block_size, d.num_kv_heads, d.head_dim, d.cache_dtype, self.config.device)
        return Speculator(spec, mc.max_model_len, DraftModel(ModelRunner(self.draft_model, kv, self.config.device)))

    def _capture_graphs(self, kv: KVCache, sizes: tuple[int, ...]) -> DecodeGraphs | None:
        """CUDA graphs for decode steps; a capture that fails leaves the engine eager, with a
        warning that names the cause."""
        if not sizes:
            return None
        assert self.model is not None
        mc, bs = self.config.model, self.config.cache.block_size
        if mc.moe is not None:  # the experts' routing reads token counts on the host each layer
            log.info("CUDA graphs are off for %s: routed experts run eagerly", mc.architecture)
            return None
        start = time.perf_counter()
        try:
            graphs = DecodeGraphs(
                self.model, kv, torch.device(self.config.device), sizes, -(-mc.max_model_len // bs), self.num_blocks, cuda_capture()
            )
        except Exception as exc:  # noqa: BLE001 - eager still works; say why graphs are off
            log.warning("CUDA graphs are off, every step runs eagerly: capture failed (%s: %s)", type(exc).__name__, exc)
            return None
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s", list(sizes), time.perf_counter() - start)
        return graphs

    def _load_shard(self, size: int) -> CausalLM:
        """Start the workers and load rank 0's shard; the cores are split between the ranks."""
        from triollm.engine.distributed.group import TensorParallelGroup

        mc, device = self.config.model, self.config.device
        threads = max(1, (self.config.num_threads or torch.get_num_threads()) // size)
        torch.set_num_threads(threads)
        self.group = group = TensorParallelGroup(size, threads, mc, device, self.config.cache.block_size)
        self.num_kv_heads = group.shard.kv_heads(mc.num_heads, mc.num_kv_heads)[1]
        return load_model(mc, device, group.shard, group.comm)

    def close(self) -> None:
        """Stop the grammar threads and the tensor-parallel workers, if any (idempotent)."""
        self.grammars.close()
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ sizing

    def _bytes_per_block(self) -> int:
        """KV bytes per block: the model's and, with a draft model, the draft's (same blocks)."""
        mc, bs = self.config.model, self.config.cache.block_size
        size = KVCache.bytes_per_block(mc.num_layers, self.num_kv_heads, mc.head_dim, bs, mc.cache_dtype)
        spec = self.config.speculative
        if spec is not None and spec.draft is not None and self.draft_model is not None:
            d = spec.draft
            size += KVCache.bytes_per_block(d.num_layers, d.num_kv_heads, d.head_dim, bs, d.cache_dtype)
        return size

    def _num_kv_blocks(self) -> int:
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            return cache.num_kv_blocks
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            budget = default_kv_budget(self.config.device, cache.gpu_memory_utilization)
        blocks = budget // self._bytes_per_block()
        # More blocks than every sequence at full length could use would only waste memory.
        useful = self.config.scheduler.max_num_seqs * math.ceil(
            self.config.model.max_model_len / cache.block_size
        )
        blocks = min(blocks, useful + 1)
        if blocks <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                f"(one block needs {self._bytes_per_block()} bytes)"
            )
        return int(blocks)

    # ------------------------------------------------------------------ requests

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError (and changes nothing) if it is invalid."""
        mc = self.config.model
        rid = request.request_id
        if rid in self.requests:
            raise ValueError(f"request_id: {rid!r} is already running")
        ids = request.prompt_token_ids
        if not ids:
            raise ValueError("prompt: the prompt is empty")
        if len(ids) >= mc.max_model_len:
            raise ValueError(
                f"prompt: {len(ids)} tokens leave no room to generate within "
                f"max_model_len ({mc.max_model_len})"
            )
        if min(ids) < 0 or max(ids) >= mc.vocab_size:
            raise ValueError(f"prompt_token_ids: token ids must be in [0, {mc.vocab_size})")
        capacity = self.num_blocks * self.config.cache.block_size
        if len(ids) >= capacity:
            raise ValueError(
                f"prompt: {len(ids)} tokens do not fit in the KV cache ({capacity} tokens)"
            )
        room = mc.max_model_len - len(ids)
        max_tokens = request.sampling_params.max_tokens
        max_tokens = room if max_tokens is None else min(max_tokens, room)
        # The last sampled token is never fed back: prompt + max_tokens - 1 KV slots. More than
        # the cache holds would preempt the request (and block the queue) forever.
        if len(ids) + max_tokens - 1 > capacity:
            raise ValueError(
                f"max_tokens: {max_tokens} tokens after a prompt of {len(ids)} do not fit in the "
                f"KV cache ({capacity} tokens)"
            )
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

    # ------------------------------------------------------------------ the step

    def step(self) -> list[EngineCoreOutput]:
        """Run one scheduled batch; return the outputs of the requests that advanced.

        With nothing to run but grammars compiling, it waits up to `_GRAMMAR_WAIT_S` for one
        of them instead, and counts as a step (`num_steps`) while any still compiles: the
        loop calls it again rather than waiting for input that may never come."""
        outputs = self._take_grammars() if self._compiling else []
        sched = self._schedule()
        if (sched is None or not sched.scheduled) and self._compiling:
            self._wait_for_a_grammar()
            outputs += self._take_grammars()
            sched = self._schedule()
            if (sched is None or not sched.scheduled) and self._compiling:
                self.num_steps += 1
        if sched is None or not sched.scheduled:
            return outputs
        if self.lora is not None:
            sched = self._place_adapters(sched, outputs)
            if not sched.scheduled:
                return outputs
        if self.speculator is not None:
            self.speculator.fill(sched.scheduled)
        self.num_steps += 1
        start = time.perf_counter()
        result = self.runner.execute(sched.scheduled)
        self.scheduler.record_step(sched, time.perf_counter() - start)  # the prefill budget's data
        for item in sched.scheduled:
            req = item.request
            rid = req.request_id
            # With drafts: the accepted ones and the target's own token, appended before
            # `advance` (the accepted drafts' K/V is computed); a plain step advances first.
            tokens = result.spec_tokens.get(rid) if item.num_draft else None
            if tokens is None:
                self.scheduler.advance(item)
            elif self.speculator is not None:
                self.speculator.record(req, item.num_draft, len(tokens) - 1)
            prompt_lps = result.prompt_logprobs.get(rid)
            if not item.samples:
                if prompt_lps is not None:
                    outputs.append(EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_lps))
                continue
            spec = tokens is not None
            if tokens is None:
                tokens = [result.sampled[rid]]
            grammar = req.grammar
            if grammar is not None and not grammar.consume_token(tokens[0]):
                # The grammar failed (llguidance raised, or it allows no token the other
                # constraints do): this request alone ends, without the token.
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                del self.requests[rid]
                reason = f"structured_outputs: {grammar.error}"[:2000]
                outputs.append(
                    EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, stop_reason=reason, new_prompt_logprobs=prompt_lps)
                )
                continue
            status = None
            for n, token in enumerate(tokens, 1):  # a stop among them drops the tokens after it
                req.append_output_token(token)
                status = self.scheduler.check_stop(req, token)
                if status is None and grammar is not None and grammar.is_stopped():
                    status = RequestStatus.FINISHED_STOPPED  # the grammar is complete
                if status is not None:
                    del tokens[n:]
                    break
            if spec:  # computed: every emitted token but the last (the rejected drafts' slots are free)
                self.scheduler.advance(item, item.num_new_tokens - len(tokens))
                req.draft_computed = min(req.draft_computed, req.num_computed_tokens)
            if status is not None:
                self.scheduler.finish(req, status)
                del self.requests[rid]
            lps = result.logprobs.get(rid)
            if lps is not None and len(lps.token_ids) > len(tokens):
                lps = Logprobs(lps.token_ids[: len(tokens)], lps.logprobs[: len(tokens)], lps.ranks[: len(tokens)])
            outputs.append(
                EngineCoreOutput(
                    rid,
                    tokens,
                    finish_reason=req.finish_reason,
                    stop_reason=req.stop_reason,
                    new_logprobs=lps,
                    new_prompt_logprobs=prompt_lps,
                    num_cached_tokens=max(req.num_cached_tokens, 0),
                )
            )
        return outputs

    def _schedule(self) -> SchedulerOutput | None:
        if not self.scheduler.has_unfinished_requests():
            return None
        if self.speculator is not None:
            self.speculator.prepare(self.scheduler.running)
        return self.scheduler.schedule()

    def _place_adapters(self, sched: SchedulerOutput, outputs: list[EngineCoreOutput]) -> SchedulerOutput:
        """Every scheduled request's adapter in a slot; a request whose adapter fails to load
        ends alone, with the reason as its error (in `outputs`), and leaves the step."""
        assert self.lora is not None
        wanted = [s.request.lora_request for s in sched.scheduled if s.request.lora_request is not None]
        if not wanted:
            return sched
        running = {r.lora_request.lora_int_id for r in self.scheduler.running if r.lora_request is not None}
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
            del self.requests[req.request_id]
            reason = failed[lr.lora_int_id][:2000]
            outputs.append(EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.ERROR, stop_reason=reason))
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
                after = req.sampling_params.structured_outputs.start_after_token_ids  # type: ignore[union-attr]
                req.grammar.start_after = tuple(after or ())
            except Exception as exc:  # noqa: BLE001 - whatever llguidance raised: this request's
                req.status = RequestStatus.FINISHED_ABORTED
                del self.requests[rid]
                message = str(exc) if isinstance(exc, ValueError) else f"structured_outputs: {type(exc).__name__}: {exc}"
                failed.append(EngineCoreOutput(rid, [], finish_reason=FinishReason.ERROR, stop_reason=message[:2000]))
                continue
            self.scheduler.add_request(req)
        return failed

    def _wait_for_a_grammar(self) -> None:
        # Blocks the compute thread only: the compiler's threads hold no lock it needs, and
        # llguidance compiles without the GIL.
        wait_futures([f for _, f in self._compiling.values()], _GRAMMAR_WAIT_S, FIRST_COMPLETED)

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
            **self._spec_statistics(),
        )

    def _spec_statistics(self) -> dict[str, Any]:
        sp = self.speculator
        if sp is None:
            return {}
        return {
            "spec_num_drafts": sp.num_drafts,
            "spec_num_draft_tokens": sp.num_draft_tokens,
            "spec_num_accepted_tokens": sp.num_accepted_tokens,
            "spec_accepted_per_pos": tuple(sp.accepted_per_pos),
        }

    def check_integrity(self) -> None:
        live = list(self.scheduler.live_requests())
        self.block_manager.check_integrity(live)
        # Every request is in the scheduler or compiling its grammar, never both, never neither.
        ids = [r.request_id for r in live] + list(self._compiling)
        assert sorted(ids) == sorted(self.requests), f"requests {sorted(self.requests)} vs scheduled or compiling {sorted(ids)}"
        assert all(not r.block_ids for r, _ in self._compiling.values()), "a compiling request holds KV blocks"


@dataclass(frozen=True)
class EngineCoreFactory:
    """Builds the engine core in place of `build_engine_core(config)`: a test or benchmark hook.

    `target` names a function, "package.module:function", called as `function(config, **kwargs)`
    and returning a `Core` (an `EngineCore`, say). Both parts are plain data (`kwargs` JSON-able), so the same
    value builds the core in this process and in the engine-core child process.
    """

    target: str
    kwargs: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        module, sep, name = self.target.partition(":")
        if not (sep and module and name.isidentifier()):
            raise ValueError(
                f"engine_core_factory: {self.target!r} is not 'package.module:function'"
            )

    @classmethod
    def coerce(cls, value: EngineCoreFactory | str | None) -> EngineCoreFactory | None:
        """A "module:function" string is a factory without keyword arguments."""
        if value is None or isinstance(value, cls):
            return value
        if isinstance(value, str):
            return cls(value)
        raise ValueError(
            f"engine_core_factory: expected 'module:function' or an EngineCoreFactory, got {type(value).__name__}"
        )

    def build(self, config: EngineConfig) -> Core:
        module, _, name = self.target.partition(":")
        function = getattr(importlib.import_module(module), name)
        core = function(config, **self.kwargs)
        if not isinstance(core, Core):
            raise TypeError(
                f"engine_core_factory: {self.target} returned {type(core).__name__}, not an "
                "EngineCore (or another engine core: see the Core protocol in engine/core_protocol.py)"
            )
        return core


def default_kv_budget(device: str, gpu_memory_utilization: float) -> int:
    """KV cache bytes when `kv_cache_memory_bytes` is not set, measured after the model loaded.

    CUDA, as vLLM: this engine may use `gpu_memory_utilization` of the GPU's total memory, and
    the KV cache gets what of that share the weights (and anything else) left free. CPU: a
    fifth of the available memory, at most 2 GiB.
    """
    if device == "cuda":
        free, total = torch.cuda.mem_get_info()
        budget = int(free - (1.0 - gpu_memory_utilization) * total)
        if budget <= 0:
            used = (total - free) / 2**30
            raise ValueError(
                f"gpu_memory_utilization: {gpu_memory_utilization} of {total / 2**30:.1f} GiB leaves "
                f"no room for the KV cache ({used:.1f} GiB are already in use); raise it"
            )
        return budget
    return int(min(_available_memory() * _DEFAULT_CPU_KV_FRACTION, _DEFAULT_CPU_KV_MAX))


def _available_memory() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
