"""Data parallel on one node: N engine-core processes behind one `CoreClient` (vLLM's
`DPLBAsyncMPClient`, the internal load balancer).

```
AsyncLLM ── client.inputs ─▶ router ─┬─▶ rank 0: open_process_core (its own KV cache, threads)
                                     └─▶ rank 1: ...
AsyncLLM ◀─ client.outputs ◀─ merge ◀┬── rank 0 outputs (each OutputBatch: the rank's statistics)
                                     └── rank 1 outputs
```

Each rank is an ordinary engine-core child (`actors/process.py`), or with
`data_parallel_backend="ray"` a Ray actor in its own placement group (`actors/ray_core.py`),
running the frontend's resolved config with its own fields set (`rank_config`: one engine core,
its rank, its share of the cores); nothing is resolved again. The frontend above sees one core:

- **Routing.** `AddRequest` goes to the rank with the lowest load score, vLLM's rule:
  `max(in flight, waiting + running)`, with the in-flight count kept here and waiting + running
  from the `EngineCoreStats` riding on the rank's latest `OutputBatch` (a heartbeat's too, so a
  rank deep in a long prompt's chunks still reports its queue); ties rotate. An abort
  goes to the rank that owns the request. A utility call goes to every rank and its answers are
  combined (statistics by `EngineCoreStats.merge`, booleans and-ed, the first error wins). Dense
  models need no step synchronisation between ranks.
- **Death.** The first `EngineDead` from any rank (its step raised, or its process died) is
  forwarded, naming the rank, and ends the merged output stream: the engine is dead as a whole
  (`EngineDeadError` on every request and utility call, /health 503), as in vLLM. Every rank is
  stopped when the client's context exits.
- **Hangs.** A rank can hang while the others produce (a deadlocked step, a stopped process or
  Ray actor), which the frontend's watchdog, hearing the merged stream, would miss. So each
  rank's forwarder runs a `Watchdog` of its own (`engine_output_timeout_s`): a rank that owes a
  message (`Router.pending`: an unanswered utility call, or unfinished requests routed to it
  while not paused) and sent nothing for that long is declared dead like any other death,
  naming the rank, and gets no shutdown grace (its step will not end). A message the forwarder
  holds because the frontend lags counts as heard. A rank that steps sends a message every step
  (a heartbeat when the step had no outputs: actors/messages.py); the forwarder passes it on
  like any batch, so the rank's watchdog and the frontend's both hear a rank busy with a long
  prompt, and the frontend's copy of its statistics stays fresh. Rejected: one watchdog with a clock per
  rank, fed from here: one `Watchdog` per forwarder needs no new interface, and the
  single-core engine keeps the frontend's.
- **Shutdown** exits the ranks' contexts (each sends `Shutdown`, then signals, within its grace).

The topology is fixed at start-up, as in vLLM.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
import pickle
from collections.abc import AsyncIterator, Callable
from contextlib import AsyncExitStack, asynccontextmanager

import anyio
import cloudpickle
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from triollm.actors.core_client import OUTPUT_BUFFER, SHUTDOWN_GRACE_S, CoreClient
from triollm.actors.errors import EngineDeadError
from triollm.actors.messages import (
    AbortRequests,
    AddRequest,
    CoreInput,
    CoreOutput,
    EngineDead,
    OutputBatch,
    Ready,
    RequestError,
    Shutdown,
    UtilityCall,
    UtilityOp,
    UtilityResult,
)
from triollm.actors.process import default_num_threads, open_process_core
from triollm.actors.ray_core import open_ray_core, ray_session
from triollm.actors.watchdog import Watchdog
from triollm.engine.config import EngineConfig
from triollm.engine.core_factory import EngineCoreFactory
from triollm.engine.core_protocol import EngineCoreStats

__all__ = ["Router", "open_data_parallel_client", "rank_config", "rank_threads"]

log = logging.getLogger("triollm")

_NOT_FINISHED = -1


def rank_threads(num_threads: int | None, size: int) -> int:
    """Torch threads per rank: the engine's threads (`num_threads`, else the default for one
    core) split evenly, at least one each."""
    total = num_threads or default_num_threads()
    return max(1, total // size)


class Router:
    """Which rank runs which request, and how loaded each rank is."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.owner: dict[str, int] = {}  # core request id -> rank, while it runs
        self.in_flight = [0] * size
        self.queued = [0] * size  # waiting + running, from the rank's latest statistics
        self.assigned = [0] * size  # requests routed to each rank so far (statistics)
        self.stats: list[EngineCoreStats | None] = [None] * size  # each rank's latest
        self.paused = False  # between a routed PAUSE and the next RESUME: ranks do not step
        self._turn = itertools.cycle(range(size))
        self._calls: dict[int, dict[int, UtilityResult]] = {}  # call id -> the answers, by rank

    def assign(self, request_id: str) -> int:
        start = next(self._turn)
        order = [(start + k) % self.size for k in range(self.size)]
        rank = min(order, key=lambda r: max(self.in_flight[r], self.queued[r]))
        self.owner[request_id] = rank
        self.in_flight[rank] += 1
        self.assigned[rank] += 1
        return rank

    def release(self, request_id: str) -> int | None:
        rank = self.owner.pop(request_id, None)
        if rank is not None:
            self.in_flight[rank] -= 1
        return rank

    def abort(self, request_ids: list[str]) -> dict[int, list[str]]:
        """The ids by owning rank (ids no rank owns, already finished, are dropped)."""
        by_rank: dict[int, list[str]] = {}
        for rid in request_ids:
            rank = self.release(rid)
            if rank is not None:
                by_rank.setdefault(rank, []).append(rid)
        return by_rank

    def observe(self, rank: int, batch: OutputBatch) -> None:
        if batch.stats is not None:
            self.stats[rank] = batch.stats
            self.queued[rank] = batch.stats.num_running + batch.stats.num_waiting
        for rid, reason in zip(batch.request_ids, batch.finish_reasons):
            if reason != _NOT_FINISHED:
                self.release(rid)

    def expect(self, call: UtilityCall) -> None:
        """`call` goes to every rank: wait for each one's answer."""
        self._calls[call.call_id] = {}
        if call.op in (UtilityOp.PAUSE, UtilityOp.RESUME):
            self.paused = call.op == UtilityOp.PAUSE

    def gather(self, rank: int, result: UtilityResult) -> UtilityResult | None:
        """The combined answer once every rank answered `result.call_id`, else None."""
        if isinstance(result.result, EngineCoreStats):
            self.stats[rank] = result.result
        got = self._calls.get(result.call_id)
        if got is None:
            return None
        got[rank] = result
        if len(got) < self.size:
            return None
        del self._calls[result.call_id]
        return _combine(result.call_id, [got[r] for r in range(self.size)])

    def pending(self, rank: int) -> bool:
        """Whether `rank` owes the frontend a message: the answer to a utility call, or steps of
        the requests routed to it that are unfinished (none while paused: it does not step)."""
        if any(rank not in got for got in self._calls.values()):
            return True
        return self.in_flight[rank] > 0 and not self.paused


