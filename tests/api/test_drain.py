"""The server's drain closes without a gap (in process, on asyncio and trio): a request that passed
the availability check but was still being rendered or tokenized when the drain began is refused
(503) or waited for and aborted, never left running; a second signal cuts the grace period."""

from __future__ import annotations

from typing import Any

import anyio
import httpx
import pytest
from test_app import CHAT, GREEDY, post

from triollm.actors.async_llm import AsyncLLM
from triollm.api import serving_chat
from triollm.api.server import _drain
from triollm.api.state import ServerState

pytestmark = pytest.mark.anyio


async def test_a_request_entering_the_engine_when_the_drain_starts_is_aborted(
    client: httpx.AsyncClient, state: ServerState, llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = llm.add_request
    drained = anyio.Event()

    async with anyio.create_task_group() as tg:

        async def drain() -> None:
            await _drain(state, 0.0)
            drained.set()

        async def slow_tokenization(*args: Any, **kwargs: Any) -> Any:
            tg.start_soon(drain)  # the drain begins while this request is being tokenized
            await anyio.sleep(0.05)
            return await real(*args, **kwargs)

        monkeypatch.setattr(llm, "add_request", slow_tokenization)
        with anyio.fail_after(30):
            r = await post(client, "/v1/completions", {"prompt": "Hi", "max_tokens": 200, **GREEDY})
            await drained.wait()
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["finish_reason"] == "abort"  # not "length": it was aborted
    assert llm.num_unfinished_requests == 0


async def test_a_request_rendering_its_chat_when_the_drain_starts_is_refused(
    client: httpx.AsyncClient, state: ServerState, llm: AsyncLLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_render = serving_chat.render_chat
    added = 0
    real_add = llm.add_request

    async def counting(*args: Any, **kwargs: Any) -> Any:
        nonlocal added
        added += 1
        return await real_add(*args, **kwargs)

    async def render_then_drain(*args: Any, **kwargs: Any) -> Any:
        result = await real_render(*args, **kwargs)
        await _drain(state, 0.0)  # began while the chat was rendered (in a thread when large)
        return result

    monkeypatch.setattr(serving_chat, "render_chat", render_then_drain)
    monkeypatch.setattr(llm, "add_request", counting)
    for stream in (False, True):
        body = {"messages": CHAT, "max_tokens": 200, "stream": stream, **GREEDY}
        r = await post(client, "/v1/chat/completions", body)
        assert r.status_code == 503, r.text
        assert "shutting down" in r.json()["error"]["message"]
    assert added == 0 and llm.num_unfinished_requests == 0


async def test_a_second_signal_cuts_the_grace_period(
    client: httpx.AsyncClient, state: ServerState, llm: AsyncLLM
) -> None:
    escalate = anyio.Event()
    responses: list[httpx.Response] = []

    async def request() -> None:
        body = {"prompt": "Hi", "max_tokens": 240, **GREEDY}
        responses.append(await post(client, "/v1/completions", body))

    with anyio.fail_after(20):
        async with anyio.create_task_group() as tg:
            tg.start_soon(request)
            while llm.num_unfinished_requests == 0:  # noqa: ASYNC110 (no event to wait on)
                await anyio.sleep(0.001)
            with anyio.fail_after(10):  # far below the 600 s of grace
                async with anyio.create_task_group() as drain:
                    drain.start_soon(_drain, state, 600.0, escalate)
                    await anyio.sleep(0.01)
                    escalate.set()
    [r] = responses
    assert r.json()["choices"][0]["finish_reason"] == "abort"
    assert llm.num_unfinished_requests == 0
