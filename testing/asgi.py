"""An in-memory ASGI client: drive an app's lifespan and streaming responses with no socket.

Why not httpx's `ASGITransport`: it returns a response once the app has sent all of it, and a
client cannot disconnect midway, which is what a shutdown test needs. Why not a real server:
real I/O races trio's `MockClock`. Here everything is memory streams and events in one event
loop, so a test of an app in front of an `AsyncLLM` with a `FakeCore` stepping in the event
loop runs in virtual time.

    async with open_asgi_client(app) as client:        # lifespan startup ... shutdown
        async with client.request("POST", "/generate", json={...}) as response:
            assert response.status == 200
            async for chunk in response:                # body chunks as the app sends them
                ...
        await client.shutdown()                         # lifespan shutdown now (idempotent)

Leaving `client.request(...)` before the body is complete is a client disconnect: the app's
`receive()` returns `http.disconnect` (as Hypercorn's does) and the app must then end within
`disconnect_grace_s`; one that does not is a bug, reported as `AppDidNotEnd` (an
AssertionError). What the app sends after the disconnect is dropped. An exception in the app is
raised by `request(...)` on exit. Scopes use ASGI spec version 2.3 (Hypercorn's), so Starlette
listens for `http.disconnect`. The lifespan's startup and shutdown run under
`mock_clock_patience()` (they wait on the engine's threads).
"""

from __future__ import annotations

import json as jsonlib
import math
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

import anyio
import anyio.lowlevel
from anyio.streams.memory import MemoryObjectReceiveStream

from triollm.actors.errors import unwrap_single_error
from triollm.testing.clock import mock_clock_patience

__all__ = ["ASGIClient", "ASGIResponse", "AppDidNotEnd", "open_asgi_client"]

ASGI = {"version": "3.0", "spec_version": "2.3"}


class AppDidNotEnd(AssertionError):
    """The app went on after its client disconnected, or its lifespan shutdown did not end."""


class ASGIResponse:
    """One response as it arrives: `status` and `headers` once the app started it, then the
    body chunks by async iteration; `complete` once the app sent the last chunk."""

    def __init__(self, chunks: MemoryObjectReceiveStream[bytes]) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.complete = False
        self._chunks = chunks

    def __aiter__(self) -> AsyncIterator[bytes]:
        return self._chunks

    async def read(self) -> bytes:
        """The rest of the body."""
        return b"".join([chunk async for chunk in self._chunks])


