"""What the frontend holds of an engine core, however it runs (see `actors/transport.py`)."""

from __future__ import annotations

from dataclasses import dataclass

from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from triollm.actors.messages import CoreInput, CoreOutput, Ready
from triollm.engine.core_protocol import EngineCoreStats

__all__ = ["OUTPUT_BUFFER", "SHUTDOWN_GRACE_S", "CoreClient"]

OUTPUT_BUFFER = 64  # engine steps in flight towards the output actor
SHUTDOWN_GRACE_S = 5.0


@dataclass
class CoreClient:
    ready: Ready
    inputs: MemoryObjectSendStream[CoreInput]
    outputs: MemoryObjectReceiveStream[CoreOutput]
    pid: int | None = None  # the engine-core child, when there is one
    # How long the teardown waits for the core to end its current step before cancelling it
    # (in-process) or signalling it (a child). The frontend sets 0 for a core it declared hung:
    # that step will not end.
    shutdown_grace_s: float = SHUTDOWN_GRACE_S
    # Data parallel (actors/data_parallel.py): each rank's child, the requests routed to each
    # rank so far and each rank's latest statistics (both live lists).
    rank_pids: tuple[int, ...] = ()
    assigned: list[int] | None = None
    rank_stats: list[EngineCoreStats | None] | None = None
