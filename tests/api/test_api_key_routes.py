"""`--api-key-all-routes`: /tokenize, /detokenize and /metrics behind the API key too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import httpx
import pytest

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.cli import build_parser
from triollm.api.server import _attach_metrics
from triollm.api.state import ServerSettings, ServerState

pytestmark = pytest.mark.anyio

MODEL = "tiny"  # as in conftest.py
GOOD = {"Authorization": "Bearer s3cret"}


@asynccontextmanager
async def open_client(all_routes: bool, llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    settings = ServerSettings(served_model_names=(MODEL,), api_key="s3cret", api_key_all_routes=all_routes)
    state = ServerState(llm, settings)
    _attach_metrics(state)
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as client:
        yield client


async def _statuses(client: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, int]:
    tokenize = await client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=headers)
    detokenize = await client.post("/detokenize", json={"model": MODEL, "tokens": [1, 2]}, headers=headers)
    return {
        "/tokenize": tokenize.status_code,
        "/detokenize": detokenize.status_code,
        "/metrics": (await client.get("/metrics", headers=headers)).status_code,
        "/v1/models": (await client.get("/v1/models", headers=headers)).status_code,
        "/health": (await client.get("/health", headers=headers)).status_code,
        "/version": (await client.get("/version", headers=headers)).status_code,
    }


async def test_all_routes_behind_the_key(llm: AsyncLLM) -> None:
    async with open_client(True, llm) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            got = await _statuses(client, headers)
            assert got == {
                "/tokenize": 401, "/detokenize": 401, "/metrics": 401, "/v1/models": 401,
                "/health": 200, "/version": 200,
            }
            r = await client.get("/metrics/", headers=headers)  # no way around by a slash
            assert r.status_code in (401, 404) and r.status_code != 200
        assert set((await _statuses(client, GOOD)).values()) == {200}
        r = await client.get("/metrics")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]


async def test_default_keeps_those_routes_open(llm: AsyncLLM) -> None:
    async with open_client(False, llm) as client:
        got = await _statuses(client, {})
        assert got["/v1/models"] == 401
        assert got["/tokenize"] == got["/detokenize"] == got["/metrics"] == 200


def test_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).api_key_all_routes is False
    assert parser.parse_args(["serve", "--api-key", "k", "--api-key-all-routes"]).api_key_all_routes is True
