"""An engine core as a Ray actor (`data_parallel_backend="ray"`): vLLM's Ray data-parallel
backend, for ranks on other machines of a Ray cluster.

```
frontend (this process, a Ray driver)                       Ray actor (any node of the cluster)
Endpoints.bind("tcp://ADDRESS")  ── PUSH ══tcp+CURVE══▶ PULL ─▶ EngineCoreActor.run():
                                 ◀─ PULL ◀══tcp+CURVE══ PUSH ◀─   child.serve_core (trio)
watcher: ray.wait on run()'s ObjectRef (the long-running call) = the actor's liveness
```

Each rank gets its own placement group (one bundle: `{"CPU": threads}`, plus `{"GPU": 1}` on
CUDA), created and awaited before the actor, so a cluster without room fails start-up with a
message naming the resources instead of waiting forever. The ZMQ sockets are bound here before
the actor exists (on `data_parallel_address`, else Ray's address of this node), and the actor
connects back with the link's CURVE client keys, which it gets in its constructor arguments
(they travel through Ray's control plane: anyone who controls the cluster controls its actors).
The constructor also gets the spec a child process gets (`process.child_spec`): the driver's
resolved `EngineConfig` for this rank, which the actor runs as it is, never resolving it again.

Everything else is the child-process link (`process.link_core`): the handshake (`Ready` or
`StartupError`), the socket pumps, the watcher and the teardown. Only the way to watch and stop
the core differs:

- **Liveness** is the actor's long-running `run()` call: its `ObjectRef` resolves with the exit
  code when the core ends, and raises when the actor dies (its process killed, its node gone).
  A dead actor is a dead rank, which is a dead engine.
- **Stop**: `Shutdown` on the socket as always; `stop()` (the actor runs two calls at once, so
  it is not queued behind `run()`) in place of the child's stdin; `ray.kill` in place of the
  signals. The placement group is removed at the end.
- **Orphans**: Ray ends an actor with the process that created it, as the stdin pipe does for a
  child process.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from typing import Any

import anyio
import anyio.from_thread
import anyio.lowlevel
import msgspec

from triollm.actors import zmq_io
from triollm.actors.child import ChildSpec, configure_core_process
from triollm.actors.core_client import CoreClient
from triollm.actors.process import (
    EngineStartupError,
    StderrTail,
    child_spec,
    link_core,
)
from triollm.engine.config import EngineConfig
from triollm.engine.core_factory import EngineCoreFactory

__all__ = ["EngineCoreActor", "open_ray_core", "ray_session"]

log = logging.getLogger("triollm")

PLACEMENT_TIMEOUT_S = 60.0  # the cluster must find room for a rank within this many seconds
POLL_S = 0.2  # how often the watcher re-checks the actor (a blocking ray.wait, in a thread)
ACTOR_EXIT_CODE = -9  # what `wait()` reports for an actor that died (as SIGKILL would)


def import_ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ValueError(
            "data_parallel_backend: 'ray' needs Ray, which is not installed: "
            "pip install 'triollm[ray]' (or use data_parallel_backend='mp')"
        ) from None
    return ray


@asynccontextmanager
async def ray_session() -> AsyncIterator[Any]:
    """Ray, connected: the cluster this process already joined (`ray.init()` before us), else
    the one `RAY_ADDRESS` names, else a new local one, which is shut down again at the end."""
    ray = import_ray()
    if ray.is_initialized():
        yield ray
        return
    await anyio.to_thread.run_sync(lambda: ray.init(address=os.environ.get("RAY_ADDRESS")))
    try:
        yield ray
    finally:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(ray.shutdown)


class EngineCoreActor:
    """The engine core in a Ray actor: `run()` is `child.serve_core` on trio, for as long as
    the core runs; `stop()` asks it to stop after its current step."""

    def __init__(self, spec_json: str, curve_keys: str | None) -> None:
        self._spec = msgspec.json.decode(spec_json, type=ChildSpec)
        self._config = self._spec.engine_config()  # the driver's, resolved there once
        self._curve = zmq_io.ClientKeys.decode(curve_keys) if curve_keys else None
        self._token: Any = None
        self._stop: anyio.Event | None = None
        configure_core_process(self._spec, self._config)  # the log format, the torch threads

    def pid(self) -> int:
        return os.getpid()

    def run(self) -> int:
        # In a thread of its own: Ray's threads for actor calls may have an asyncio loop set.
        result: list[int] = []
        errors: list[BaseException] = []

        def main() -> None:
            try:
                result.append(anyio.run(self._main, backend="trio"))
            except BaseException as exc:  # noqa: BLE001 - re-raised in the caller's thread
                errors.append(exc)

        thread = threading.Thread(target=main, name="triollm-engine-core")
        thread.start()
        thread.join()
        if errors:
            raise errors[0]
        return result[0]

    async def _main(self) -> int:
        from triollm.actors.child import serve_core

        self._stop = anyio.Event()
        self._token = anyio.lowlevel.current_token()
        try:
            return await serve_core(self._spec, self._config, self._curve, self._stop)
        finally:
            self._token = None

    def stop(self) -> None:
        token, event = self._token, self._stop
        if token is None or event is None:
            return
        try:
            anyio.from_thread.run_sync(event.set, token=token)
        except RuntimeError:
            pass  # its event loop has just ended


class _RayChild:
    """`process.CoreChild` for an `EngineCoreActor`: liveness from its `run()` call."""

    def __init__(self, ray: Any, actor: Any, run_ref: Any, pid: int | None, rank: int) -> None:
        self._ray = ray
        self._actor = actor
        self._run_ref = run_ref
        self.pid = pid
        self.name = f"Ray actor of data parallel rank {rank} (pid {pid})"
        self.stderr = StderrTail()  # its output goes to Ray's logs (and the driver's stderr)
        self.stderr.eof.set()
        self.death = ""
        self._code: int | None = None

    @property
    def returncode(self) -> int | None:
        return self._code

    async def forward_output(self) -> None:
        pass

    async def wait(self) -> int:
        while self._code is None:
            ready, _ = await anyio.to_thread.run_sync(lambda: self._ray.wait([self._run_ref], timeout=POLL_S))
            if ready:
                self._code = self._result()
        return self._code

    def _result(self) -> int:
        try:
            return int(self._ray.get(self._run_ref))
        except self._ray.exceptions.RayActorError as exc:
            self.death = _first_line(exc)
            self.stderr.text = str(exc)
            return ACTOR_EXIT_CODE
        except self._ray.exceptions.RayError as exc:  # run() raised: its traceback
            self.death = _last_line(exc)
            self.stderr.text = str(exc)
            return 1

    async def request_stop(self) -> None:
        try:
            self._actor.stop.remote()
        except Exception:  # noqa: BLE001 - the actor is already gone
            pass

    def terminate(self) -> None:
        self._ray.kill(self._actor, no_restart=True)

    kill = terminate

    def describe_exit(self, code: int) -> str:
        if code == ACTOR_EXIT_CODE:
            return f"Ray actor died: {self.death}" if self.death else "Ray actor died"
        if self.death:
            return f"Ray actor failed: {self.death}"
        return f"Ray actor exited with code {code}"

    async def aclose(self) -> None:
        pass


def _last_line(exc: BaseException) -> str:
    lines = [line for line in str(exc).strip().splitlines() if line.strip()]
    return lines[-1].strip() if lines else type(exc).__name__


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


@asynccontextmanager
async def open_ray_core(
    ray: Any,
    config: EngineConfig,
    rank: int,
    *,
    core_factory: EngineCoreFactory | None = None,
) -> AsyncIterator[CoreClient]:
    """Place one engine core that runs `config` (this rank's, resolved by the driver; the actor
    gets `child_config(config)`) on the Ray cluster (its own placement group) and link it; the
    client is the same as for a child process. Raises `EngineStartupError` if it cannot start."""
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    actor_config = config.actor
    address = actor_config.zmq_address
    if not address.startswith("tcp://"):  # the actor may be on another machine: no ipc
        host = actor_config.data_parallel_address or ray.util.get_node_ip_address()
        address = f"tcp://{host}"
    threads = int(config.num_threads or 1)
    bundle: dict[str, float] = {"CPU": float(threads)}
    if config.device == "cuda":
        bundle["GPU"] = 1.0
    async with AsyncExitStack() as stack:
        ends = zmq_io.Endpoints.bind(address, insecure_tcp=actor_config.zmq_insecure_tcp)
        stack.callback(ends.close)
        group = placement_group([bundle], strategy="STRICT_PACK", name=f"triollm-dp{rank}-{uuid.uuid4().hex[:8]}")
        stack.callback(_quietly, remove_placement_group, group)
        placed = await anyio.to_thread.run_sync(lambda: group.wait(PLACEMENT_TIMEOUT_S))
        if not placed:
            raise EngineStartupError(
                f"data parallel rank {rank}: the Ray cluster found no room for {bundle} within "
                f"{PLACEMENT_TIMEOUT_S:g} s (resources now: {ray.available_resources()}); add "
                "nodes, or lower data_parallel_size or num_threads"
            )
        spec = child_spec(config, ends, core_factory)
        keys = ends.client_keys.encode() if ends.client_keys is not None else None
        remote = ray.remote(EngineCoreActor).options(
            name=f"triollm-engine-core-dp{rank}-{uuid.uuid4().hex[:8]}",
            num_cpus=threads,
            num_gpus=bundle.get("GPU", 0),
            max_concurrency=2,  # stop() and pid() run beside the long-running run()
            max_restarts=0,
            scheduling_strategy=PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=0),
        )
        actor = remote.remote(msgspec.json.encode(spec).decode(), keys)
        stack.callback(_quietly, ray.kill, actor, no_restart=True)
        started = time.monotonic()
        try:
            pid = await anyio.to_thread.run_sync(lambda: ray.get(actor.pid.remote(), timeout=PLACEMENT_TIMEOUT_S))
        except Exception as exc:  # noqa: BLE001 - the actor could not be created
            raise EngineStartupError(
                f"data parallel rank {rank}: the Ray actor did not start: {_first_line(exc)}"
            ) from None
        log.info("data parallel rank %d: Ray actor pid %d up in %.1f s", rank, pid, time.monotonic() - started)
        child = _RayChild(ray, actor, actor.run.remote(), pid, rank)
        async with link_core(child, ends) as client:
            yield client


def _quietly(func: Any, *args: Any, **kwargs: Any) -> None:
    try:
        func(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 - teardown of something already gone
        log.debug("ray teardown: %r", exc)
