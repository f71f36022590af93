"""vLLM's development routes (api/serving_dev.py): 404 without `VLLM_SERVER_DEV_MODE=1`, and with
it sleep / wake-up / is_sleeping, collective_rpc, reset_prefix_cache and pause / resume on the
tiny model, on asyncio and trio, with the engine core in process and in a child process."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import httpx
import pytest

from triollm.actors.async_llm import AsyncLLM
from triollm.api.app import build_app
from triollm.api.state import ServerSettings, ServerState
from triollm.engine.config import EngineArgs

pytestmark = pytest.mark.anyio

MODEL = "tiny"  # the name served here (the `llm` fixture, tests/api/conftest.py: the tiny model)
MAX_MODEL_LEN = 256

ROUTES = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("POST", "/collective_rpc"),
    ("POST", "/reset_prefix_cache"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("GET", "/is_paused"),
]
COMPLETION = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 6, "temperature": 0}


async def _client(llm: AsyncLLM) -> AsyncIterator[httpx.AsyncClient]:
    app = build_app(ServerState(llm, ServerSettings(served_model_names=(MODEL,))))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
        yield c


@pytest.fixture
async def dev_client(llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[httpx.AsyncClient]:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    async for c in _client(llm):
        yield c


def _error(r: httpx.Response, status: int, param: str | None) -> str:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param
    return str(error["message"])


async def _tokens(client: httpx.AsyncClient) -> list[str]:
    r = await client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 200, r.text
    return [c["text"] for c in r.json()["choices"]]


@pytest.mark.parametrize("value", [None, "0", "false"])
@pytest.mark.parametrize("method, path", ROUTES)
async def test_without_dev_mode_the_routes_are_404(
    llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch, method: str, path: str, value: str | None
) -> None:
    if value is None:
        monkeypatch.delenv("VLLM_SERVER_DEV_MODE", raising=False)
    else:
        monkeypatch.setenv("VLLM_SERVER_DEV_MODE", value)
    async for client in _client(llm):
        assert (await client.request(method, path)).status_code == 404
        assert path not in (await client.get("/openapi.json")).json()["paths"]


async def test_with_dev_mode_the_routes_are_documented(dev_client: httpx.AsyncClient) -> None:
    paths = (await dev_client.get("/openapi.json")).json()["paths"]
    for method, path in ROUTES:
        assert method.lower() in paths[path], path


async def test_sleep_wake_up_and_is_sleeping(dev_client: httpx.AsyncClient) -> None:
    before = await _tokens(dev_client)
    assert (await dev_client.get("/is_sleeping")).json() == {"is_sleeping": False}
    assert (await dev_client.post("/sleep", params={"level": "2"})).status_code == 200
    assert (await dev_client.get("/is_sleeping")).json() == {"is_sleeping": True}
    r = await dev_client.post("/v1/completions", json=COMPLETION)
    assert r.status_code == 400 and "sleeping (weights and KV cache freed)" in r.text, r.text
    assert (await dev_client.post("/wake_up", params={"tags": "weights"})).status_code == 200
    assert (await dev_client.get("/is_sleeping")).json() == {"is_sleeping": True}  # the KV cache sleeps
    assert (await dev_client.post("/wake_up")).status_code == 200
    assert (await dev_client.get("/is_sleeping")).json() == {"is_sleeping": False}
    assert await _tokens(dev_client) == before


async def test_bad_sleep_and_wake_up_arguments_are_400(dev_client: httpx.AsyncClient) -> None:
    assert "allowed: 1, 2" in _error(await dev_client.post("/sleep", params={"level": "3"}), 400, "level")
    message = _error(await dev_client.post("/wake_up", params={"tags": "lora"}), 400, "tags")
    assert "allowed: weights, kv_cache" in message


async def test_collective_rpc(dev_client: httpx.AsyncClient) -> None:
    r = await dev_client.post("/collective_rpc", json={"method": "bytes_per_block"})
    assert r.status_code == 200, r.text
    (result,) = r.json()["results"]
    assert int(result) > 0  # vLLM's answer: str() of what is not a dict, a list or None
    r = await dev_client.post("/collective_rpc", json={"method": "sleep", "kwargs": {"level": 1}})
    assert r.json() == {"results": [None]}
    assert (await dev_client.get("/is_sleeping")).json() == {"is_sleeping": True}
    await dev_client.post("/collective_rpc", json={"method": "wake_up", "args": [["kv_cache", "weights"]]})
    assert (await dev_client.get("/is_sleeping")).json() == {"is_sleeping": False}
    message = _error(await dev_client.post("/collective_rpc", json={"method": "no_such"}), 400, "method")
    assert "'no_such' is not a method of the worker" in message
    _error(await dev_client.post("/collective_rpc", json={"args": []}), 400, "method")
    _error(await dev_client.post("/collective_rpc", json={"method": "bytes_per_block", "timeout": 0}), 400, "timeout")


async def test_reset_prefix_cache(dev_client: httpx.AsyncClient, llm: AsyncLLM) -> None:
    long = {**COMPLETION, "prompt": "The quick brown fox jumps over the lazy dog. " * 4}
    for _ in range(2):
        assert (await dev_client.post("/v1/completions", json=long)).status_code == 200
    assert (await llm.get_engine_stats()).num_cached_blocks > 0
    assert (await dev_client.post("/reset_prefix_cache")).status_code == 200
    assert (await llm.get_engine_stats()).num_cached_blocks == 0


async def test_pause_holds_requests_until_resume(dev_client: httpx.AsyncClient) -> None:
    expected = await _tokens(dev_client)
    assert (await dev_client.post("/pause")).json() == {"status": "paused"}
    assert (await dev_client.get("/is_paused")).json() == {"is_paused": True}
    got: list[list[str]] = []

    async def complete() -> None:
        got.append(await _tokens(dev_client))

    async with anyio.create_task_group() as tg:
        tg.start_soon(complete)
        await anyio.sleep(0.5)
        assert got == []  # held while paused
        assert (await dev_client.post("/resume")).json() == {"status": "resumed"}
    assert got == [expected]
    assert (await dev_client.get("/is_paused")).json() == {"is_paused": False}
    _error(await dev_client.post("/pause", params={"mode": "later"}), 400, "mode")


@pytest.fixture
async def child_llm(tiny_model_dir: Path) -> AsyncIterator[AsyncLLM]:
    args = EngineArgs(model=str(tiny_model_dir), max_model_len=MAX_MODEL_LEN, multiprocess=True, seed=0)
    async with AsyncLLM.from_engine_args(args) as engine:
        yield engine


async def test_sleep_and_rpc_with_the_engine_core_in_a_child_process(
    child_llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    async for client in _client(child_llm):
        before = await _tokens(client)
        assert (await client.post("/sleep", params={"level": "2"})).status_code == 200
        body: dict[str, Any] = (await client.get("/is_sleeping")).json()
        assert body == {"is_sleeping": True}
        assert (await client.post("/wake_up")).status_code == 200
        assert await _tokens(client) == before
        r = await client.post("/collective_rpc", json={"method": "bytes_per_block"})
        assert int(r.json()["results"][0]) > 0
