"""The actor layer: the frontend (`AsyncLLM`, `LLM`) and its link to the engine core, which
runs in this process or a child, one per data parallel rank, over ipc or tcp."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from triollm.engine import envs
from triollm.engine.config.checks import positive

__all__ = ["ActorConfig", "resolve_actor", "resolve_multiprocess"]


@dataclass(frozen=True)
class ActorConfig:
    """The frontend (`AsyncLLM`, `LLM`) and its link to the engine core."""

    multiprocess: bool  # the engine core in a child process (resolved: flag, else env, else True)
    output_chunk_size: int  # RequestOutputs built per chunk before yielding to the event loop
    zmq_address: str  # "ipc" or "tcp://HOST"
    # tcp without CURVE: unauthenticated and unencrypted (an explicit opt-in; no effect on ipc).
    zmq_insecure_tcp: bool
    max_logprobs: int  # the most logprobs a request may ask for (-1: no limit)
    # With work pending, no output from the engine core for this long means it is hung: the
    # engine is declared dead (EngineDeadError everywhere, /health 503). None: never.
    engine_output_timeout_s: float | None
    # Engine-core processes behind the frontend, requests balanced over them (data parallel).
    data_parallel_size: int = 1
    # External load balancing: this server is rank `data_parallel_rank` of `data_parallel_world`
    # servers and runs that one engine core (data_parallel_size is 1 then).
    data_parallel_rank: int = 0
    data_parallel_world: int = 1
    data_parallel_backend: str = "mp"  # "ray": the engine cores are Ray actors
    data_parallel_address: str | None = None  # Ray: the host the engine cores connect back to


class ActorArgs(Protocol):
    """The `EngineArgs` fields the actor layer reads."""

    @property
    def multiprocess(self) -> bool | None: ...
    @property
    def output_chunk_size(self) -> int: ...
    @property
    def zmq_address(self) -> str: ...
    @property
    def zmq_insecure_tcp(self) -> bool: ...
    @property
    def max_logprobs(self) -> int: ...
    @property
    def engine_output_timeout_s(self) -> float | None: ...
    @property
    def data_parallel_size(self) -> int: ...
    @property
    def data_parallel_rank(self) -> int | None: ...
    @property
    def data_parallel_external_lb(self) -> bool: ...
    @property
    def data_parallel_backend(self) -> str: ...
    @property
    def data_parallel_address(self) -> str | None: ...


def resolve_multiprocess(value: bool | None) -> bool:
    """The flag, else $TRIOLLM_MULTIPROCESS (0/1), else True."""
    if value is not None:
        return value
    env = envs.multiprocess()
    return True if env is None else env


def resolve_actor(args: ActorArgs) -> ActorConfig:
    """The transport checked, and the data parallel ranks this frontend runs."""
    positive("output_chunk_size", args.output_chunk_size)
    multiprocess = resolve_multiprocess(args.multiprocess)
    # External load balancing: this server runs one rank, alone (its share of the threads).
    local_ranks = 1 if args.data_parallel_external_lb else args.data_parallel_size
    ray = args.data_parallel_backend == "ray"
    if (local_ranks > 1 or ray) and not multiprocess:
        what = (
            f"data_parallel_size: {args.data_parallel_size}"
            if local_ranks > 1
            else "data_parallel_backend: 'ray'"
        )
        raise ValueError(
            f"{what} needs an engine-core process per rank, but multiprocess is off "
            "(multiprocess=False or $TRIOLLM_MULTIPROCESS=0); allowed with it off: "
            "data_parallel_size=1 and data_parallel_backend='mp'"
        )
    if args.data_parallel_address is not None and not ray:
        raise ValueError(
            "data_parallel_address: only the Ray backend connects engine cores back over the "
            "network; allowed with data_parallel_backend='mp': None"
        )
    timeout = args.engine_output_timeout_s
    if timeout is not None and (
        isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0
    ):
        raise ValueError(
            "engine_output_timeout_s: must be a positive number of seconds or None, "
            f"got {timeout!r}"
        )
    if not isinstance(args.max_logprobs, int) or args.max_logprobs < -1:
        raise ValueError(f"max_logprobs: must be an integer >= -1, got {args.max_logprobs!r}")
    if args.zmq_address != "ipc" and not args.zmq_address.startswith("tcp://"):
        raise ValueError(f"zmq_address: {args.zmq_address!r} is not 'ipc' or 'tcp://HOST'")
    if not isinstance(args.zmq_insecure_tcp, bool):  # "0" would be truthy: no guessing
        raise ValueError(f"zmq_insecure_tcp: must be True or False, got {args.zmq_insecure_tcp!r}")
    return ActorConfig(
        multiprocess=multiprocess,
        output_chunk_size=args.output_chunk_size,
        zmq_address=args.zmq_address,
        zmq_insecure_tcp=args.zmq_insecure_tcp,
        max_logprobs=args.max_logprobs,
        engine_output_timeout_s=None if timeout is None else float(timeout),
        data_parallel_size=local_ranks,
        data_parallel_rank=args.data_parallel_rank or 0,
        data_parallel_world=args.data_parallel_size,
        data_parallel_backend=args.data_parallel_backend,
        data_parallel_address=args.data_parallel_address,
    )
