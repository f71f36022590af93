"""`Core`: what the actor shell needs of an engine core, and the statistics it reports.

There are two implementations, chosen once from the model's runner type by
`build_engine_core` (engine/cores.py): `EngineCore` (engine/core.py) for a generative model —
scheduler, paged KV cache, sampler — and `PoolingEngineCore` (engine/pooling_core.py) for a
pooling (embedding) model, one encoder pass per request and no KV cache. The loop that drives
either (actors/core_loop.py), the transports and the engine-core process see only this protocol.

Rejected: a base class whose `__new__` returned its pooling subclass for a pooling config. It
made `EngineCore(config)` return an object of another class, and tied the two modules into an
import circle; a protocol with two implementations says what is meant.

The statistics are one record, `EngineCoreStats` (speculation's counters nested in it as
`SpecDecodingStats`), which is also what crosses the wire to the frontend and what data parallel
merges: a new counter is one field, its producer and its consumers, not a copy per layer.

This module sits below both implementations (it imports neither), so each may name it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from triollm.engine.request import EngineCoreOutput, EngineCoreRequest

__all__ = ["Core", "EngineCoreStats", "SpecDecodingStats"]


class SpecDecodingStats(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """Speculative decoding's counters (engine/speculative/: `Speculator.statistics()`),
    cumulative since start: vLLM's `vllm:spec_decode_*`. A draft is one request's proposals
    verified in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # [i] counts the drafts whose token i was accepted: num_speculative_tokens entries.
    accepted_per_pos: tuple[int, ...] = ()

    @classmethod
    def merge(cls, stats: Sequence[SpecDecodingStats]) -> SpecDecodingStats:
        """The sum over data-parallel ranks. A shorter `accepted_per_pos` counts as zeros in the
        positions it lacks, so the sum is as long as the longest."""
        per_pos = [0] * max((len(s.accepted_per_pos) for s in stats), default=0)
        for s in stats:
            for i, n in enumerate(s.accepted_per_pos):
                per_pos[i] += n
        counts: dict[str, Any] = {f: sum(getattr(s, f) for s in stats) for f in _SPEC_COUNTS}
        return cls(**counts, accepted_per_pos=tuple(per_pos))

    def since(self, earlier: SpecDecodingStats | None) -> SpecDecodingStats:
        """The counts of the interval from `earlier` (None: the start) to these."""
        if earlier is None:
            return self
        before = list(earlier.accepted_per_pos)
        before += [0] * (len(self.accepted_per_pos) - len(before))
        per_pos = (n - b for n, b in zip(self.accepted_per_pos, before))
        counts: dict[str, Any] = {f: getattr(self, f) - getattr(earlier, f) for f in _SPEC_COUNTS}
        return SpecDecodingStats(**counts, accepted_per_pos=tuple(per_pos))

    @property
    def acceptance_rate(self) -> float | None:
        """Accepted draft tokens per proposed one; None before any draft."""
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else None

    @property
    def mean_acceptance_length(self) -> float | None:
        """Tokens per verified draft, the target's own token included (vLLM's convention)."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else None


_SPEC_COUNTS = tuple(f for f in SpecDecodingStats.__struct_fields__ if f != "accepted_per_pos")


class EngineCoreStats(msgspec.Struct, array_like=True, frozen=True, omit_defaults=True, gc=False):
    """`Core.statistics()`, and the value on the wire: the core loop sends it as it is with each
    step's `OutputBatch` and as the answer to a statistics call (actors/messages.py).

    Every field is a count that data parallel sums (`merge`) except the two rates and `spec`: a
    new count is one field here, its producer and its consumers."""

    num_running: int = 0
    num_waiting: int = 0
    num_blocks: int = 0
    num_free_blocks: int = 0
    num_cached_blocks: int = 0
    kv_cache_usage: float = 0.0  # fraction of the KV blocks in use
    prefix_cache_hit_rate: float = 0.0  # of the prompt tokens looked up since start
    num_preemptions: int = 0
    # KV blocks given back mid-request as they fell out of every layer's sliding window.
    num_window_released_blocks: int = 0
    spec: SpecDecodingStats | None = None  # None without speculation (no spec metrics then)

    @classmethod
    def merge(cls, stats: Sequence[EngineCoreStats]) -> EngineCoreStats:
        """One record for the data-parallel ranks: the counts summed, the KV usage of the pooled
        blocks, the ranks' mean prefix-cache hit rate (they report no lookup counts to weigh it
        by), and the speculation counters of the ranks that report them summed."""
        if not stats:
            return cls()
        fields = [f for f in cls.__struct_fields__ if f not in _NOT_COUNTS]
        counts: dict[str, Any] = {f: sum(getattr(s, f) for s in stats) for f in fields}
        blocks, free = counts["num_blocks"], counts["num_free_blocks"]
        specs = [s.spec for s in stats if s.spec is not None]
        return cls(
            **counts,
            kv_cache_usage=1.0 - free / blocks if blocks else 0.0,
            prefix_cache_hit_rate=sum(s.prefix_cache_hit_rate for s in stats) / len(stats),
            spec=SpecDecodingStats.merge(specs) if specs else None,
        )


_NOT_COUNTS = ("kv_cache_usage", "prefix_cache_hit_rate", "spec")


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

    # vLLM's sleep mode, weight reload, collective_rpc and profiler (engine/execution/sleep_mode.py).
    # Bad arguments, and a state that does not allow the call, are ValueErrors naming them.

    def sleep(self, level: int = 1) -> None:
        """Free the KV cache (level 1) and the weights (level 2), the prefix cache forgotten;
        requests are refused until `wake_up`. Refused while requests are unfinished."""
        ...

    def wake_up(self, tags: list[str] | None = None) -> None:
        """Restore what `tags` names ("weights", "kv_cache"; None: all)."""
        ...

    def is_sleeping(self) -> bool: ...

    def reload_weights(self, weights_path: str | None = None) -> None:
        """Read the weights again (from `weights_path`: another checkpoint of the running
        architecture); the prefix cache is forgotten. Refused while requests are unfinished."""
        ...

    def collective_rpc(
        self,
        method: str | Callable[..., Any],
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
    ) -> list[Any]:
        """`method` on every rank's worker, one result per rank (vLLM's `collective_rpc`)."""
        ...

    def start_profile(self) -> None: ...

    def stop_profile(self) -> None: ...

    def close(self) -> None:
        """Release what the core started (tensor-parallel workers); idempotent."""
        ...