def _combine(call_id: int, results: list[UtilityResult]) -> UtilityResult:
    errors = [r.error for r in results if r.error is not None]
    if errors:
        return UtilityResult(call_id, None, error=errors[0])
    values = [r.result for r in results]
    stats = [v for v in values if isinstance(v, EngineCoreStats)]
    if len(stats) == len(values):
        return UtilityResult(call_id, EngineCoreStats.merge(stats))
    pickled = [v for v in values if isinstance(v, bytes)]
    if len(pickled) == len(values):  # a core method's results: rpc lists joined in rank order
        answers = [pickle.loads(v) for v in pickled]
        if all(isinstance(a, list) for a in answers):
            return UtilityResult(call_id, cloudpickle.dumps([x for a in answers for x in a]))
        return UtilityResult(call_id, pickled[0])
    return UtilityResult(call_id, all(bool(v) for v in values))


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """What rank `rank` of `config`'s data-parallel ranks runs: the frontend's resolved config,
    with the rank's own fields (one engine core, rank `rank` of them all, its share of the
    threads) and nothing resolved again."""
    size = config.actor.data_parallel_size
    actor = dataclasses.replace(
        config.actor,
        data_parallel_size=1,  # one engine core, as an external-load-balancing rank's server
        data_parallel_rank=rank,
        data_parallel_world=size,
        data_parallel_backend="mp",
        data_parallel_address=None,
    )
    return dataclasses.replace(config, num_threads=rank_threads(config.num_threads, size), actor=actor)


