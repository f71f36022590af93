"""The in-memory ASGI client: streamed bodies, disconnects, apps that misbehave, lifespans."""

from __future__ import annotations

from typing import Any

import anyio
import pytest

from triollm.testing import AppDidNotEnd, open_asgi_client
from triollm.testing.pytest_plugin import trio_mock_clock

pytestmark = pytest.mark.anyio


class App:
    """A raw ASGI app: lifespan events logged; GET /stream?n streams n chunks (forever with
    n=0, until the client disconnects); /deaf ignores the disconnect; /boom raises; /mute
    returns without a response."""

    def __init__(self, fail_startup: bool = False) -> None:
        self.events: list[str] = []
        self.fail_startup = fail_startup

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while True:
                message = await receive()
                self.events.append(message["type"])
                if message["type"] == "lifespan.startup":
                    if self.fail_startup:
                        await send({"type": "lifespan.startup.failed", "message": "no model"})
                        return
                    scope["state"]["greeting"] = "hello"
                    await send({"type": "lifespan.startup.complete"})
                else:
                    await send({"type": "lifespan.shutdown.complete"})
                    return
        path = scope["path"]
        assert (await receive())["type"] == "http.request"
        if path == "/boom":
            raise ValueError("boom")
        if path == "/mute":
            return
        headers = [(b"x-greeting", scope["state"]["greeting"].encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        n = int(scope["query_string"] or 0)
        async with anyio.create_task_group() as tg:

            async def on_disconnect() -> None:
                assert (await receive())["type"] == "http.disconnect"
                self.events.append(f"{path}: disconnect")
                if path != "/deaf":
                    tg.cancel_scope.cancel()

            tg.start_soon(on_disconnect)
            i = 0
            while n == 0 or i < n:
                await send({"type": "http.response.body", "body": b"x%d " % i, "more_body": True})
                await anyio.sleep(1 if path == "/deaf" else 0.001)
                i += 1
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            tg.cancel_scope.cancel()


async def test_a_streamed_body_arrives_whole_and_the_lifespan_runs_once() -> None:
    app = App()
    async with open_asgi_client(app) as client:
        async with client.request("GET", "/stream?3") as response:
            assert response.status == 200 and response.headers["x-greeting"] == "hello"
            assert await response.read() == b"x0 x1 x2 "
            assert response.complete
        await client.shutdown()
        await client.shutdown()
    assert app.events == ["lifespan.startup", "lifespan.shutdown"]


async def test_leaving_early_is_a_disconnect_the_app_sees() -> None:
    app = App()
    async with open_asgi_client(app) as client:
        with anyio.fail_after(5):
            async with client.request("POST", "/stream", json={"a": 1}) as response:
                async for chunk in response:
                    assert chunk == b"x0 "
                    break
            assert not response.complete
    assert app.events == ["lifespan.startup", "/stream: disconnect", "lifespan.shutdown"]


@pytest.mark.parametrize("anyio_backend", [trio_mock_clock()])
async def test_an_app_that_goes_on_after_the_disconnect_is_reported() -> None:
    async with open_asgi_client(App(), disconnect_grace_s=30) as client:
        t0 = anyio.current_time()
        with pytest.raises(AppDidNotEnd, match="still running 30 s after its client disconnected"):
            async with client.request("GET", "/deaf") as response:
                async for _ in response:
                    break
        assert anyio.current_time() - t0 == pytest.approx(30, abs=0.1)


async def test_an_exception_in_the_app_reaches_the_client_unwrapped() -> None:
    async with open_asgi_client(App()) as client:
        with pytest.raises(ValueError, match="boom"):
            async with client.request("GET", "/boom"):
                pytest.fail("a response started")
        with pytest.raises(RuntimeError, match="GET /mute: the app ended without starting a response"):
            async with client.request("GET", "/mute"):
                pytest.fail("a response started")
        with pytest.raises(KeyError):  # the client's own error, unwrapped from the task group
            async with client.request("GET", "/stream?1"):
                raise KeyError("mine")


async def test_a_failed_startup_raises() -> None:
    with pytest.raises(RuntimeError, match="lifespan startup failed: no model"):
        async with open_asgi_client(App(fail_startup=True)):
            pytest.fail("the app started")
