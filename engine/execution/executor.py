"""`Executor`: the device side of a generative engine core, built in one explicit order.

`Executor.build(config)` owns everything that holds device memory or processes, so the engine
core (engine/core.py) holds only bookkeeping: the scheduler, the block manager, the grammars.
Its build order is the one place the dependencies between device resources are written down:

1. process knobs: torch's thread count and seed;
2. the model, or rank 0's shard with the tensor-parallel workers started (their share of the
   cores set first);
3. the LoRA manager: its adapter buffers are allocated beside the weights, before the KV cache
   takes what memory is left;
4. the draft model (speculative decoding's `draft_model` method), for the same reason;
5. the KV block count: `cache.num_kv_blocks`, or the budget (`kv_cache_memory_bytes`, or
   measured now that the weights are loaded: `default_kv_budget`) over the bytes of one block
   of the model's cache and the draft's; sent to the TP workers; checked against
   max_model_len;
6. the KV cache, CUDA graphs captured over it, and the runner; the draft's runner over a KV
   cache of its own (the same block ids).

With an injected `runner` (tests, benchmarks) steps 2-4 and 6 are skipped: no model, no KV
memory, and the block count comes from the model's configuration alone. `close()` stops the
TP workers (idempotent); a build that raises closes what it started.

Sleep mode (engine/execution/sleep_mode.py): `sleep(1)` drops the runner (the KV cache and the
graphs over it), `sleep(2)` the model, the LoRA manager and the draft model too; `wake_up`
rebuilds them as steps 2-4 and 6 did; a weight reload (the core's) is a level-2 sleep and a
wake-up after `use_checkpoint` named the same or another checkpoint of the architecture. The
executor is also the rank-0 worker of `collective_rpc`: a method name is one of its methods, a
callable gets it as first argument. With tensor parallelism each of these goes to the workers
too (`TensorParallelGroup.call`; their side is engine/distributed/worker.py's `RankWorker`).

Rejected: the core building these itself (the order was held by comments such as "before the
KV cache is sized"), and a worker class per device as in vLLM: one process drives the device
here, and tensor parallelism is the group the runner already talks to.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import torch

from triollm.engine.config import EngineConfig
from triollm.engine.execution.cuda_graphs import DecodeGraphs, cuda_capture
from triollm.engine.execution.layers.attention import calculate_kv_scales_on_first_prompt
from triollm.engine.execution.layers.recurrent import StatePool
from triollm.engine.execution.model_runner import ModelRunner, RunnerOutput
from triollm.engine.execution.models import CausalLM, load_model
from triollm.engine.execution.sleep_mode import check_level, check_tags, run_rpc, same_architecture
from triollm.engine.scheduling.scheduler import ScheduledRequest
from triollm.engine.speculative.draft import DraftModel
from triollm.kernels import KVCache, allocate_kv_cache, cpu_native
from triollm.lora.manager import LoRAManager

if TYPE_CHECKING:
    from triollm.engine.distributed.group import TensorParallelGroup

__all__ = ["Executor", "Runner", "default_kv_budget"]

log = logging.getLogger("triollm")

_DEFAULT_CPU_KV_FRACTION = 0.2
_DEFAULT_CPU_KV_MAX = 2 << 30


class Runner(Protocol):
    """What the core needs of a model runner: one forward pass (and sampling) per step."""

    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput: ...


class Executor:
    """The built device resources; see the module docstring for the order. Attributes:
    `runner` (executes a step), `num_blocks` (KV blocks, this rank's), `num_kv_heads` (this
    rank's), `model` and `lora` (None with an injected runner), `draft` (the draft model's
    runner, with a draft model only), `group` (the TP workers, with tensor_parallel_size > 1)."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.group: TensorParallelGroup | None = None
        self.model: CausalLM | None = None
        self.lora: LoRAManager | None = None
        self.draft_model: CausalLM | None = None
        self.draft: DraftModel | None = None
        self.num_kv_heads = config.model.num_kv_heads
        self.num_blocks = 0
        self.num_state_slots = 0  # a hybrid model's recurrent-state slots (_num_state_slots)
        self.runner: Runner
        self._injected: Runner | None = None  # tests' runner: kept through sleep
        self._asleep: set[str] = set()  # of sleep_mode.WAKE_TAGS
        self._lora_pins: set[int] = set()  # the LoRA manager's pins, kept while the weights sleep

    @classmethod
    def build(cls, config: EngineConfig, runner: Runner | None = None) -> Executor:
        self = cls(config)
        try:
            self._build(runner)
        except BaseException:
            self.close()
            raise
        return self

    def _build(self, runner: Runner | None) -> None:
        config, mc = self.config, self.config.model
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        cpu_native.keep_freed_memory(config.device)  # a step's activations not faulted in anew
        if config.seed is not None:
            torch.manual_seed(config.seed)
        if runner is None:
            self.model = self._load_model()
            if config.lora is not None:
                keep_loads = self.group is not None
                self.lora = LoRAManager(self.model, config.lora, config.device, keep_loads=keep_loads)
            spec = config.speculative
            if spec is not None and spec.draft is not None:
                self.draft_model = load_model(spec.draft, config.device)
        self.num_blocks = self._num_kv_blocks()
        if self.group is not None:
            self.group.send_cache(self.num_blocks)
        self._check_fits_max_model_len()
        if runner is not None:
            self.runner = self._injected = runner
        else:
            self.runner = self._model_runner()
            self.draft = self._draft_runner()
        log.info(
            "KV cache: %d blocks of %d tokens (%d tokens, %.1f MiB) for %s on %s",
            self.num_blocks,
            config.cache.block_size,
            self.num_blocks * config.cache.block_size,
            self.num_blocks * self.bytes_per_block() / 2**20,
            mc.path.name,
            config.device,
        )

    # ------------------------------------------------------------------ sleep mode

    @property
    def is_sleeping(self) -> bool:
        return bool(self._asleep)

    @property
    def asleep(self) -> frozenset[str]:
        """The parts asleep: "weights", "kv_cache" (sleep_mode.WAKE_TAGS)."""
        return frozenset(self._asleep)

    @property
    def injected(self) -> bool:
        """A runner was injected (tests, benchmarks): no model, and sleep frees nothing."""
        return self._injected is not None

    def get_model(self) -> CausalLM | None:
        """vLLM's `worker.get_model()`: the model (None with an injected runner or asleep)."""
        return self.model

    def apply_model(self, func: Callable[[CausalLM], Any]) -> Any:
        """vLLM's `worker.apply_model`: `func(model)` (LLM.apply_model's rank-0 part)."""
        if self.model is None:
            raise ValueError("apply_model: no model is loaded (the weights are asleep, or a runner was injected)")
        return func(self.model)

    def sleep(self, level: int = 1) -> None:
        """Drop the KV cache (level 1), and the weights (level 2); see sleep_mode.py. The
        memory is given back once the caller has dropped its own references to the runner
        (`sleep_mode.release_memory`)."""
        level = check_level(level)
        self._asleep.add("kv_cache")
        if self._injected is None:
            self.runner = _Asleep()
            self.draft = None
        if level == 2:
            self._asleep.add("weights")
            if self.lora is not None:  # pins outlive the manager (`pin_lora`)
                self._lora_pins = set(self.lora.pinned)
            self.model = self.lora = self.draft_model = None
        if self.group is not None:
            self.group.call("sleep", (level,), {}, local=lambda: None)

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore the parts `tags` names ("weights", "kv_cache"; None: both): the weights read
        from the checkpoint again, the KV cache allocated anew (empty). The runner is rebuilt
        once both are back."""
        wanted = check_tags(tags) & self._asleep
        if "weights" in wanted and self._injected is None:
            self._load_weights()
        if self.group is not None:  # the workers' shards of the same checkpoint
            self.group.call("wake_up", (sorted(wanted),), {"model": self.config.model}, local=lambda: None)
        self._asleep -= wanted
        if not self._asleep and self._injected is None and isinstance(self.runner, _Asleep):
            self.runner = self._model_runner()
            self.draft = self._draft_runner()

    def use_checkpoint(self, weights_path: str | None) -> None:
        """Read the weights from `weights_path` from the next wake-up on: another checkpoint of
        the running architecture (checked now: a ValueError naming the field that differs).
        None: the running checkpoint."""
        if weights_path is not None:
            self.config = replace(self.config, model=same_architecture(self.config.model, weights_path))

    def collective_rpc(
        self, method: str | Callable[..., Any], args: Sequence[Any], kwargs: Mapping[str, Any]
    ) -> list[Any]:
        """`method` run on every rank, one result per rank (sleep_mode.run_rpc): on this one
        with the executor as the worker, on the others with their `RankWorker`."""
        if self.group is not None:
            return self.group.call(method, args, kwargs, local=lambda: run_rpc(self, method, args, kwargs))
        return [run_rpc(self, method, args, kwargs)]

    def _load_weights(self) -> None:
        config, group = self.config, self.group
        if group is None:
            self.model = load_model(config.model, config.device)
        else:
            self.model = load_model(config.model, config.device, group.shard, group.comm)
        if config.lora is not None:
            self.lora = LoRAManager(self.model, config.lora, config.device, keep_loads=group is not None)
            self.lora.pinned = self._lora_pins
        spec = config.speculative
        if spec is not None and spec.draft is not None:
            self.draft_model = load_model(spec.draft, config.device)

    def close(self) -> None:
        """Stop the tensor-parallel workers, if any (idempotent)."""
        if self.group is not None:
            self.group.close()
            self.group = None

    # ------------------------------------------------------------------ the model

    def _load_model(self) -> CausalLM:
        """The whole model, or with tensor_parallel_size N > 1 rank 0's shard after starting
        the N-1 workers (the cores are split between the ranks)."""
        from triollm.engine.distributed.group import TensorParallelGroup

        config, mc = self.config, self.config.model
        size = config.tensor_parallel_size
        if size == 1:
            return load_model(mc, config.device)
        threads = max(1, (config.num_threads or torch.get_num_threads()) // size)
        torch.set_num_threads(threads)
        block_size = config.cache.block_size
        self.group = group = TensorParallelGroup(size, threads, mc, config.device, block_size)
        self.num_kv_heads = group.shard.kv_heads(mc.num_heads, mc.num_kv_heads)[1]
        return load_model(mc, config.device, group.shard, group.comm)

    def _model_runner(self) -> ModelRunner:
        """The KV cache (with CUDA graphs, one spare block beyond the block manager's: the
        padding rows' slot), the graphs, and the runner over them."""
        assert self.model is not None
        config, mc = self.config, self.config.model
        sizes = config.cuda_graph_sizes
        kv = allocate_kv_cache(
            len(mc.kv_layers),
            self.num_blocks + (1 if sizes else 0),
            config.cache.block_size,
            self.num_kv_heads,
            mc.head_dim,
            mc.cache_dtype,
            config.device,
        )
        graphs = self._capture_graphs(kv, sizes)
        if mc.calculate_kv_scales:  # after the capture's dummy steps: from the first real prompt
            calculate_kv_scales_on_first_prompt(self.model)
        vision = None
        if mc.multimodal is not None and mc.multimodal.takes_images:
            from triollm.engine.execution.vision import load_vision_encoder

            if self.group is not None:  # the other ranks would embed the placeholders as tokens
                raise ValueError(
                    f"tensor_parallel_size: {mc.multimodal.architecture} runs its images on one rank; allowed: 1"
                )
            vision = load_vision_encoder(mc, config.device)
        states = None
        if mc.recurrent is not None:  # a hybrid model's recurrent layers (layers/recurrent.py)
            states = StatePool(self.state_shapes(), self.num_state_slots, mc.dtype, config.device)
        return ModelRunner(self.model, kv, config.device, self.group, graphs, self.lora, vision, states)

    def state_shapes(self) -> list[tuple[int, ...]]:
        """A hybrid model's recurrent states for one request, layer by layer ([] for others)."""
        mc = self.config.model
        if mc.recurrent is None:
            return []
        return len(mc.state_layers) * mc.recurrent.state_shapes(mc.hidden_size)

    def _draft_runner(self) -> DraftModel | None:
        """The draft model's runner over a KV cache of its own (the same block ids)."""
        spec = self.config.speculative
        if spec is None or spec.draft is None or self.draft_model is None:
            return None
        d, config = spec.draft, self.config
        kv = allocate_kv_cache(
            d.num_layers,
            self.num_blocks,
            config.cache.block_size,
            d.num_kv_heads,
            d.head_dim,
            d.cache_dtype,
            config.device,
        )
        if d.calculate_kv_scales:
            calculate_kv_scales_on_first_prompt(self.draft_model)
        return DraftModel(ModelRunner(self.draft_model, kv, config.device))

    def _capture_graphs(self, kv: KVCache, sizes: tuple[int, ...]) -> DecodeGraphs | None:
        """CUDA graphs for decode steps; a capture that fails leaves the engine eager, with a
        warning that names the cause."""
        if not sizes:
            return None
        assert self.model is not None
        mc, bs = self.config.model, self.config.cache.block_size
        if mc.recurrent is not None:  # the states are indexed by slots the host picks each step
            log.info("CUDA graphs are off for %s: its recurrent layers run eagerly", mc.architecture)
            return None
        if mc.moe is not None:  # the experts' routing reads token counts on the host each layer
            log.info("CUDA graphs are off for %s: routed experts run eagerly", mc.architecture)
            return None
        start = time.perf_counter()
        device = torch.device(self.config.device)
        max_blocks = -(-mc.max_model_len // bs)
        try:
            graphs = DecodeGraphs(self.model, kv, device, sizes, max_blocks, self.num_blocks, cuda_capture())
        except Exception as exc:  # noqa: BLE001 - eager still works; say why graphs are off
            log.warning(
                "CUDA graphs are off, every step runs eagerly: capture failed (%s: %s)",
                type(exc).__name__,
                exc,
            )
            return None
        elapsed = time.perf_counter() - start
        log.info("captured CUDA graphs for decode batch sizes %s in %.1f s", list(sizes), elapsed)
        return graphs

    # ------------------------------------------------------------------ KV sizing

    def bytes_per_block(self) -> int:
        """KV bytes per block: the model's and, with a draft model, the draft's (same blocks)."""
        mc, bs = self.config.model, self.config.cache.block_size
        size = KVCache.bytes_per_block(len(mc.kv_layers), self.num_kv_heads, mc.head_dim, bs, mc.cache_dtype)
        spec = self.config.speculative
        if spec is not None and spec.draft is not None and self.draft_model is not None:
            d = spec.draft
            size += KVCache.bytes_per_block(d.num_layers, d.num_kv_heads, d.head_dim, bs, d.cache_dtype)
        return size

    def fixed_bytes(self) -> int:
        """KV bytes whatever the block count (an fp8 cache's per-layer scales), draft included."""
        mc = self.config.model
        size = KVCache.fixed_bytes(len(mc.kv_layers), mc.cache_dtype)
        size += StatePool.bytes_needed(self.state_shapes(), self.num_state_slots, mc.dtype)
        spec = self.config.speculative
        if spec is not None and spec.draft is not None and self.draft_model is not None:
            size += KVCache.fixed_bytes(spec.draft.num_layers, spec.draft.cache_dtype)
        return size

    def _num_kv_blocks(self) -> int:
        """The blocks that fit the budget (kv_cache_memory_bytes, or what the device has free):
        every byte of the cache counted, its scales included (`KVCache.bytes_per_block`)."""
        cache = self.config.cache
        if cache.num_kv_blocks is not None:
            self.num_state_slots = self._num_state_slots(None)
            return cache.num_kv_blocks
        budget = cache.kv_cache_memory_bytes
        if budget is None:
            budget = default_kv_budget(self.config.device, cache.gpu_memory_utilization)
        self.num_state_slots = self._num_state_slots(budget)
        blocks = (budget - self.fixed_bytes()) // self.bytes_per_block()
        # More blocks than every sequence at full length could use would only waste memory.
        per_seq = math.ceil(self.config.model.max_model_len / cache.block_size)
        blocks = min(blocks, self.config.scheduler.max_num_seqs * per_seq + 1)
        if blocks <= 0:
            raise ValueError(
                f"kv_cache_memory_bytes: {budget} bytes hold no KV block "
                f"(one block needs {self.bytes_per_block()} bytes)"
            )
        return int(blocks)

    def _num_state_slots(self, budget: int | None) -> int:
        """Recurrent-state slots: one per running request (`max_num_seqs`), or as many as half
        the memory budget holds where that is fewer (a Mamba-2 layer's state is megabytes): the
        scheduler then admits no more requests than there are slots (BlockManager)."""
        shapes = self.state_shapes()
        if not shapes:
            return 0
        slots = self.config.scheduler.max_num_seqs
        if budget is not None:
            per_slot = StatePool.bytes_per_slot(shapes, self.config.model.dtype)
            slots = min(slots, budget // 2 // per_slot)
            if slots < 1:
                raise ValueError(
                    f"kv_cache_memory_bytes: {budget} bytes hold no recurrent state of "
                    f"{self.config.model.architecture} (one request's needs {per_slot} bytes, within half the budget)"
                )
        return int(slots)

    def _check_fits_max_model_len(self) -> None:
        cache, max_len = self.config.cache, self.config.model.max_model_len
        tokens = self.num_blocks * cache.block_size
        if tokens < max_len and cache.num_kv_blocks is None:
            raise ValueError(
                f"max_model_len: {max_len} tokens do not fit in the KV cache "
                f"({self.num_blocks} blocks x {cache.block_size} = {tokens} tokens); "
                "raise kv_cache_memory_bytes or lower max_model_len"
            )


class _Asleep:
    """The runner while the executor sleeps: the core refuses requests first, so a step here
    is a bug."""

    def execute(self, scheduled: list[ScheduledRequest]) -> RunnerOutput:
        raise RuntimeError("the engine is sleeping: call wake_up() before stepping")


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
                f"gpu_memory_utilization: {gpu_memory_utilization} of {total / 2**30:.1f} GiB "
                f"leaves no room for the KV cache ({used:.1f} GiB are already in use); raise it"
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