@asynccontextmanager
async def open_data_parallel_client(
    config: EngineConfig, *, core_factory: EngineCoreFactory | None = None
) -> AsyncIterator[CoreClient]:
    """N ranks (`config.actor.data_parallel_size`) behind one client; each rank's core runs
    `rank_config(config, rank)`."""
    size = config.actor.data_parallel_size
    async with AsyncExitStack() as stack:
        ray = None
        if config.actor.data_parallel_backend == "ray":
            ray = await stack.enter_async_context(ray_session())
        ranks: list[CoreClient] = []
        # Each rank's output stream is closed after its context has exited (this callback runs
        # last), never by a forwarder: a rank that dies after the first death still delivers
        # its EngineDead into an open stream (a closed one raised BrokenResourceError there).
        stack.callback(_close_outputs, ranks)
        for rank in range(size):  # one after the other: a failed start stops the ones already up
            own = rank_config(config, rank)
            if ray is not None:
                opened = open_ray_core(ray, own, rank, core_factory=core_factory)
            else:
                opened = open_process_core(own, core_factory=core_factory)
            ranks.append(await stack.enter_async_context(opened))
        router = Router(size)
        timeout = config.actor.engine_output_timeout_s
        ready = Ready(
            min(r.ready.num_kv_blocks for r in ranks),  # a request runs on one rank
            ranks[0].ready.block_size,
            ranks[0].ready.max_model_len,
            ranks[0].ready.vocab_size,
        )
        in_send, in_recv = anyio.create_memory_object_stream[CoreInput](math.inf)
        out_send, out_recv = anyio.create_memory_object_stream[CoreOutput](OUTPUT_BUFFER)
        client = CoreClient(
            ready,
            in_send,
            out_recv,
            ranks[0].pid,
            SHUTDOWN_GRACE_S,
            rank_pids=tuple(r.pid for r in ranks if r.pid is not None),
            assigned=router.assigned,
            rank_stats=router.stats,
        )
        async with anyio.create_task_group() as tg:
            tg.start_soon(_route_inputs, in_recv, [r.inputs for r in ranks], router)
            # One scope per forwarder, so that the first death can stop them all: never the task
            # group's own scope, which encloses the `yield` (the frontend's code).
            forwarders = [anyio.CancelScope() for _ in ranks]
            async with anyio.create_task_group() as merge:
                for rank, r in enumerate(ranks):
                    merge.start_soon(_merge_outputs, rank, r, out_send.clone(), router, forwarders, timeout)
                out_send.close()
                try:
                    yield client
                finally:
                    for r in ranks:  # the frontend (or a rank's watchdog) may have declared it hung
                        r.shutdown_grace_s = min(r.shutdown_grace_s, client.shutdown_grace_s)
                    in_send.close()
                    merge.cancel_scope.cancel()
            tg.cancel_scope.cancel()
        # Leaving the stack stops every rank (Shutdown, then signals), the last started first.


def _close_outputs(ranks: list[CoreClient]) -> None:
    for r in ranks:
        r.outputs.close()


