"""Fixtures for the HTTP API tests: an in-process `AsyncLLM` on the tiny model and the app
served through httpx's ASGI transport, on asyncio and trio."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

MAX_MODEL_LEN = 256
MODEL = "tiny"


@pytest.fixture(params=["asyncio", "trio"])
def anyio_backend(request: pytest.FixtureRequest) -> str:
    return str(request.param)


@pytest.fixture
async def llm(tiny_model_dir: Path) -> AsyncIterator[AsyncLLM]:
    args = EngineArgs(
        model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, multiprocess=False, seed=0
    )
    async with AsyncLLM.from_engine_args(args) as engine:
        yield engine


@pytest.fixture
def settings() -> ServerSettings:
    return ServerSettings(served_model_names=(MODEL, "tiny-alias"))


@pytest.fixture
def state(llm: AsyncLLM, settings: ServerSettings) -> ServerState:
    return ServerState(llm, settings)


@pytest.fixture
async def client(state: ServerState) -> AsyncIterator[httpx.AsyncClient]:
    transport = httpx.ASGITransport(app=build_app(state))
    async with httpx.AsyncClient(transport=transport, base_url="http://testserver") as c:
        yield c
