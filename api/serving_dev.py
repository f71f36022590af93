"""vLLM's development routes, served only with `VLLM_SERVER_DEV_MODE=1` (404 otherwise, as in
vLLM): the engine's sleep mode, `collective_rpc`, the prefix cache and pausing, for RL loops and
model-swapping setups that drive a running server.

    POST /sleep?level=1|2           free the KV cache (1), and the weights (2)      -> 200
    POST /wake_up[?tags=weights&tags=kv_cache]   restore them (all by default)     -> 200
    GET  /is_sleeping                                           -> {"is_sleeping": bool}
    POST /collective_rpc  {"method", "args", "kwargs", "timeout"}     -> {"results": [...]}
    POST /reset_prefix_cache                                                        -> 200
    POST /pause[?mode=keep|wait|abort&clear_cache=true]          -> {"status": "paused"}
    POST /resume                                                 -> {"status": "resumed"}
    GET  /is_paused                                               -> {"is_paused": bool}

`/pause` stops the engine from stepping: by default (`mode=keep`) the requests in flight keep
their place and their KV blocks and wait, new ones are held, and `/resume` continues them all;
`mode=abort` ends the requests in flight, `mode=wait` lets them finish first
(`AsyncLLM.pause_generation`). `/collective_rpc` answers each rank's result as JSON where it is
a dict, a list or null, and as its `str()` otherwise, as vLLM does. Bad arguments are 400s
naming the field (the engine's ValueErrors, openai_errors.from_exception).

`VLLM_SERVER_DEV_MODE` is read when the app is built (`dev_mode`), in the server's process.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import msgspec
from starlette.requests import Request
from starlette.responses import Response

from triollm.api.openai_errors import bad_request
from triollm.api.protocol import decode_request
from triollm.api.serving_common import SMALL_BODY_BYTES, read_body

if TYPE_CHECKING:
    from triollm.actors.async_llm import PauseMode
    from triollm.api.endpoints import Endpoints
    from triollm.api.state import ServerState

__all__ = [
    "DEV_MODE_ENV",
    "CollectiveRPCRequest",
    "collective_rpc",
    "dev_mode",
    "is_paused",
    "is_sleeping",
    "pause",
    "reset_prefix_cache",
    "resume",
    "sleep",
    "wake_up",
    "with_dev_mode",
]

DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"  # vLLM's name
_PAUSE_MODES = ("keep", "wait", "abort")


def dev_mode(environ: Mapping[str, str] = os.environ) -> bool:
    """vLLM's `VLLM_SERVER_DEV_MODE`: "1" or "true" (any case) turns the routes on."""
    return environ.get(DEV_MODE_ENV, "0").strip().lower() in ("1", "true")


def with_dev_mode(state: ServerState) -> bool:
    """The routes' `when` (api/routes.py)."""
    return dev_mode()


class CollectiveRPCRequest(msgspec.Struct, forbid_unknown_fields=True):
    method: str
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    timeout: float | None = None


def _ok() -> Response:
    return Response(status_code=200)


def _json(obj: Any) -> Response:
    return Response(msgspec.json.encode(obj), media_type="application/json")


def _flag(request: Request, name: str, default: bool) -> bool:
    value = request.query_params.get(name)
    if value is None:
        return default
    if value.lower() not in ("true", "false", "1", "0"):
        raise bad_request(f"{name}: {value!r} is not a boolean; allowed: true, false", name)
    return value.lower() in ("true", "1")


async def sleep(api: Endpoints, request: Request) -> Response:
    raw = request.query_params.get("level", "1")
    if raw not in ("1", "2"):
        raise bad_request(f"level: {raw!r} is not a sleep level; allowed: 1, 2", "level")
    await api.llm.sleep(int(raw))
    return _ok()


async def wake_up(api: Endpoints, request: Request) -> Response:
    tags = request.query_params.getlist("tags")
    await api.llm.wake_up(tags or None)
    return _ok()


async def is_sleeping(api: Endpoints, request: Request) -> Response:
    return _json({"is_sleeping": await api.llm.is_sleeping()})


async def collective_rpc(api: Endpoints, request: Request) -> Response:
    body = decode_request(await read_body(request, SMALL_BODY_BYTES), CollectiveRPCRequest)
    if body.timeout is not None and not body.timeout > 0:
        raise bad_request(f"timeout: {body.timeout} seconds; allowed: more than 0, or null", "timeout")
    results = await api.llm.collective_rpc(body.method, body.timeout, tuple(body.args), body.kwargs)
    return _json({"results": [r if r is None or isinstance(r, (dict, list)) else str(r) for r in results]})


async def reset_prefix_cache(api: Endpoints, request: Request) -> Response:
    await api.llm.reset_prefix_cache()
    return _ok()


async def pause(api: Endpoints, request: Request) -> Response:
    mode = request.query_params.get("mode", "keep")
    if mode not in _PAUSE_MODES:
        raise bad_request(f"mode: {mode!r}; allowed: {', '.join(_PAUSE_MODES)}", "mode")
    if _flag(request, "wait_for_inflight_requests", False):  # vLLM's older spelling of mode=wait
        mode = "wait"
    clear = _flag(request, "clear_cache", True)
    await api.llm.pause_generation(mode=cast("PauseMode", mode), clear_cache=clear)
    return _json({"status": "paused"})


async def resume(api: Endpoints, request: Request) -> Response:
    await api.llm.resume_generation()
    return _json({"status": "resumed"})


async def is_paused(api: Endpoints, request: Request) -> Response:
    return _json({"is_paused": await api.llm.is_paused()})
