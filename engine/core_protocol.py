"""`Core`: what the actor shell needs of an engine core, and the statistics it reports.

There are two implementations, chosen once from the model's runner type by
`build_engine_core` (engine/cores.py): `EngineCore` (engine/core.py) for a generative model —
scheduler, paged KV cache, sampler — and `PoolingEngineCore` (engine/pooling_core.py) for a
pooling (embedding) model, one encoder pass per request and no KV cache. The loop that drives
either (actors/core_loop.py), the transports and the engine-core process see only this protocol.

Rejected: a base class whose `__new__` returned its pooling subclass for a pooling config. It
made `EngineCore(config)` return an object of another class, and tied the two modules into an
import circle; a protocol with two implementations says what is meant.

This module sits below both implementations (it imports neither), so each may name it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from triollm.engine.request import EngineCoreOutput, EngineCoreRequest

__all__ = ["Core", "EngineCoreStats"]


@dataclass(frozen=True)
class EngineCoreStats:
    num_running: int
    num_waiting: int
    num_blocks: int
    num_free_blocks: int
    num_cached_blocks: int
    kv_cache_usage: float
    prefix_cache_hit_rate: float
    num_preemptions: int
    # KV blocks given back mid-request as they fell out of every layer's sliding window.
    num_window_released_blocks: int = 0
    # Speculative decoding (engine/speculative/), cumulative since start; vLLM's
    # `vllm:spec_decode_*` counters. A draft is one request's proposals verified in one step.
    spec_num_drafts: int = 0
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    # Accepted drafts by position: [i] counts drafts whose token i was accepted. Its length is
    # num_speculative_tokens with speculation configured, () without (no spec metrics then).
    spec_accepted_per_pos: tuple[int, ...] = ()


@runtime_checkable
class Core(Protocol):
    """A synchronous, sans-IO engine core: inputs between steps, one `step()` at a time, all
    from one thread (the one that built it). Nothing here blocks on I/O or awaits."""

    @property
    def num_blocks(self) -> int:
        """KV cache blocks (0 for a core without a KV cache): reported in the start-up
        handshake."""
        ...

    @property
    def num_steps(self) -> int:
        """Steps that ran a forward pass or waited on a grammar compile so far: a `step()` that
        leaves it unchanged had nothing to run or wait on (the loop then waits for input
        instead of spinning)."""
        ...

    def add_request(self, request: EngineCoreRequest) -> None:
        """Queue a request. Raises ValueError (and changes nothing) if it is invalid."""
        ...

    def abort_requests(self, request_ids: list[str] | str) -> None:
        """Finish the requests now, without an output; unknown ids are ignored."""
        ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[EngineCoreOutput]:
        """Advance the scheduled requests by one forward pass; the outputs of those that
        advanced (possibly none)."""
        ...

    def statistics(self) -> EngineCoreStats: ...

    def reset_prefix_cache(self) -> bool:
        """Forget the cached prefixes of the free blocks; False if some are still in use."""
        ...

    def check_integrity(self) -> None:
        """Raise AssertionError if the core's bookkeeping is inconsistent (tests, debugging)."""
        ...

    def close(self) -> None:
        """Release what the core started (tensor-parallel workers); idempotent."""
        ...