class ASGIClient:
    def __init__(self, app: Any, state: dict[str, Any], disconnect_grace_s: float) -> None:
        self.app = app
        self.state = state  # the lifespan state (a copy goes into each request's scope)
        self.disconnect_grace_s = disconnect_grace_s
        self._shutdown: Any = None  # set by open_asgi_client

    async def shutdown(self) -> None:
        """Run the app's lifespan shutdown now (at the latest when the client's block ends)."""
        await self._shutdown()

    @asynccontextmanager
    async def request(
        self,
        method: str,
        path: str,
        *,
        body: bytes = b"",
        json: Any = None,
        headers: Iterable[tuple[str, str]] = (),
    ) -> AsyncIterator[ASGIResponse]:
        """Send one request; the block gets the response once the app has started it."""
        raw_headers = [(k.lower().encode(), v.encode()) for k, v in headers]
        if json is not None:
            body = jsonlib.dumps(json).encode()
            raw_headers.append((b"content-type", b"application/json"))
        raw_headers.append((b"host", b"testserver"))
        path, _, query = path.partition("?")
        scope = {
            "type": "http",
            "asgi": ASGI,
            "http_version": "1.1",
            "method": method,
            "scheme": "http",
            "path": path,
            "raw_path": path.encode(),
            "query_string": query.encode(),
            "root_path": "",
            "headers": raw_headers,
            "client": ("127.0.0.1", 50000),
            "server": ("testserver", 80),
            "state": dict(self.state),
        }
        chunk_send, chunk_recv = anyio.create_memory_object_stream[bytes](math.inf)
        response = ASGIResponse(chunk_recv)
        started, disconnected, ended = anyio.Event(), anyio.Event(), anyio.Event()
        errors: list[BaseException] = []
        sent_body = False

        async def receive() -> dict[str, Any]:
            nonlocal sent_body
            if not sent_body:
                sent_body = True
                return {"type": "http.request", "body": body, "more_body": False}
            await disconnected.wait()
            return {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            await anyio.lowlevel.checkpoint()
            if disconnected.is_set():
                return
            if message["type"] == "http.response.start":
                response.status = message["status"]
                response.headers = {k.decode().lower(): v.decode() for k, v in message.get("headers", [])}
                started.set()
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    chunk_send.send_nowait(message["body"])
                if not message.get("more_body", False):
                    response.complete = True
                    chunk_send.close()

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            except Exception as exc:  # re-raised in the client's task, unwrapped
                errors.append(exc)
            finally:
                chunk_send.close()
                ended.set()
                started.set()

        with unwrap_single_error():
            async with anyio.create_task_group() as tg:
                tg.start_soon(run)
                try:
                    await started.wait()
                    if errors:
                        raise errors[0]
                    if response.status == 0:
                        raise RuntimeError(f"{method} {path}: the app ended without starting a response")
                    yield response
                finally:
                    disconnected.set()
                    chunk_recv.close()
                    with anyio.CancelScope(shield=True), anyio.move_on_after(self.disconnect_grace_s):
                        await ended.wait()
                    if not ended.is_set():
                        tg.cancel_scope.cancel()
                        raise AppDidNotEnd(
                            f"{method} {path}: the app was still running {self.disconnect_grace_s} s "
                            "after its client disconnected"
                        )
                if errors:
                    raise errors[0]


@asynccontextmanager
async def open_asgi_client(
    app: Any, *, shutdown_timeout_s: float | None = None, disconnect_grace_s: float = 5.0
) -> AsyncIterator[ASGIClient]:
    """Run `app`'s lifespan startup, yield a client, run its shutdown at the end (or at
    `client.shutdown()`). A startup failure raises RuntimeError with the app's message; a
    shutdown that does not end within `shutdown_timeout_s` (None: no bound) raises
    `AppDidNotEnd`. Under trio's MockClock leave it None: an engine's teardown joins threads,
    and the clock would jump to the bound meanwhile (rely on the test's own timeout)."""
    state: dict[str, Any] = {}
    scope = {"type": "lifespan", "asgi": ASGI, "state": state}
    to_app, app_inbox = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
    app_outbox, from_app = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
    done = False
    errors: list[Exception] = []

    async def run() -> None:
        async with app_inbox, app_outbox:
            try:
                await app(scope, app_inbox.receive, app_outbox.send)
            except Exception as exc:  # reported by the client's task (startup or shutdown)
                errors.append(exc)

    async def shutdown() -> None:
        nonlocal done
        if done:
            return
        done = True
        message: dict[str, Any] = {}
        bound_s = math.inf if shutdown_timeout_s is None else shutdown_timeout_s
        with mock_clock_patience(), anyio.CancelScope(shield=True), anyio.move_on_after(bound_s) as bound:
            to_app.send_nowait({"type": "lifespan.shutdown"})
            try:
                message = await from_app.receive()
            except anyio.EndOfStream:
                cause = errors[0] if errors else None
                raise RuntimeError("the app's lifespan ended before its shutdown") from cause
        if bound.cancelled_caught:
            raise AppDidNotEnd(f"the app's lifespan shutdown did not end within {shutdown_timeout_s} s")
        if message["type"] == "lifespan.shutdown.failed":
            raise RuntimeError(f"lifespan shutdown failed: {message.get('message', '')}")

    with unwrap_single_error():
        async with anyio.create_task_group() as tg, to_app, from_app:
            tg.start_soon(run)
            to_app.send_nowait({"type": "lifespan.startup"})
            try:
                with mock_clock_patience():  # the engine starts: threads
                    message = await from_app.receive()
            except anyio.EndOfStream:
                message = {"type": "ended", "message": repr(errors[0]) if errors else "no reply"}
            if message["type"] != "lifespan.startup.complete":
                done = True
                raise RuntimeError(f"lifespan startup failed: {message.get('message', message)}")
            client = ASGIClient(app, state, disconnect_grace_s)
            client._shutdown = shutdown
            try:
                yield client
            finally:
                await shutdown()