def _send(stream: MemoryObjectSendStream[CoreInput], msg: CoreInput) -> None:
    try:
        stream.send_nowait(msg)  # the ranks' input streams are unbounded
    except (anyio.ClosedResourceError, anyio.BrokenResourceError):
        pass  # that rank is gone; its death is on its output stream


async def _route_inputs(
    inputs: MemoryObjectReceiveStream[CoreInput],
    ranks: list[MemoryObjectSendStream[CoreInput]],
    router: Router,
) -> None:
    async with inputs:
        async for msg in inputs:
            match msg:
                case AddRequest(request=req):
                    _send(ranks[router.assign(req.request_id)], msg)
                case AbortRequests(request_ids=ids):
                    for rank, group in router.abort(ids).items():
                        _send(ranks[rank], AbortRequests(group))
                case UtilityCall():
                    router.expect(msg)
                    for stream in ranks:
                        _send(stream, msg)
                case Shutdown():
                    for stream in ranks:
                        _send(stream, msg)


async def _merge_outputs(
    rank: int,
    client: CoreClient,
    merged: MemoryObjectSendStream[CoreOutput],
    router: Router,
    forwarders: list[anyio.CancelScope],
    silence_s: float | None,
) -> None:
    """Forward rank `rank`'s outputs until its death, which ends every forwarder: its own
    `EngineDead`, or (with `silence_s`, `engine_output_timeout_s`) its watchdog's finding that it
    owes a message and sent nothing for `silence_s` seconds."""
    with forwarders[rank], merged:
        line = _RankLine(rank, client.outputs, merged, router)
        hung: list[EngineDeadError] = []
        death: EngineDead | None = None
        async with anyio.create_task_group() as watch:
            if silence_s is not None:

                def declare(error: EngineDeadError) -> None:
                    hung.append(error)
                    client.shutdown_grace_s = 0.0  # its step will not end: no grace
                    watch.cancel_scope.cancel()

                watchdog = Watchdog(silence_s, line.owes, declare)
                line.heard = watchdog.heard
                watch.start_soon(watchdog.run)
            death = await line.forward()
            watch.cancel_scope.cancel()
        if death is None and hung:
            death = EngineDead(str(hung[0]))
        if death is None:
            return
        log.error("data parallel rank %d died: %s", rank, death.message)
        await merged.send(EngineDead(f"data parallel rank {rank}: {death.message}", death.traceback))
        for scope in forwarders:  # the merged stream ends with the first death
            scope.cancel()


class _RankLine:
    """One rank's output stream, forwarded into the merged one."""

    def __init__(
        self,
        rank: int,
        outputs: MemoryObjectReceiveStream[CoreOutput],
        merged: MemoryObjectSendStream[CoreOutput],
        router: Router,
    ) -> None:
        self.rank = rank
        self.outputs = outputs
        self.merged = merged
        self.router = router
        self.heard: Callable[[], None] = lambda: None  # the rank's watchdog clock
        self._holding = False  # a message of the rank's not delivered yet (the frontend lags)

    def owes(self) -> bool:
        """The watchdog's "work pending": the rank owes a message and this forwarder holds none
        (one held here, waiting for room in the merged stream, is the frontend lagging, not the
        rank silent)."""
        return not self._holding and self.router.pending(self.rank)

    async def forward(self) -> EngineDead | None:
        """Until the rank's stream ends (None) or it reports its death."""
        rank, router = self.rank, self.router
        async for msg in self.outputs:
            self._holding = True
            match msg:
                case OutputBatch():
                    router.observe(rank, msg)
                    await self.merged.send(msg)
                case RequestError(request_id=rid):
                    router.release(rid)
                    await self.merged.send(msg)
                case UtilityResult():
                    combined = router.gather(rank, msg)
                    if combined is not None:
                        await self.merged.send(combined)
                case EngineDead():
                    return msg
                case _:
                    await self.merged.send(msg)
            self._holding = False
            self.heard()  # delivered: the clock runs from here
        return None
