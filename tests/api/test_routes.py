"""The route table (api/routes.py): the app's Starlette routes and the paths of /openapi.json
are the same list, for every setting that adds or removes a route, and the paths open without
the API key are the operations the document leaves unsecured. No engine runs: building the
app and serving /openapi.json read nothing of it."""

from __future__ import annotations

import itertools
from typing import Any, cast

import httpx
import pytest
from starlette.routing import Route

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.endpoints import Endpoints
from triollm.api.metrics import Metrics
from triollm.api.playground import page_paths
from triollm.api.routes import OPEN_PATHS, ROUTES, served_routes
from triollm.api.state import ServerSettings, ServerState

pytestmark = pytest.mark.anyio

KEY = {"Authorization": "Bearer k"}


class _NoEngine:
    """The engine as far as building the app and its metrics go: no config, running."""

    config = None
    is_running = True


def _state(*, lora: bool, metrics: bool, api_key: bool, all_routes: bool = False) -> ServerState:
    settings = ServerSettings(
        served_model_names=("m",),
        allow_runtime_lora_updating=lora,
        api_key="k" if api_key else None,
        api_key_all_routes=all_routes,
    )
    state = ServerState(cast(AsyncLLM, _NoEngine()), settings)
    if metrics:
        state.metrics = Metrics(state, fresh_stats=False)
    return state


async def _document(state: ServerState) -> dict[str, Any]:
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
        r = await client.get("/openapi.json", headers=KEY)
    assert r.status_code == 200, r.text
    return dict(r.json())


SETTINGS = [
    dict(lora=lora, metrics=metrics, api_key=api_key)
    for lora, metrics, api_key in itertools.product([False, True], repeat=3)
]


@pytest.mark.parametrize("options", SETTINGS, ids=lambda o: "-".join(k for k, v in o.items() if v))
async def test_starlette_routes_are_the_openapi_paths(options: dict[str, bool]) -> None:
    state = _state(**options)
    app = build_app(state)
    pages = set(page_paths(playground=True, docs=True))
    served = {
        (route.path, method)
        for route in app.routes
        if isinstance(route, Route) and route.methods is not None and route.path not in pages
        for method in route.methods - {"HEAD"}
    }
    doc = await _document(state)
    documented = {(path, method.upper()) for path, ops in doc["paths"].items() for method in ops}
    assert served == documented
    assert served == {(spec.path, spec.method) for spec in served_routes(state)}
    assert (("/v1/load_lora_adapter", "POST") in served) is options["lora"]
    assert (("/metrics", "GET") in served) is options["metrics"]
    assert ("/v1/responses/{response_id}", "DELETE") in served


@pytest.mark.parametrize("all_routes", [False, True])
async def test_the_open_paths_are_the_unsecured_operations(all_routes: bool) -> None:
    doc = await _document(_state(lora=True, metrics=True, api_key=True, all_routes=all_routes))
    unsecured = {path for path, ops in doc["paths"].items() for op in ops.values()
                 if "security" not in op}  # fmt: skip
    assert unsecured == (set() if all_routes else set(OPEN_PATHS))
    for path, ops in doc["paths"].items():
        for op in ops.values():
            assert ("401" in op["responses"]) is ("security" in op), path


def test_the_table_is_well_formed() -> None:
    keys = [(spec.path, spec.method) for spec in ROUTES]
    assert len(keys) == len(set(keys))
    assert len({spec.operation_id for spec in ROUTES}) == len(ROUTES)
    for spec in ROUTES:
        assert spec.method in ("GET", "POST", "DELETE"), spec
        # An Endpoints method, or a serving module's function of (Endpoints, Request): serving_dev.py
        own = getattr(Endpoints, spec.handler.__name__, None) is spec.handler
        assert own or spec.handler.__module__.startswith("triollm.api.serving_"), spec
        assert spec.request is None or spec.method == "POST", spec
    assert {spec.path for spec in ROUTES} >= {"/health", "/openapi.json", "/metrics"}
