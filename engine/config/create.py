"""`create_engine_config`: `EngineArgs` in, the frozen `EngineConfig` out, one resolver per
concern, each checking its own fields. Everything that can be refused without the model is
refused before the model is read (a Hub model may be downloaded then); the rest follows the
model's sizes.

The resolvers read `EngineArgs` through Protocols (`LoRAArgs`, `CacheArgs`, ...): each names
the fields it reads, and none imports `EngineArgs`, which sits above them (`args.py` calls
this module), so the package has no import circle."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

from triollm.engine.config.actor import ActorArgs, resolve_actor
from triollm.engine.config.cache import CacheArgs, resolve_cache
from triollm.engine.config.checks import positive
from triollm.engine.config.compilation import GraphArgs, cuda_graph_sizes
from triollm.engine.config.engine_config import EngineConfig
from triollm.engine.config.ignored import IgnoredArgs, ignored_args, warn_ignored
from triollm.engine.config.limits import LimitsArgs, resolve_limits
from triollm.engine.config.lora import LoRAArgs, resolve_lora
from triollm.engine.config.model import (
    ModelArgs,
    check_model_impl,
    check_pooling,
    resolve_device,
    resolve_model_config,
    resolve_tokenizer,
)
from triollm.engine.config.parallel import check_tensor_parallel_model
from triollm.engine.config.quantization import QuantArgs, quantize, with_kv_cache_dtype
from triollm.engine.config.scheduler import SchedulerArgs, check_scheduler, resolve_scheduler
from triollm.engine.config.speculative import SpeculativeArgs, resolve_speculative

__all__ = ["ResolverArgs", "create_engine_config"]


class ResolverArgs(
    ActorArgs, CacheArgs, GraphArgs, IgnoredArgs, LimitsArgs, LoRAArgs, ModelArgs, QuantArgs,
    SchedulerArgs, SpeculativeArgs, Protocol,
):  # fmt: skip
    """Every `EngineArgs` field a resolver reads, and the few read here."""

    @property
    def device(self) -> str: ...
    @property
    def seed(self) -> int: ...
    @property
    def num_threads(self) -> int | None: ...
    @property
    def cache_dir(self) -> str | None: ...


def create_engine_config(args: ResolverArgs, defaults: Mapping[str, object]) -> EngineConfig:
    """`args` validated once and resolved; `defaults` (each field's default, by name) tell
    which ignored vLLM arguments were set. Raises ValueError naming the field."""
    device = resolve_device(args.device)
    check_scheduler(args)
    cache = resolve_cache(args, device)
    if args.num_threads is not None:
        positive("num_threads", args.num_threads)
    limits = resolve_limits(args)
    actor = resolve_actor(args)
    cache_dir = Path(args.cache_dir) if args.cache_dir else None
    model = resolve_model_config(args, device, cache_dir)
    model = with_kv_cache_dtype(quantize(model, args, device), args.kv_cache_dtype, device, args.calculate_kv_scales)
    check_pooling(model, args.tensor_parallel_size, args.max_num_batched_tokens)
    check_model_impl(model, args.tensor_parallel_size, args.enable_lora)
    check_tensor_parallel_model(args.tensor_parallel_size, device, model)
    scheduler = resolve_scheduler(args, model)
    ignored = ignored_args(args, defaults, device)
    warn_ignored(args, ignored)
    return EngineConfig(
        model=model,
        cache=cache,
        scheduler=scheduler,
        device=device,
        seed=args.seed,
        num_threads=args.num_threads,
        tokenizer=resolve_tokenizer(args, model.path, cache_dir),
        actor=actor,
        limits=limits,
        ignored_args=ignored,
        tensor_parallel_size=args.tensor_parallel_size,
        cuda_graph_sizes=cuda_graph_sizes(args, device),
        lora=resolve_lora(args, model),
        speculative=resolve_speculative(args, model, device, cache_dir),
    )
