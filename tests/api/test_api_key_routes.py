"""`--api-key`: every route but the open ones (/health, /version, /openapi.json, /tokenize,
/detokenize, /metrics) needs the key, /score and unknown paths included; with
`--api-key-all-routes` every route does."""

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


OPEN = ("/tokenize", "/detokenize", "/metrics", "/health", "/version", "/openapi.json")
# Keyed by default. /score answers 400 with the key (the tiny model is no pooling model): the
# point is that without one it never gets that far.
GENERATION = {"/v1/models": 200, "/score": 400, "/v1/score": 400, "/v1/embeddings": 400}


async def _statuses(client: httpx.AsyncClient, headers: dict[str, str]) -> dict[str, int]:
    tokenize = await client.post("/tokenize", json={"model": MODEL, "prompt": "hi"}, headers=headers)
    detokenize = await client.post("/detokenize", json={"model": MODEL, "tokens": [1, 2]}, headers=headers)
    score = {"model": MODEL, "text_1": "a", "text_2": "b"}
    return {
        "/tokenize": tokenize.status_code,
        "/detokenize": detokenize.status_code,
        "/metrics": (await client.get("/metrics", headers=headers)).status_code,
        "/v1/models": (await client.get("/v1/models", headers=headers)).status_code,
        "/health": (await client.get("/health", headers=headers)).status_code,
        "/version": (await client.get("/version", headers=headers)).status_code,
        "/openapi.json": (await client.get("/openapi.json", headers=headers)).status_code,
        "/score": (await client.post("/score", json=score, headers=headers)).status_code,
        "/v1/score": (await client.post("/v1/score", json=score, headers=headers)).status_code,
        "/v1/embeddings": (
            await client.post("/v1/embeddings", json={"model": MODEL, "input": "a"}, headers=headers)
        ).status_code,
    }


async def test_all_routes_behind_the_key(llm: AsyncLLM) -> None:
    async with open_client(True, llm) as client:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            got = await _statuses(client, headers)
            assert got == dict.fromkeys(got, 401)
            for path in ("/metrics/", "/health/", "/nowhere"):  # no way around by a slash
                r = await client.get(path, headers=headers)
                assert r.status_code == 401, path
        assert await _statuses(client, GOOD) == {**dict.fromkeys(OPEN, 200), **GENERATION}
        r = await client.get("/health")
        assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
        doc = (await client.get("/openapi.json", headers=GOOD)).json()
        assert all(op.get("security") for methods in doc["paths"].values() for op in methods.values())


async def test_default_keys_every_generation_and_pooling_route(llm: AsyncLLM) -> None:
    async with open_client(False, llm) as client:
        got = await _statuses(client, {})
        assert got == {**dict.fromkeys(OPEN, 200), **dict.fromkeys(GENERATION, 401)}
        assert (await client.get("/nowhere")).status_code == 401  # deny by default
        assert await _statuses(client, GOOD) == {**dict.fromkeys(OPEN, 200), **GENERATION}


def test_flag() -> None:
    parser = build_parser()
    assert parser.parse_args(["serve"]).api_key_all_routes is False
    ns = parser.parse_args(["serve", "--api-key", "k", "--api-key-all-routes"])
    assert ns.api_key_all_routes is True and ns.api_key == ["k"]
